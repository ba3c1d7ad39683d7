"""Random store programs from a seed: phases of concurrent per-actor operations, then barriers.

A program runs on one store. Each phase starts its actors together (asyncio tasks on the
store's loop and threads through the sync facade), optionally under an injected fault plan;
when they are all done, the phase's barrier operations run alone (a full check, a
close-and-reopen, a check of every retained version through a read-only open, a commit).
Every actor owns its keys (only it writes them), so the model knows each key's value after
each of its own calls; commits and, with the ``cross_reads`` feature, reads of other actors'
keys race with those writes.

The same seed and features always give the same program (``generate``), so a failing seed is
a reproducer. Hypothesis' stateful testing would do the same job; it is not installed here.
"""

from __future__ import annotations

import dataclasses
import random

#: what a program may do; ``generate`` draws only from the features it is given
FEATURES = (
    "threads",  # actors that call the sync facade from their own threads
    "faults",  # phases with injected EIO/ENOSPC at write/read/fsync/mkdir/catalog call sites
    "full_disk",  # failing writes under a tight RAM budget, e.g. every write ENOSPC (disk full)
    "cancel",  # puts, gets, deletes and prefetches cancelled (wait_for or task.cancel)
    "cancel_commit",  # commits cancelled the same way
    "concurrent_commit",  # actors commit while the others put, get and delete
    "cross_reads",  # actors read keys that another actor is writing
    "reopen",  # close-and-reopen barriers, with and without a commit
    "versions",  # read-only opens of every retained version at barriers
    "device",  # gets and prefetches into the device window (the CPU window without CUDA)
    "sharded",  # puts in the sharded layout (inner chunks of a few rows in shard files)
    "adopt",  # puts with copy=False (the tensor's memory becomes the RAM tier's buffers)
    "lend",  # window gets with copy=False (the RAM tier's buffer lent), the last one held
    "update",  # update(): the lent value checked against the model, overwritten in place
    "update_many",  # half the updates go through update_many() / begin_updates(), half of
    #                 those a batch of two own keys (lent in sorted order, all or none)
    "finalize",  # barriers that drop the store in a reference cycle without close, collect it
    #              (on its own loop thread or the caller's) and reopen
    "restore",  # restore(): an own key's head made a random retained version's generation again
    "lazy",  # puts with lazy=True (written only when the budget or a commit needs them)
    "loan_writes",  # an actor writes into a tensor get(..., copy=False) returned (forbidden): the
    #                 commit that needs the changed bytes may be refused (LoanWritten naming the
    #                 key), reads of the key may see them until it is put, deleted or reopened,
    #                 and no commit or reopen ever holds them
    "update_again",  # a third of the updates are followed at once by another update of the same
    #                  key (lent again in the generation the first one made, when nothing else saw it)
    "fork",  # an actor forks a child while the writer is open (the child exits at once, after a
    #          short sleep, or lives until the phase's barriers are done); the phase then ends
    #          with a close and reopen, run while a child may still live
)

#: features that hit a known, unfixed store defect (feature -> a description of the defect):
#: left out of the default mix (``BASE``, and so of the CI programs) until it is fixed;
#: ``--features all`` still runs them; empty while none is known
KNOWN: dict[str, str] = {}

#: features whose past defects (a cancelled commit still landing, a get racing a put of its key,
#: a full disk) showed only on committed data that is no longer in RAM: their programs begin
#: with a setup phase that makes it
EVICTED_START = ("cancel_commit", "cross_reads", "full_disk")

#: every feature without a known defect
BASE = tuple(f for f in FEATURES if f not in KNOWN)

CODECS = ("raw", "raw", "zstd")
DTYPES = ("float32", "float32", "int32", "float16")
FAULT_SITES = ("write", "read", "fsync", "mkdir", "catalog", "delete")
INDEX_KINDS = ("list", "tensor", "tensor2d", "int", "npint", "tensor0d", "nparray2d", "empty")


