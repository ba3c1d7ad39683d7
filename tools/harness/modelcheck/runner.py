"""Run a program on a real store and compare every result with the model; shrink failures.

Threads: the store's own loop thread runs the asyncio actors (``run_coroutine_threadsafe``) and
every store coroutine; each thread actor is a ``threading.Thread`` calling the sync facade; the
caller's thread orchestrates (starts a phase, waits for it with a deadline, runs the barriers).
Every call has a deadline: an asyncio actor's call is wrapped in ``wait_for(OP_TIMEOUT_S)``, and
a phase whose actors are not all done after ``2 * OP_TIMEOUT_S`` is a hang. A hung store is
abandoned (its threads are daemons), not closed: closing it would hang too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import gc
import itertools
import os
import random
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import torch

import tierstore
from tierstore import sync as tierstore_sync
from tierstore.errors import (
    BudgetError,
    DiskError,
    InvalidIndex,
    KeyNotFound,
    LoanWritten,
    StoreError,
    StoreNotFound,
)
from tierstore.faults import FaultPlan
from tools.cli.verify_cmd import check_metadata
from tools.harness.modelcheck.model import ABSENT, Model, consistent, same_tensor
from tools.harness.modelcheck.programs import Op, Program, without, without_phase

OP_TIMEOUT_S = 10.0
_RUNS = itertools.count()
READ_KINDS = ("get", "slice", "gather")

#: (seed, message) of event-loop errors (e.g. "Task exception was never retrieved") reported
#: after their program's run ended: a task in a reference cycle reports when a full
#: collection frees it, and a full collection per program would cost 0.25 s (torch's heap)
STRAY_LOOP_ERRORS: list[tuple[int, str]] = []


def collect_strays() -> list[tuple[int, str]]:
    """Run a full garbage collection; return (and forget) the loop errors it brought out."""
    gc.collect()
    out = list(STRAY_LOOP_ERRORS)
    STRAY_LOOP_ERRORS.clear()
    return out


@dataclasses.dataclass
class Outcome:
    """The result of one program run."""

    seed: int
    failures: list[str]
    hang: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No mismatch and no hang."""
        return not self.failures and not self.hang


class _Hang(Exception):
    pass


class _Stop(Exception):
    """An actor stops after its first mismatch (the program has failed already)."""


@dataclasses.dataclass
class _Call:
    """One prepared call: how to make it (async or through the facade), how to judge it."""

    run_async: Callable[[tierstore.AsyncStore], Coroutine[Any, Any, Any]]
    run_sync: Callable[[tierstore.Store], Any]
    finish: Callable[[Any, BaseException | None, bool], None]  # result, error, cancelled


def fault_plan(spec: dict | None) -> FaultPlan | None:
    """The FaultPlan a phase's ``faults`` describe."""
    if spec is None:
        return None
    err = getattr(errno, spec["error"])
    if "fail_sites" in spec:
        return FaultPlan(fail_sites=set(spec["fail_sites"]), error=err)
    return FaultPlan(fail_calls=set(spec["fail_calls"]), sites=tuple(spec["sites"]), error=err)


def _torch_index(index: Any) -> Any:
    """``index`` as torch's own indexing takes it (the reference of a gather)."""
    if isinstance(index, np.ndarray):
        return torch.from_numpy(index)
    if isinstance(index, np.integer):
        return int(index)
    if isinstance(index, list):
        return torch.tensor(index, dtype=torch.int64)
    return index


def _expect(t: torch.Tensor | None, op: Op, index: Any) -> Any:
    """The result (a tensor) or error class a read ``op`` of value ``t`` must give."""
    if t is None:
        return KeyNotFound
    if op.kind == "get":
        return t
    if t.dim() == 0:
        return InvalidIndex
    if op.kind == "slice":
        return t[op.lo : op.hi]
    try:
        return t[_torch_index(index)]
    except IndexError:
        return InvalidIndex


