"""Acceptance: an unmodified `openai` client runs two-turn tool episodes against a generator's chat
endpoint (the generator service in-process on a real nats-server, the warm-started chat policy),
the weights move between the turns, and the reward service scores the published group onto the
stream the trainer reads, token-exact.

Checked token by token: the prompt is the template's rendering of the first request; the first
policy run is what the first response returned (its tool call renders back to those tokens); the
template tokens between the turns are the rendering of only the new message; the mask is 1 exactly
on the two policy runs; versions are 0 on the first run and 1 on the second (weights staged between
the turns); and a trainer-side recompute of the policy tokens' logprobs under those versions
matches the recorded behaviour logprobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
import torch
from safetensors.torch import save as save_safetensors

from rlbus.schemas import ScoredGroup
from rlbus.services.chat.server import EPISODE_HEADER
from rlbus.services.chat.template import ChatTemplate
from rlbus.services.generator import service as generator_service
from rlbus.services.generator.settings import ChatEndpointOptions, GeneratorSettings
from rlbus.services.generator.torch_backend import TorchBackend
from rlbus.services.policy.chat_model import CALCULATOR_TOOL
from rlbus.services.policy.load import load_policy, load_state_from_safetensors
from rlbus.services.policy.logprobs import completion_logprobs
from rlbus.services.policy.sampling import SamplingParams
from rlbus.services.reward import service as reward_service
from rlbus.services.reward.settings import RewardSettings
from rlbus.services.runtime.config import RunSettings
from rlbus.services.runtime.lifecycle import Lifecycle

pytestmark = pytest.mark.integration
TOOLS = [CALCULATOR_TOOL]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def perturbed(model: torch.nn.Module, seed: int) -> bytes:
    """A nearby version: logprobs move measurably, the policy still emits its tool-call format."""
    g = torch.Generator().manual_seed(seed)
    return save_safetensors({k: (v + 0.003 * torch.randn(v.shape, generator=g)).contiguous()
                             for k, v in model.state_dict().items()})


async def first_of(bus: Any, subject: str, decode: Any, timeout: float = 30.0) -> Any:
    watch = bus.watch(subject, deliver="all")
    try:
        async with asyncio.timeout(timeout):
            async for d in watch:
                return decode(d.msg)
    finally:
        await watch.aclose()


async def episode(client: openai.AsyncOpenAI, backend: TorchBackend, v1: bytes | None, question: str,
                  seeds: tuple[int, int], headers: dict[str, str]) -> dict[str, Any]:
    """Two turns: the policy calls the calculator, gets the value, answers.  Weights v1 are staged
    between the turns when given.  The seeds are ones whose first turn is a well-formed call under
    this policy (about 4 in 10 samples of the briefly warm-started policy are malformed calls)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    raw = await client.chat.completions.with_raw_response.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=48, seed=seeds[0], extra_headers=headers)
    first = raw.parse()
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
    value = str(eval(json.loads(call.function.arguments)["expression"], {"__builtins__": {}}))
    if v1 is not None:
        backend.stage(1, v1)  # applied at the next sample call's start: the second turn runs on v1
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": value}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=16,
                                                  seed=seeds[1], extra_headers={EPISODE_HEADER: raw.headers[EPISODE_HEADER]})
    return {"id": raw.headers[EPISODE_HEADER], "messages": messages, "first": first, "second": second}


