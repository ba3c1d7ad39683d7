"""The command line itself: --help everywhere, usage errors exit 2 with one line, no tracebacks."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from tools.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_has_help(command: str, capsys) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tierstore {command}")
    assert "--quiet" in out


def test_top_level_help_lists_commands(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize("argv, needle", [
    ([], "usage: tierstore"),
    (["frobnicate"], "invalid choice"),
    (["inspect"], "the following arguments are required: STORE"),
    (["export", "s", "o"], "--format"),
    (["export", "s", "o", "--format", "onnx"], "invalid choice"),
    (["inspect", "s", "--version", "two"], "invalid int value"),
])
def test_argparse_usage_errors_exit_2(argv: list[str], needle: str, capsys) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_missing_store_is_one_line_exit_2(cli, tmp_path) -> None:
    for command in (["inspect"], ["verify"], ["export", "--format", "safetensors"]):
        argv = [command[0], str(tmp_path / "nope"), *([str(tmp_path / "out")] if command[0] == "export" else []), *command[1:]]
        code, out, err = cli(*argv)
        assert code == 2, argv
        assert err.count("\n") == 1 and "no tierstore at" in err and "Traceback" not in err


def test_version_not_retained_exit_2(cli, tmp_path, make_store) -> None:
    import torch

    store = make_store(tmp_path / "s", {"a": torch.ones(2)})
    code, _, err = cli("inspect", store, "--version", "7")
    assert code == 2 and "7" in err and "Traceback" not in err


def test_bad_size_flag_exit_2(cli, tmp_path, make_store) -> None:
    import torch

    store = make_store(tmp_path / "s", {"a": torch.ones(2)})
    code, _, err = cli("export", store, str(tmp_path / "o"), "--format", "safetensors",
                       "--max-shard-size", "lots")
    assert code == 2 and "--max-shard-size" in err


def test_console_script_entry_point(tmp_path) -> None:
    """``python -m tools.cli`` exits with main's code (what the console script does)."""
    r = subprocess.run([sys.executable, "-m", "tools.cli", "inspect", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("tierstore inspect: error:") and "Traceback" not in r.stderr


def test_train_without_trainer_exit_2(cli, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "trainer", None)  # makes `import trainer` fail
    monkeypatch.setitem(sys.modules, "trainer.demo", None)
    code, _, err = cli("train")
    assert code == 2 and "trainer" in err and "not importable" in err
    code, _, err = cli("train", "--model", "m.json", "--data", "d.npy")
    assert code == 2 and "not importable" in err


def test_train_options_need_model(cli) -> None:
    code, _, err = cli("train", "--max-steps", "3")
    assert code == 2 and "--model is required with --max-steps" in err


def test_train_no_arguments_runs_the_demo(cli, monkeypatch) -> None:
    calls = []
    demo = types.ModuleType("trainer.demo")
    demo.main = lambda argv=None: calls.append(("demo", argv)) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trainer.demo", demo)
    assert cli("train")[0] == 0
    assert calls == [("demo", [])]  # no flags reach the demo from `tierstore train`


def test_train_maps_flags_to_training_arguments(cli, monkeypatch, tmp_path) -> None:
    import numpy as np

    seen: dict[str, object] = {}

    class Args:
        def __init__(self, **kw: object) -> None:
            seen["args"] = kw
            self.output_dir = kw.get("output_dir", "x")

    class Trainer:
        def __init__(self, model, train_dataset, args) -> None:
            seen["dataset"] = train_dataset

        def train(self, resume_from_checkpoint: bool = False):
            return types.SimpleNamespace(global_step=2, training_loss=1.5)

    fake = types.ModuleType("trainer")
    fake.TrainingArguments = Args  # type: ignore[attr-defined]
    fake.Trainer = Trainer  # type: ignore[attr-defined]
    fake.init = lambda **kw: seen.setdefault("init", kw)  # type: ignore[attr-defined]
    fake.load_model = lambda src: types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=300))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trainer", fake)
    (tmp_path / "m").mkdir()
    np.save(tmp_path / "t.npy", np.arange(40, dtype=np.int32))
    code, out, err = cli("train", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "t.npy"),
                         "--block-size", "8", "--max-steps", "2", "--learning-rate", "0.001",
                         "--gradient-accumulation-steps", "4", "--output-dir", str(tmp_path / "o"),
                         "--max-ram-gb", "1")
    assert code == 0, err
    assert seen["args"] == {"output_dir": str(tmp_path / "o"), "max_steps": 2, "learning_rate": 0.001,
                            "gradient_accumulation_steps": 4}
    assert seen["init"] == {"max_ram_gb": 1.0, "offload_dir": str(tmp_path / "o" / "store")}  # the store in D
    assert len(seen["dataset"]) == 5 and seen["dataset"][1]["input_ids"].tolist() == list(range(8, 16))
    assert "trained 2 steps" in out


def test_train_rejects_pickled_npy(cli, monkeypatch, tmp_path) -> None:
    import numpy as np

    fake = types.ModuleType("trainer")
    for name in ("TrainingArguments", "Trainer", "init", "load_model"):
        setattr(fake, name, lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "trainer", fake)
    np.save(tmp_path / "p.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "m").mkdir()
    code, _, err = cli("train", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "p.npy"))
    assert code == 1 and "not a plain .npy array" in err


def test_bench_without_module_exit_2(cli, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tools.bench.store", None)
    code, _, err = cli("bench")
    assert code == 2 and "tools.bench.store" in err


def test_bench_delegates_to_bench_modules(cli, monkeypatch) -> None:
    calls = []
    store_bench = types.ModuleType("tools.bench.store")
    store_bench.main = lambda argv: calls.append(("store", argv)) or 0  # type: ignore[attr-defined]
    codec_bench = types.ModuleType("tools.bench.codecs")
    codec_bench.main = lambda argv: calls.append(("codecs", argv)) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tools.bench.store", store_bench)
    monkeypatch.setitem(sys.modules, "tools.bench.codecs", codec_bench)
    assert cli("bench", "--size", "8MiB", "--tensor", "1MiB", "--repeats", "1")[0] == 0
    assert calls == [("store", ["--size", "8MiB", "--tensor", "1MiB", "--repeats", "1"]),
                     ("codecs", [])]


def test_bench_list_names_every_benchmark_and_runs_none(cli, monkeypatch) -> None:
    from tools.bench import BENCHMARKS, benchmarks

    for name in BENCHMARKS:  # listing reads the files; importing one would fail here
        monkeypatch.setitem(sys.modules, f"tools.bench.{name}", None)
    code, out, err = cli("bench", "--list")
    assert code == 0 and err == ""
    listed = benchmarks()
    assert [b.module for b in listed][: len(BENCHMARKS)] == [f"tools.bench.{n}" for n in BENCHMARKS]
    assert "tools.gpu.bench" in [b.module for b in listed]
    for b in listed:
        assert f"{b.command}\n    {b.measures}\n" in out
        assert b.command == f"python -m {b.module}" and len(b.measures) > 20 and "``" not in b.measures
    assert "python -m tools.bench.store\n    Store throughput vs the raw disk" in out


def test_bench_list_is_complete() -> None:
    """Every module of tools/bench that runs as a command is in the list."""
    import os

    import tools.bench

    folder = os.path.dirname(tools.bench.__file__)
    runnable = set()
    for f in os.listdir(folder):
        if f.endswith(".py") and f != "__init__.py":
            with open(os.path.join(folder, f), encoding="utf-8") as fh:
                if 'if __name__ == "__main__":' in fh.read():
                    runnable.add(f[:-3])
    assert runnable == set(tools.bench.BENCHMARKS)
