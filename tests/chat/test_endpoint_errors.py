"""The chat endpoint over HTTP with the real `openai` client and a scripted policy: bad input.

What an agent author relies on: every bad request gets a 4xx in OpenAI's error shape that says
what to fix (the client raises its own error class for it), a malformed tool call from the policy
ends the episode with a reason while keeping its tokens, and the endpoint keeps serving after
each of them.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from rlbus.bus.subjects import Subjects
from rlbus.schemas import RolloutGroup
from rlbus.services.chat.server import EPISODE_HEADER, ChatEndpoint
from rlbus.services.generator.settings import ChatEndpointOptions
from rlbus.services.policy.chat_model import CALCULATOR_TOOL
from tests.chat.conftest import RecordingBus, ScriptedBackend

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>'
USER = {"role": "user", "content": "What is 1 + 2?"}


class Served:
    def __init__(self, endpoint: ChatEndpoint, backend: ScriptedBackend, bus: RecordingBus, base: str) -> None:
        self.endpoint, self.backend, self.bus, self.base = endpoint, backend, bus, base
        self.client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

    async def end(self, episode_id: str, body: Any) -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as s, s.post(f"{self.base}/v1/rlbus/episodes/{episode_id}/end",
                                                        data=body if isinstance(body, str) else json.dumps(body)) as r:
            return r.status, await r.json()


@pytest.fixture
async def served(chat_tokenizer: Any) -> AsyncIterator[Served]:
    backend = ScriptedBackend(chat_tokenizer, max_context=160)
    bus = RecordingBus()
    endpoint = ChatEndpoint(bus, Subjects("r"), backend, chat_tokenizer, model_lock=threading.Lock(), model="policy",
                            generator_id="gen-0", options=ChatEndpointOptions(max_tokens=8), default_pool="chat",
                            default_group_size=2)
    server = TestServer(endpoint.app())
    await server.start_server()
    try:
        yield Served(endpoint, backend, bus, str(server.make_url("")).rstrip("/"))
    finally:
        await server.close()


async def ok_turn(s: Served, **kw: Any) -> Any:
    s.backend.script.append(("The answer is 3.", True))
    return await s.client.chat.completions.with_raw_response.create(model="policy", messages=[USER], **kw)


async def test_bad_requests_get_openai_errors_and_the_endpoint_keeps_serving(served: Served) -> None:
    s = served
    async with aiohttp.ClientSession() as http, http.post(f"{s.base}/v1/chat/completions", data="{not json") as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError, match="serves 'policy'") as err:
        await s.client.chat.completions.create(model="gpt-4o", messages=[USER])
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        await s.client.chat.completions.create(model="policy", messages=[])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await s.client.chat.completions.create(model="policy", messages=[USER], temperature=7)
    with pytest.raises(openai.NotFoundError, match="no open episode 'ep-missing'") as err:
        await s.client.chat.completions.create(
            model="policy", messages=[USER, {"role": "assistant", "content": "x"}, USER],
            extra_headers={EPISODE_HEADER: "ep-missing"})
    assert err.value.code == "unknown_episode"
    with pytest.raises(openai.BadRequestError, match="exceeds the model's context of 160") as err:
        await s.client.chat.completions.create(model="policy", messages=[USER], tools=[CALCULATOR_TOOL], max_tokens=150)
    assert err.value.code == "context_length_exceeded"
    assert s.backend.prompts == [], "no refused request may cost sampling"
    status, body = await s.end("ep-missing", {"reward": 1})
    assert status == 404 and body["error"]["code"] == "unknown_episode"
    raw = await ok_turn(s)  # still serving
    reply = raw.parse()
    assert reply.choices[0].message.content == "The answer is 3." and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(s.backend.tokenizer.encode("The answer is 3.")) + 1
    status, body = await s.end(raw.headers[EPISODE_HEADER], '{"reward": "high"}')
    assert status == 400 and "finite number" in body["error"]["message"]


async def test_malformed_tool_call_ends_the_episode_and_keeps_its_tokens(served: Served) -> None:
    s = served
    s.backend.script.append(('<tool_call>{"name": "calculator", "arguments": {"expr', True))
    with pytest.raises(openai.UnprocessableEntityError, match="never closed") as err:
        await s.client.chat.completions.create(model="policy", messages=[USER], tools=[CALCULATOR_TOOL],
                                               extra_headers={EPISODE_HEADER: "ep-bad", "x-rlbus-group-size": "1"})
    assert err.value.code == "malformed_tool_call" and "policy_error" in err.value.message
    assert err.value.response.headers[EPISODE_HEADER] == "ep-bad"  # so an agent without its own id can end it
    with pytest.raises(openai.ConflictError, match="ended \\(policy_error\\)"):
        await s.client.chat.completions.create(model="policy", messages=[USER], tools=[CALCULATOR_TOOL],
                                               extra_headers={EPISODE_HEADER: "ep-bad"})
    status, body = await s.end("ep-bad", {"reward": 0.0})
    assert status == 200 and body["group_published"] and body["finish_reason"] == "policy_error"
    group = RolloutGroup.decode(s.bus.published[0][1])
    rollout = group.rollouts[0]
    sampled = s.backend.tokenizer.encode('<tool_call>{"name": "calculator", "arguments": {"expr')
    assert rollout.finish_reason == "policy_error" and rollout.completion_len == len(sampled) + 1
    assert rollout.loss_mask.tolist() == [1] * rollout.completion_len
    assert rollout.token_ids[: rollout.prompt_len].tolist() == s.backend.prompts[0]
    assert "<tool_call>" in rollout.text
    with pytest.raises(openai.ConflictError, match="has ended: give a new episode a new id"):
        await s.client.chat.completions.create(model="policy", messages=[USER], extra_headers={EPISODE_HEADER: "ep-bad"})


async def test_episode_found_by_prefix_and_group_published_at_group_size(served: Served) -> None:
    s = served
    headers = {"x-rlbus-task": "task-1", "x-rlbus-pool": "chat"}
    ends = []
    for k in range(2):
        s.backend.script.append((CALL, True))
        first = await s.client.chat.completions.with_raw_response.create(
            model="policy", messages=[USER], tools=[CALCULATOR_TOOL], temperature=0.5, extra_headers=headers)
        msg = first.parse().choices[0].message
        assert first.parse().choices[0].finish_reason == "tool_calls"
        assert json.loads(msg.tool_calls[0].function.arguments) == {"expression": "1 + 2"}
        s.backend.script.append(("3", True))
        # No episode header: the conversation prefix finds the episode.
        second = await s.client.chat.completions.with_raw_response.create(
            model="policy", tools=[CALCULATOR_TOOL], temperature=0.5,
            messages=[USER, msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                                                               "content": "3"}])
        assert second.headers[EPISODE_HEADER] == first.headers[EPISODE_HEADER]
        ends.append(await s.end(first.headers[EPISODE_HEADER], {"reward": float(k)}))
    assert [b["group_published"] for _, b in ends] == [False, True]
    assert len(s.bus.published) == 1
    subject, data, msg_id = s.bus.published[0]
    group = RolloutGroup.decode(data)
    assert subject == "rl.r.rollouts.chat" and msg_id == "rollouts.task-1"
    assert [r.turns for r in group.rollouts] == [2, 2] and group.sampling.temperature == 0.5
    assert group.task.metadata["reported_rewards"] == {group.rollouts[0].rollout_id: 0.0,
                                                       group.rollouts[1].rollout_id: 1.0}
    with pytest.raises(openai.ConflictError, match="already published"):
        await s.client.chat.completions.create(model="policy", messages=[USER], extra_headers=headers)
    await ok_turn(s, temperature=0.9, extra_headers={"x-rlbus-task": "task-2"})
    with pytest.raises(openai.BadRequestError, match="temperature/top_p"):  # one distribution per group
        await s.client.chat.completions.create(model="policy", messages=[USER], temperature=0.5,
                                               extra_headers={"x-rlbus-task": "task-2"})



async def test_a_turn_samples_under_the_generator_model_lock(served: Served) -> None:
    # The batch sampler, the episode engine and weight swaps hold this lock: a chat turn must wait for it.
    s = served
    s.endpoint.model_lock.acquire()
    try:
        turn = asyncio.create_task(ok_turn(s))
        await asyncio.sleep(0.3)
        assert not turn.done() and s.backend.prompts == []
    finally:
        s.endpoint.model_lock.release()
    assert (await turn).parse().choices[0].message.content == "The answer is 3."


async def test_a_streaming_client_gets_the_turn_as_chunks_and_the_episode_records_it(served: Served) -> None:
    """`stream=True` (what many agent loops send): the openai client assembles the same content,
    tool call and finish reason from the chunks, the usage comes last when asked for, the episode
    header comes with the stream, and the episode records the turn as for a plain request."""
    s = served
    s.backend.script.append((CALL, True))
    raw = await s.client.chat.completions.with_raw_response.create(
        model="policy", messages=[USER], tools=[CALCULATOR_TOOL], stream=True, stream_options={"include_usage": True})
    episode_id = raw.headers[EPISODE_HEADER]
    chunks = [c async for c in raw.parse()]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == "" and finish == ["tool_calls"]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("calculator", {"expression": "1 + 2"})]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(s.backend.tokenizer.encode(CALL)) + 1
    assert s.endpoint.book.open[episode_id].turns == 1  # recorded, as a plain request's turn is
    s.backend.script.append(("The answer is 3.", True))
    stream = await s.client.chat.completions.create(
        model="policy", stream=True, tools=[CALCULATOR_TOOL], extra_headers={EPISODE_HEADER: episode_id},
        messages=[USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {"name": "calculator", "arguments": calls[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "3"}])
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == "The answer is 3."
    assert s.endpoint.book.open[episode_id].turns == 2
    with pytest.raises(openai.BadRequestError, match="only allowed with stream=true"):
        await s.client.chat.completions.create(model="policy", messages=[USER], stream_options={"include_usage": True})
