"""Readers of old versions: other processes, retention, killed readers, read-only folders.

A reader process opens an early version and re-reads it from disk in a loop (its RAM budget is
too small to cache it, and ``verify`` re-reads every chunk) while this process commits with
``keep_last=2``: its lease keeps the version's folders until it closes or dies.
"""

from __future__ import annotations

import os
import pathlib
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading

import pytest
import torch

import tierstore
from tierstore.leases import LEASE_DIR
from tierstore.tiers.disk import DiskTier

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("w", "m")
N = 16_384  # 64 KiB a tensor: four 16 KiB chunks, more than half the reader's RAM budget
OPTS = dict(chunk_bytes="16KiB", ram_budget="64KiB", keep_last=2)

READER = r"""
import os, sys, torch, tierstore
path, version, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def value(step, j):
    return torch.randn(16_384, generator=torch.Generator().manual_seed(step * 10 + j))
with tierstore.open(path, mode="r", version=version, chunk_bytes="16KiB", ram_budget="64KiB") as r:
    step = r.versions()[-1].step if version is None else [c for c in r.versions()
                                                           if c.version == version][0].step
    want = {k: value(step, j) for j, k in enumerate(("w", "m"))}
    loops = bad = 0
    while True:
        for k, v in want.items():
            bad += not torch.equal(r.get(k), v)
        bad += len(r.verify())
        loops += 1
        if loops == 1:
            print("ready", flush=True)
        if os.path.exists(stop):
            break
    print(loops, bad, flush=True)
"""


def value(step: int, j: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(step * 10 + j))


def write_step(s: tierstore.Store, step: int) -> int:
    for j, k in enumerate(KEYS):
        s.put(k, value(step, j))
    return s.commit(step=step)


def start_reader(path, version: int, stop) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.Popen([sys.executable, "-c", READER, str(path), str(version), str(stop)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 120)
    line = p.stdout.readline() if ready else ""
    if line.strip() != "ready":
        p.kill()
        raise AssertionError(f"reader did not start: {line!r} {p.stderr.read() if p.stderr else ''}")
    return p


def gens_on_disk(path) -> set[int]:
    return {g for _, g in DiskTier(str(path)).scan_generations()}


def retained(s: tierstore.Store) -> set[int]:
    return {g for c in s.versions() for g in c.generations.values()}


def du(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path / "data") for f in fs)


@pytest.fixture
def fast_dir(tmp_path):
    """A folder on tmpfs where there is one: 100 commits' fsyncs cost seconds on a real disk."""
    if not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    d = tempfile.mkdtemp(prefix="tierstore-readers-", dir="/dev/shm")
    try:
        yield pathlib.Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def first_version_and_its_reader(s: tierstore.Store, path, stop) -> tuple[int, set[int], subprocess.Popen]:
    """Commit version 1, then start a reader process of it: (version, its generations, process)."""
    v1 = write_step(s, 0)
    return v1, set(s.versions()[-1].generations.values()), start_reader(path, v1, stop)


def leases(path) -> list[str]:
    return [n for n in os.listdir(path / LEASE_DIR) if n.endswith(".lease")]


def test_reader_process_keeps_its_version_while_the_writer_commits(fast_dir) -> None:
    path, stop = fast_dir / "s", fast_dir / "stop"
    with tierstore.open(path, mode="w", **OPTS) as s:
        v1, early, reader = first_version_and_its_reader(s, path, stop)
        try:
            for step in range(1, 101):
                write_step(s, step)
            assert len(s.versions()) == 2 and v1 not in [c.version for c in s.versions()]
            assert early <= gens_on_disk(path)  # dropped by retention, kept for the reader
            assert len(leases(path)) == 1
            stop.touch()
            out, err = reader.communicate(timeout=120)
        finally:
            reader.kill()
        assert reader.returncode == 0, err
        loops, bad = map(int, out.split()[-2:])
        assert loops >= 1 and bad == 0, out
        assert leases(path) == []  # the reader deleted its lease on close
        head = retained(s)
    # the writer's close collected the reader's generations: disk = the keep_last commits
    assert gens_on_disk(path) == head and len(head) == 2 * len(KEYS)
    assert du(path) <= 2 * len(KEYS) * 4 * N * 1.02


def test_a_killed_reader_does_not_pin_its_version_forever(fast_dir) -> None:
    path, stop = fast_dir / "s", fast_dir / "stop"
    with tierstore.open(path, mode="w", **OPTS) as s:
        v1, early, reader = first_version_and_its_reader(s, path, stop)
        try:
            for step in range(1, 11):
                write_step(s, step)
            assert early <= gens_on_disk(path)
        finally:
            reader.send_signal(signal.SIGKILL)
            reader.wait(timeout=60)
        assert len(leases(path)) == 1  # a dead reader leaves its lease behind
        write_step(s, 11)  # the next commit finds the lease unlocked and reclaims it
        assert leases(path) == []
        assert gens_on_disk(path) == retained(s)
        assert du(path) <= 2 * len(KEYS) * 4 * N * 1.02


