"""The reference model: what each key's head and committed values may be, as sets of value ids.

A value id names a tensor (``value_tensor``); ``ABSENT`` stands for "no such key". A key's head
is a *set* of ids because a call that failed or was cancelled either happened completely or not
at all: both are allowed until a later read tells which (the read then narrows the set). The
committed state is a list of alternatives (one per commit that may or may not have happened),
each mapping keys to the ids a commit may have captured: a commit racing puts of other actors
may capture the value before or after each of them.

Shared by the runner's asyncio tasks (on the store's loop thread) and its threads: every
method takes ``lock``.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from tools.harness.modelcheck.programs import Op, Program

ABSENT = -1
Alternative = dict[str, frozenset[int]]


def value_tensor(vid: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """The tensor of value ``vid``: distinct per id, exact in every dtype used (|x| < 1000)."""
    n = math.prod(shape)
    base = torch.arange(n, dtype=torch.int64) * 7 + vid * 131
    return ((base % 2000) - 1000).to(getattr(torch, dtype)).reshape(shape)


def _puts(program: Program) -> list[Op]:
    out = []
    for ph in program.phases:
        for op in ph.ops:
            inner = op.inner if op.kind == "cancel" else op
            if inner is not None and inner.kind == "put":
                out.append(inner)
    return out


class Model:
    """Head and committed states of one program's store; see the module docstring."""

    def __init__(self, program: Program):
        self.lock = threading.Lock()
        self._specs = {op.vid: (op.shape, op.dtype) for op in _puts(program)}
        self._tensors: dict[int, torch.Tensor] = {}
        keys = program.keys()
        self.head: dict[str, set[int]] = {k: {ABSENT} for k in keys}
        #: every value a key was ever given (or being given): what a racing reader may see
        self.ever: dict[str, set[int]] = {k: {ABSENT} for k in keys}
        self.committed: list[Alternative] = [{k: frozenset({ABSENT}) for k in keys}]
        #: alternatives of each version a commit returned
        self.versions: dict[int, list[Alternative]] = {}
        self._writing: dict[str, set[int]] = {k: set() for k in keys}
        self._commits: dict[int, tuple[dict[str, set[int]], dict[str, set[int]]]] = {}
        self._next_token = 0
        self.failures: list[str] = []
        #: values made by writing into a loan (``loan_written``): id -> (key, the ids it was lent as).
        #: Reads of the key may see one or the other; commits capture only the lent ones
        self.scribbled: dict[int, tuple[str, frozenset[int]]] = {}
        self._next_scribble = 1 << 30  # above every id a program draws

    # ------------------------------------------------------------ values

    def tensor(self, vid: int) -> torch.Tensor:
        """The tensor of value ``vid``."""
        t = self._tensors.get(vid)
        if t is None:
            t = self._tensors[vid] = value_tensor(vid, *self._specs[vid])
        return t

    def register(self, vid: int, shape: tuple[int, ...], dtype: str) -> None:
        """Give value ``vid`` (an update's, whose shape is the value it replaces) its shape and dtype."""
        with self.lock:
            self._specs[vid] = (shape, dtype)

    def fail(self, message: str) -> None:
        """Record a mismatch (the program fails)."""
        with self.lock:
            self.failures.append(message)

    # ------------------------------------------------------------ writes and commits

    def write_begin(self, key: str, vid: int) -> None:
        """A put (or a delete: ``ABSENT``) of ``key`` starts; racing commits may capture it."""
        with self.lock:
            self._writing[key].add(vid)
            self.ever[key].add(vid)
            for _, accum in self._commits.values():
                accum[key].add(vid)

    def write_end(self, key: str, vid: int, outcome: str) -> None:
        """The write ended: ``done`` (it happened), ``unknown`` (maybe) or ``none`` (it did not)."""
        with self.lock:
            self._writing[key].discard(vid)
            if outcome == "done":
                self.head[key] = {vid}
            elif outcome == "unknown":
                self.head[key].add(vid)

    def restore_end(self, key: str, vids: set[int], outcome: str) -> None:
        """A restore of ``key`` ended (its ``vids`` each began with ``write_begin``): ``done``,
        ``unknown`` or ``none``, as ``write_end``; done, the head is one of ``vids``."""
        with self.lock:
            self._writing[key] -= vids
            # a restored generation may be one whose RAM copy was written into through a loan
            if outcome == "done":
                self.head[key] = self._with_scribbles(key, set(vids))
            elif outcome == "unknown":
                self.head[key] |= self._with_scribbles(key, vids)

    def version_values(self, key: str, version: int) -> set[int]:
        """The ids ``key`` may have in ``version`` (every value it ever had when the model does not know it)."""
        with self.lock:
            alts = self.versions.get(version)
            if not alts:
                return set(self.ever[key])
            return set().union(*(a.get(key, frozenset({ABSENT})) for a in alts))

    def loan_written(self, key: str, lent_as: set[int], changed: torch.Tensor) -> int:
        """The owner wrote into a loan of ``key`` whose value was one of ``lent_as``; the id of the changed value."""
        with self.lock:
            vid = self._next_scribble
            self._next_scribble += 1
            self._tensors[vid] = changed
            self.scribbled[vid] = (key, frozenset(lent_as))
            self.head[key].add(vid)
            self.ever[key].add(vid)
            return vid

    def scribbled_keys(self) -> set[str]:
        """Keys written into through a loan since the last reopen."""
        with self.lock:
            return {k for k, _ in self.scribbled.values()}

    def _unscribbled(self, vids: set[int]) -> set[int]:
        """``vids`` with each changed value replaced by the values it was lent as: what disk and commits hold."""
        out = set()
        for v in vids:
            s = self.scribbled.get(v)
            out |= set(s[1]) if s is not None else {v}
        return out

    def _with_scribbles(self, key: str, vids: set[int]) -> set[int]:
        """``vids`` plus each changed value of ``key`` lent as one of them (the RAM copy may still hold it)."""
        return vids | {w for w, (k, lent) in self.scribbled.items() if k == key and vids & lent}

    def commit_begin(self) -> int:
        """A commit starts: it captures each key's head now or any write overlapping it."""
        with self.lock:
            token = self._next_token
            self._next_token += 1
            snap = {k: self._unscribbled(set(v) | self._writing[k]) for k, v in self.head.items()}
            self._commits[token] = (snap, {k: set() for k in self.head})
            return token

    def commit_end(self, token: int, outcome: str, version: int | None = None) -> None:
        """The commit ended: ``done`` with its version, or ``unknown`` (failed or cancelled)."""
        with self.lock:
            snap, accum = self._commits.pop(token)
            alt = {k: frozenset(snap[k] | self._unscribbled(accum[k])) for k in snap}
            if outcome == "done":
                assert version is not None
                self.versions[version] = [alt]
                if version >= max(self.versions):
                    self.committed = [alt]
                else:  # a later commit already returned: this one may come before or after it
                    self.committed = _dedupe([*self.committed, alt])
            elif outcome == "unknown":
                self.committed = _dedupe([*self.committed, alt])

    def head_alternative(self) -> Alternative:
        """The head as one alternative (what a commit with nothing racing captures)."""
        with self.lock:
            return {k: frozenset(self._unscribbled(v)) for k, v in self.head.items()}

    # ------------------------------------------------------------ reads

    def candidates(self, key: str, racing: bool = False) -> set[int]:
        """The values a read of ``key`` may return (``racing``: while another actor writes it)."""
        with self.lock:
            return set(self.ever[key] if racing else self.head[key])

    def narrow(self, key: str, vids: set[int]) -> None:
        """A read by the key's owner saw one of ``vids``: the others did not happen."""
        with self.lock:
            # a changed value and the one it was lent as stay together: reads may alternate
            # between the RAM copy and the window's (or the disk's once it is evicted)
            head = self.head[key]
            kept = head & vids
            kept |= self._unscribbled(kept) & head
            self.head[key] = kept | (self._with_scribbles(key, kept) & head)

    def identify(self, key: str, observed: Any) -> set[int]:
        """The ids among every value ``key`` ever had that equal ``observed`` (tensor or error)."""
        from tierstore.errors import KeyNotFound

        with self.lock:
            ever = set(self.ever[key])
        if isinstance(observed, KeyNotFound):
            return {ABSENT}
        if not isinstance(observed, torch.Tensor):
            return set()
        return {v for v in ever if v != ABSENT and same_tensor(observed, self.tensor(v))}

    def reset(self, state: dict[str, set[int]], last: int) -> None:
        """After a reopen: the head and the committed state are what was read back."""
        with self.lock:
            self.scribbled.clear()  # a reopen reads what the disk holds: no loan survives it
            self.head = {k: set(v) for k, v in state.items()}
            alt = {k: frozenset(v) for k, v in state.items()}
            self.committed = [alt]
            if last:
                self.versions[last] = [alt]


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b))


def consistent(state: dict[str, set[int]], alts: list[Alternative]) -> list[Alternative]:
    """The alternatives that agree with an observed state on every key."""
    return [alt for alt in alts if all(state[k] & alt.get(k, frozenset({ABSENT})) for k in state)]


def _dedupe(alts: list[Alternative]) -> list[Alternative]:
    out: list[Alternative] = []
    for a in alts:
        if a not in out:
            out.append(a)
    return out[-16:]  # a long run of failed commits: the oldest alternatives are long settled
