"""Load test: tens of thousands of concurrent operations from tasks and threads vs a model."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

import tierstore

RAM, WINDOW = 256 * 1024, 64 * 1024


def value(worker: int, key: int, version: int) -> torch.Tensor:
    n = [1, 50, 700, 3000, 9000][(key + version) % 5]
    return torch.full((n,), float(worker * 1_000_000 + key * 1000 + version))


async def task_worker(s: tierstore.AsyncStore, w: int, ops: int, model: dict[str, torch.Tensor],
                      rng: random.Random) -> None:
    versions: dict[int, int] = {}
    for _ in range(ops):
        k = rng.randrange(20)
        key = f"w{w}/k{k}"
        op = rng.random()
        if op < 0.4:
            versions[k] = versions.get(k, 0) + 1
            t = value(w, k, versions[k])
            await s.put(key, t, codec="zstd" if k % 7 == 0 else "raw")
            model[key] = t
        elif op < 0.8:
            if key in model:
                got = await s.get(key, index=slice(0, 5) if k % 3 == 0 else None)
                want = model[key][:5] if k % 3 == 0 else model[key]
                assert torch.equal(got, want), key
            else:
                with pytest.raises(tierstore.KeyNotFound):
                    await s.get(key)
        elif op < 0.9:
            if key in model and model[key].numel() * 4 <= WINDOW // 4:
                got = await s.get(key, device="cpu")
                assert torch.equal(got, model[key])
                del got
        elif op < 0.995:
            if key in model:
                await s.delete(key)
                del model[key]
        else:
            await s.commit()
        stats = s.stats()
        assert stats["host_bytes"] <= RAM and stats["device_bytes"] <= WINDOW


def thread_worker(s: tierstore.Store, w: int, ops: int, model: dict[str, torch.Tensor],
                  errors: list[BaseException]) -> None:
    rng = random.Random(w)
    try:
        for i in range(ops):
            key = f"t{w}/k{rng.randrange(10)}"
            if rng.random() < 0.5:
                t = value(w, i % 10, i)
                s.put(key, t)
                model[key] = t
            elif key in model:
                assert torch.equal(s.get(key), model[key])
    except BaseException as e:  # reported by the main thread
        errors.append(e)


@pytest.mark.slow
def test_concurrent_load_matches_model(tmp_path) -> None:
    s = tierstore.open(tmp_path, ram_budget=RAM, device_budget=WINDOW, chunk_bytes="4KiB",
                       device="cpu", keep_last=2)
    a = s.async_store
    task_models: list[dict[str, torch.Tensor]] = [{} for _ in range(8)]
    thread_models: list[dict[str, torch.Tensor]] = [{} for _ in range(2)]
    errors: list[BaseException] = []

    async def run_tasks() -> None:
        rngs = [random.Random(100 + w) for w in range(8)]
        await asyncio.wait_for(asyncio.gather(*(
            task_worker(a, w, 2500, task_models[w], rngs[w]) for w in range(8))), timeout=300)

    threads = [threading.Thread(target=thread_worker, args=(s, w, 1500, thread_models[w], errors))
               for w in range(2)]
    for t in threads:
        t.start()
    s._loop.run(run_tasks())  # 20,000 task operations on the store's own loop
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a thread worker hung"
    assert not errors, errors
    stats = s.stats()
    assert stats["peak_host_bytes"] <= RAM and stats["peak_device_bytes"] <= WINDOW
    assert stats["puts"] > 8000 and stats["reads_disk"] > 0
    s.close()
    want = {k: v for m in task_models + thread_models for k, v in m.items()}
    with tierstore.open(tmp_path, mode="r") as r:
        assert r.keys() == sorted(want)
        for k, v in want.items():
            assert torch.equal(r.get(k), v), k
        assert r.verify() == []