@dataclasses.dataclass(frozen=True)
class Op:
    """One call of a program; which fields matter depends on ``kind``."""

    kind: str  # put get slice gather delete restore commit prefetch cancel mark_step fork loan_write
    #            | barrier kinds
    actor: int = -1  # -1: a barrier, run alone after the phase's actors
    key: str = ""
    vid: int = 0  # put: the value's id (the tensor is a function of it)
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    codec: str = "raw"
    lo: int = 0  # slice bounds
    hi: int = 0
    index_kind: str = ""  # gather: how the rows are given (list, 2-D tensor, numpy int, ...)
    rows: tuple[int, ...] = ()  # gather: fractions of dim 0 in 1/1000
    device: bool = False  # get / prefetch into the device window
    keys: tuple[str, ...] = ()  # prefetch
    wait: bool = False  # prefetch
    inner: Op | None = None  # cancel: the call that is cancelled
    style: str = ""  # cancel: "wait_for" (tiny timeout) or "cancel" (task.cancel after yields);
    #                  finalize: the thread that collects the dropped store ("loop" or "caller");
    #                  fork: how the child ends ("exit" at once, "sleep", "hold" until released)
    delay: int = 0  # cancel: loop yields (or microseconds of timeout) before cancelling;
    #                 fork "sleep": milliseconds the child sleeps
    commit: bool = True  # reopen: close with or without a commit
    chunk_rows: int = 0  # put: rows per inner chunk of the sharded layout (0: one file per chunk)
    shard_rows: int = 0  # put: rows per shard file (0: the store's default)
    copy: bool = True  # put: False hands the tensor's memory over; get (device): False borrows
    chunked: bool = False  # update: lent as one flat view per chunk
    many: bool = False  # update: through update_many() / begin_updates()
    key2: str = ""  # update (many): a second own key in the batch, updated to ``vid2`` (if it exists)
    vid2: int = 0
    pick: int = 0  # restore: which retained version (modulo how many there are when it runs)
    lazy: bool = False  # put: written only when the budget or a commit needs it

    def describe(self) -> str:
        """One line for a listing of the program."""
        who = "barrier" if self.actor < 0 else f"actor {self.actor}"
        k = self.kind
        if k == "put":
            what = f"put {self.key} v{self.vid} {self.dtype}{list(self.shape)} {self.codec}"
            if self.chunk_rows:
                what += f" chunk_rows={self.chunk_rows} shard_rows={self.shard_rows or None}"
            if not self.copy:
                what += " copy=False"
            if self.lazy:
                what += " lazy"
        elif k == "update":
            what = (f"update {self.key} -> v{self.vid}" + (" chunked" if self.chunked else "")
                    + (f" + {self.key2} -> v{self.vid2}" if self.key2 else "")
                    + (" (update_many)" if self.many else ""))
        elif k == "restore":
            what = f"restore {self.key} to retained version #{self.pick} (modulo their count)"
        elif k in ("get", "delete"):
            what = f"{k} {self.key}" + (" device" if self.device else "") + ("" if self.copy else " copy=False")
        elif k == "loan_write":
            what = f"get {self.key} device copy=False, then write into the loan"
        elif k == "slice":
            what = f"get {self.key}[{self.lo}:{self.hi}]"
        elif k == "gather":
            what = f"get {self.key} index={self.index_kind}{list(self.rows)}"
        elif k == "prefetch":
            what = f"prefetch {list(self.keys)} to={'device' if self.device else 'host'} wait={self.wait}"
        elif k == "cancel":
            assert self.inner is not None
            what = f"cancel[{self.style} {self.delay}] {self.inner.describe().split(': ', 1)[1]}"
        elif k == "reopen":
            what = f"close(commit={self.commit}) and reopen"
        elif k == "finalize":
            what = f"drop without close, collect on the {self.style} thread, reopen"
        elif k == "fork":
            ends = {"exit": "exits at once", "hold": "lives until released"}.get(self.style, f"sleeps {self.delay} ms")
            what = f"fork a child that {ends}"
        else:
            what = k
        return f"{who}: {what}"


@dataclasses.dataclass(frozen=True)
class Phase:
    """Concurrent per-actor operations, an optional fault plan, then barrier operations."""

    ops: tuple[Op, ...]  # actor operations (each actor runs its own in order)
    barriers: tuple[Op, ...]
    faults: dict | None = None  # FaultPlan arguments: fail_sites / fail_calls / sites / error


