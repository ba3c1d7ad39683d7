"""Data parallel over torch.distributed with sharded optimizer state (ZeRO-1/2 style).

``torchrun --nproc-per-node N script.py`` runs the same script on N ranks: ``mt.Trainer`` reads
``RANK``/``WORLD_SIZE`` (or an initialised process group) and, with N > 1, each rank

- opens its own store, ``<store>/rank-<r>`` (one writer per store: a shared one gave rank 0
  ``StoreLocked``), holding the full fp32 weights it streams and 1/N of the Adam moments;
- trains on its own rows of each global micro-batch (``per_device_train_batch_size`` rows of the
  ``N * per_device_train_batch_size`` the single process would take), the loss divided by the
  loss tokens of the whole global step, so the summed gradient is the single process's;
- reduce-scatters each parameter group's gradient as it leaves backward (an async collective;
  backward goes on), so rank r receives the sum over ranks of its shard only;
- runs AdamW on its shard (rows ``[r*ceil(R/N), (r+1)*ceil(R/N))`` along dim 0 of each
  parameter) and all-gathers the updated rows, group by group, into the full weights the next
  forward streams. Every rank then holds bit-identical weights.

Equal numbers to the single process with the N-times batch: AdamW is element-wise, so an update
on a shard is the update of those elements; only the gradient's summation order differs (a sum
of N partial sums instead of one), a rounding-level difference (tests: within 1e-5).

Threads and process groups: collectives of one group must be issued in the same order on every
rank, so each thread has its own group. The caller's thread issues the gradient reductions (the
engine's sink runs there on the CPU, on the drain thread under CUDA: one thread either way, in
group order); the update thread (``trainer-adamw``) issues the weight all-gathers in group order;
the training thread also issues the step's scalars, norms, broadcasts and checkpoint votes on
the default group (never while the sink thread could, as the engine has flushed by then).
Collectives run on gloo over host tensors (the gradients and master weights live in host memory
next to the CPU optimizer), on CUDA runs too.

A rank that dies makes the others' next collective fail: gloo raises at once on a closed peer,
and every wait is bounded by ``ddp_timeout`` seconds; either surfaces as ``DistributedError``.

Checkpoints are a two-phase commit: every rank commits its store, then rank 0 writes
``<store>/dp-manifest.json`` (fsync, atomic rename) naming each rank's version; only a step the
manifest names is a checkpoint. ``<store>`` is the folder holding the rank stores a run has
open (``manifest_root``), whatever its ``output_dir``. A rank whose store committed past the
manifest (a peer died between the two phases) is rolled back to the manifest's version on
resume (``Store.restore``: the stored bytes), and the resume rewrites the manifest. Invariant:
every rank's store holds the version the manifest names, or its last commit has the manifest's
step: each store keeps at least 2 commits (``retention``), and the manifest is rewritten before
a rank commits past a rollback. Resuming with another N raises ``DistributedError`` naming both.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tierstore.errors import StoreError
from trainer.optimizer import EXP_AVG, EXP_AVG_SQ, AdamWHyper, StoreAdamW, adamw_update_

MANIFEST = "dp-manifest.json"
# torch 2.13 renamed the flat-tensor collectives (the old names warn); older releases have only those
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
RANK_DIR = "rank-{}"


class DistributedError(StoreError, RuntimeError):
    """A data-parallel run cannot go on: a rank died or timed out, or a checkpoint has another world size."""


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from an initialised process group, else torchrun's environment."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        return rank, world, int(os.environ.get("LOCAL_RANK", rank))
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", "0") or 0)
    return rank, world, int(os.environ.get("LOCAL_RANK", rank) or 0)


def rank_store_path(root: str) -> str:
    """This rank's store under ``root`` (``root`` itself in a single process)."""
    rank, world, _ = env_world()
    return root if world == 1 else os.path.join(root, RANK_DIR.format(rank))