def test_reader_in_the_same_process_holds_its_version(tmp_path) -> None:
    with tierstore.open(tmp_path, mode="w", **OPTS) as s:
        write_step(s, 0)
        with tierstore.open(tmp_path, mode="r", chunk_bytes="16KiB", ram_budget="64KiB") as r:
            for step in range(1, 6):
                write_step(s, step)
                for j, k in enumerate(KEYS):
                    assert torch.equal(r.get(k), value(0, j)), (step, k)
                assert r.verify() == []
        write_step(s, 6)
        assert gens_on_disk(tmp_path) == retained(s)


def test_readers_opening_during_commits_always_get_a_whole_version(fast_dir) -> None:
    path = fast_dir / "s"
    s = tierstore.open(path, mode="w", **dict(OPTS, keep_last=1))  # the harshest retention
    write_step(s, 0)
    stop = threading.Event()
    errors: list[BaseException] = []

    def commit_forever() -> None:
        step = 1
        try:
            while not stop.is_set():
                write_step(s, step)
                step += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    writer = threading.Thread(target=commit_forever)
    writer.start()
    try:
        for _ in range(30):  # each open races the writer's retention dropping its version
            with tierstore.open(path, mode="r", chunk_bytes="16KiB", ram_budget="64KiB") as r:
                step = r.versions()[-1].step
                assert step is not None
                for j, k in enumerate(KEYS):
                    assert torch.equal(r.get(k), value(step, j)), (step, k)
                assert r.verify() == []
    finally:
        stop.set()
        writer.join()
        s.close()
    assert errors == []


def test_a_writer_reopened_after_a_crash_keeps_leased_orphans(tmp_path) -> None:
    with tierstore.open(tmp_path, mode="w", **OPTS) as s:
        write_step(s, 0)
    with tierstore.open(tmp_path, mode="r", chunk_bytes="16KiB", ram_budget="64KiB") as r:
        with tierstore.open(tmp_path, **OPTS) as s:
            for step in range(1, 4):
                write_step(s, step)
        with tierstore.open(tmp_path, **OPTS) as s:  # reopen: version 0's folders are orphans
            for j, k in enumerate(KEYS):
                assert torch.equal(r.get(k), value(0, j))
            assert r.verify() == []
    with tierstore.open(tmp_path, **OPTS) as s:
        assert gens_on_disk(tmp_path) == retained(s)


# ---------------------------------------------------------------- read-only folders


def _make_read_only(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            os.chmod(os.path.join(d, f), 0o444)
        os.chmod(d, 0o555)


def _read_as(uid: int, gid: int, path: str) -> tuple[int, str]:
    """Fork, drop to ``uid``, open ``path`` read-only and check it; (exit code, message)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no new imports (the interpreter's own files may be unreadable)
        code = 1
        try:
            os.close(rfd)
            os.setgid(gid)
            os.setuid(uid)
            with tierstore.open(path, mode="r", chunk_bytes="16KiB", ram_budget="64KiB") as r:
                ok = all(torch.equal(r.get(k), value(0, j)) for j, k in enumerate(KEYS))
                ok = ok and r.verify() == [] and r.keys() == sorted(KEYS)
            msg, code = ("ok", 0) if ok else ("values differ", 1)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            msg = f"{type(e).__name__}: {e}"
        os.write(wfd, msg.encode()[:4000])
        os._exit(code)
    os.close(wfd)
    ready, _, _ = select.select([rfd], [], [], 120)
    msg = os.read(rfd, 4096).decode() if ready else "timed out"
    os.close(rfd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), msg


def test_open_read_only_on_a_folder_without_write_permission() -> None:
    root = tempfile.mkdtemp(prefix="tierstore-ro-", dir="/tmp")
    path = os.path.join(root, "s")
    try:
        with tierstore.open(path, mode="w", **OPTS) as s:
            write_step(s, 0)
        os.chmod(root, 0o755)
        _make_read_only(path)
        if os.geteuid() != 0:
            code, msg = _read_as(os.getuid(), os.getgid(), path)
        else:
            try:
                import pwd
                nobody = pwd.getpwnam("nobody")
            except KeyError:
                pytest.skip("running as root and there is no user 'nobody' to drop to")
            code, msg = _read_as(nobody.pw_uid, nobody.pw_gid, path)
            if code != 0 and "Operation not permitted" in msg:
                pytest.skip(f"cannot drop root privileges here: {msg}")
        assert (code, msg) == (0, "ok")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o555
    finally:
        for d, _, _ in os.walk(root):
            os.chmod(d, 0o755)
        shutil.rmtree(root, ignore_errors=True)