@dataclasses.dataclass(frozen=True)
class Program:
    """A seeded program and the store configuration it runs under."""

    seed: int
    features: tuple[str, ...]
    actors: tuple[str, ...]  # "async" or "thread", by actor number
    config: dict
    phases: tuple[Phase, ...]

    def keys(self) -> list[str]:
        """Every key an actor of the program owns (some are never written)."""
        return sorted(k for a in range(len(self.actors)) for k in owned_keys(a))

    def n_ops(self) -> int:
        """Operations in all (actor calls and barriers)."""
        return sum(len(ph.ops) + len(ph.barriers) for ph in self.phases)

    def listing(self) -> str:
        """The program as text: configuration, then each phase's faults and calls."""
        lines = [f"seed {self.seed} features {','.join(self.features)} actors {list(self.actors)}",
                 f"config {self.config}"]
        for i, ph in enumerate(self.phases):
            lines.append(f"phase {i}" + (f" faults {ph.faults}" if ph.faults else ""))
            lines += [f"  {op.describe()}" for op in ph.ops]
            lines += [f"  {op.describe()}" for op in ph.barriers]
        return "\n".join(lines)


def owned_keys(actor: int) -> list[str]:
    """The keys actor ``actor`` writes (others may read them)."""
    # nested keys: generation folders then share parents, which the disk tier creates and prunes
    return [f"a{actor}/k{j}" for j in range(2)] + [f"a{actor}/n/k2"]


def _shape(rng: random.Random) -> tuple[int, ...]:
    r = rng.random()
    if r < 0.08:
        return ()
    if r < 0.15:
        return (0,) if rng.random() < 0.5 else (0, 3)
    if r < 0.6:
        return (rng.randint(1, 40),)
    return (rng.randint(1, 12), rng.randint(1, 5))


def _read_op(rng: random.Random, actor: int, key: str, feats: set[str]) -> Op:
    r = rng.random()
    if r < 0.35:
        device, copy = "device" in feats and rng.random() < 0.3, True
        # drawn only with the feature, so programs without it stay what their seeds gave before
        if "lend" in feats and rng.random() < 0.5:
            device, copy = True, False
        return Op("get", actor, key, device=device, copy=copy)
    if r < 0.6:
        return Op("slice", actor, key, lo=rng.randint(-6, 14), hi=rng.randint(-6, 20))
    n = rng.randint(0, 5)
    return Op("gather", actor, key, index_kind=rng.choice(INDEX_KINDS),
              rows=tuple(rng.randrange(1000) for _ in range(max(n, 1))),
              device="device" in feats and rng.random() < 0.15)