def manifest_root(rank_store: str) -> str:
    """Where the manifest of the rank store at ``rank_store`` lives: the folder holding the rank stores.

    Derived from the store a rank has open, never from ``output_dir``: a run resumed from an
    explicit store path with another ``output_dir`` keeps its checkpoints, manifest included,
    with the stores they describe.
    """
    return os.path.dirname(os.path.normpath(rank_store))


def read_manifest(root: str) -> dict[str, Any] | None:
    """The data-parallel checkpoint manifest at ``root``, or None."""
    path = os.path.join(root, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_manifest(root: str, manifest: dict[str, Any]) -> None:
    """Write the manifest durably: a temporary file, fsync, rename over the old one, fsync the folder."""
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MANIFEST))
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_world(root: str, world: int) -> dict[str, Any] | None:
    """The manifest at ``root`` if it matches ``world`` ranks; DistributedError naming both sizes if not."""
    man = read_manifest(root)
    have = int(man["world_size"]) if man is not None else (1 if os.path.isdir(os.path.join(root, "catalog")) else None)
    if have is not None and have != world:
        how = (f"torchrun --nproc-per-node {have}" if have > 1 else "one process (no torchrun)")
        raise DistributedError(
            f"the checkpoint at {root} was written by {have} rank(s) and this run has {world}: resharding "
            f"the optimizer state is not implemented; resume with {how}")
    return man


def retention(keep_last: int) -> int:
    """The commits each rank's store keeps for ``keep_last`` (``save_total_limit``): at least 2.

    Between the two phases of a checkpoint a rank's store holds the new commit while the manifest
    still names the one before it; if a peer dies then, resume rolls back to that one, so it
    must outlive the new commit: with ``save_total_limit=1`` each rank keeps the commit the
    manifest names beside the newest (one more on disk), as torchtitan keeps at least 2.
    """
    return max(2, keep_last)


