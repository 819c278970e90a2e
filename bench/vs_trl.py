"""Race TRL's GRPOTrainer against `rlbus up` on 3-digit addition: wall seconds to held-out 0.8 / 0.9.

Both systems run one after the other on this machine, from the same warm-start Hugging Face folder
(default models/tiny-addition, built with `rlbus init-model` when missing), with the same recipe:
group size 8, 32 prompts per optimiser step, AdamW lr 1e-4, no KL, temperature 1.0, at most 6 new
tokens, 1 torch thread per process, the same 65536 training tasks (make_split("train", 65536, 0)) and
the same 200 held-out tasks (make_split("heldout", 200, 0)), evaluated greedily every 2 steps.

Prints ONE JSON object (also written to --out): per system the seconds to held-out >= 0.8 and >= 0.9
(null when not reached within --budget), the accuracy curve, and trl_time / rlbus_time per threshold.

Clocks (the same definition on both sides: "seconds of training until weights with that held-out
accuracy existed", model loading and process start-up excluded):
  * TRL (bench/trl_grpo.py): from `on_train_begin`; the evaluation callback runs between steps, in
    the training process, and its time is subtracted.
  * rlbus: from the moment all services are up = the latest `*_ready` log event of the services
    (the generator's, after it has imported torch and loaded the model; the trainer loads at the
    same time and has no ready event of its own). An eval point is placed at the time the trainer
    produced the evaluated version (its `step` log event).
    --rlbus-eval posthoc (default): every version the trainer writes is hard-linked out of the run
    folder by this driver, and every 2nd one is evaluated after the run with TRL's own evaluation
    function (bench/trl_grpo.py greedy_heldout_accuracy) — evaluation off the clock on both sides.
    The pipeline itself evaluates only every 20 versions, so `rlbus up` stops near the target.
    --rlbus-eval inline: rlbus evaluates every 2 versions in its own pipeline, concurrently with
    training, on the same cores, so evaluation is on its clock (the earlier, harsher reading).
    The `known_at` variant places each inline point when the 200th eval result reached the monitor
    instead (eval latency included).
  `rlbus up` feeds training tasks to the bus as its backlog drains, from the same process that
  watches the run; that work is on rlbus's clock.
  The raw `rlbus up` monitor clock (`t` in metrics.jsonl: seconds since `rlbus up` started watching,
  right after launching the service processes, so it includes their boot) is kept per point as
  `t_monitor`.

`rlbus up` evaluates held-out tasks with the task file's sampling parameters; its own held-out
file has none, so it would sample at temperature 1 with up to 16 tokens. This bench hands the
controller its own held-out file (same 200 tasks, `sampling: {temperature: 0, max_new_tokens: 6}`)
so both sides measure greedy accuracy.

  .venv/bin/python bench/vs_trl.py --quick              # plumbing check, 60 s per system
  .venv/bin/python bench/vs_trl.py --out vs_trl.json    # the real race, up to 600 s per system
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pipeline_bench import with_settings  # noqa: E402
from bench.trl_grpo import (  # noqa: E402
    EVAL_SEED,
    EVAL_TASKS,
    GROUP_SIZE,
    LEARNING_RATE,
    MAX_NEW_TOKENS,
    PROMPTS_PER_STEP,
    TEMPERATURE,
    TRAIN_SEED,
    TRAIN_TASKS,
    first_time_at,
)

THRESHOLDS = (0.8, 0.9)
# Also reported (not the headline): useful when a loaded machine keeps both below 0.8 in the budget.
AUX_THRESHOLDS = (0.5, 0.6, 0.7)
EVAL_EVERY = 2
# --rlbus-eval posthoc: the pipeline still evaluates now and then, so `rlbus up` stops at the target.
POSTHOC_LIVE_EVAL_EVERY = 20
STALL_S = 120.0  # stop `rlbus up` when its trainer has not stepped for this long


def log(msg: str) -> None:
    print(f"[vs_trl {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}


def ensure_model(path: Path) -> None:
    if (path / "config.json").exists():
        return
    log(f"no model at {path}: building it with `rlbus init-model` …")
    subprocess.run([sys.executable, "-m", "rlbus.services.cli", "init-model", "--out", str(path)], check=True, cwd=ROOT,
                   env=child_env())


# --------------------------------------------------------------------------------------------- TRL


def run_trl(model: Path, budget: float, work: Path) -> dict[str, Any]:
    out = work / "trl.json"
    cmd = [sys.executable, str(ROOT / "bench" / "trl_grpo.py"), "--model", str(model), "--budget", str(budget),
           "--eval-every", str(EVAL_EVERY), "--stop-at", str(max(THRESHOLDS)), "--out", str(out)]
    log(f"TRL: {' '.join(cmd)}")
    started = time.perf_counter()
    with open(work / "trl.log", "w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=fh,
                              timeout=budget * 3 + 600)
    if proc.returncode != 0 or not out.exists():
        tail = (work / "trl.log").read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"TRL run failed ({proc.returncode}):\n" + "\n".join(tail))
    result = json.loads(out.read_text())
    result["process_seconds"] = round(time.perf_counter() - started, 1)
    return result


# ------------------------------------------------------------------------------------------- rlbus


def write_greedy_heldout(path: Path) -> None:
    from rlbus.services.tasks.addition import make_split, task_record

    with path.open("w") as fh:
        for task in make_split("heldout", EVAL_TASKS, EVAL_SEED):
            row = {**task_record(task), "sampling": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}}
            fh.write(json.dumps(row) + "\n")


def rlbus_config(model: Path, heldout: Path, *, eval_every: int, keep_versions: int) -> str:
    return f"""[run]