def _actor_op(rng: random.Random, actor: int, is_async: bool, all_keys: list[str],
              feats: set[str], vids: list[int]) -> Op:
    own = owned_keys(actor)
    key = rng.choice(own)
    r = rng.random()
    if r < 0.32 and "update" in feats and rng.random() < 0.4:
        # drawn only with the feature, so programs without it stay what their seeds gave before
        vids[0] += 1
        # ``many`` and the batch from the value id, not the generator: programs keep their draws
        op = Op("update", actor, key, vid=vids[0], chunked=rng.random() < 0.5,
                many="update_many" in feats and vids[0] % 2 == 1)
        if op.many and vids[0] % 4 == 1:  # half of them a batch of two of the actor's keys
            vids[0] += 1
            op = dataclasses.replace(op, key2=own[(own.index(key) + 1) % len(own)], vid2=vids[0])
    elif r < 0.32:
        vids[0] += 1
        shape = _shape(rng)
        chunk_rows = shard_rows = 0
        # drawn only with the feature, so programs without it stay what their seeds gave before
        if "sharded" in feats and shape and rng.random() < 0.4:
            chunk_rows = rng.randint(1, 4)
            shard_rows = chunk_rows * rng.choice((0, 1, 2, 5))
        copy = not ("adopt" in feats and rng.random() < 0.4)
        op = Op("put", actor, key, vid=vids[0], shape=shape, dtype=rng.choice(DTYPES),
                codec=rng.choice(CODECS), chunk_rows=chunk_rows, shard_rows=shard_rows, copy=copy)
        if "lazy" in feats and rng.random() < 0.5:  # drawn last: other seeds' programs unchanged
            op = dataclasses.replace(op, lazy=True)
    elif r < 0.62 and "loan_writes" in feats and rng.random() < 0.25:
        # drawn only with the feature, so programs without it stay what their seeds gave before
        op = Op("loan_write", actor, key)
    elif r < 0.62:
        other = "cross_reads" in feats and rng.random() < 0.4
        op = _read_op(rng, actor, rng.choice(all_keys) if other else key, feats)
    elif r < 0.72 and "restore" in feats and rng.random() < 0.5:
        # drawn only with the feature, so programs without it stay what their seeds gave before
        op = Op("restore", actor, key, pick=rng.randrange(1000))
    elif r < 0.72:
        op = Op("delete", actor, key)
    elif r < 0.8:
        pool = all_keys if "cross_reads" in feats else own
        op = Op("prefetch", actor, keys=tuple(rng.sample(pool, rng.randint(1, 2))),
                device="device" in feats and rng.random() < 0.3, wait=rng.random() < 0.5)
    elif r < 0.86 and "concurrent_commit" in feats:
        op = Op("commit", actor)
    elif r < 0.89 and "fork" in feats and rng.random() < 0.4:
        # drawn only with the feature, so programs without it stay what their seeds gave before
        style = rng.choice(("exit", "sleep", "hold"))
        op = Op("fork", actor, style=style, delay=rng.choice((1, 5, 30)) if style == "sleep" else 0)
    elif r < 0.89:
        op = Op("mark_step", actor)
    else:
        op = _read_op(rng, actor, key, feats)
    if is_async and ("cancel" in feats or "cancel_commit" in feats) and rng.random() < 0.25:
        cancellable = ("put", "get", "slice", "gather", "delete", "prefetch", "update", "restore") \
            if "cancel" in feats else ()
        if op.kind == "commit" and "cancel_commit" not in feats:
            return op
        if op.kind not in cancellable and op.kind != "commit":
            return op
        style = rng.choice(("wait_for", "cancel"))
        return Op("cancel", actor, inner=op, style=style, delay=rng.choice((0, 1, 2, 5, 20, 200)))
    if is_async and "cancel_commit" in feats and op.kind != "commit" and rng.random() < 0.15:
        # a commit yields a few dozen times (drain, fsync, catalog on io threads): spread the
        # cancellation over all of its awaits
        return Op("cancel", actor, inner=Op("commit", actor), style=rng.choice(("wait_for", "cancel")),
                  delay=rng.randint(0, 60))
    return op


def _faults(rng: random.Random, feats: set[str]) -> dict | None:
    r = rng.random()
    if "full_disk" in feats and r < 0.4:
        return {"fail_sites": ["write"], "error": "ENOSPC"}
    if "faults" in feats and r < 0.28:
        return {"fail_sites": ["read"], "error": "EIO"}  # a bad disk region: every read fails
    if "faults" in feats and r < 0.5:
        sites = sorted(rng.sample(FAULT_SITES, rng.randint(1, 3)))
        return {"fail_calls": sorted(rng.sample(range(30), rng.randint(1, 4))), "sites": sites,
                "error": rng.choice(("EIO", "ENOSPC"))}
    return None


def _again(op: Op, feats: set[str], vids: list[int]) -> list[Op]:
    """``op``, and with ``update_again`` for a third of the updates another one of its key right after."""
    if "update_again" not in feats or op.kind != "update" or op.key2 or op.vid % 3:
        return [op]  # decided by the value id, not the generator: programs keep their draws
    vids[0] += 1
    return [op, dataclasses.replace(op, vid=vids[0], chunked=not op.chunked, many=False)]


