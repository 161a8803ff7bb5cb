"""psframe's benchmarks: training throughput against torch.distributed baselines."""