run = "vs-trl"
model_path = "{model}"
group_size = {GROUP_SIZE}
batch_groups = {PROMPTS_PER_STEP}

[trainer]
lr = {LEARNING_RATE}
threads = 1

[trainer.objective]
kl_coef = 0.0

[generator]
threads = 1

[broadcast]
keep_versions = {keep_versions}

[controller]
eval_every = {eval_every}
eval_tasks = "{heldout}"

[up]
max_steps = 100000
stop_at_accuracy = {max(THRESHOLDS)}
eval_tasks = {EVAL_TASKS}
train_tasks = {TRAIN_TASKS}
seed = {TRAIN_SEED}
max_new_tokens = {MAX_NEW_TOKENS}
temperature = {TEMPERATURE}
backend = "torch"
generators = 1
"""


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _log_events(log_dir: Path) -> tuple[dict[str, float], dict[int, float]]:
    """(`*_ready` event -> unix time, trainer step -> unix time of its `step` event)."""
    ready: dict[str, float] = {}
    steps: dict[int, float] = {}
    for f in sorted(log_dir.glob("*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if not line.startswith("{") or '"event"' not in line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            event, stamp = row.get("event", ""), row.get("timestamp")
            if not stamp:
                continue
            if event.endswith("_ready"):
                ready.setdefault(f"{f.stem}:{event}", _ts(stamp))
            elif event == "step" and row.get("service") == "trainer" and "step" in row:
                steps.setdefault(int(row["step"]), _ts(stamp))
    return ready, steps


def _stalled_for(trainer_log: Path) -> float | None:
    """Seconds since the trainer's last `step` event (None before the first)."""
    last = None
    try:
        lines = trainer_log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"event": "step"' in line:
            try:
                last = _ts(json.loads(line)["timestamp"])
            except (json.JSONDecodeError, KeyError, ValueError):
                continue
            break
    return None if last is None else time.time() - last