def generate(seed: int, features: tuple[str, ...] | None = None, max_phases: int = 3,
             max_ops: int = 6) -> Program:
    """The program of ``seed`` using only ``features`` (default: every feature without a KNOWN defect).

    ``max_phases`` and ``max_ops`` (calls per actor and phase) bound its length: CI runs short
    programs, ``tools.harness.fuzz_store`` longer ones.
    """
    feats = set(BASE if features is None else features)
    unknown = feats - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {', '.join(FEATURES)}")
    rng = random.Random(seed)
    n_async = rng.randint(1, 3)
    n_thread = rng.randint(0, 2) if "threads" in feats else 0
    actors = ("async",) * n_async + ("thread",) * n_thread
    chunk = rng.choice((16, 64, 256))
    config = {"chunk_bytes": chunk, "ram_budget": rng.choice((4, 8, 32)) * max(chunk, 64),
              "device_budget": 4096, "io_threads": rng.randint(1, 3), "io_depth": rng.randint(1, 4),
              "keep_last": rng.randint(1, 3), "prefetch_ahead": rng.randint(0, 2)}
    all_keys = sorted(k for a in range(len(actors)) for k in owned_keys(a))
    vids = [0]
    phases = []
    if feats & set(EVICTED_START) and rng.random() < 0.5:
        # every actor puts all its keys (mostly compressed), then a commit and reopen empties
        # the RAM tier: later reads of old generations reach the disk
        setup = []
        for a in range(len(actors)):
            for key in owned_keys(a):
                vids[0] += 1
                setup.append(Op("put", a, key, vid=vids[0], shape=(rng.randint(4, 12), 4),
                                dtype="float32", codec=rng.choice(("zstd", "zstd", "raw"))))
        phases.append(Phase(tuple(setup), (Op("reopen", commit=True),)))
    for _ in range(rng.randint(1, max_phases)):
        ops = []
        for a, kind in enumerate(actors):
            for _ in range(rng.randint(1, max_ops)):
                ops += _again(_actor_op(rng, a, kind == "async", all_keys, feats, vids), feats, vids)
        barriers = []
        r = rng.random()
        if "reopen" in feats and r < 0.3:
            barriers.append(Op("reopen", commit=rng.random() < 0.6))
        elif r < 0.5:
            barriers.append(Op("commit"))
        if "versions" in feats and rng.random() < 0.25:
            barriers.append(Op("versions"))
        if rng.random() < 0.3:
            barriers.append(Op("check"))
        # drawn only with the feature, so programs without it stay what their seeds gave before
        if "finalize" in feats and rng.random() < 0.3:
            barriers.append(Op("finalize", style=rng.choice(("loop", "caller"))))
        if any(op.kind == "fork" for op in ops) and not any(b.kind == "reopen" for b in barriers):
            # the point of a fork: the parent closes and reopens its store while the child lives
            barriers.insert(0, Op("reopen", commit=rng.random() < 0.6))
        phases.append(Phase(tuple(ops), tuple(barriers), _faults(rng, feats)))
    if "cross_reads" in feats:
        # a racing read reaches the disk only for chunks evicted from RAM: keep the budget tight
        config["ram_budget"] = 4 * max(chunk, 64)
    if seed % 3 == 2:  # from the seed, not the generator: other seeds keep the programs they gave
        config["kernel_threads"] = 1  # the store's threads run their kernels on one thread
    if seed % 4 == 1:  # every crc and codec call awaits the cpu pool, as large chunks do
        config["inline_bytes"] = 0
    return Program(seed, tuple(sorted(feats)), actors, config, tuple(phases))


def without(program: Program, phase: int, where: str, i: int) -> Program:
    """``program`` with one operation (``where``: "ops" or "barriers") or a phase's faults dropped."""
    phases = list(program.phases)
    ph = phases[phase]
    if where == "faults":
        phases[phase] = dataclasses.replace(ph, faults=None)
    else:
        seq = list(getattr(ph, where))
        del seq[i]
        phases[phase] = dataclasses.replace(ph, **{where: tuple(seq)})
    return dataclasses.replace(program, phases=tuple(phases))


def without_phase(program: Program, phase: int) -> Program:
    """``program`` with one whole phase dropped."""
    phases = program.phases[:phase] + program.phases[phase + 1 :]
    return dataclasses.replace(program, phases=phases)
