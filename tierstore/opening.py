"""Opening a store: its folders, the writer lock, the catalog, and the head it starts from.

Plain functions of the store, called once by ``AsyncStore.open`` before the store is shared:
``open_files`` runs on a ``tierstore-io`` thread (it blocks on the disk and the lock), then
``load_head`` on the event loop thread. A writer deletes here what a crash left behind (orphan
generation folders, ``tierstore.retirement.delete_orphans``); a reader leases the generations of
the version it opens and then lets go of the catalog.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from tierstore.catalog import Catalog
from tierstore.errors import CorruptData, StoreError, StoreNotFound
from tierstore.leases import LEASE_DIR, ReaderLease
from tierstore.locks import writer_lock
from tierstore.retirement import delete_orphans

if TYPE_CHECKING:
    from tierstore.store import AsyncStore

STORE_ENTRIES = {"LOCK", "catalog", "data", LEASE_DIR}  # what a store folder may hold
OPEN_RETRIES = 5  # a reader retries its open when retention drops its version meanwhile


def open_files(store: AsyncStore) -> None:
    """Make (or find) the store's folders, take the writer lock and open the catalog (io thread)."""
    root = store.path
    is_store = True
    if store.readonly:
        if not os.path.isdir(os.path.join(root, "catalog")):
            raise StoreNotFound(f"no tierstore at {root}")
    else:
        if not os.path.isdir(root):
            os.makedirs(root)
            store._ledger.created(root)
        store._writer_lock = writer_lock(root)  # a forked child closes its copy (tierstore.locks)
        is_store = os.path.exists(os.path.join(root, "catalog", "data.mdb"))
        if not is_store:
            refuse_foreign(store, root)
        if store.mode == "w":
            for sub in ("catalog", "data", LEASE_DIR):
                shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
        for sub in ("data", "catalog"):
            if not os.path.isdir(os.path.join(root, sub)):
                os.makedirs(os.path.join(root, sub))
                store._ledger.created(os.path.join(root, sub))
        os.makedirs(os.path.join(root, LEASE_DIR), exist_ok=True)  # readers need not create it
    store._catalog = Catalog(os.path.join(root, "catalog"), create=not store.readonly,
                             readonly=store.readonly)
    if not store.readonly and (store.mode == "w" or not is_store):
        store._ledger.written(os.path.join(root, "catalog"))  # the entries of the new LMDB files


def refuse_foreign(store: AsyncStore, root: str) -> None:
    """Refuse to create a store over a folder holding things no store wrote (mode "w" or "a")."""
    foreign = sorted(set(os.listdir(root)) - STORE_ENTRIES) if store.mode == "w" else []
    for sub in ("data", "catalog"):
        p = os.path.join(root, sub)
        if os.path.exists(p) and (not os.path.isdir(p) or os.listdir(p)):
            foreign.append(f"{sub}/")  # an empty data/ is what a crash during creation leaves
    if foreign:
        what = "wipe" if store.mode == "w" else "create a store in"
        raise StoreError(f"mode={store.mode!r} refuses to {what} {root}: it is not a tierstore "
                         f"(no catalog) but holds {foreign[:5]}; pick an empty folder")


def load_head(store: AsyncStore, version: int | None) -> None:
    """Load the head and the records of the last commit (a writer) or of ``version`` (a reader)."""
    assert store._catalog is not None
    if store.readonly:
        load_leased_head(store, version)
        return
    store._commits = store._catalog.commits()
    head = store._commits[-1] if store._commits else None
    gens = head.generations if head is not None else {}
    recs = store._catalog.records(store._catalog.generation_ids())
    store._records = dict(recs)
    store._gen_keys = {g: r.key for g, r in recs.items()}
    delete_orphans(store)
    store._head = {k: recs[g] for k, g in gens.items()}
    store._committed = {g for c in store._commits for g in c.generations.values()}
    known = [*recs, *(g for _, g in store._disk.scan_generations())]
    store._next_gen = max(known, default=0) + 1


def load_leased_head(store: AsyncStore, version: int | None) -> None:
    """A reader's open: load a version, lease its generations, check they were not dropped.

    The writer drops a version's records in its catalog transaction and reads the leases
    after it: a lease written before that transaction is honoured, and a version dropped
    before our check is seen as missing records here, and the open retries. After this the
    reader needs nothing from the catalog and lets go of it.
    """
    assert store._catalog is not None
    for attempt in range(OPEN_RETRIES):
        lease = None
        try:
            commits = store._catalog.commits()
            head = store._catalog.commit(version) if version is not None else (
                commits[-1] if commits else None)
            gens = dict(head.generations) if head is not None else {}
            recs = store._catalog.records(gens.values())
            if head is not None:
                lease = ReaderLease.acquire(store.path, head.version, list(gens.values()))
            store._catalog.records(gens.values())  # still there: our lease came in time
            if version is not None:
                store._catalog.commit(version)
        except (CorruptData, StoreNotFound):
            # dropped by the writer between our reads (or really missing: the last try says)
            if lease is not None:
                lease.release()
            if version is not None or attempt == OPEN_RETRIES - 1:
                raise
            continue
        store._lease = lease
        store._commits = commits
        store._head = {k: recs[g] for k, g in gens.items()}
        store._committed = {g for c in commits for g in c.generations.values()} | set(gens.values())
        store._catalog.close()
        store._catalog = None
        return
    raise StoreError(f"the store at {store.path} changes faster than a reader can open it")