class VersionArchive:
    """Hard-links every weight version `rlbus up` writes (file transport, in its run folder) into
    `dest` before weight-broadcast retires it, so each version can be evaluated after the run.

    A link costs no copy and no CPU worth measuring, and it happens in this driver process, not
    in the pipeline whose clock is being read.
    """

    def __init__(self, run_dir: Path, dest: Path) -> None:
        self.src = run_dir / "weights" / "policy"
        self.dest = dest
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        self.dest.mkdir(parents=True, exist_ok=True)
        while not self.stop.is_set():
            self.sweep()
            self.stop.wait(0.1)
        self.sweep()

    def sweep(self) -> None:
        for f in self.src.glob("v*/model.safetensors") if self.src.exists() else []:
            target = self.dest / f"{f.parent.name}.safetensors"
            if not target.exists():
                try:
                    os.link(f, target)
                except FileNotFoundError:
                    pass  # retired between the glob and the link; the next one will not be

    def versions(self) -> dict[int, Path]:
        return {int(p.stem.removeprefix("v")): p for p in sorted(self.dest.glob("v*.safetensors"))}


def posthoc_curve(model: Path, archive: dict[int, Path], produced_at: dict[int, float], budget: float,
                  stop_at: float) -> list[dict[str, Any]]:
    """Greedy held-out accuracy of every EVAL_EVERY-th archived version, with TRL's own evaluation
    function, placed at the time the trainer produced that version (seconds since services up).
    Stops after two consecutive evaluations at or above `stop_at` (TRL stops at its first)."""
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM

    from bench.trl_grpo import _tokenizer_with_bos, greedy_heldout_accuracy
    from rlbus.services.tasks.addition import make_split

    torch.set_num_threads(1)  # as TRL's in-process evaluation
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer = _tokenizer_with_bos(str(model))
    heldout = make_split("heldout", EVAL_TASKS, EVAL_SEED)
    curve: list[dict[str, Any]] = [{"t": 0.0, "acc": greedy_heldout_accuracy(policy, tokenizer, heldout), "version": 0}]
    above = 0
    for v in sorted(archive):
        t = produced_at.get(v)
        if v % EVAL_EVERY or t is None or t > budget:
            continue
        policy.load_state_dict(safetensors.torch.load_file(str(archive[v])))
        acc = greedy_heldout_accuracy(policy, tokenizer, heldout)
        curve.append({"t": round(t, 3), "acc": acc, "version": v})
        above = above + 1 if acc >= stop_at else 0
        if above >= 2:
            break
    return curve


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
    return rows


def run_rlbus(model: Path, budget: float, work: Path, eval_mode: str, *, deterministic: bool = False,
              settings: list[str] | None = None) -> dict[str, Any]:
    run_dir = work / "rlbus-run"
    heldout = work / "heldout-greedy.jsonl"
    write_greedy_heldout(heldout)
    cfg = work / "rlbus.toml"
    if eval_mode == "posthoc":
        # Evaluation off the clock, as TRL's: the pipeline only evaluates now and then (to stop at
        # the target), and every version is kept for evaluation after the run.
        text = rlbus_config(model.resolve(), heldout.resolve(), eval_every=POSTHOC_LIVE_EVAL_EVERY, keep_versions=20)
    else:
        text = rlbus_config(model.resolve(), heldout.resolve(), eval_every=EVAL_EVERY, keep_versions=3)
    if deterministic:
        settings = [*(settings or []), "trainer.deterministic=true", "generator.deterministic=true"]
    cfg.write_text(with_settings(text, settings or [], flag="--rlbus-set"))
    archive = VersionArchive(run_dir, work / "versions")
    if eval_mode == "posthoc":
        archive.thread.start()
    cmd = [sys.executable, "-m", "rlbus.services.cli", "up", str(cfg), "--run-dir", str(run_dir), "--no-view"]
    log(f"rlbus: {' '.join(cmd)}")
    launched = time.time()
    out_log = open(work / "rlbus.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    monitor_t0: list[float] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            # `rlbus up` prints this line once its services are launched, then starts watching
            # (t = 0 of metrics.jsonl).
            if not monitor_t0 and line.startswith("rlbus up: run folder"):
                monitor_t0.append(time.time())
            out_log.write(line)
            out_log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stop_why = "held-out target reached"
    hard_deadline = time.time() + budget + 300  # boot + slack; never hang the bench
    ready_at: float | None = None
    last_check = 0.0
    while proc.poll() is None:
        time.sleep(1.0)
        if ready_at is not None and time.time() - last_check > 5:
            last_check = time.time()
            stalled = _stalled_for(run_dir / "logs" / "trainer.log")
            if stalled is not None and stalled > STALL_S:
                stop_why = f"stalled: no trainer step for {stalled:.0f} s (task pool drained or a service hung)"
                log(f"rlbus: {stop_why}; stopping `rlbus up` (SIGTERM)")
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=150)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                break
        if ready_at is None:
            ready, _ = _log_events(run_dir / "logs")
            gens = [k for k in ready if k.startswith("generator")]
            if gens and any(k.startswith("environment") for k in ready):
                ready_at = max(ready.values())
        if (ready_at is not None and time.time() - ready_at > budget) or time.time() > hard_deadline:
            stop_why = f"budget {budget}s"
            log("rlbus: budget spent, stopping `rlbus up` (SIGTERM)")
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=150)
            except subprocess.TimeoutExpired:
                log("rlbus: `rlbus up` did not stop in 150 s; killing it (its services may need a manual stop)")
                proc.kill()
                proc.wait()
            break
    reader.join(timeout=10)
    out_log.close()
    archive.stop.set()
    if archive.thread.is_alive():
        archive.thread.join(timeout=10)
    if proc.returncode not in (0, -signal.SIGTERM, 143) and stop_why.startswith("held-out"):
        stop_why = f"rlbus up exited with {proc.returncode}"
    if not monitor_t0:
        tail = (work / "rlbus.log").read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"`rlbus up` never started watching ({proc.returncode}):\n" + "\n".join(tail))
    # Kept so --reparse can rebuild the result from the work dir without rerunning.
    (work / "rlbus-clock.json").write_text(json.dumps(
        {"launched": launched, "monitor_t0": monitor_t0[0], "stopped": stop_why, "exit_code": proc.returncode,
         "eval_mode": eval_mode}))
    return parse_rlbus(model, budget, work)