def _make_index(op: Op, rows: int, rng: random.Random) -> Any:
    picked = [r * rows // 1000 for r in op.rows] if rows > 0 else []
    first = picked[0] if picked else 0  # 0 of an empty dim 0: out of range, InvalidIndex
    kind = op.index_kind
    if kind == "list":
        return [r - rows if rng.random() < 0.3 else r for r in picked]
    if kind == "tensor":
        return torch.tensor(picked, dtype=torch.int64)
    if kind == "tensor2d":
        return torch.tensor(picked, dtype=torch.int64).reshape(-1, 1 if rng.random() < 0.5 else len(picked) or 1)
    if kind == "int":
        return first - rows if rows and rng.random() < 0.3 else first
    if kind == "npint":
        return np.int64(first)
    if kind == "tensor0d":
        return torch.tensor(first)
    if kind == "nparray2d":
        return np.array(picked, dtype=np.int64).reshape(1, -1)
    return torch.empty(0, dtype=torch.int64)


class Runner:
    """Executes one program; ``run()`` returns its Outcome."""

    def __init__(self, program: Program, root: str, op_timeout_s: float = OP_TIMEOUT_S):
        self.p = program
        self.op_timeout_s = op_timeout_s
        # a fresh folder per run: a hung run's abandoned store keeps its folder's LOCK
        self.path = os.path.join(root, f"store-{program.seed}-{next(_RUNS)}")
        self.model = Model(program)
        self.store: tierstore.Store | None = None
        self.faulty = False  # a fault phase ran since the last good commit: failures may linger
        self.loop_errors: list[str] = []
        self._done = False  # run() has returned: later loop errors go to STRAY_LOOP_ERRORS
        self._running: dict[int, str] = {}
        self._rng = random.Random(program.seed ^ 0x5EED)
        #: the last tensor a get(copy=False) lent, a copy of it then, and the call: held across
        #: the program's later puts, deletes, commits and reopens, it must never change
        self._loan: tuple[torch.Tensor, torch.Tensor, str] | None = None
        self._loan_lock = threading.Lock()
        #: forked children still to reap: (pid, the pipe end whose close releases a "hold" child)
        self._children: list[tuple[int, int]] = []
        self._children_lock = threading.Lock()

    # ------------------------------------------------------------ plumbing

    def _open(self, mode: str, version: int | None = None) -> tierstore.Store:
        s = tierstore.open(self.path, mode=mode, device="cpu", version=version, **self.p.config)
        s._loop.loop.set_exception_handler(self._on_loop_error)
        if mode != "r" and "update" in self.p.features and self.p.seed % 2:
            # half the programs that update run under an access plan (eviction by plan distance),
            # half of those with a third of the keys hot (kept ahead of the rest, as weights)
            keys = self.p.keys()
            random.Random(self.p.seed).shuffle(keys)
            s.plan(keys, hot=keys[: len(keys) // 3] if self.p.seed % 4 == 1 else ())
        return s

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        what = context.get("task") or context.get("future")
        msg = f"{context.get('message')}: {type(exc).__name__}: {exc} ({what!r:.300})"
        if self._done:
            STRAY_LOOP_ERRORS.append((self.p.seed, msg))
        else:
            self.loop_errors.append(msg)

    def _allowed(self, exc: BaseException) -> bool:
        """An error a call may raise while injected faults (or their aftermath) are live, or
        after a write into a loan: the commit that needs the changed bytes is refused (naming
        the key), and until then they hold their RAM, which the budget may miss."""
        if self.faulty and isinstance(exc, (DiskError, BudgetError)):
            return True
        if isinstance(exc, LoanWritten):
            return exc.key in self.model.scribbled_keys()
        return (isinstance(exc, BudgetError) and bool(self.model.scribbled_keys())
                and "changed after it was stored" in str(exc))

    def _unexpected(self, op: Op, exc: BaseException) -> None:
        self.model.fail(f"{op.describe()} raised {type(exc).__name__}: {exc}")
        raise _Stop

    # ------------------------------------------------------------ calls

    def _prepare(self, op: Op) -> _Call:
        kind = op.kind
        m = self.model
        if kind == "put":
            t = m.tensor(op.vid)

            def finish_put(res: Any, exc: BaseException | None, cancelled: bool) -> None:
                if exc is None and not cancelled:
                    m.write_end(op.key, op.vid, "done")
                elif cancelled or self._allowed(exc):  # type: ignore[arg-type]
                    m.write_end(op.key, op.vid, "unknown")
                else:
                    m.write_end(op.key, op.vid, "unknown")
                    self._unexpected(op, exc)  # type: ignore[arg-type]

            m.write_begin(op.key, op.vid)
            layout: dict[str, Any] = ({"chunk_rows": op.chunk_rows, "shard_rows": op.shard_rows or None}
                                      if op.chunk_rows else {})
            if not op.copy:
                layout["copy"] = False  # the clone below is the store's from then on
            if op.lazy:
                layout["lazy"] = True
            return _Call(lambda a: a.put(op.key, t.clone(), op.codec, **layout),
                         lambda s: s.put(op.key, t.clone(), op.codec, **layout), finish_put)
        if kind in READ_KINDS:
            return self._prepare_read(op)
        if kind == "loan_write":
            return self._prepare_read(dataclasses.replace(op, kind="get", device=True, copy=False),
                                      scribble=True)
        if kind == "update":
            return self._prepare_update(op)
        if kind == "delete":
            before = m.candidates(op.key)

            def finish_delete(res: Any, exc: BaseException | None, cancelled: bool) -> None:
                if exc is None and not cancelled:
                    if before == {ABSENT}:
                        m.fail(f"{op.describe()} succeeded but the key cannot exist (model {before})")
                    m.write_end(op.key, ABSENT, "done")
                elif isinstance(exc, KeyNotFound):
                    if ABSENT not in before:
                        m.fail(f"{op.describe()} raised KeyNotFound but the key exists (model {before})")
                    m.write_end(op.key, ABSENT, "done")
                elif cancelled or self._allowed(exc):  # type: ignore[arg-type]
                    m.write_end(op.key, ABSENT, "unknown")
                else:
                    m.write_end(op.key, ABSENT, "unknown")
                    self._unexpected(op, exc)  # type: ignore[arg-type]

            m.write_begin(op.key, ABSENT)
            return _Call(lambda a: a.delete(op.key), lambda s: s.delete(op.key), finish_delete)
        if kind == "restore":
            return self._prepare_restore(op)
        if kind == "commit":
            token = m.commit_begin()

            def finish_commit(res: Any, exc: BaseException | None, cancelled: bool) -> None:
                if exc is None and not cancelled:
                    if not isinstance(res, int):
                        m.fail(f"{op.describe()} returned {res!r}, not a version number")
                    m.commit_end(token, "done", res)
                elif cancelled or self._allowed(exc):  # type: ignore[arg-type]
                    m.commit_end(token, "unknown")
                else:
                    m.commit_end(token, "unknown")
                    self._unexpected(op, exc)  # type: ignore[arg-type]

            return _Call(lambda a: a.commit(), lambda s: s.commit(), finish_commit)
        if kind == "prefetch":
            own = all(k.startswith(f"a{op.actor}/") for k in op.keys)
            sets = [m.candidates(k, racing=not own) for k in op.keys]
            surely_missing = any(c == {ABSENT} for c in sets)
            maybe_missing = any(ABSENT in c for c in sets)
            to = "device" if op.device else "host"

            def finish_prefetch(res: Any, exc: BaseException | None, cancelled: bool) -> None:
                if cancelled or (exc is not None and self._allowed(exc)):
                    return
                if exc is None:
                    if surely_missing and own:
                        m.fail(f"{op.describe()} succeeded but a key cannot exist ({sets})")
                elif isinstance(exc, KeyNotFound):
                    if not maybe_missing:
                        m.fail(f"{op.describe()} raised KeyNotFound: {exc} (model {sets})")
                else:
                    self._unexpected(op, exc)

            return _Call(lambda a: a.prefetch(list(op.keys), to=to, wait=op.wait),
                         lambda s: s.prefetch(list(op.keys), to=to, wait=op.wait), finish_prefetch)
        if kind == "fork":
            def fork_sync(_: Any) -> None:
                self._fork(op)

            async def fork_async(_: Any) -> None:
                self._fork(op)  # on the store's loop thread, as a callback of an async caller would
            return _Call(fork_async, fork_sync, lambda r, e, c: None if e is None else
                         self._unexpected(op, e))
        if kind == "mark_step":
            async def step(a: tierstore.AsyncStore) -> None:
                a.mark_step()
            return _Call(step, lambda s: s.mark_step(), lambda r, e, c: None if e is None else
                         self._unexpected(op, e))
        raise AssertionError(f"not an actor operation: {kind}")

    def _prepare_restore(self, op: Op) -> _Call:
        """A restore of an own key to a retained version, picked when it runs; the model knows its values."""
        m = self.model
        #: set when the call starts (a wait_for may cancel it before): the version and its values
        began: dict[str, Any] = {}

        def start(versions: list[int]) -> int:
            v = versions[op.pick % len(versions)] if versions else 0  # none: version 0 is not retained
            began["version"], began["vids"] = v, m.version_values(op.key, v)
            for vid in began["vids"]:
                m.write_begin(op.key, vid)  # a racing commit may capture any of them
            return v

        async def run_async(a: tierstore.AsyncStore) -> None:
            await a.restore(op.key, start([c.version for c in a.versions()]))

        def run_sync(s: tierstore.Store) -> None:
            s.restore(op.key, start([c.version for c in s.versions()]))

        def finish(res: Any, exc: BaseException | None, cancelled: bool) -> None:
            if not began:
                return  # cancelled before it started
            v, vids = began["version"], began["vids"]
            present = vids - {ABSENT}
            what = f"{op.describe()} (version {v}, model {vids})"
            if exc is None and not cancelled:
                if not present:
                    m.fail(f"{what} succeeded but the version cannot hold the key")
                m.restore_end(op.key, vids, "none")
                m.restore_end(op.key, present, "done")
            elif isinstance(exc, KeyNotFound) and not isinstance(exc, StoreNotFound):
                if ABSENT not in vids:
                    m.fail(f"{what} raised KeyNotFound: {exc}")
                m.restore_end(op.key, vids, "none")
            elif isinstance(exc, StoreNotFound):
                # allowed only for a version a racing commit's retention dropped (never back)
                if v in [c.version for c in self.store.async_store.versions()]:  # type: ignore[union-attr]
                    m.fail(f"{what} raised StoreNotFound for a retained version: {exc}")
                m.restore_end(op.key, vids, "none")
            elif cancelled or self._allowed(exc):  # type: ignore[arg-type]
                m.restore_end(op.key, vids, "none")
                m.restore_end(op.key, present, "unknown")
            else:
                m.restore_end(op.key, vids, "none")
                self._unexpected(op, exc)  # type: ignore[arg-type]

        return _Call(run_async, run_sync, finish)

    def _prepare_update(self, op: Op) -> _Call:
        """An update of an own key (and, in a batch of two, of a second one the model knows to
        exist): each lent value must be one the model allows; it becomes the key's new value."""
        m = self.model
        targets = [(op.key, op.vid)]
        if op.key2 and ABSENT not in m.candidates(op.key2):  # else a KeyNotFound names neither
            targets.append((op.key2, op.vid2))
        keys = [k for k, _ in targets]
        began: list[tuple[str, int]] = []

        def body(key: str, vid: int, lent: Any) -> None:
            flat = lent if op.chunked else [lent.reshape(-1)]
            whole = torch.cat([p.reshape(-1) for p in flat]) if flat else None
            cands = m.candidates(key)

            def same(v: int) -> bool:
                want = m.tensor(v)
                if whole is None:
                    return want.numel() == 0
                if not op.chunked and tuple(lent.shape) != tuple(want.shape):
                    return False
                return same_tensor(whole, want.reshape(-1))

            ok = {v for v in cands if v != ABSENT and same(v)}
            if not ok:
                got = "nothing" if whole is None else f"{whole.dtype}{list(whole.shape)} {whole[:6].tolist()}"
                m.fail(f"{op.describe()}: {key} lent {got}, which no allowed value {sorted(cands)} equals")
                raise _Stop
            m.narrow(key, ok)
            like = m.tensor(min(ok))
            m.register(vid, tuple(like.shape), str(like.dtype).removeprefix("torch."))
            m.write_begin(key, vid)
            began.append((key, vid))

        def write(vid: int, lent: Any) -> None:
            new = m.tensor(vid).reshape(-1)
            at = 0
            for p in (lent if op.chunked else [lent.reshape(-1)]):
                p.reshape(-1).copy_(new[at : at + p.numel()])
                at += p.numel()

        def scribble(lent: Any) -> None:
            # half-written state, visible to anyone who reads the loan before it ends
            for p in (lent if op.chunked else [lent]):
                p.reshape(-1)[: (p.numel() + 1) // 2].fill_(7)

        def begin_all(lents: list[Any]) -> None:
            for (key, vid), lent in zip(targets, lents, strict=True):
                body(key, vid, lent)
                scribble(lent)

        def write_all(lents: list[Any]) -> None:
            for (_, vid), lent in zip(targets, lents, strict=True):
                write(vid, lent)

        @contextlib.asynccontextmanager
        async def lend_async(a: tierstore.AsyncStore) -> Any:
            if not op.many:
                async with a.update(op.key, chunked=op.chunked) as lent:
                    yield [lent]
                return
            us = await a.begin_updates(keys, chunked=op.chunked)
            try:
                yield [u.value() for u in us]
            finally:
                await a.end_updates(us)

        @contextlib.contextmanager
        def lend_sync(s: tierstore.Store) -> Any:
            if not op.many:
                with s.update(op.key, chunked=op.chunked) as lent:
                    yield [lent]
                return
            with s.update_many(keys, chunked=op.chunked) as lents:
                yield lents

        async def run_async(a: tierstore.AsyncStore) -> None:
            async with lend_async(a) as lents:
                begin_all(lents)
                try:
                    for _ in range(3):  # other actors run while the loans are half-written
                        await asyncio.sleep(0)
                finally:
                    write_all(lents)  # cancelled or not, the block leaves the new values

        def run_sync(s: tierstore.Store) -> None:
            with lend_sync(s) as lents:
                begin_all(lents)
                time.sleep(0.0005)
                write_all(lents)

        def finish(res: Any, exc: BaseException | None, cancelled: bool) -> None:
            if isinstance(exc, _Stop):
                raise exc
            if exc is None and not cancelled:
                for key, vid in targets:
                    m.write_end(key, vid, "done")
                return
            for key, vid in began:
                m.write_end(key, vid, "unknown")
            if isinstance(exc, KeyNotFound):  # only op.key may be absent (see targets)
                if ABSENT not in m.candidates(op.key):
                    m.fail(f"{op.describe()} raised KeyNotFound but the key exists")
                m.narrow(op.key, {ABSENT})
            elif len(targets) > 1 and not began and isinstance(exc, BudgetError):
                pass  # two loans held at once may not fit the budget: the batch is refused whole
            elif not cancelled and not self._allowed(exc):  # type: ignore[arg-type]
                self._unexpected(op, exc)  # type: ignore[arg-type]

        return _Call(run_async, run_sync, finish)

    def _prepare_read(self, op: Op, scribble: bool = False) -> _Call:
        m = self.model
        owner = op.key.startswith(f"a{op.actor}/")
        cands = m.candidates(op.key, racing=not owner)
        tensors = {v: (None if v == ABSENT else m.tensor(v)) for v in cands}
        index = None
        if op.kind == "gather":
            rows = min((t.shape[0] for t in tensors.values() if t is not None and t.dim()), default=1)
            index = _make_index(op, rows, self._rng)
        expected = {v: _expect(t, op, index) for v, t in tensors.items()}

        def finish_read(res: Any, exc: BaseException | None, cancelled: bool) -> None:
            if cancelled or (exc is not None and self._allowed(exc)):
                return
            # a window tensor is shared: another actor's write into its loan may land while this
            # is checked, so compare a snapshot, taken before the candidates (the model counts
            # such a write before it is made)
            seen = (res.clone() if isinstance(res, torch.Tensor) else res) if exc is None else exc
            if not owner:  # a put that started after this read was prepared may be what it saw
                for v in m.candidates(op.key, racing=True) - set(expected):
                    expected[v] = _expect(None if v == ABSENT else m.tensor(v), op, index)
            ok = {v for v, e in expected.items() if (
                same_tensor(seen, e) if isinstance(e, torch.Tensor) and isinstance(seen, torch.Tensor)
                else isinstance(e, type) and isinstance(seen, e))}
            if not ok:
                if exc is not None and not isinstance(exc, (KeyNotFound, InvalidIndex)):
                    self._unexpected(op, exc)
                got = f"{type(exc).__name__}: {exc}" if exc is not None else (
                    f"{res.dtype}{list(res.shape)} {res.reshape(-1)[:6].tolist()}")
                want = {v: (e.__name__ if isinstance(e, type) else f"{e.dtype}{list(e.shape)}")
                        for v, e in expected.items()}
                m.fail(f"{op.describe()} (index {index!r}) gave {got}; the model allows {want}")
                raise _Stop
            if owner:
                m.narrow(op.key, ok)
            if not op.copy and isinstance(res, torch.Tensor):
                if scribble:
                    self._scribble(op.key, res, ok - {ABSENT})
                else:
                    self._hold_loan(res, op.describe())

        dev = "cpu" if op.device else None
        if op.kind == "get":
            kw: dict[str, Any] = {} if op.copy else {"copy": False}
        elif op.kind == "slice":
            kw = {"index": slice(op.lo, op.hi)}
        else:
            kw = {"index": index}
        return _Call(lambda a: a.get(op.key, device=dev, **kw),
                     lambda s: s.get(op.key, device=dev, **kw), finish_read)

    def _fork(self, op: Op) -> None:
        """Fork a child that only waits and exits (``op.style``); the parent goes on at once.

        The child runs the interpreter's fork handlers (the store's close its copies of the lock
        descriptors) and then no Python code of the program: a fork of a threaded process may
        leave locks held by threads that do not exist in the child.
        """
        # one fork at a time, each child closing every write end it inherits: two actors forking
        # at once gave each child the other's, and neither saw its end of file (a cycle)
        with self._children_lock:
            go_r, go_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    for _, w in (*self._children, (0, go_w)):
                        os.close(w)
                    if op.style == "sleep":
                        time.sleep(op.delay / 1000)
                    elif op.style == "hold":
                        os.read(go_r, 1)  # until the parent closes its end (or dies)
                finally:
                    os._exit(0)
            os.close(go_r)
            self._children.append((pid, go_w))

    def _children_alive(self) -> bool:
        """Whether a forked child may still run (one not yet reaped)."""
        with self._children_lock:
            return bool(self._children)

    def _reap_children(self) -> None:
        """Release every forked child and wait for it to exit; one still running after the deadline hangs."""
        with self._children_lock:
            children, self._children = self._children, []
        deadline = time.monotonic() + 2 * self.op_timeout_s
        for _, go_w in children:
            os.close(go_w)
        stuck = []
        for pid, _ in children:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
                        self.model.fail(f"a forked child ended with status {status:#x}")
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    stuck.append(pid)
                    break
                time.sleep(0.001)
        if stuck:
            self.model.fail(f"forked children {stuck} did not exit once released (stuck in a fork handler?)")

    def _scribble(self, key: str, t: torch.Tensor, lent_as: set[int]) -> None:
        """Write into ``t``, which ``get(key, copy=False)`` returned (forbidden; lent or not)."""
        if t.numel() == 0 or not lent_as:
            return
        changed = t.clone()
        changed.reshape(-1)[0] = 1500  # exact in every dtype used, and no value of the model's
        self.model.loan_written(key, lent_as, changed)  # before the write: racing readers may see it
        with self._loan_lock:
            t.reshape(-1)[0] = 1500
            held = self._loan
            if held is not None and held[0].untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                self._loan = (held[0], held[0].clone(), held[2])  # the held loan is the one written into

    def _hold_loan(self, t: torch.Tensor, what: str) -> None:
        """Keep ``t`` (lent) instead of the previous loan, which is checked as it is dropped."""
        with self._loan_lock:
            prev, self._loan = self._loan, (t, t.clone(), what)
            # checked under the lock: a write into a loan of the same memory (``_scribble``, on
            # another actor's thread) refreshes only the loan held then, and once this one is
            # no longer held it would find a changed tensor it was not told of
            self._check_loan(prev)

    def _check_loan(self, loan: tuple[torch.Tensor, torch.Tensor, str] | None) -> None:
        if loan is not None and not same_tensor(loan[0], loan[1]):
            self.model.fail(f"{loan[2]}: the lent tensor changed while it was held "
                            f"(now {loan[0].reshape(-1)[:6].tolist()}, lent as {loan[1].reshape(-1)[:6].tolist()})")

    async def _cancelled(self, op: Op, call: _Call, a: tierstore.AsyncStore) -> None:
        coro = call.run_async(a)
        res, exc, cancelled = None, None, False
        if op.style == "wait_for":
            try:
                res = await asyncio.wait_for(coro, timeout=op.delay * 1e-5)
            except asyncio.TimeoutError:
                cancelled = True
            except Exception as e:  # judged by finish
                exc = e
        else:
            task = asyncio.get_running_loop().create_task(coro)
            for _ in range(op.delay):
                await asyncio.sleep(0)
            task.cancel()
            try:
                res = await task
            except asyncio.CancelledError:
                cancelled = True
            except Exception as e:
                exc = e
        call.finish(res, exc, cancelled)

    async def _async_op(self, op: Op, a: tierstore.AsyncStore) -> None:
        if op.kind == "cancel":
            assert op.inner is not None
            await self._cancelled(op, self._prepare(op.inner), a)
            return
        call = self._prepare(op)
        try:
            res = await call.run_async(a)
        except Exception as e:
            call.finish(None, e, False)
            return
        call.finish(res, None, False)

    async def _async_actor(self, actor: int, ops: list[Op]) -> None:
        assert self.store is not None
        a = self.store.async_store
        for op in ops:
            self._running[actor] = op.describe()
            try:
                await asyncio.wait_for(self._async_op(op, a), self.op_timeout_s)
            except asyncio.TimeoutError:
                raise _Hang(op.describe()) from None
            except _Stop:
                return
        self._running.pop(actor, None)

    def _thread_actor(self, actor: int, ops: list[Op]) -> None:
        assert self.store is not None
        for op in ops:
            self._running[actor] = op.describe()
            call = self._prepare(op)
            try:
                try:
                    res = call.run_sync(self.store)
                except Exception as e:
                    call.finish(None, e, False)
                    continue
                call.finish(res, None, False)
            except _Stop:
                return
        self._running.pop(actor, None)

    # ------------------------------------------------------------ phases and barriers

    def _phase(self, ops: tuple[Op, ...]) -> None:
        assert self.store is not None
        loop = self.store._loop.loop
        futures: list[concurrent.futures.Future[Any]] = []
        threads: list[threading.Thread] = []
        for actor, kind in enumerate(self.p.actors):
            mine = [op for op in ops if op.actor == actor]
            if not mine:
                continue
            if kind == "async":
                futures.append(asyncio.run_coroutine_threadsafe(self._async_actor(actor, mine), loop))
            else:
                th = threading.Thread(target=self._thread_actor, args=(actor, mine), daemon=True,
                                      name=f"modelcheck-actor-{actor}")
                th.start()
                threads.append(th)
        deadline = time.monotonic() + 2 * self.op_timeout_s
        for f in futures:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise _Hang(f"phase still running: {self._running}") from None
        for th in threads:
            th.join(timeout=max(0.0, deadline - time.monotonic()))
            if th.is_alive():
                raise _Hang(f"a thread actor is stuck in: {self._running}")

    def _read_all(self, store: tierstore.Store, what: str) -> dict[str, set[int]]:
        """Every key read back through ``store``: the ids each read can be (empty = unknown)."""
        state: dict[str, set[int]] = {}
        listed = set(store.keys())
        for k in self.p.keys():
            try:
                seen: Any = store.get(k)
            except KeyNotFound as e:
                seen = e
            state[k] = self.model.identify(k, seen)
            if not state[k]:
                self.model.fail(f"{what}: {k} reads {seen!r:.120}, a value it never had")
            if (k in listed) != (ABSENT not in state[k]):
                self.model.fail(f"{what}: keys() {'lists' if k in listed else 'lacks'} {k} "
                                f"but get says {state[k]}")
        extra = listed - set(self.p.keys())
        if extra:
            self.model.fail(f"{what}: keys() lists keys never put: {sorted(extra)}")
        return state

    def _check_head(self) -> None:
        assert self.store is not None
        state = self._read_all(self.store, "check")
        for k, ids in state.items():
            allowed = self.model.candidates(k)
            if ids and not ids & allowed:
                self.model.fail(f"check: {k} holds {ids}, the model's head allows {allowed}")
            else:
                self.model.narrow(k, ids)

    def _check_budgets(self, store: tierstore.Store) -> None:
        st = store.stats()
        if st["peak_host_bytes"] > st["ram_budget"] or st["host_bytes"] > st["ram_budget"]:
            self.model.fail(f"RAM budget broken: peak {st['peak_host_bytes']} B, now "
                            f"{st['host_bytes']} B, budget {st['ram_budget']} B")
        if st["peak_device_bytes"] > st["device_budget"]:
            self.model.fail(f"device budget broken: peak {st['peak_device_bytes']} B > "
                            f"{st['device_budget']} B")

    def _check_committed(self, store: tierstore.Store, what: str) -> dict[str, set[int]]:
        """The store opened at the last commit holds one of the committed alternatives."""
        state = self._read_all(store, what)
        alts = consistent(state, self.model.committed)
        if not alts:
            self.model.fail(f"{what}: read back {state}, which is none of the committed states "
                            f"the model allows: {self.model.committed}")
            return state
        return {k: ids & set().union(*(a[k] for a in alts)) for k, ids in state.items()}

    def _check_versions(self) -> None:
        assert self.store is not None
        versions = [c.version for c in self.store.versions()]
        if versions != sorted(set(versions)) or len(versions) > self.p.config["keep_last"]:
            self.model.fail(f"versions() {versions}: not increasing or more than keep_last")
        for v in versions:
            with self._open("r", version=v) as r:
                state = self._read_all(r, f"version {v}")
                known = self.model.versions.get(v)
                if known is not None and not consistent(state, known):
                    self.model.fail(f"version {v} reads {state}; it committed {known}")
        if versions:
            with self._open("r") as r:
                self._check_committed(r, "read-only open of the last version")

    def _barrier(self, op: Op) -> None:
        assert self.store is not None
        if op.kind == "check":
            self._check_head()
        elif op.kind == "commit":
            token = self.model.commit_begin()
            try:
                v = self.store.commit()
            except StoreError as e:
                self.model.commit_end(token, "unknown")
                if not self._allowed(e):
                    self.model.fail(f"barrier commit (no faults) raised {type(e).__name__}: {e}")
                return
            self.model.commit_end(token, "done", v)
            self.faulty = False
        elif op.kind == "versions":
            self._check_versions()
        elif op.kind == "reopen":
            self._reopen(op.commit)
        elif op.kind == "finalize":
            self._finalize(op.style)
        else:
            raise AssertionError(op.kind)

    def _reopen(self, commit: bool) -> None:
        assert self.store is not None
        self._check_budgets(self.store)
        if self._children_alive():
            # a child closed its copy of the LOCK descriptor without unlocking: still ours
            try:
                tierstore.open(self.path, mode="a", device="cpu", **self.p.config).close(commit=False)
            except tierstore.StoreLocked:
                pass
            else:
                self.model.fail("a second writer opened the store while ours was open (after a fork)")
        if commit:
            head = self.model.head_alternative()
        try:
            self.store.close(commit=commit)
        except StoreError as e:
            if not self._allowed(e):
                self.model.fail(f"close(commit={commit}) (no faults) raised {type(e).__name__}: {e}")
        else:
            if commit:
                with self.model.lock:
                    self.model.committed = [head]
        self.store = self._open("a")
        state = self._check_committed(self.store, f"reopen after close(commit={commit})")
        versions = self.store.versions()
        self.model.reset(state, versions[-1].version if versions else 0)
        self.faulty = False

    def _finalize(self, where: str) -> None:
        """Drop the store in a reference cycle without closing it and collect it on ``where``'s
        thread (its own loop thread: the cyclic GC's usual choice there), then reopen: the
        finalizer's close without a commit must have released the LOCK and kept the last commit.

        The collection that finds the store finalizes its tasks too, in no fixed order: a
        failed write's task may report "Task exception was never retrieved" before the store's
        finalizer closes it (and retrieves it). Those reports are ignored here, nothing else.
        """
        assert self.store is not None
        self._check_budgets(self.store)
        s, self.store = self.store, None
        s.cycle = s  # type: ignore[attr-defined]  # only the cyclic GC can free it
        dropped = weakref.ref(s)
        loop = s._loop.loop
        del s
        errors = len(self.loop_errors)
        if where == "loop":
            async def collect() -> None:
                gc.collect()

            gc.disable()  # no automatic collection elsewhere first
            try:
                asyncio.run_coroutine_threadsafe(collect(), loop).result(timeout=self.op_timeout_s)
            finally:
                gc.enable()
        # the harness's own references (a failed call's traceback in a finished thread) may
        # outlive the first collection for a moment
        for _ in range(20):
            if dropped() is None:
                break
            gc.collect()
            time.sleep(0.005)
        self.loop_errors[errors:] = [e for e in self.loop_errors[errors:]
                                     if not e.startswith("Task exception was never retrieved")]
        del loop
        if dropped() is not None:
            self.model.fail("a store dropped in a cycle was still referenced after 20 collections")
            return
        try:
            self.store = self._open("a")
        except StoreError as e:
            self.model.fail(f"reopen after a store was finalized without close raised {type(e).__name__}: {e}")
            return
        state = self._check_committed(self.store, "reopen after a finalization without close")
        versions = self.store.versions()
        self.model.reset(state, versions[-1].version if versions else 0)
        self.faulty = False

    def _bounded(self, fn: Callable[[], None], what: str) -> None:
        """Run a barrier step in a helper thread: a step still running after the deadline hangs."""
        error: list[BaseException] = []

        def step() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
                error.append(e)

        th = threading.Thread(target=step, daemon=True, name="modelcheck-barrier")
        th.start()
        th.join(2 * self.op_timeout_s)
        if th.is_alive():
            raise _Hang(f"{what} did not return")
        if error:
            raise error[0]

    def run(self) -> Outcome:
        """Execute the program; every mismatch, hang and stray loop error is in the Outcome."""
        t0 = time.perf_counter()
        shutil.rmtree(self.path, ignore_errors=True)
        hang = False
        try:
            self.store = self._open("w")
            for ph in self.p.phases:
                plan = fault_plan(ph.faults)
                if plan is not None:
                    self.faulty = True
                self.store.async_store.inject_faults(plan)
                try:
                    self._phase(ph.ops)
                finally:
                    self.store.async_store.inject_faults(None)
                self._check_budgets(self.store)
                self._check_loan(self._loan)
                if self.model.failures:
                    break
                for op in ph.barriers:
                    self._bounded(lambda op=op: self._barrier(op), op.describe())
                self._reap_children()
                if self.model.failures:
                    break
            if not self.model.failures:
                self._bounded(self._finish, "final check, close and read-only reopen")
        except _Hang as e:
            hang = True
            self.model.fail(f"hang: {e}")
            if self.store is not None:  # abandoned: a close would hang as well
                tierstore_sync._OPEN_STORES.discard(self.store)
                self.store = None
        except Exception as e:  # noqa: BLE001  (the harness reports, whatever broke)
            self.model.fail(f"harness or barrier error {type(e).__name__}: {e}")
        finally:
            self._reap_children()
            if self.store is not None:
                try:
                    self.store.close(commit=False)
                except Exception as e:  # noqa: BLE001
                    self.model.fail(f"final close raised {type(e).__name__}: {e}")
            gc.collect(1)  # tasks whose exception was never retrieved report when collected
            self._done = True
            if self.loop_errors:
                self.model.fail(f"event loop errors: {self.loop_errors[:3]}")
            if not hang:
                shutil.rmtree(self.path, ignore_errors=True)
        return Outcome(self.p.seed, list(self.model.failures), hang, time.perf_counter() - t0)

    def _finish(self) -> None:
        """Check the head, commit it by closing, and reopen read-only to verify every chunk."""
        assert self.store is not None
        self._check_head()
        self._check_budgets(self.store)
        self._check_loan(self._loan)
        head = self.model.head_alternative()
        s, self.store = self.store, None
        try:
            s.close(commit=True)
        except LoanWritten as e:  # refused: the store closed without the commit
            if not self._allowed(e):
                raise
        else:
            with self.model.lock:
                self.model.committed = [head]
        with self._open("r") as r:
            faults = r.verify()
            # and each tensor's zarr.json names its generation (a commit writes the metadata
            # that write-backs for room left to it)
            faults += [f for k in r.keys() for f in check_metadata(r, k)]
            if faults:
                self.model.fail(f"verify after the final commit: {faults[:3]}")
            self._check_committed(r, "final read-only reopen")


def run_program(program: Program, root: str, op_timeout_s: float = OP_TIMEOUT_S) -> Outcome:
    """Run ``program`` on a fresh store under ``root`` and return its Outcome.

    A call (or barrier) that takes longer than ``op_timeout_s`` (twice that for a phase) hangs.
    """
    return Runner(program, root, op_timeout_s).run()


def shrink(program: Program, root: str, budget_s: float = 60.0, tries: int = 2,
           op_timeout_s: float = OP_TIMEOUT_S) -> Program:
    """A smaller program that still fails: drop phases, then single calls, while it fails.

    Concurrency makes a failure flaky, so a candidate counts as failing if any of ``tries``
    runs fails; the search stops after ``budget_s`` seconds.
    """
    deadline = time.monotonic() + budget_s

    def fails(p: Program) -> bool:
        return any(not run_program(p, root, op_timeout_s).ok for _ in range(tries))

    best = program
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for i in reversed(range(len(best.phases))):
            if len(best.phases) > 1 and time.monotonic() < deadline:
                cand = without_phase(best, i)
                if fails(cand):
                    best, changed = cand, True
        for pi in reversed(range(len(best.phases))):
            for where in ("barriers", "ops"):
                for i in reversed(range(len(getattr(best.phases[pi], where)))):
                    if time.monotonic() >= deadline:
                        return best
                    cand = without(best, pi, where, i)
                    if fails(cand):
                        best, changed = cand, True
            if best.phases[pi].faults and time.monotonic() < deadline:
                cand = without(best, pi, "faults", 0)
                if fails(cand):
                    best, changed = cand, True
    return best
