"""The LMDB catalog: generation records, commits and the format version.

Threading: LMDB environments are shared per process through ``_ENVIRONMENTS`` (the explicit
registry): opening one environment twice in a process breaks its POSIX locks (py-lmdb docs).
All catalog calls are short and run on the store's event loop thread; a commit is exactly one
write transaction, synced to disk before it returns.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterable

import lmdb

from tierstore.errors import CorruptData, DiskError, FormatVersionError, StoreError, StoreNotFound
from tierstore.records import Commit, GenRecord

#: the newest format this code reads. 1: one file per chunk. 2: also sharded generations
#: (``tierstore.shards``). A catalog is created at 1 and raised to 2 by the first commit that
#: publishes a sharded generation, so an older tierstore refuses exactly the stores it would misread
FORMAT_VERSION = 2
_BASE_FORMAT = 1
SHARDED_FORMAT = 2
_MAP_SIZE = 1 << 36  # address space only; the file grows as data is written

EnvKey = tuple[int, int]  # (st_dev, st_ino) of data.mdb: one environment per file, not per path

_DBS = (b"meta", b"generations", b"commits")
Handles = tuple[lmdb.Environment, dict[bytes, lmdb._Database]]

#: (environment and its database handles, openers, read-only) per catalog file. Keyed by the
#: file's identity, not its path: ``mode="w"`` deletes and recreates the catalog under the same
#: path, and a path key handed the new store the old environment, whose files were gone (the
#: new commit vanished). The database handles are opened once, with the environment: LMDB
#: forbids ``mdb_dbi_open`` while another transaction of the process runs (a reader opening
#: beside a committing writer hung there).
_ENVIRONMENTS: dict[EnvKey, tuple[Handles, int, bool]] = {}
_ENV_LOCK = threading.Lock()


def _u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def _from_u64(b: bytes) -> int:
    return struct.unpack(">Q", b)[0]


def _env_key(real: str) -> EnvKey | None:
    try:
        st = os.stat(os.path.join(real, "data.mdb"))
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def _can_lock(real: str) -> bool:
    """Whether this process may use LMDB's lock file (a read-only folder or mount: no)."""
    lockfile = os.path.join(real, "lock.mdb")
    if os.path.exists(lockfile):
        return os.access(lockfile, os.W_OK)
    return os.access(real, os.W_OK)


def _open_dbs(env: lmdb.Environment, create: bool, readonly: bool) -> dict[bytes, lmdb._Database]:
    # on a fresh environment nobody else uses yet (py-lmdb takes a read txn when read-only)
    return {name: env.open_db(name, create=create and not readonly) for name in _DBS}


def _acquire_env(path: str, create: bool, readonly: bool) -> tuple[Handles, EnvKey]:
    real = os.path.realpath(path)
    with _ENV_LOCK:
        key = _env_key(real)
        if key is None and not create:
            raise StoreNotFound(f"no tierstore catalog at {path}")
        if key is not None and key in _ENVIRONMENTS:
            handles, refs, ro = _ENVIRONMENTS[key]
            if ro and not readonly:
                raise StoreError(f"the catalog at {path} is being opened read-only in this process; "
                                 "open the writer after the reader's open returns")
            _ENVIRONMENTS[key] = (handles, refs + 1, ro)
            return handles, key
        # a reader passes readonly=True (no write transaction, works on read-only files) and,
        # where it may not write lock.mdb (read-only folder or mount), lock=False
        lock = True if not readonly else _can_lock(real)
        try:
            env = lmdb.open(real, map_size=_MAP_SIZE, max_dbs=4, subdir=True,
                            create=create and not readonly, readonly=readonly, lock=lock,
                            sync=True, metasync=True, readahead=False, max_readers=256)
        except lmdb.Error as e:
            raise StoreError(f"cannot open the catalog at {path}: {e}") from None
        try:
            dbs = _open_dbs(env, create, readonly)
        except lmdb.Error as e:
            env.close()
            raise StoreNotFound(f"{path} is not a tierstore catalog: {e}") from None
        key = _env_key(real)
        assert key is not None  # lmdb.open made it
        _ENVIRONMENTS[key] = ((env, dbs), 1, readonly)
        return (env, dbs), key


