"""The benchmark suite: the sections :mod:`benchmarks.run` runs and ``docs/benchmarks.md`` reports.

Each section's module measures one thing, makes its own table, and runs
alone with ``python -m benchmarks.suite.<section> [--quick]``. They use
psframe's public API; what they need from below it is in
:mod:`benchmarks.suite.psframe_internals`, and nowhere else.
"""