def local_rows(micro: list[dict[str, torch.Tensor]], rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """This rank's rows of each global micro-batch (contiguous blocks of ceil(rows / world))."""
    out = []
    for j, b in enumerate(micro):
        rows = int(b["input_ids"].shape[0])
        per = -(-rows // world)
        lo, hi = rank * per, min(rows, (rank + 1) * per)
        if (world - 1) * per >= rows:  # some rank would get no row: every rank sees the same batch and raises
            raise DistributedError(
                f"micro-batch {j} has {rows} rows, too few for {world} ranks of {per}: set "
                "dataloader_drop_last=True or a dataset size that fills every batch")
        out.append({k: v[lo:hi] for k, v in b.items()})
    return out


@dataclass(frozen=True, slots=True)
class _Piece:
    """One parameter's place in its group's flat per-rank block."""

    name: str
    shape: tuple[int, ...]
    unit: int  # elements per dim-0 row
    per: int  # rows per rank (the last ranks may hold fewer, or none)
    offset: int  # element offset in the per-rank block

    def rows(self, r: int) -> tuple[int, int]:
        """Rows [lo, hi) of rank r."""
        total = self.shape[0] if self.shape else 1
        return min(total, r * self.per), min(total, (r + 1) * self.per)


class _Reduced:
    """A group's reduce-scatter in flight; waited once (locked: two threads may ask)."""

    def __init__(self, work: Any, out: torch.Tensor, keep: torch.Tensor) -> None:
        self.work, self.out, self.keep = work, out, keep
        self.lock = threading.Lock()
        self.done = False
        self.error: BaseException | None = None
        self.sq: torch.Tensor | None = None  # per-parameter squared norms of this rank's shards


class DataParallel:
    """This process's rank in a data-parallel run: the store layout, the shards and the collectives."""

    def __init__(self, timeout_s: float = 1800.0, device: torch.device | None = None) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        created = not dist.is_initialized()
        if created:
            backend = "cpu:gloo,cuda:nccl" if device is not None and device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=self.timeout)
        self.created = created
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = env_world()[2]
        groups = _groups(self.timeout)
        self.default, self.grad_group, self.weight_group = groups
        self.layouts: dict[int, list[_Piece]] = {}
        self._pending: dict[int, _Reduced] = {}
        self._mutex = threading.Lock()

    # -- errors ------------------------------------------------------------------------------
    def _fail(self, what: str, e: BaseException) -> DistributedError:
        return DistributedError(
            f"rank {self.rank} of {self.world}: the {what} with the other ranks failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else e!r}); a rank died or stalled past ddp_timeout="
            f"{self.timeout.total_seconds():.0f}s")

    def _run(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            work = fn(*args, **kwargs, async_op=True)
            work.wait(self.timeout)
        except DistributedError:
            raise
        except Exception as e:  # gloo raises RuntimeError/DistBackendError on a dead or silent peer
            raise self._fail(what, e) from e
        return work

    # -- layout --------------------------------------------------------------------------------
    def layout(self, g: int, shapes: dict[str, tuple[int, ...]]) -> list[_Piece]:
        """Group ``g``'s pieces (dim-0 row blocks of each parameter), computed once."""
        lay = self.layouts.get(g)
        if lay is None:
            lay, off = [], 0
            for name, shape in shapes.items():
                rows = shape[0] if shape else 1
                unit = math.prod(shape[1:]) if shape else 1
                per = -(-rows // self.world)
                lay.append(_Piece(name, tuple(shape), unit, per, off))
                off += per * unit
            self.layouts[g] = lay
        return lay

    @staticmethod
    def _block(lay: list[_Piece]) -> int:
        return lay[-1].offset + lay[-1].per * lay[-1].unit if lay else 0

    def shard_rows(self, g: int, name: str) -> tuple[int, int]:
        """This rank's rows [lo, hi) of parameter ``name`` of group ``g``."""
        return next(p for p in self.layouts[g] if p.name == name).rows(self.rank)

    # -- gradients -----------------------------------------------------------------------------
    def reduce(self, g: int, grads: dict[str, torch.Tensor]) -> None:
        """Start the sum over ranks of group ``g``'s gradients; this rank keeps its shard (async)."""
        lay = self.layout(g, {n: tuple(t.shape) for n, t in grads.items()})
        block = self._block(lay)
        flat = torch.zeros(self.world * block, dtype=torch.float32)
        for p in lay:
            src = grads[p.name].reshape(-1)
            for r in range(self.world):
                lo, hi = p.rows(r)
                at = r * block + p.offset
                flat[at:at + (hi - lo) * p.unit] = src[lo * p.unit:hi * p.unit]
        out = torch.empty(block, dtype=torch.float32)
        try:
            work = _reduce_scatter_flat(out, flat, group=self.grad_group, async_op=True)
        except Exception as e:
            raise self._fail(f"gradient reduce-scatter of group {g}", e) from e
        with self._mutex:
            self._pending[g] = _Reduced(work, out, flat)

    def _wait(self, g: int) -> _Reduced:
        with self._mutex:
            red = self._pending[g]
        with red.lock:
            if not red.done:
                try:
                    red.work.wait(self.timeout)
                except Exception as e:
                    red.error = self._fail(f"gradient reduce-scatter of group {g}", e)
                red.done, red.keep = True, None  # type: ignore[assignment]
                if red.error is None:
                    lay = self.layouts[g]
                    red.sq = torch.stack([torch.linalg.vector_norm(self._slice(red.out, p), 2.0) ** 2 for p in lay]) \
                        if lay else torch.zeros(0)
            if red.error is not None:
                raise red.error
        return red

    def _slice(self, flat: torch.Tensor, p: _Piece) -> torch.Tensor:
        lo, hi = p.rows(self.rank)
        return flat[p.offset:p.offset + (hi - lo) * p.unit].view((hi - lo, *p.shape[1:]) if p.shape else (hi - lo,))

    def shards(self, g: int) -> dict[str, torch.Tensor]:
        """Group ``g``'s summed gradient shards of this rank (waits for the reduction)."""
        red = self._wait(g)
        if red.out is None:
            raise DistributedError(f"group {g}'s gradient shards were already consumed by its update")
        return {p.name: self._slice(red.out, p) for p in self.layouts[g]}

    def grad_norms(self) -> dict[str, torch.Tensor]:
        """Per-parameter L2 norms of the summed gradients (waits for every reduction of the step)."""
        with self._mutex:
            groups = sorted(self._pending)
        reds = [(g, self._wait(g)) for g in groups]
        sq = torch.cat([r.sq for _, r in reds]) if reds else torch.zeros(0)  # type: ignore[misc]
        self._run("gradient-norm all-reduce", dist.all_reduce, sq, group=self.default)
        out, i = {}, 0
        for g, _ in reds:
            for p in self.layouts[g]:
                out[p.name] = sq[i].sqrt()
                i += 1
        return out

    def release(self, g: int) -> None:
        """Drop group ``g``'s gradient shards (its update is done); its squared norms stay for ``grad_norms``."""
        with self._mutex:
            red = self._pending.get(g)
        if red is not None:
            with red.lock:
                red.out = None  # type: ignore[assignment]

    # -- weights ---------------------------------------------------------------------------------
    def gather(self, g: int, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The full parameters of group ``g`` from every rank's updated rows (all-gather)."""
        lay = self.layouts[g]
        block = self._block(lay)
        mine = torch.zeros(block, dtype=torch.float32)
        for p in lay:
            lo, hi = p.rows(self.rank)
            mine[p.offset:p.offset + (hi - lo) * p.unit] = shards[p.name].reshape(-1)
        full = torch.empty(self.world * block, dtype=torch.float32)
        self._run(f"weight all-gather of group {g}", _all_gather_flat, full, mine, group=self.weight_group)
        out = {}
        for p in lay:
            parts = []
            for r in range(self.world):
                lo, hi = p.rows(r)
                at = r * block + p.offset
                parts.append(full[at:at + (hi - lo) * p.unit])
            out[p.name] = torch.cat(parts).view(p.shape)
        return out

    def broadcast_weights(self, store: Any, names: list[str], lock: Any) -> None:
        """Give every rank rank 0's weights (DDP does the same at construction)."""
        for name in names:
            with lock:
                t = store.get(name).to(torch.float32).contiguous()
            self._run(f"weight broadcast of {name}", dist.broadcast, t, src=0, group=self.default)
            if self.rank != 0:
                with lock:
                    store.put(name, t, codec="raw")

    # -- scalars and checkpoints -----------------------------------------------------------------
    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        self._run("step all-reduce", dist.all_reduce, t, group=self.default)
        return [float(x) for x in t]

    def gather_ints(self, value: int) -> list[int]:
        """``value`` of every rank, in rank order."""
        mine = torch.tensor([value], dtype=torch.int64)
        full = torch.empty(self.world, dtype=torch.int64)
        self._run("checkpoint vote", _all_gather_flat, full, mine, group=self.default)
        return [int(x) for x in full]

    def commit_manifest(self, root: str, step: int, version: int) -> None:
        """Phase two of a checkpoint: rank 0 names every rank's committed version; all wait for it.

        Also written on resume, once every rank's head is the manifest's step again: a rank
        rolled back has a new version, and the next checkpoint's retention may drop the old one.
        """
        versions = self.gather_ints(version)
        if self.rank == 0:
            write_manifest(root, {"world_size": self.world, "step": step, "versions": versions})
        self._run("checkpoint barrier", dist.all_reduce, torch.zeros(1), group=self.default)


class ShardedAdamW(StoreAdamW):
    """``StoreAdamW`` on this rank's rows of each parameter; the updated rows are all-gathered into the weights.

    The moments in this rank's store (``opt/exp_avg/<name>``, ``opt/exp_avg_sq/<name>``) have the
    shard's shape ``(rows of this rank, *shape[1:])``; a rank with no row of a parameter keeps none.
    """

    def __init__(self, dp: DataParallel, store: Any, groups: list[list[str]], no_decay: set[str],
                 compression: bool | str | None, lock: Any) -> None:
        super().__init__(store, groups, no_decay, compression, lock)
        self.dp = dp
        for g, names in enumerate(groups):
            dp.layout(g, {n: tuple(store.info(n).shape) for n in names})

    def update_group(self, g: int, step: int, h: AdamWHyper, clip_coef: float | None,
                     grads: dict[str, torch.Tensor] | None = None) -> None:
        """Update this rank's rows of group ``g`` from the reduced gradient shards, then all-gather them."""
        start = time.perf_counter()
        shards = self.dp.shards(g)  # the summed gradients of this rank's rows (``grads`` is the local sum)
        new: dict[str, torch.Tensor] = {}
        for name in self.groups[g]:
            lo, hi = self.dp.shard_rows(g, name)
            grad = shards[name]
            if hi == lo:
                new[name] = grad  # an empty shard: nothing to update or keep
                continue
            with self.lock:
                param = self.store.get(name, index=slice(lo, hi)) if grad.dim() else self.store.get(name).reshape(1)
                if step == 1:
                    m, v = torch.zeros_like(param), torch.zeros_like(param)
                else:
                    m = self.store.get(EXP_AVG + name).to(torch.float32)
                    v = self.store.get(EXP_AVG_SQ + name).to(torch.float32)
            t0 = time.perf_counter()
            if clip_coef is not None:
                grad = grad * clip_coef
            wd = 0.0 if name in self.no_decay else h.weight_decay
            param = param.to(torch.float32).clone()
            adamw_update_(param, grad.to(torch.float32), m, v, step, h, wd)
            self.update_s += time.perf_counter() - t0
            mc, vc = self._codecs(param)
            with self.lock:
                self.store.put(EXP_AVG + name, m, codec=mc)
                self.store.put(EXP_AVG_SQ + name, v, codec=vc)
            new[name] = param
        full = self.dp.gather(g, new)
        self.dp.release(g)
        with self.lock:
            for name, t in full.items():
                self.store.put(name, t, codec="raw")
        self.busy_s += time.perf_counter() - start


_GROUPS: tuple[Any, Any, Any] | None = None


def _groups(timeout: datetime.timedelta) -> tuple[Any, Any, Any]:
    """(default, gradient, weight) process groups; the two extra gloo groups are made once per process."""
    global _GROUPS
    if _GROUPS is None:
        default = None
        if dist.get_backend() != "gloo":  # the default group's CPU ops need gloo (cpu:gloo,cuda:nccl has it)
            default = dist.new_group(backend="gloo", timeout=timeout)
        _GROUPS = (default, dist.new_group(backend="gloo", timeout=timeout),
                   dist.new_group(backend="gloo", timeout=timeout))
    return _GROUPS


def from_env(timeout_s: float, device: torch.device) -> DataParallel | None:
    """A ``DataParallel`` when this process is one of several ranks (torchrun's env or a process group)."""
    if not dist.is_available():
        return None
    _, world, _ = env_world()
    if world <= 1:
        return None
    return DataParallel(timeout_s, device)


def rollback(store: Any, version: int, step: int) -> None:
    """Make the store's head equal its commit ``version`` again (a commit past the manifest is dropped).

    The store continues from its last commit only, so every key's head is pointed back at the
    generation ``version`` holds (``Store.restore``: the stored bytes, no re-encode, so quantized
    moments, whose stochastic rounding is not idempotent, and sharded layouts come back exactly),
    keys it lacks are deleted, and that is committed anew; a rare path (a rank died between the
    two phases of a commit).
    """
    commits = {c.version: c for c in store.versions()}
    if version not in commits:
        raise DistributedError(
            f"the store at {store.path} no longer holds version {version} that the data-parallel manifest "
            f"names (it holds {sorted(commits)}): its retention dropped it")
    keep = commits[version].generations
    for key in store.keys():
        if key not in keep:
            store.delete(key)
    for key in sorted(keep):
        store.restore(key, version)
    store.commit(step=step, message=f"trainer step {step} (rolled back to version {version})")
