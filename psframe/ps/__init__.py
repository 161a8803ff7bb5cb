"""The ps side: the variables a ps task holds, their optimizers, and the service that serves them.

Nothing here imports the worker side (:mod:`psframe.worker`). Every module,
with a line on what it holds: docs/modules.md.
"""
