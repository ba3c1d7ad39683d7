"""Crash harness for training: SIGKILL a training run at random moments, resume, compare.

    python -m tools.harness.crash_train --trials 50 [--steps 16] [--dir DIR]

A tiny deterministic CPU run (a 2-layer Llama, a checkpoint commit every step, budgets under
the weights and the training state so that the device window, the RAM tier and the disk are all
in use) is first trained without interruption: the reference losses and the final store. Each
trial then starts the same run in a fresh folder, kills it with SIGKILL a random time after its
first commit (during the forward/backward, puts, write-behind, the optimizer thread or a
commit), opens the store read-only and verifies every committed chunk, and resumes it with
``resume_from_checkpoint=True`` in a new process (possibly killing that one too) until the run
reaches its last step. Every step logged by any of the processes (also one logged by a killed
process after its last commit) must equal the reference, and so must every tensor of the final
store, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import tierstore

# Fields of a log entry that a deterministic run reproduces; the others are timings.
EXACT_FIELDS = ("step", "loss", "learning_rate", "grad_norm")
STATE_KEY = "trainer/state"  # the trainer's JSON state holds timings: compared field by field


def child(out: str, steps: int, resume: bool) -> None:
    """Train the tiny run in ``out`` (resuming its store if asked), printing each log and commit."""
    torch.set_num_threads(1)  # one thread: the float sums are in the same order in every process
    from transformers import AutoModelForCausalLM, LlamaConfig

    import trainer as mt
    from trainer.data import default_dataset

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # on resume its weights are ignored (the store's win)
    n_params = sum(p.numel() for p in model.parameters())
    # The window holds under half the weights, the RAM tier a third of the state (16 B a parameter).
    mt.init(offload_dir=os.path.join(out, "store"), max_vram_gb=f"{4 * n_params * 45 // 100}B",
            max_ram_gb=f"{16 * n_params // 3}B", optimizer_compression=True, device="cpu")
    args = mt.TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                learning_rate=2e-3, weight_decay=0.1, max_steps=steps, warmup_steps=3,
                                max_grad_norm=1.0, logging_steps=1, save_steps=1, disable_tqdm=True)

    class PrintingTrainer(mt.Trainer):
        def _log(self, *a: Any, **kw: Any) -> None:
            super()._log(*a, **kw)
            entry = self.state.log_history[-1]
            print("log", json.dumps({k: entry[k] for k in EXACT_FIELDS}), flush=True)

    tr = PrintingTrainer(model=model, train_dataset=default_dataset(block_size=32, max_bytes=64 * 1024), args=args)
    store = tr.store
    commit = store.commit

    def printing_commit(step: int | None = None, message: str = "") -> int:
        # The parent times its kill from the first commit and checks that none is lost.
        version = commit(step=step, message=message)
        print("commit", step, flush=True)
        return version

    store.commit = printing_commit  # an instance attribute: the Trainer calls store.commit(...)
    try:
        tr.train(resume_from_checkpoint=True if resume else None)
    finally:
        tr.close()
    print("done", flush=True)


@dataclass
class Run:
    """What one child process printed before it exited or was killed."""

    logs: list[dict[str, Any]] = field(default_factory=list)
    commits: list[int] = field(default_factory=list)
    done: bool = False
    killed: bool = False
    error: str = ""
    training_s: float = 0.0
    """Seconds from the first commit to the exit or the kill."""


def _parse(lines: list[str], run: Run) -> None:
    for i, line in enumerate(lines):
        kind, _, rest = line.partition(" ")
        try:
            if kind == "log":
                run.logs.append(json.loads(rest))
            elif kind == "commit":
                run.commits.append(int(rest))
            elif kind == "done":
                run.done = True
        except ValueError:
            if not (run.killed and i == len(lines) - 1):  # a line cut by the kill is expected
                run.error = f"unparsable output line {line!r}"


def run_child(out: str, steps: int, resume: bool, delay: float | None) -> Run:
    """Run ``child`` in a subprocess; kill it ``delay`` seconds after its first commit (None: never)."""
    code = ("import sys; from tools.harness.crash_train import child; "
            "child(sys.argv[1], int(sys.argv[2]), sys.argv[3] == '1')")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", code, out, str(steps), "1" if resume else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    run = Run()
    lines: list[str] = []
    # The clock starts at the child's first commit, so that slow imports on a loaded machine
    # never turn a kill into one before anything was committed.
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("commit ") or line.startswith("done"):
            break
    t0 = time.perf_counter()
    if delay is not None and proc.poll() is None and lines and lines[-1].startswith("commit "):
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    rest, err = proc.communicate()
    run.training_s = time.perf_counter() - t0
    lines += rest.splitlines()
    run.killed = proc.returncode == -signal.SIGKILL
    _parse(lines, run)
    if proc.returncode not in (0, -signal.SIGKILL):
        run.error = f"child exited with {proc.returncode}: {err[-800:]}"
    elif proc.returncode == 0 and not run.done:
        run.error = "child exited 0 without finishing"
    return run


def open_and_verify(store_path: str) -> tuple[int | None, list[str]]:
    """Open the store read-only; its last committed step and the faults ``verify`` finds."""
    try:
        with tierstore.open(store_path, mode="r", ram_budget="64MiB", device_budget="64MiB", device="cpu") as s:
            versions = s.versions()
            step = versions[-1].step if versions else None
            return step, [str(f) for f in s.verify()]
    except Exception as e:  # noqa: BLE001  (a store that does not open is what we count)
        return None, [f"open failed: {type(e).__name__}: {e}"]


def final_tensors(store_path: str) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Every tensor of the store's last commit but the trainer state, and the state's exact log."""
    with tierstore.open(store_path, mode="r", ram_budget="64MiB", device_budget="64MiB", device="cpu") as s:
        tensors = {k: s.get(k).clone() for k in s.keys() if k != STATE_KEY}
        state = json.loads(bytes(s.get(STATE_KEY).numpy().tobytes()))
    return tensors, [{k: e[k] for k in EXACT_FIELDS} for e in state["log_history"]]


