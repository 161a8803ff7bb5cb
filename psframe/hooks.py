"""Training hooks, in the spirit of TF's ``MonitoredTrainingSession`` (defined in
:mod:`psframe.worker.hooks`; this is their public name)."""

from psframe.worker.hooks import (
    CheckpointSaverHook,
    Hook,
    LoggingHook,
    NanGuardHook,
    StopAtStepHook,
    TensorBoardHook,
)

__all__ = ["CheckpointSaverHook", "Hook", "LoggingHook", "NanGuardHook", "StopAtStepHook", "TensorBoardHook"]
