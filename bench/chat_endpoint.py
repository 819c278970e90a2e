"""Chat endpoint cost on the tiny chat policy: request latency and requests/s through the `openai`
client, and how much of it is sampling.  Prints one JSON object.

The endpoint runs in this process on the torch backend (one thread); published groups go to an
in-memory recorder, so this measures the HTTP + template + stitching + sampling path, not the bus.
Each episode is the calculator exchange of tests/chat: a tool call (max_tokens 48), the tool's
value, an answer (max_tokens 16), then the end call.  `--concurrency` episodes run at once; their
sampling calls take turns on the one model (the generator's model lock), so latency grows with it while
requests/s shows what the overlap of HTTP and template work buys.

    python -m bench.chat_endpoint --model tests/.cache/chat-calculator-w150-<key> --episodes 40
    (without --model, a chat policy is built first: about a minute)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import openai
import torch
from aiohttp import web

from rlbus.bus.subjects import Subjects
from rlbus.services.chat.server import EPISODE_HEADER, ChatEndpoint
from rlbus.services.generator.settings import ChatEndpointOptions
from rlbus.services.generator.torch_backend import TorchBackend
from rlbus.services.policy.chat_model import CALCULATOR_TOOL, build_chat_model


class NullBus:
    def __init__(self) -> None:
        self.groups = 0

    async def publish(self, subject: str, data: bytes, *, msg_id: str, headers: Any = None) -> None:
        self.groups += 1


async def one_episode(client: openai.AsyncOpenAI, k: int, latencies: list[float], outcomes: dict[str, int]) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is {100 + k} + {250 + 3 * k}?"}]
    t0 = time.perf_counter()
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=48, seed=k)
    except openai.UnprocessableEntityError as exc:  # a malformed call: the episode ended there
        latencies.append(time.perf_counter() - t0)
        outcomes["malformed_call"] += 1
        await client.post(f"/rlbus/episodes/{exc.response.headers[EPISODE_HEADER]}/end", cast_to=object, body={})
        return
    latencies.append(time.perf_counter() - t0)
    episode = raw.headers[EPISODE_HEADER]
    message = raw.parse().choices[0].message
    if message.tool_calls:
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "42"}]
        t0 = time.perf_counter()
        try:
            await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_TOOL],
                                                 max_tokens=16, seed=k, extra_headers={EPISODE_HEADER: episode})
            outcomes["two_turns"] += 1
        except openai.UnprocessableEntityError:
            outcomes["malformed_call"] += 1
        latencies.append(time.perf_counter() - t0)
    else:
        outcomes["no_call"] += 1
    await client.post(f"/rlbus/episodes/{episode}/end", cast_to=object, body={"reward": 1.0})


async def run(model: Path, episodes: int, concurrency: int) -> dict[str, Any]:
    backend = TorchBackend(str(model))
    bus = NullBus()
    endpoint = ChatEndpoint(bus, Subjects("bench"), backend, backend.tokenizer, model_lock=threading.Lock(),
                            model="policy", generator_id="bench", options=ChatEndpointOptions(), default_pool="chat",
                            default_group_size=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = web.AppRunner(endpoint.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    latencies: list[float] = []
    outcomes = {"two_turns": 0, "no_call": 0, "malformed_call": 0}
    await one_episode(client, 10_000, [], dict(outcomes))  # warm-up, not counted
    sample_s0, tokens0 = backend.sample_seconds, backend.tokens
    queue = list(range(episodes))

    async def worker() -> None:
        while queue:
            await one_episode(client, queue.pop(), latencies, outcomes)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await runner.cleanup()
    latencies.sort()
    return {"bench": "chat_endpoint", "model": str(model), "threads": torch.get_num_threads(), "episodes": episodes,
            "concurrency": concurrency, "requests": len(latencies), "wall_s": round(wall, 3),
            "requests_per_s": round(len(latencies) / wall, 2),
            "latency_p50_ms": round(1000 * statistics.median(latencies), 1),
            "latency_p95_ms": round(1000 * latencies[int(0.95 * (len(latencies) - 1))], 1),
            "sampling_share": round((backend.sample_seconds - sample_s0) / wall, 3),
            "sampled_tokens": backend.tokens - tokens0, "groups_published": bus.groups - 1, **outcomes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="chat policy folder (default: build one, warm_steps=150)")
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "chat"
            build_chat_model(model, warm_steps=150, log=lambda _: None)
        print(json.dumps(asyncio.run(run(model, args.episodes, args.concurrency))))


if __name__ == "__main__":
    main()