@dataclass
class Reference:
    """The uninterrupted run: per-step log entries, final store tensors, seconds after step 1."""

    logs: dict[int, dict[str, Any]]
    tensors: dict[str, torch.Tensor]
    seconds: float


def reference(base: str, steps: int) -> Reference:
    """Train the run once without a kill."""
    out = os.path.join(base, "reference")
    run = run_child(out, steps, resume=False, delay=None)
    if run.error or not run.done:
        raise RuntimeError(f"the reference run failed: {run.error}")
    tensors, _ = final_tensors(os.path.join(out, "store"))
    logs = {e["step"]: e for e in run.logs}
    if sorted(logs) != list(range(1, steps + 1)):
        raise RuntimeError(f"the reference run logged steps {sorted(logs)}, not 1..{steps}")
    return Reference(logs, tensors, run.training_s)


@dataclass
class TrialResult:
    """The outcome of one run trained to the end across kills."""

    kills: int = 0
    kill_steps: list[int] = field(default_factory=list)
    """The last committed step after each kill."""
    corrupted: list[str] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def first_log_difference(logs: list[dict[str, Any]], ref: Reference) -> str | None:
    """The first logged step (in step order) whose exact fields differ from the reference's."""
    for e in sorted(logs, key=lambda e: e["step"]):
        want = ref.logs.get(e["step"])
        if want != e:
            return f"step {e['step']}: logged {e}, reference {want}"
    return None


