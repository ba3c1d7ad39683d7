"""Per-thread kernel threads: the store's threads and a limited thread run torch kernels on one
core, while the thread that opened the store, and threads started later, keep torch's default."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import tierstore
from tierstore.errors import StoreError
from tierstore.kernel_threads import _loaded_runtime, limit_this_thread

needs_openmp = pytest.mark.skipif(_loaded_runtime() is None or torch.get_num_threads() < 2,
                                  reason="needs torch's OpenMP runtime and at least 2 intra-op threads")


def _in_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@needs_openmp
def test_a_limited_thread_keeps_its_limit_and_no_other_thread_takes_it() -> None:
    default = torch.get_num_threads()

    def limited() -> tuple[bool, int, int]:
        ok = limit_this_thread(1)
        before = torch.get_num_threads()
        torch.randn(512, 512).mul(2.0)  # a parallel kernel: torch's lazy set-up must not undo it
        return ok, before, torch.get_num_threads()

    assert _in_thread(limited) == (True, 1, 1)
    assert torch.get_num_threads() == default
    assert _in_thread(torch.get_num_threads) == default  # unlike torch.set_num_threads


@pytest.mark.parametrize("n", [0, -1, True, 1.0])
def test_a_bad_thread_count_is_refused_by_name(n: Any, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="kernel threads must be an int >= 1"):
        limit_this_thread(n)
    with pytest.raises(StoreError, match="kernel_threads must be None or an int >= 1"):
        tierstore.open(tmp_path / "s", mode="w", kernel_threads=n)


@needs_openmp
@pytest.mark.parametrize("kernel_threads", [None, 1])
def test_the_stores_threads_run_kernels_on_the_configured_threads(tmp_path, kernel_threads: int | None) -> None:  # noqa: ANN001
    default = torch.get_num_threads()
    with tierstore.open(tmp_path / "s", mode="w", kernel_threads=kernel_threads) as s:
        a = s._a

        async def on_loop() -> int:
            return torch.get_num_threads()

        seen = {
            "loop": s._loop.run(on_loop()),
            "cpu": a._cpu.submit(torch.get_num_threads).result(),
            "io": a._io.submit(torch.get_num_threads).result(),
        }
        s.put("w", torch.arange(10.0))
        assert torch.equal(s.get("w"), torch.arange(10.0))
    want = default if kernel_threads is None else kernel_threads
    assert seen == {"loop": want, "cpu": want, "io": want}
    assert torch.get_num_threads() == default
