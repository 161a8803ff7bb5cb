"""One-off measurements behind ``docs/decisions.md``, run by hand, never by :mod:`benchmarks.run`.

Each one answers one question for one decision, with the command that
``docs/decisions.md`` names; they may use psframe's internals.
"""