def trial(out: str, ref: Reference, steps: int, rng: random.Random, max_kills: int, span: float) -> TrialResult:
    """Train one run in ``out`` to ``steps``, killing it up to ``max_kills`` times; check it all."""
    res = TrialResult()
    store_path = os.path.join(out, "store")
    logs: list[dict[str, Any]] = []
    resume = False
    committed = 1  # the step at which the next start's kill clock starts
    for attempt in range(max_kills + 1 + 3):  # a few spare starts where a kill came too late
        # Uniform over what is left of the run, so that a resumed start is killed as often.
        left = span * max(0, steps - committed) / max(1, steps - 1)
        delay = rng.uniform(0.0, left) if res.kills < max_kills else None
        run = run_child(out, steps, resume, delay)
        logs += run.logs
        if run.error:
            res.errors.append(f"start {attempt + 1}: {run.error}")
            return res
        if run.done:
            break
        res.kills += 1
        step, faults = open_and_verify(store_path)
        if faults:
            res.corrupted.append(f"kill {res.kills}: " + "; ".join(faults[:3]))
            return res
        # The kill may fall between a durable commit and its printed line, never before the commit.
        printed = run.commits[-1] if run.commits else None
        if step is None or printed is None or step not in (printed, printed + 1):
            res.corrupted.append(f"kill {res.kills}: last commit is step {step}, the child printed {printed}")
            return res
        res.kill_steps.append(step)
        committed = step + 1
        resume = True
    else:
        res.errors.append("the run did not reach its last step")
        return res
    diff = first_log_difference(logs, ref)
    if diff is None and sorted({e["step"] for e in logs}) != list(range(1, steps + 1)):
        diff = f"logged steps {sorted({e['step'] for e in logs})}, not 1..{steps}"
    step, faults = open_and_verify(store_path)
    if faults:
        res.corrupted.append("final store: " + "; ".join(faults[:3]))
        return res
    tensors, state_log = final_tensors(store_path)
    if diff is None:
        diff = first_log_difference(state_log, ref)  # the history carried through the checkpoints
    if diff is not None:
        res.differing.append(f"trajectory differs at {diff}")
    if set(tensors) != set(ref.tensors):
        res.differing.append(f"store keys differ: {sorted(set(tensors) ^ set(ref.tensors))[:5]}")
    else:
        bad = [k for k, t in ref.tensors.items() if not torch.equal(tensors[k], t)]
        if bad:
            res.differing.append(f"final tensors differ: {bad[:5]} ({len(bad)} of {len(tensors)})")
    return res


def main(argv: list[str] | None = None) -> int:
    """Run the reference and the trials, print a summary; exit 1 on a corrupted or differing run."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=50, help="runs trained to the end across kills")
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps of each run")
    ap.add_argument("--max-kills", type=int, default=2, help="kills per run at most (1..this, at random)")
    ap.add_argument("--dir", default=None, help="where to make the runs (default: a temp dir, removed)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    base = tempfile.mkdtemp(prefix="crash-train-", dir=args.dir)
    t0 = time.perf_counter()
    kills = corrupted = differing = errors = 0
    try:
        ref = reference(base, args.steps)
        # Kill times span the reference's training after its first commit, so kills fall on every step.
        # (less a margin: a loaded machine may run a start faster than it ran the reference).
        span = max(0.2, 0.6 * ref.seconds)
        print(f"reference: steps 2..{args.steps} in {ref.seconds:.1f}s, final loss {ref.logs[args.steps]['loss']:.6f}; "
              f"kills within {span:.1f}s of a start's first commit", flush=True)
        for i in range(args.trials):
            out = os.path.join(base, f"trial-{i:03d}")
            res = trial(out, ref, args.steps, rng, rng.randint(1, args.max_kills), span)
            kills += res.kills
            corrupted += bool(res.corrupted)
            differing += bool(res.differing)
            errors += bool(res.errors)
            problems = res.corrupted + res.differing + res.errors
            print(f"trial {i + 1}/{args.trials}: {res.kills} kill(s) (store at steps {res.kill_steps}): "
                  + ("ok" if not problems else "; ".join(problems)), flush=True)
            if not problems and not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.keep and not (corrupted or differing or errors):
            shutil.rmtree(base, ignore_errors=True)
    print(f"trials {args.trials}, kills {kills}, corrupted stores {corrupted}, differing runs {differing}, "
          f"harness errors {errors}; {time.perf_counter() - t0:.0f}s")
    print(f"{kills} kills, {corrupted} corrupted, {differing} differing")
    return 1 if corrupted or differing or errors else 0


if __name__ == "__main__":
    sys.exit(main())