def parse_rlbus(model: Path, budget: float, work: Path) -> dict[str, Any]:
    run_dir = work / "rlbus-run"
    clock = json.loads((work / "rlbus-clock.json").read_text())
    launched, t0, stop_why = clock["launched"], clock["monitor_t0"], clock["stopped"]
    ready, step_ts = _log_events(run_dir / "logs")
    if not ready:
        raise RuntimeError(f"no service of the rlbus run in {run_dir} logged a *_ready event")
    ready_at = max(ready.values())
    rows = _read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in rows if r.get("kind") == "eval"]
    trains = [r for r in rows if r.get("kind") == "train"]
    curve, known = [], []
    for r in evals:
        v = min(r["versions"])  # the oldest weights that produced any of the 200 answers
        produced = ready_at if v == 0 else step_ts.get(v)
        t_known = t0 + r["t"] - ready_at
        t_weights = (produced - ready_at) if produced is not None else t_known
        point = {"t": round(max(t_weights, 0.0), 3), "acc": r["heldout/accuracy"], "version": r["eval_round"],
                 "versions": r["versions"], "t_known": round(t_known, 3), "t_monitor": r["t"]}
        if point["t"] <= budget:
            curve.append(point)
            known.append({"t": point["t_known"], "acc": point["acc"]})
    last_step = max(step_ts) if step_ts else 0
    train_s = (step_ts[last_step] - ready_at) if last_step else None
    eval_mode = clock.get("eval_mode", "inline")
    inline = curve
    if eval_mode == "posthoc":
        versions = VersionArchive(run_dir, work / "versions").versions()
        log(f"rlbus: evaluating {len(versions) // EVAL_EVERY} of {len(versions)} archived versions after the run")
        curve = posthoc_curve(model, versions, {v: ts - ready_at for v, ts in step_ts.items()}, budget,
                              max(THRESHOLDS))
    return {
        "system": "rlbus",
        "model": str(model),
        "eval_mode": eval_mode,
        "t_to_0.8": first_time_at(curve, 0.8),
        "t_to_0.9": first_time_at(curve, 0.9),
        "known_at": {f"t_to_{th}": first_time_at(sorted(known, key=lambda p: p["t"]), th) for th in THRESHOLDS},
        "inline_t_to": {f"t_to_{th}": first_time_at(inline, th) for th in THRESHOLDS},
        "steps": last_step,
        "s_per_step": round(train_s / last_step, 4) if last_step and train_s else None,
        "train_seconds": round(train_s, 3) if train_s is not None else None,
        "boot_seconds": round(ready_at - launched, 3),
        # `rlbus up` publishes every training task after starting the services; while it still publishes,
        # the services already run (and train) on the clock, sharing the cores with the publisher.
        "publishing_after_ready_s": round(max(t0 - ready_at, 0.0), 3),
        "steps_while_publishing": sum(1 for ts in step_ts.values() if ts < t0),
        "ready_events": {k: round(v - launched, 3) for k, v in sorted(ready.items(), key=lambda kv: kv[1])},
        "groups_filtered_total": (trains[-1].get("trainer/groups_dropped_total") if trains else None),
        "train_tasks_published": TRAIN_TASKS,
        "train_tasks_consumed": (int(trains[-1].get("trainer/groups_trained_total", 0)
                                     + trains[-1].get("trainer/groups_dropped_total", 0)) if trains else None),
        "evals": len(evals),
        "stopped": stop_why,
        "exit_code": clock["exit_code"],
        "run_dir": str(run_dir),
        "clock": ("seconds since all services were up (latest *_ready log event); each eval point at the time the "
                  "trainer produced the evaluated version; "
                  + ("every 2nd version evaluated after the run with TRL's evaluation function (evaluation off the "
                     "clock, as TRL's); the pipeline evaluated only every "
                     f"{POSTHOC_LIVE_EVAL_EVERY} versions, to stop at the target" if eval_mode == "posthoc" else
                     "evaluation runs concurrently in the pipeline every 2 versions and is not subtracted")),
        "curve": curve,
        "inline_curve": inline,
    }


