"""The settings users give whole: option groups, security and liveness.

Plain dataclasses, checked when they are made; the front door re-exports them
(``psframe.Placement``, ``psframe.Security``, ``psframe.Liveness``...):

- :mod:`psframe.config.options`: the Trainer's groups (placement,
  checkpoints, transport, row caching, bounded staleness, data ranges);
- :mod:`psframe.config.security`: who may talk to a task (an auth token, TLS);
- :mod:`psframe.config.liveness`: how soon a task notices a peer is gone;
- :mod:`psframe.config.stopping`: how a task asked to stop (SIGTERM, Ctrl-C)
  leaves, within ``PSFRAME_STOP_GRACE``.
"""
