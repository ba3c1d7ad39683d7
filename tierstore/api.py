"""``open`` and ``open_async``: the entry points of the store."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import torch

from tierstore.config import StoreConfig
from tierstore.store import AsyncStore
from tierstore.sync import LoopThread, Store, _Finalizing


def open(path: str | os.PathLike[str], mode: str = "a", *, ram_budget: int | str | None = "4GiB",
         device_budget: int | str | None = "2GiB", device: str | torch.device | None = None,
         version: int | None = None, **options: Any) -> Store:
    """Open (``"r"``/``"a"``) or create (``"w"``) a store and return its blocking facade.

    ``options`` are further ``StoreConfig`` fields (chunk_bytes, io_threads, keep_last, ...).
    """
    config = StoreConfig(ram_budget=ram_budget, device_budget=device_budget, device=device, **options)
    _Finalizing.wait(os.path.realpath(path))  # a store of this path dropped without close()
    loop = LoopThread(kernel_threads=config.kernel_threads)
    try:
        astore = loop.run(AsyncStore.open(path, mode, config, version))
    except BaseException:
        loop.stop()
        raise
    return Store(astore, loop)


async def open_async(path: str | os.PathLike[str], mode: str = "a", *,
                     ram_budget: int | str | None = "4GiB", device_budget: int | str | None = "2GiB",
                     device: str | torch.device | None = None, version: int | None = None,
                     **options: Any) -> AsyncStore:
    """Open or create a store on the running event loop; methods are coroutines."""
    config = StoreConfig(ram_budget=ram_budget, device_budget=device_budget, device=device, **options)
    if _Finalizing.pending(os.path.realpath(path)):
        await asyncio.to_thread(_Finalizing.wait, os.path.realpath(path))
    return await AsyncStore.open(path, mode, config, version)