# -------------------------------------------------------------------------------------------- main


def first_sustained(curve: list[dict[str, Any]], threshold: float) -> float | None:
    """First t of two consecutive evaluations >= threshold (a 200-task accuracy has ~0.03 noise)."""
    for a, b in zip(curve, curve[1:], strict=False):
        if a["acc"] >= threshold and b["acc"] >= threshold:
            return a["t"]
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b is not None and b > 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny-addition", help="warm-start Hugging Face folder (built if missing)")
    p.add_argument("--budget", type=float, default=600.0, help="training seconds per system before giving up")
    p.add_argument("--quick", action="store_true", help="plumbing check: --budget 60")
    p.add_argument("--only", choices=["trl", "rlbus"], default=None, help="run one system only")
    p.add_argument("--work-dir", default=None, help="where logs and the rlbus run folder go (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--rlbus-eval", choices=["posthoc", "inline"], default="posthoc",
                   help="posthoc (default): evaluate rlbus's versions after the run, off its clock like TRL's; "
                        "inline: evaluate every 2 versions inside the running pipeline, on its clock")
    p.add_argument("--deterministic", action="store_true",
                   help="run rlbus with deterministic = true on generator and trainer (bit-exact logprobs)")
    p.add_argument("--rlbus-set", action="append", default=[], metavar="TABLE.KEY=VALUE",
                   help="one more rlbus setting (TOML value), e.g. generator.batch_wait_s=0; repeatable")
    p.add_argument("--reparse", action="store_true",
                   help="rebuild the JSON from an earlier --work-dir (trl.json, rlbus-run/) without running anything")
    args = p.parse_args(argv)
    if args.reparse and not args.work_dir:
        p.error("--reparse needs --work-dir")
    budget = 60.0 if args.quick else args.budget
    model = Path(args.model)
    if not model.is_absolute():
        model = (Path.cwd() / model).resolve()
    if not args.reparse:
        ensure_model(model)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"work dir {work}")
    from rlbus.services.policy.model_info import MODEL_INFO_FILE

    info_file = model / MODEL_INFO_FILE
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    result: dict[str, Any] = {
        "bench": "vs_trl",
        "quick": bool(args.quick),
        "budget_s": budget,
        "model": str(model),
        "warm_start_heldout_accuracy": info.get("heldout_accuracy"),
        "recipe": {"group_size": GROUP_SIZE, "prompts_per_step": PROMPTS_PER_STEP, "lr": LEARNING_RATE, "kl": 0.0,
                   "temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS, "train_tasks": TRAIN_TASKS,
                   "heldout_tasks": EVAL_TASKS, "heldout_decoding": "greedy", "eval_every_steps": EVAL_EVERY,
                   "torch_threads_per_process": 1},
        "machine": {"cpus": os.cpu_count()},
        "work_dir": str(work),
    }
    systems = [args.only] if args.only else ["trl", "rlbus"]
    for name in systems:
        if not args.reparse:
            result["machine"][f"loadavg_before_{name}"] = [round(x, 2) for x in os.getloadavg()]
        if args.reparse and name == "trl":
            res = json.loads((work / "trl.json").read_text())
        elif args.reparse:
            res = parse_rlbus(model, budget, work)
        else:
            res = run_trl(model, budget, work) if name == "trl" else run_rlbus(model, budget, work, args.rlbus_eval,
                                                                                    deterministic=args.deterministic,
                                                                                    settings=args.rlbus_set)
        if not args.reparse:
            result["machine"][f"loadavg_after_{name}"] = [round(x, 2) for x in os.getloadavg()]
        res["t_to_aux"] = {str(th): first_time_at(res["curve"], th) for th in AUX_THRESHOLDS}
        res["t_to_sustained"] = {str(th): first_sustained(res["curve"], th) for th in THRESHOLDS}
        res["best_acc"] = max((pt["acc"] for pt in res["curve"]), default=None)
        res["final_acc"] = res["curve"][-1]["acc"] if res["curve"] else None
        result[name] = res
        log(f"{name}: 0.8 at {res['t_to_0.8']} s, 0.9 at {res['t_to_0.9']} s, {res['steps']} steps ({res['stopped']})")
    if "trl" in result and "rlbus" in result:
        result["ratio_trl_over_rlbus"] = {
            str(th): _ratio(result["trl"][f"t_to_{th}"], result["rlbus"][f"t_to_{th}"]) for th in THRESHOLDS}
        result["ratio_trl_over_rlbus_sustained"] = {
            str(th): _ratio(result["trl"]["t_to_sustained"][str(th)], result["rlbus"]["t_to_sustained"][str(th)])
            for th in THRESHOLDS}
        result["ratio_trl_over_rlbus_aux"] = {
            str(th): _ratio(result["trl"]["t_to_aux"][str(th)], result["rlbus"]["t_to_aux"][str(th)])
            for th in AUX_THRESHOLDS}
        result["ratio_trl_over_rlbus_known_at"] = {
            str(th): _ratio(result["trl"][f"t_to_{th}"], result["rlbus"]["known_at"][f"t_to_{th}"])
            for th in THRESHOLDS}
    result["notes"] = [
        "TRL's clock excludes its held-out evaluation (run between steps). rlbus with --rlbus-eval posthoc (default): "
        "versions are evaluated after the run with the same function, so evaluation is off both clocks; with "
        "--rlbus-eval inline rlbus evaluates every 2 versions inside its pipeline and that cost is on its clock.",
        "rlbus drops zero-variance groups and trains on 32 informative groups per step (more sampling per step); "
        "TRL trains on 32 groups whatever their variance (zero-variance groups get advantage 0).",
        "rlbus is asynchronous (max_staleness 2, truncated IS); TRL is on-policy (1 generation per step).",
        "The two runs are sequential on a shared machine: compare loadavg_before_*; one seed each.",
        "t_to_* is the first evaluation at or above the threshold; a 200-task accuracy has ~0.03 standard error, "
        "so t_to_sustained (two consecutive evaluations at or above it) is the less noisy reading.",
    ]
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
