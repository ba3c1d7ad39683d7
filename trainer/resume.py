"""What ``resume_from_checkpoint`` names, and bringing the store it opens to the checkpoint to continue from.

One process: ``trainer.checkpoint.resolve_resume`` turns True, a store folder, a run folder holding
``store/`` or an HF-style ``checkpoint-N`` into a store path. Data parallel: the manifest beside
the rank stores (``trainer.distributed``) says which step is the last complete checkpoint; each
rank resumes its own ``rank-<r>`` store, rolled back to the manifest's version when it committed
past it (a peer died between the two phases of a checkpoint), and the manifest is rewritten naming
every rank's head before any new commit. A writer continues from its store's head, the last
commit: an older ``checkpoint-N`` is refused, with how to open it read-only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from trainer import distributed
from trainer.checkpoint import NO_CHECKPOINT, has_checkpoint, resolve_resume


@dataclass(frozen=True, slots=True)
class ResumeTarget:
    """Where this process resumes from."""

    path: str
    """The store folder (in data parallel, this rank's)."""
    step: int | None
    """The step a ``checkpoint-N`` name asked for; None: the store's last commit."""
    manifest: dict[str, Any] | None
    """The data-parallel manifest at the run's root, when there is one."""


def resume_target(resume: Any, root: str, default: str, output_dir: str, dp: Any = None) -> ResumeTarget:
    """The store to resume for ``resume_from_checkpoint=resume``.

    ``root`` is the folder it names (for True: the run's store root); ``default`` the store a fresh
    run would use; ``dp`` the ``trainer.distributed.DataParallel`` of a data-parallel run, or None.
    """
    if (dp is not None and distributed.read_manifest(root) is None
            and distributed.read_manifest(os.path.join(root, "store")) is not None):
        root = os.path.join(root, "store")  # a run folder holding store/, as resolve_resume takes it
    world = 1 if dp is None else dp.world
    manifest = distributed.check_world(root, world) if os.path.isdir(root) else None
    if dp is not None:
        if manifest is None:
            raise ValueError(f"{NO_CHECKPOINT} ({output_dir}): no data-parallel checkpoint "
                             f"({distributed.MANIFEST}) at {root}")
        resume = os.path.join(root, distributed.RANK_DIR.format(dp.rank))
    path, step = resolve_resume(resume, default, output_dir)
    return ResumeTarget(path, step, manifest)


def bring_to_checkpoint(store: Any, target: ResumeTarget, output_dir: str, dp: Any = None, lock: Any = None) -> None:
    """Check that ``store`` (opened at ``target.path``) holds the checkpoint to resume; in data parallel
    roll it back to the manifest's step and name its head in the manifest. ``lock`` guards the store."""
    path, step, manifest = target.path, target.step, target.manifest
    if not has_checkpoint(store):
        raise ValueError(f"{NO_CHECKPOINT} ({output_dir}): the store at {path} has no trainer checkpoint")
    if manifest is not None and dp is not None and store.versions()[-1].step != manifest["step"]:
        # this rank committed past the last complete checkpoint (a peer died between the phases)
        with lock:
            distributed.rollback(store, manifest["versions"][dp.rank], manifest["step"])
    if manifest is not None and dp is not None:
        # name each rank's head (a rolled-back rank's is a new version) before any new commit
        last = store.versions()[-1]
        dp.commit_manifest(distributed.manifest_root(store.path), last.step, last.version)
    steps = [v.step for v in store.versions()]
    if step is not None and step != steps[-1]:
        # a writer continues from the head, which is the last commit: older ones are read-only
        raise ValueError(f"checkpoint-{step}: the store {path} can resume from its last commit only "
                         f"(step {steps[-1]}; retained steps {steps}); open an older one read-only with "
                         f"tierstore.open(path, mode='r', version=...)")
