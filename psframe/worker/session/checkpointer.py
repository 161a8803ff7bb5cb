"""The chief's checkpoints: full ones, and deltas since the last one committed.

Every ps task writes its shard and the chief commits the checkpoint (:mod:`psframe.checkpoint`);
a ps task lost as it saves is waited for (:meth:`psframe.worker.session.session.Session.call`),
and the checkpoint saved again, whole.
"""

from __future__ import annotations

import logging

from psframe import checkpoint
from psframe.config.options import DEFAULT_KEEP_CHECKPOINTS, Checkpointing
from psframe.errors import CheckpointError
from psframe.worker.session.session import Session

log = logging.getLogger(__name__)


class Checkpointer:
    """Saves the model the ps tasks hold, at the global step of the values received.

    Args:
        session: the worker's session (its client of the moment, and the global step of its values).
        checkpointing: where checkpoints go and how many are kept; None: the chief saves none.
    """

    def __init__(self, session: Session, checkpointing: Checkpointing | None) -> None:
        self._session = session
        self._dir = checkpointing.dir if checkpointing is not None else None
        self._keep = checkpointing.keep if checkpointing is not None else DEFAULT_KEEP_CHECKPOINTS
        self.last_commit: int | None = None  # the step of the last checkpoint this chief committed

    def save(self) -> checkpoint.Manifest:
        """Have every ps task save its shard, then commit the checkpoint (``Trainer.save_checkpoint``).

        Raises:
            CheckpointError: no checkpoint folder, or a ps task could not write.
        """
        folder = self._folder("save_checkpoint()")
        session = self._session
        # A ps task lost as it saved: wait for it, then save again (at the step of the values then).
        manifest = session.call(
            lambda at: checkpoint.save(at.client, folder, session.global_step, self._keep), pull=True, moved=False
        )
        self.last_commit = manifest.step
        log.info("checkpoint of global step %d committed in %s", manifest.step, manifest.folder)
        return manifest

    def save_delta(self) -> checkpoint.Manifest:
        """Commit a delta checkpoint, only what changed since the last checkpoint committed
        (``Trainer.save_delta``); a full one where there is none to follow, or a ps task cannot
        write a delta.

        Raises:
            CheckpointError: no checkpoint folder, or a ps task could not write.
        """
        folder = self._folder("save_delta()")
        parent = self.last_commit
        if parent is None:
            chain = checkpoint.latest_chain(folder)
            parent = None if chain is None else chain.step
        if parent is None:
            return self.save()
        step = self._session.global_step
        if step <= parent:
            return checkpoint.read(folder, parent).last
        try:
            manifest = self._session.call(
                lambda at: None if at.retry else checkpoint.save_delta(at.client, folder, step, parent),
                pull=True,
                moved=False,
            )
        except CheckpointError as e:
            log.warning("a delta from checkpoint step %d cannot be written; saving whole: %s", parent, e)
            return self.save()
        if manifest is None:  # a ps task was lost as it saved: it restored, so save whole
            return self.save()
        self.last_commit = manifest.step
        log.info("delta of global step %d (after step %d) committed in %s", manifest.step, parent, manifest.folder)
        return manifest

    def _folder(self, asked: str) -> str:
        if not self._dir:
            raise CheckpointError(f"{asked} needs Trainer(checkpointing=psframe.Checkpointing(dir))")
        return self._dir