def _release_env(key: EnvKey) -> None:
    with _ENV_LOCK:
        handles, refs, ro = _ENVIRONMENTS[key]
        if refs > 1:
            _ENVIRONMENTS[key] = (handles, refs - 1, ro)
        else:
            del _ENVIRONMENTS[key]
            handles[0].close()


class Catalog:
    """Generation records, commits and store metadata in one LMDB environment."""

    def __init__(self, path: str, create: bool, readonly: bool = False):
        self.path = path
        (self._env, dbs), self._key = _acquire_env(path, create, readonly)
        self._meta, self._gens, self._commits = (dbs[name] for name in _DBS)
        if create and not readonly:
            with self._env.begin(write=True) as txn:
                if txn.get(b"format_version", db=self._meta) is None:
                    txn.put(b"format_version", str(_BASE_FORMAT).encode(), db=self._meta)
        self._check_format()

    def _check_format(self) -> None:
        with self._env.begin() as txn:
            raw = txn.get(b"format_version", db=self._meta)
        if raw is None:
            _release_env(self._key)
            raise StoreNotFound(f"{self.path} has no format version: not a tierstore catalog")
        try:
            version = int(bytes(raw))
        except ValueError:
            _release_env(self._key)
            raise CorruptData(f"unreadable format version {bytes(raw)!r} in {self.path}") from None
        if version > FORMAT_VERSION:
            _release_env(self._key)
            raise FormatVersionError(
                f"store format {version} is newer than this tierstore reads ({FORMAT_VERSION}); "
                "upgrade tierstore"
            )

    def close(self) -> None:
        """Release this opener's reference to the environment."""
        if self._env is not None:
            _release_env(self._key)
            self._env = None  # type: ignore[assignment]

    def set_format_version(self, version: int) -> None:
        """Overwrite the stored format version (tests of version checks use this)."""
        with self._env.begin(write=True) as txn:
            txn.put(b"format_version", str(version).encode(), db=self._meta)

    def format_version(self) -> int:
        """The stored format version."""
        with self._env.begin() as txn:
            return int(bytes(txn.get(b"format_version", db=self._meta)))

    def commits(self) -> list[Commit]:
        """Every retained commit, oldest first."""
        with self._env.begin() as txn:
            return [Commit.from_json(v) for _, v in txn.cursor(db=self._commits)]

    def commit(self, version: int) -> Commit:
        """One commit by version id."""
        with self._env.begin() as txn:
            raw = txn.get(_u64(version), db=self._commits)
        if raw is None:
            raise StoreNotFound(f"version {version} is not retained in this store")
        return Commit.from_json(raw)

    def records(self, generations: Iterable[int]) -> dict[int, GenRecord]:
        """Generation records by id; CorruptData if a commit names a missing record."""
        out: dict[int, GenRecord] = {}
        with self._env.begin() as txn:
            for g in generations:
                raw = txn.get(_u64(g), db=self._gens)
                if raw is None:
                    raise CorruptData(f"the catalog lacks the record of generation {g}")
                out[g] = GenRecord.from_json(raw)
        return out

    def generation_ids(self) -> set[int]:
        """Ids of every generation with a record."""
        with self._env.begin() as txn:
            return {_from_u64(k) for k in txn.cursor(db=self._gens).iternext(values=False)}

    def publish(self, commit: Commit, new_records: Iterable[GenRecord],
                drop_commits: Iterable[int], drop_generations: Iterable[int]) -> None:
        """Write a commit, its new records and the retention drops in one durable transaction."""
        try:
            with self._env.begin(write=True) as txn:
                for rec in new_records:
                    if rec.shard and int(bytes(txn.get(b"format_version", db=self._meta))) < SHARDED_FORMAT:
                        txn.put(b"format_version", str(SHARDED_FORMAT).encode(), db=self._meta)
                    txn.put(_u64(rec.generation), rec.to_json(), db=self._gens)
                txn.put(_u64(commit.version), commit.to_json(), db=self._commits)
                for v in drop_commits:
                    txn.delete(_u64(v), db=self._commits)
                for g in drop_generations:
                    txn.delete(_u64(g), db=self._gens)
            # sync=True already synced the commit; this also covers metasync-less filesystems
            self._env.sync(True)
        except lmdb.Error as e:  # e.g. MapFullError, DiskError (EIO/ENOSPC): nothing was published
            raise DiskError(f"catalog commit failed: {e}") from None
