"""What fsync-before-acknowledge costs: acked publishes/s with JetStream's default fsync (every two
minutes) against ``sync_interval: always`` (deploy/nats/cluster-node.conf, and why), on this
machine's disk.

Two embedded servers run side by side, one per setting, on the same file system; repetitions
alternate between them so that other load on the machine hits both alike.  Each repetition
publishes ``--messages`` messages of ~1 KiB through the bus (``JetStreamBus``) to a fresh run's
TASKS stream, in two patterns:

- ``sequential``: one publish at a time, each waiting for its ack (a service publishing one
  result, then acking its input: bound by the latency of one durable write);
- ``pipelined``: ``publish_many`` (many acks outstanding; the server may fsync many at once).

With ``--cluster`` the same on two 3-node clusters (``replicas = 3``), where each write is also
replicated to a quorum before it is acknowledged.  Prints one JSON object: per setting and
pattern the median acked publishes/s and every repetition, and ``always / default`` ratios.

``python -m bench.sync_cost [--reps 5] [--messages 2000] [--cluster] [--dir PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlbus.bus.jetstream import JetStreamBus
from rlbus.bus.retention import Retention
from rlbus.bus.server import EmbeddedServer, cluster_nodes

MESSAGE_BYTES = 1024
SETTINGS = {"default": None, "always": "always"}
PIPELINE_CHUNK = 500  # messages per publish_many call


def file_system(path: Path) -> str:
    """The type of the file system ``path`` is on (from /proc/mounts; '' where unknown)."""
    best, kind = "", ""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in mounts:
        parts = line.split()
        if len(parts) > 2 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
            best, kind = parts[1], parts[2]
    return kind


async def one_rep(urls: str, run: str, replicas: int, messages: int) -> dict[str, float]:
    bus = await JetStreamBus.connect(urls, run, name="sync-bench", retention=Retention(replicas=replicas),
                                     connect_timeout=60.0)
    try:
        s = bus.subjects
        payload = os.urandom(MESSAGE_BYTES)
        t0 = time.perf_counter()
        for i in range(messages):
            await bus.publish(s.tasks("seq"), payload, msg_id=f"s{i}")
        sequential = messages / (time.perf_counter() - t0)
        items = [(s.tasks("pipe"), payload, f"p{i}") for i in range(messages * 5)]
        t0 = time.perf_counter()
        for k in range(0, len(items), PIPELINE_CHUNK):
            await bus.publish_many(items[k:k + PIPELINE_CHUNK])
        pipelined = len(items) / (time.perf_counter() - t0)
        stored = sum(st.messages for st in await bus.streams() if st.name == s.stream("TASKS"))
        if stored != messages * 6:
            raise RuntimeError(f"{stored} messages stored of {messages * 6} acked: the benchmark lost some")
        return {"sequential": sequential, "pipelined": pipelined}
    finally:
        await bus.close()


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {pattern: {"median_msgs_s": round(statistics.median(r[pattern] for r in runs), 1),
                      "runs_msgs_s": [round(r[pattern], 1) for r in runs]}
            for pattern in ("sequential", "pipelined")}


async def compare(setups: dict[str, list[EmbeddedServer]], replicas: int, reps: int, messages: int) -> dict[str, Any]:
    for nodes in setups.values():
        await asyncio.gather(*(n.astart() for n in nodes))
    try:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
        for rep in range(reps):
            for name, nodes in setups.items():  # alternate: other load on the machine hits both alike
                urls = ",".join(n.url for n in nodes)
                runs[name].append(await one_rep(urls, f"sync_{name}_{rep}", replicas, messages))
        out: dict[str, Any] = {name: summary(r) for name, r in runs.items()}
        out["always_over_default"] = {
            p: round(out["always"][p]["median_msgs_s"] / out["default"][p]["median_msgs_s"], 3)
            for p in ("sequential", "pipelined")}
        return out
    finally:
        for nodes in setups.values():
            for n in nodes:
                await n.astop()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rlbus-sync-", dir=args.dir) as tmp:
        root = Path(tmp)
        result: dict[str, Any] = {
            "bench": "sync_cost", "message_bytes": MESSAGE_BYTES, "messages_per_rep": {
                "sequential": args.messages, "pipelined": args.messages * 5},
            "reps": args.reps, "store": str(root.parent), "file_system": file_system(root),
            "python": platform.python_version(), "cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()[0],
        }
        single = {name: [EmbeddedServer(root / f"single-{name}", sync_interval=sync)]
                  for name, sync in SETTINGS.items()}
        result["single_server"] = await compare(single, 1, args.reps, args.messages)
        if args.cluster:
            clusters = {name: cluster_nodes(3, root / f"cluster-{name}", cluster_name=f"sync-{name}",
                                            sync_interval=sync)
                        for name, sync in SETTINGS.items()}
            result["cluster_3_replicas"] = await compare(clusters, 3, args.reps, args.messages)
        result["load_avg_at_end"] = os.getloadavg()[0]
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions per setting (medians are reported)")
    parser.add_argument("--messages", type=int, default=2000, help="sequential publishes per repetition "
                        "(pipelined: five times as many)")
    parser.add_argument("--cluster", action="store_true", help="also compare two 3-node clusters, replicas 3")
    parser.add_argument("--dir", default=None, help="where the servers store (default: the temp dir; "
                        "the point is the disk the servers would use, so not a tmpfs)")
    args = parser.parse_args(argv)
    from rlbus.observability.logging import configure_logging

    configure_logging(service="bench", run="bench", level="ERROR", json=True)  # stdout is for the result
    result = asyncio.run(main_async(args))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
