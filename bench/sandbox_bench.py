"""Sandbox throughput: executions per second of the code sandbox, with a plain subprocess as the
baseline in the same run on the same machine.

Modes, each running the same programs with the same interpreter:
- ``plain``: ``asyncio.create_subprocess_exec`` of the interpreter, no isolation (the baseline);
- ``fallback``: what the sandbox does without bubblewrap (``unshare -n``, a uid per run, rlimits);
- ``bwrap``: the full sandbox (bubblewrap namespaces, a uid per run, rlimits).
Programs: ``trivial`` (``pass``) and ``heavy_import`` (asyncio, decimal, json, email, http.client,
xml.etree, unittest: the interpreter has no numpy).  ``concurrency`` runs go at once (default 2,
this machine's cores).  Prints one JSON object; needs root and bubblewrap for every mode.

``python -m bench.sandbox_bench [--runs N] [--concurrency C]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time

from rlbus.services.sandbox import Sandbox, SandboxSettings, probe

PROGRAMS = {
    "trivial": "pass",
    "heavy_import": "import asyncio, decimal, json, email.mime.multipart, http.client, xml.etree.ElementTree, unittest",
}


class PlainRunner:
    """The baseline: the same interpreter in a subprocess, output captured, nothing isolated."""

    def __init__(self, python: str) -> None:
        self.python = python

    async def run_code(self, code: str) -> bool:
        proc = await asyncio.create_subprocess_exec(self.python, "-I", "-c", code, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        await proc.communicate()
        return proc.returncode == 0


async def rate(runner, code: str, runs: int, concurrency: int) -> dict:
    async def one() -> bool:
        result = await runner.run_code(code)
        return result if isinstance(result, bool) else result.ok

    await one()  # warm the page cache and the probe
    t0 = time.perf_counter()
    ok = 0
    for start in range(0, runs, concurrency):
        ok += sum(await asyncio.gather(*(one() for _ in range(min(concurrency, runs - start)))))
    wall = time.perf_counter() - t0
    return {"runs": runs, "ok": ok, "execs_per_s": round(runs / wall, 1), "ms_per_exec": round(1000 * wall / runs, 1)}


async def main(runs: int, concurrency: int) -> dict:
    iso = probe()
    settings = SandboxSettings(uid_base=61400, max_concurrent=concurrency)
    runners = {"plain": PlainRunner(settings.python)}
    sandboxes = []
    if iso.separate_uid:
        sandboxes.append(Sandbox(settings.model_copy(update={"uid_base": 61450}), use_bwrap=False))
        runners["fallback"] = sandboxes[-1]
    if iso.bwrap:
        sandboxes.append(Sandbox(settings))
        runners["bwrap"] = sandboxes[-1]
    out: dict = {"machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
                 "isolation": {name: r.isolation.describe() for name, r in runners.items() if hasattr(r, "isolation")},
                 "concurrency": concurrency, "programs": {}}
    try:
        for prog, code in PROGRAMS.items():
            rows = {name: await rate(r, code, runs, concurrency) for name, r in runners.items()}
            for name in runners:
                if name != "plain":
                    rows[name]["vs_plain"] = round(rows[name]["execs_per_s"] / rows["plain"]["execs_per_s"], 2)
            out["programs"][prog] = rows
    finally:
        for sb in sandboxes:
            sb.close()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=100, help="executions per mode and program")
    ap.add_argument("--concurrency", type=int, default=2, help="executions at once")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.runs, args.concurrency)), indent=2))