async def test_openai_client_two_turn_tool_episodes_reach_the_trainer_token_exact(
        bus: Any, run_name: str, chat_model_warm: Path, tmp_path: Path) -> None:
    port = free_port()
    run_cfg = RunSettings(run=run_name, model_path=str(chat_model_warm), pools=["chat"], group_size=2,
                          run_dir=str(tmp_path))
    cfg = GeneratorSettings(openai_port=port, openai=ChatEndpointOptions(group_timeout_s=60.0))
    backend = TorchBackend(str(chat_model_warm))
    v1 = perturbed(backend.slot.model, seed=1)
    life = Lifecycle(grace=2.0)
    services = [asyncio.create_task(generator_service.run(run_cfg, cfg, bus=bus, life=life, backend=backend)),
                asyncio.create_task(reward_service.run(run_cfg, RewardSettings(), bus=bus, life=life))]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        async with asyncio.timeout(30):
            while True:  # the endpoint listens once the generator has started
                with contextlib.suppress(openai.APIConnectionError):
                    await client.models.list()
                    break
                await asyncio.sleep(0.1)
        headers = {"x-rlbus-task": "calc-1", "x-rlbus-pool": "chat", "x-rlbus-group-size": "2"}
        episodes = [await episode(client, backend, v1, "What is 123 + 456?", (2, 1), headers),
                    await episode(client, backend, None, "What is 123 + 456?", (4, 1), headers)]
        async with aiohttp.ClientSession() as http:
            for reward, ep in zip((1.0, 0.0), episodes, strict=True):
                async with http.post(f"http://127.0.0.1:{port}/v1/rlbus/episodes/{ep['id']}/end",
                                     json={"reward": reward}) as r:
                    assert r.status == 200, await r.text()
        scored = await first_of(bus, bus.subjects.scored("chat"), ScoredGroup.decode)
    finally:
        life.shutdown()
        await asyncio.wait_for(asyncio.gather(*services, return_exceptions=True), 15)
    assert [s.reward for s in scored.scored] == [1.0, 0.0] and all(s.valid for s in scored.scored)
    assert [s.rollout.rollout_id for s in scored.scored] == [ep["id"] for ep in episodes]
    assert scored.task.task_id == "calc-1" and scored.task.verifier == "reported" and scored.task.group_size == 2

    template = ChatTemplate(backend.tokenizer)
    params = SamplingParams(temperature=scored.sampling.temperature, top_p=scored.sampling.top_p)
    models = {0: load_policy(str(chat_model_warm))[0]}
    models[1] = load_policy(str(chat_model_warm))[0]
    load_state_from_safetensors(models[1], v1)
    for ep, expected_versions, s in zip(episodes, ((0, 1), (1, 1)), scored.scored, strict=True):
        r = s.rollout  # as published on ROLLOUTS (a work queue the reward service drains), carried over unchanged
        ids, p = r.token_ids.tolist(), r.prompt_len
        user, reply, tool = ep["messages"]
        assert ids[:p] == template.encode(template.render([user], TOOLS, generation_prompt=True))
        c1, c2 = ep["first"].usage.completion_tokens, ep["second"].usage.completion_tokens
        normal_reply = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator",
                                              "arguments": json.loads(reply["tool_calls"][0]["function"]["arguments"])}}]}
        before = template.render([user, normal_reply], TOOLS, generation_prompt=False)
        after = template.render([user, normal_reply, tool], TOOLS, generation_prompt=True)
        between = template.encode("\n" + after[len(before):])  # the newline after <|im_end|> was not sampled
        assert ids[p + c1 - 1] == template.end_id  # the first turn ended on its own
        assert backend.tokenizer.decode(ids[: p + c1]) + "\n" == before  # what it sampled renders back exactly
        assert ids[p + c1: p + c1 + len(between)] == between
        assert len(ids) == p + c1 + len(between) + c2
        assert r.loss_mask.tolist() == [1] * c1 + [0] * len(between) + [1] * c2
        versions = r.token_versions()
        assert versions.tolist() == [expected_versions[0]] * (c1 + len(between)) + [expected_versions[1]] * c2
        lp = r.behaviour_logprobs
        assert np.all(lp[r.loss_mask == 0] == 0.0)
        assert r.turns == 2 and r.text == ep["second"].choices[0].message.content
        for version in set(expected_versions):  # the trainer's recompute, per version that produced tokens
            with torch.no_grad():
                recomputed = completion_logprobs(models[version], [(ids[:p], ids[p:])], params)[0].numpy()
            mine = (r.loss_mask == 1) & (versions == version)
            np.testing.assert_allclose(recomputed[mine], lp[mine], atol=2e-4, rtol=0)
            if len(set(expected_versions)) == 2 and version == 0:  # and the version recorded is the one that matters
                other = (r.loss_mask == 1) & (versions == 1)
                assert np.abs(recomputed[other] - lp[other]).max() > 1e-3
