"""A training job's checkpoint directory turned into served versions, as checkpoints are committed.

:class:`CheckpointFollower` looks at the directory (:meth:`~CheckpointFollower.poll`, every
``poll_seconds`` in :meth:`~CheckpointFollower.follow`) and builds the next version aside:

1. A full checkpoint newer than the served step restarts the chain: the newest one whose
   shards verify is read whole (:func:`psframe.export.snapshot_of_shards`).
2. Then every committed delta that follows the step reached (its parent), in order, is applied
   from its own shards (:func:`psframe.serve.delta_update.read_delta_update`).
3. The model, where there is one, is loaded into an instance of its own for the new snapshot.

Only then is the version published (:class:`psframe.serve.versions.VersionHolder`): one switch
per look, however many deltas it applied. A checkpoint that cannot be used is *refused*: a
missing, truncated or corrupt shard (its size and sha256 against the manifest), a shard that
does not load, a delta that changes what its chain does not hold, a model that does not fit.
The reason is logged and kept (:attr:`~CheckpointFollower.last_refusal`, shown by ``GET
/v1/status``), serving goes on with the last good version, and the refused checkpoint is not
tried again by this process (committed files are never rewritten; a restart tries again). A
delta after a refused one cannot apply: the version stays until the next full checkpoint. A
checkpoint pruned while it was read is skipped, not refused. A restart follows the directory
afresh: the newest valid full checkpoint, then its deltas.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import fsspec

from psframe.checkpoint import Chain, Manifest
from psframe.checkpoint import files as checkpoint_files
from psframe.checkpoint.manifest import MANIFEST_NAME
from psframe.errors import CheckpointError, ClusterMismatchError
from psframe.export import Snapshot, apply_update
from psframe.export.from_checkpoint import snapshot_of_shards
from psframe.serve.delta_update import PartLayout, read_delta_update
from psframe.serve.model import ModelFactory
from psframe.serve.versions import ServedVersion, VersionHolder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refusal:
    """A checkpoint the follower would not serve, and why."""

    step: int
    kind: str  # "full" or "delta"
    folder: str
    reason: str
    at: float  # when (seconds since the epoch)

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "kind": self.kind, "folder": self.folder, "reason": self.reason, "at": self.at}


@dataclass(frozen=True)
class DirectoryView:
    """What the last look at the checkpoint directory found committed."""

    checked_at: float
    steps: frozenset[int]  # every committed step, full or delta
    newest_step: int | None
    newest_committed_at: float | None


@dataclass
class _Chain:
    """A version under construction: its snapshot, layout and where it came from."""

    snapshot: Snapshot
    layout: PartLayout
    base_step: int
    deltas_applied: int
    committed_at: float
    last: Manifest | None = None  # the newest checkpoint read into it by this look


class CheckpointFollower:
    """Follows ``checkpoint_dir`` and publishes each new version into ``holder``.

    Args:
        checkpoint_dir: the folder or fsspec URL the chief saves to.
        holder: where versions are published (and read by requests).
        models: makes each version's model; None: rows and parameters only.
    """

    def __init__(self, checkpoint_dir: str, holder: VersionHolder, *, models: ModelFactory | None = None) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.holder = holder
        self.models = models
        self.view: DirectoryView | None = None
        self.last_refusal: Refusal | None = None
        self.refusals = 0
        self.last_error: str | None = None  # the last look that failed (the directory could not be listed)
        self._refused: dict[tuple[str, int], Refusal] = {}
        self._layout: PartLayout | None = None  # the served version's chain's
        self._one_look = threading.Lock()

    # ---- looking

    def follow(self, stop: threading.Event, poll_seconds: float) -> None:
        """Look every ``poll_seconds`` until ``stop`` is set (a failed look is logged, and the next one made)."""
        while not stop.is_set():
            try:
                self.poll()
            except Exception as e:  # a bug or an unforeseen store error: said, and the version kept
                self.last_error = f"{type(e).__name__}: {e}"
                log.exception("psframe serve: a look at %s failed; serving goes on", self.checkpoint_dir)
            stop.wait(poll_seconds)

    def poll(self) -> ServedVersion | None:
        """Look at the directory once; publish and return the new version, or None if none was made."""
        with self._one_look:
            try:
                fulls = checkpoint_files.list_checkpoints(self.checkpoint_dir)
                deltas = checkpoint_files.list_checkpoints(self.checkpoint_dir, deltas=True)
            except OSError as e:
                self.last_error = f"cannot list {self.checkpoint_dir}: {e}"
                log.warning("psframe serve: %s", self.last_error)
                return None
            self.last_error = None
            self.view = _view_of(fulls, deltas)
            current = self.holder.current()
            chain = self._newer_base(fulls, -1 if current is None else current.step)
            if chain is None and current is not None and self._layout is not None:
                chain = _Chain(
                    current.snapshot, self._layout, current.base_step, current.deltas_applied, current.committed_at
                )
            if chain is None:
                return None
            self._apply_deltas(chain, deltas)
            if chain.last is None:
                return None  # nothing new
            return self._publish(chain)

    def _newer_base(self, fulls: list[Manifest], served_step: int) -> _Chain | None:
        """The newest full checkpoint after ``served_step`` that reads whole, or None."""
        for manifest in reversed([m for m in fulls if m.step > served_step]):
            if ("full", manifest.step) in self._refused:
                continue
            try:
                shards = Chain(manifest).read_shards()
                snapshot = snapshot_of_shards(shards, manifest)
            except CheckpointError as e:
                self._refuse("full", manifest, e)
                continue
            return _Chain(snapshot, PartLayout.of_shards(shards), manifest.step, 0, manifest.created, manifest)
        return None

    def _apply_deltas(self, chain: _Chain, deltas: list[Manifest]) -> None:
        """Apply to ``chain`` every delta that follows it, in order, up to the first refused."""
        following: dict[int | None, Manifest] = {}
        for manifest in deltas:
            if manifest.step > chain.snapshot.step and ("delta", manifest.step) not in self._refused:
                following.setdefault(manifest.parent, manifest)
        while (delta := following.get(chain.snapshot.step)) is not None:
            try:
                chain.snapshot = apply_update(chain.snapshot, read_delta_update(delta, chain.layout, chain.snapshot))
            except CheckpointError as e:
                self._refuse("delta", delta, e)
                return
            chain.deltas_applied += 1
            chain.committed_at = delta.created
            chain.last = delta

    def _publish(self, chain: _Chain) -> ServedVersion | None:
        assert chain.last is not None
        model = None
        if self.models is not None:
            try:
                model = self.models.model_of(chain.snapshot)
            except (ClusterMismatchError, RuntimeError, ValueError, TypeError, KeyError) as e:  # would fail again
                self._refuse("full" if chain.last.parent is None else "delta", chain.last, e)
                return None
        version = ServedVersion(
            self.holder.next_number(),
            chain.snapshot,
            chain.base_step,
            chain.deltas_applied,
            chain.committed_at,
            model=model,
        )
        self.holder.publish(version)
        self._layout = chain.layout
        log.info(
            "psframe serve: version %d is step %d (full checkpoint %d and %d deltas), committed %.1fs ago",
            version.number,
            version.step,
            version.base_step,
            version.deltas_applied,
            max(0.0, version.loaded_at - version.committed_at),
        )
        return version

    def _refuse(self, kind: str, manifest: Manifest, error: Exception) -> None:
        if not _still_committed(manifest):  # pruned while it was read: gone, not bad
            log.info("psframe serve: checkpoint %s went (pruned) while it was read", manifest.folder)
            return
        refusal = Refusal(manifest.step, kind, manifest.folder, str(error), time.time())
        self._refused[(kind, manifest.step)] = refusal
        self.last_refusal = refusal
        self.refusals += 1
        log.warning(
            "psframe serve: refused the %s checkpoint of step %d (%s): %s; serving goes on with the last good version",
            kind,
            manifest.step,
            manifest.folder,
            error,
        )

    # ---- reporting

    def status(self, now: float | None = None) -> dict[str, Any]:
        """What ``GET /v1/status`` answers: the version served, how far behind the directory, refusals."""
        now = time.time() if now is None else now
        version, view = self.holder.current(), self.view
        served: dict[str, Any] = {"state": "waiting for a checkpoint" if version is None else "serving"}
        if version is not None:
            newest_at = view.newest_committed_at if view is not None else None
            served |= {
                "version": version.number,
                "step": version.step,
                "base_step": version.base_step,
                "deltas_applied": version.deltas_applied,
                "committed_at": version.committed_at,
                "loaded_at": version.loaded_at,
                "age_seconds": max(0.0, now - version.committed_at),
                "lag_seconds": max(0.0, newest_at - version.committed_at) if newest_at is not None else 0.0,
                "behind": sum(1 for step in view.steps if step > version.step) if view is not None else 0,
            }
        return {
            "checkpoint_dir": self.checkpoint_dir,
            **served,
            "newest_step": view.newest_step if view is not None else None,
            "checked_at": view.checked_at if view is not None else None,
            "model": self.models is not None,
            "refused": self.refusals,
            "last_refused": self.last_refusal.as_json() if self.last_refusal is not None else None,
            "last_error": self.last_error,
        }


def _view_of(fulls: list[Manifest], deltas: list[Manifest]) -> DirectoryView:
    committed = [*fulls, *deltas]
    newest = max(committed, key=lambda m: (m.step, m.created), default=None)
    return DirectoryView(
        time.time(),
        frozenset(m.step for m in committed),
        None if newest is None else newest.step,
        None if newest is None else newest.created,
    )


def _still_committed(manifest: Manifest) -> bool:
    try:
        fs, folder = fsspec.core.url_to_fs(manifest.folder)
        return bool(fs.exists(f"{folder.rstrip('/')}/{MANIFEST_NAME}"))
    except OSError:
        return True  # cannot tell: taken as there


__all__ = ["CheckpointFollower", "DirectoryView", "Refusal"]
