"""What the tests share: jobs they run, test hosts, doubles."""
