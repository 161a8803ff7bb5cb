"""The worker side: a replica of the model that trains against the ps tasks.

Nothing here imports the ps side (:mod:`psframe.ps`). Every module, with a
line on what it holds: docs/modules.md.
"""
