"""The GPU check's benchmark dry-runs end to end on the CPU, and its stages are time-boxed."""

from __future__ import annotations

import json
import os

import torch

from tools.gpu import bench as gpu_bench


def test_parameter_and_flop_counts_match_the_model() -> None:
    from transformers import AutoModelForCausalLM

    for name, seq in (("tiny", 32), ("7b", 4096)):
        config = gpu_bench.llama_config(name, seq)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert gpu_bench.n_params(config) == sum(p.numel() for p in model.parameters()), name
    cfg = gpu_bench.llama_config("7b", 4096)
    n, lhs = gpu_bench.n_params(cfg), 32 * 4096 * 4096
    assert 6.7e9 < n < 6.8e9  # Llama-2-7B
    assert gpu_bench.flops_per_token(cfg, 4096, recompute=False) == (6 * n, 6 * n + 12 * lhs)
    six, executed = gpu_bench.flops_per_token(cfg, 4096, recompute=True)
    assert six == 6 * n and executed == 8 * n + 16 * lhs  # forward twice: attention too


def test_dry_run_on_cpu_writes_every_stage(tmp_path) -> None:
    out = tmp_path / "out"
    rc = gpu_bench.main(["--device", "cpu", "--out", str(out), "--work", str(tmp_path / "work"),
                         "--budget-s", "300", "--inline"])  # stage processes would double its time here
    assert sorted(os.listdir(out)) == ["gpu_bench.json", "gpu_bench.log", "gpu_bench.txt"]
    res = json.loads((out / "gpu_bench.json").read_text())
    assert rc == 0, {k: v.get("status") for k, v in res.items() if isinstance(v, dict)}
    assert all(res[s]["status"] == "ok" for s in gpu_bench.STAGES)
    assert res["env"]["result"]["zarr"] != "missing"
    copy = res["copy"]["result"]
    assert copy["store_h2d_gbps"] > 0 and copy["store_d2h_gbps"] > 0 and copy["staging"] is None
    for s in ("plain_1b", "stream_1b", "stream_7b"):
        r = res[s]["result"]
        assert len(r["step_s"]) == 1 and r["tokens_per_s"] > 0 and r["tflops_executed"] > r["tflops_6n"] > 0, s
    s7 = res["stream_7b"]["result"]
    assert s7["window_bytes"] < s7["fp32_weight_bytes"]  # the window is smaller than the model
    assert s7["store"]["peak_device_bytes"] <= s7["window_bytes"]
    assert 0 <= s7["stall_share"] <= 1 and s7["rss_bytes_per_param"] > 0
    # same model, same first batch: the streaming trainer's first loss is plain PyTorch's
    first = res["plain_1b"]["result"]["losses"][0]
    assert abs(res["stream_1b"]["result"]["losses"][0] - first) < 0.05 * first
    assert not [p for p in (tmp_path / "work").iterdir() if p.is_dir()]  # stores deleted after each stage
    assert res["work_free_gib"] > 0
    text = (out / "gpu_bench.txt").read_text()
    assert "stream_1b / plain_1b step time" in text and "H2D store" in text


def test_a_stage_past_its_time_is_killed_and_reported(tmp_path) -> None:
    out = tmp_path / "out"
    rc = gpu_bench.main(["--device", "cpu", "--out", str(out), "--work", str(tmp_path / "w"),
                         "--budget-s", "4", "--stages", "hang,stream_7b"])
    res = json.loads((out / "gpu_bench.json").read_text())
    assert rc == 1
    assert res["hang"]["status"].startswith("timeout")  # killed at the end of the whole budget
    assert res["stream_7b"]["status"].startswith("skipped")  # nothing left for it
    assert "hang: timeout" in (out / "gpu_bench.txt").read_text()
