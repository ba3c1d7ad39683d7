"""How generations leave the store: retirement of uncommitted ones, collection of unreferenced ones.

Plain functions of the store (its head, records, pins, deferred set and tiers, all owned by the
event loop thread, where these run; folder deletions run on the ``tierstore-delete`` thread).
``collect`` is the only path that deletes a generation (its RAM chunks, window copy, maps and
folder). Invariant: a generation is deleted only once nothing references it (no head entry, no
retained commit), no read of this process pins it (``PinTable``) and, if a commit ever named it,
no reader lease (``readers/*.lease``, any process) names it; until then it waits in
``store._deferred``, and the last user letting go collects it (``on_unpinned``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierstore.leases import leased_generations
from tierstore.settle import settle

if TYPE_CHECKING:
    from tierstore.store import AsyncStore


def retire_soon(store: AsyncStore, key: str, gen: int, n_chunks: int) -> None:
    """Forget an uncommitted generation: once its writes settle, drop its RAM and files."""
    spawn_retiring(store, retire(store, key, gen, n_chunks))


def spawn_retiring(store: AsyncStore, coro: Any) -> None:
    """Run a deletion in the background; commits and close wait for every one (``store._retiring``)."""
    task = store._spawn(coro)
    store._retiring.add(task)
    task.add_done_callback(store._retiring.discard)


async def retire(store: AsyncStore, key: str, gen: int, n_chunks: int) -> None:
    """Once the writes of uncommitted generation ``gen`` settle, collect it."""
    # the writes stay listed until they settle: a reservation waiting for RAM room must see
    # them pending, not dirty chunks with no write (a false BudgetError, found by the fuzz)
    await settle(list(store._writes.get(gen, [])))
    store._writes.pop(gen, None)
    await collect(store, {gen: (key, n_chunks, False)})  # never committed: no reader leases it


async def collect(store: AsyncStore, gens: dict[int, tuple[str, int, bool]]) -> None:
    """Delete unreferenced generations nothing uses; defer the rest (pinned or leased).

    The only path that deletes a generation (RAM chunks, window copy, folder).
    """
    store._deferred.update(gens)
    candidates = list(store._deferred)  # before the lease scan: later entries wait for the next
    leased: set[int] | None = set()
    if any(store._deferred[g][2] for g in candidates):
        leased = await store._run_io(leased_generations, store.path)
    for g in candidates:
        entry = store._deferred.get(g)
        if entry is None or store._pins.pinned(g):
            continue  # taken by a concurrent collection, or still read here
        key, n_chunks, shared = entry
        if shared and (leased is None or g in leased):
            continue  # a reader (maybe in another process) reads it
        del store._deferred[g]
        on_disk = g not in store._memory_only  # else never written: no folder to delete
        grid = store._folder_grids.get(g)
        forget_in_memory(store, g, n_chunks)
        if not on_disk:
            continue
        if grid is not None and not shared and not store._closing:
            # never committed, so no other process ever read it: the next write-back of
            # this key renames the folder and writes over its files (``recycle_folder``);
            # one spare a key, the one it replaces is deleted
            spare = store._spare_folders.get(key)
            store._spare_folders[key] = (g, grid)
            if spare is not None:
                await store._run_delete(delete_folder, store, key, spare[0])
            continue
        await store._run_delete(delete_folder, store, key, g)


def take_spare_folders(store: AsyncStore) -> list[tuple[str, int]]:
    """The (key, generation) folders kept for recycling, which the caller now deletes."""
    spares, store._spare_folders = store._spare_folders, {}
    return [(key, g) for key, (g, _) in spares.items()]


def delete_folders(store: AsyncStore, folders: list[tuple[str, int]]) -> None:
    """``delete_folder`` for each (key, generation)."""
    for key, g in folders:
        delete_folder(store, key, g)


def delete_folder(store: AsyncStore, key: str, g: int) -> None:
    """Delete generation ``g``'s folder, then the sync ledger's entries of deleted files."""
    store._disk.delete_generation(key, g)
    store._ledger.prune()


def forget_in_memory(store: AsyncStore, g: int, n_chunks: int) -> None:
    """Drop everything this process keeps of generation ``g`` (its RAM chunks, window copy, maps)."""
    for i in range(n_chunks):
        store._late_crcs.pop((g, i), None)
    store._gen_keys.pop(g, None)
    store._folder_grids.pop(g, None)
    store._memory_only.discard(g)
    store._meta_owed.discard(g)
    store._host.drop_generation(g, n_chunks)
    store._window.forget(g)
    store._shard_maps.pop(g, None)
    store._mapped.forget(g)


def on_unpinned(store: AsyncStore, gen: int) -> None:
    """The last in-process user of ``gen`` let go: collect it if it waited for that."""
    if gen in store._deferred and not (store._closed or store._closing):
        # while closing, the io pool is going away: a deferred generation stays an orphan
        # for the next writer open to delete (or keep, while a lease names it)
        spawn_retiring(store, collect(store, {}))


def delete_orphans(store: AsyncStore) -> None:
    """Delete generation folders no catalog record names (writes after the last commit).

    A folder a live reader lease names (a version dropped while it was read) is kept and
    collected later, like any other deferred generation.
    """
    orphans = [(k, g) for k, g in store._disk.scan_generations() if g not in store._records]
    if not orphans:
        return
    leased = leased_generations(store.path)
    for key, gen in orphans:
        if leased is None or gen in leased:
            store._deferred[gen] = (key, 0, True)
        else:
            store._disk.delete_generation(key, gen)
