"""psframe's benchmarks: what psframe costs and how fast it trains, against its peers.

Where a module lives says what it is:

- ``benchmarks/suite/``: the measurements :mod:`benchmarks.run` makes and
  ``docs/benchmarks.md`` reports, one module per section (``transport``,
  ``security``, ``memory``, ``training``, ``scaling``, ``sparse`` with
  ``ctr``, ``hosts``), each with its own table function and
  ``python -m`` command line, some with parts of their own (``training_systems``:
  each training system's processes, which scaling and hosts run too;
  ``training_tables``; ``scaling_echo``: the raw gRPC echo's run;
  ``scaling_tables``); two that :mod:`benchmarks.ctr` runs apart from
  the report (``ctr_throughput``: the CTR example at batch 512, one process
  against 1 ps + N workers; ``row_rate``: a ps task's rows per core-second
  against raw torch's); and what they share (``train_psframe``, psframe's
  training task; ``processes``, ``ps_cluster``). Suite modules use psframe's
  public API; the one door below it is ``suite/psframe_internals.py``.
- ``benchmarks/baselines/``: the systems psframe is measured against, with no
  psframe code in them: the raw gRPC ceiling (``raw_grpc``, also the report's
  first section), DDP over gloo and one process (``ddp``), the
  torch.distributed.rpc parameter servers (``rpc_ps``, ``rpc_sparse``),
  TensorFlow's (``tf_ps``, run from its own environment found by ``tf_env``)
  and raw torch on an embedding table's rows (``torch_rows``).
- ``benchmarks/experiments/``: one-off measurements behind ``docs/decisions.md``
  (``store_lock``, ``recovery``, ``step_cpu``; ``row_stores``, with the engines it
  compares in ``row_store_engines``); they may use psframe's internals and are not
  part of :mod:`benchmarks.run`.
- At the top: the command (:mod:`benchmarks.run`), the report it writes
  (:mod:`benchmarks.report`), the CTR command (:mod:`benchmarks.ctr`: the
  two suite modules above, printed together), and the leaves every other module shares:
  :mod:`benchmarks.common` (settings, deadlines, timing; standard library
  only, so the TensorFlow baseline can import it), :mod:`benchmarks.children`
  (child processes, and the ``--quick`` runs' fork server; standard library only),
  :mod:`benchmarks.formatting` (numbers, markdown tables, plots) and the
  workloads (:mod:`benchmarks.mlp_workload`, :mod:`benchmarks.embedding_workload`).

Imports point down that list, never up: experiments and the report may import
the suite (and an experiment the other modules of its own), the suite may
import the baselines, and everything may import the
leaves (a leaf only other leaves); no module imports one that imports it back
(``tests/unit/test_benchmark_layout.py`` checks all of this).
"""
