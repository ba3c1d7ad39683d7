"""Export streams: its peak RSS grows by about one tensor, not by the size of the model.

The export runs in a fresh subprocess that measures its own RSS after the imports (the
baseline), then the peak during the export: psutil polling every 2 ms and the kernel's VmHWM,
the larger of the two. (Not ``ru_maxrss``: Linux carries it over ``execve`` from the forking
parent, here pytest with its own large RSS.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors import safe_open

import tierstore

N_TENSORS = 13
TENSOR_BYTES = 16 << 20  # 208 MiB in all, with a 32 MiB RAM budget

_CHILD = r"""
import json, sys, threading, time
import psutil
from tools.cli import main, build_parser
build_parser()  # imports every command module before the baseline
proc = psutil.Process()
base = proc.memory_info().rss
peak = base
done = False
def poll():
    global peak
    while not done:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.002)
t = threading.Thread(target=poll, daemon=True)
t.start()
code = main(sys.argv[1:])
done = True
t.join()
hwm = 0
with open("/proc/self/status") as f:  # VmHWM: peak RSS of this process image, in kB
    hwm = next((int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:")), 0)
print(json.dumps({"code": code, "base": base, "peak": max(peak, hwm), "polled": peak}))
"""


def _value(i: int) -> torch.Tensor:
    return torch.full((TENSOR_BYTES // 4,), float(i)) + torch.arange(TENSOR_BYTES // 4) % 7


def test_export_peak_rss_near_one_tensor(tmp_path) -> None:
    store = str(tmp_path / "store")
    with tierstore.open(store, mode="w", ram_budget="32MiB", device="cpu") as s:
        for i in range(N_TENSORS):
            s.put(f"layers.{i}.weight", _value(i))
        s.commit()
    out = str(tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", _CHILD, "--quiet", "export", store, out,
                        "--format", "safetensors", "--ram-budget", "32MiB",
                        "--max-shard-size", "64MB"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["code"] == 0
    total = N_TENSORS * TENSOR_BYTES
    growth = m["peak"] - m["base"]
    print(f"export of {total >> 20} MiB: baseline RSS {m['base'] >> 20} MiB, peak "
          f"{m['peak'] >> 20} MiB, growth {growth >> 20} MiB ({growth / total:.0%} of the data)")
    assert growth < 0.4 * total
    assert growth < 2.5 * TENSOR_BYTES  # near one tensor: measured 19 MiB for 16 MiB tensors
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"]["layers.12.weight"]
    with safe_open(os.path.join(out, shard), framework="pt") as f:
        assert torch.equal(f.get_tensor("layers.12.weight"), _value(12))
