"""OpenAI-compatible chat-completions endpoint on the generator: unmodified agents run episodes.

serves:    POST /v1/chat/completions           (OpenAI request; non-streaming)  -> chat.completion
           POST /v1/rlbus/episodes/{id}/end    ({"reward": float | null})       -> whether a group was published
           GET  /v1/models                     the one model served
headers:   x-rlbus-episode (episode id; else the conversation prefix finds it, or a new one is opened
           and returned in this header), and on an episode's first request x-rlbus-task, x-rlbus-pool,
           x-rlbus-env, x-rlbus-group-size, x-rlbus-verifier
produces:  rl.<run>.rollouts.<pool>  (RolloutGroup)  msg id 'rollouts.<task_id>', when a task's group
           is complete or its group timeout passes (services/chat/episodes.py)
samples on the generator's backend under the generator's model lock (as the batch sampler and the
episode engine do), so chat turns share the live weights, a weight swap never lands inside a turn's
forward pass, and every token records the version that produced it.

A request is checked before it costs any sampling: the JSON, the model name, the messages, the
episode, the stitching (services/chat/stitch.py) and the context.  Every refusal is an OpenAI error
body with a 4xx status; the endpoint and the generator keep serving.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from typing import Any

from aiohttp import web

from rlbus.bus.protocol import Bus, BusError
from rlbus.bus.subjects import Subjects
from rlbus.observability.logging import get_logger
from rlbus.schemas import RolloutGroup
from rlbus.schemas import SamplingParams as WireSampling
from rlbus.services.chat.episodes import ChatEpisode, EpisodeBook, TaskRef
from rlbus.services.chat.errors import ChatError, Conflict, NotFound, PolicyOutputError
from rlbus.services.chat.stitch import Conversation, check_fits
from rlbus.services.chat.stream import completion_chunks, streaming
from rlbus.services.chat.template import ChatTemplate, normalise, parse_tool_calls
from rlbus.services.runtime.lifecycle import Lifecycle

log = get_logger()

EPISODE_HEADER = "x-rlbus-episode"


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ChatError(f"'{name}' must be a number in [{low}, {high}], got {value!r}", code="invalid_value", param=name)
    return float(value)


class ChatEndpoint:
    """Requests in, sampled turns out, ended episodes published in groups (see the module docstring)."""

    HOUSEKEEPING_S = 1.0

    def __init__(self, bus: Bus, subjects: Subjects, backend: Any, tokenizer: Any, *, model_lock: threading.Lock,
                 model: str, generator_id: str, options: Any, default_pool: str, default_group_size: int,
                 seed: int = 0) -> None:
        self.bus = bus
        self.subjects = subjects
        self.backend = backend
        self.model_lock = model_lock
        self.template = ChatTemplate(tokenizer)
        self.model = model
        self.options = options
        self.default_pool = default_pool
        self.default_group_size = default_group_size
        self.book = EpisodeBook(run=subjects.run, generator_id=generator_id, episode_ttl_s=options.episode_ttl_s,
                                group_timeout_s=options.group_timeout_s)
        self.task_sampling: dict[str, tuple[float, float]] = {}  # one distribution per group (trainer recompute)
        self.busy: set[str] = set()  # episodes with a request being sampled
        self.unpublished: list[RolloutGroup] = []  # groups whose publish failed: retried by housekeeping
        self.rng = random.Random(seed)
        self.requests = 0
        self.refused = 0

    # --- HTTP -------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/rlbus/episodes/{episode_id}/end", self._end)
        app.router.add_get("/v1/models", self._models)
        return app

    async def serve(self, host: str, port: int, life: Lifecycle) -> None:
        """Listen until the generator stops; publish what is due meanwhile."""
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        log.info("chat_endpoint_ready", url=f"http://{host}:{port}/v1", model=self.model)
        try:
            while not life.stopping.is_set():
                await self.housekeeping()
                try:
                    await asyncio.wait_for(life.stopping.wait(), self.HOUSEKEEPING_S)
                except TimeoutError:
                    pass
        finally:
            await runner.cleanup()

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ChatError(f"the request body is not valid JSON ({exc}): send a JSON object",
                            code="invalid_json") from exc
        if not isinstance(body, dict):
            raise ChatError("the request body must be a JSON object", code="invalid_json")
        return body

    async def _answer(self, call: Any, render: Any = None) -> web.StreamResponse:
        try:
            body, headers = await call()
            if render is not None:
                return await render(body, headers)
            return web.json_response(body, headers=headers)
        except ChatError as exc:
            self.refused += 1
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        except Exception as exc:  # a bug or a backend failure: this request fails, the endpoint keeps serving
            log.exception("chat_request_failed")
            body = {"error": {"message": f"internal error: {type(exc).__name__}: {exc}", "type": "server_error",
                              "param": None, "code": "internal_error"}}
            return web.json_response(body, status=500)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        asked: dict[str, Any] = {}

        async def call() -> tuple[dict[str, Any], dict[str, str]]:
            body = await self._json(request)
            asked.update(streaming(body))
            return await self.complete(body, request.headers)

        async def render(body: dict[str, Any], headers: dict[str, str]) -> web.StreamResponse:
            if not asked.get("stream"):
                return web.json_response(body, headers=headers)
            return await self._stream(request, body, headers, include_usage=asked["include_usage"])

        return await self._answer(call, render)

    async def _stream(self, request: web.Request, completion: dict[str, Any], headers: dict[str, str], *,
                      include_usage: bool) -> web.StreamResponse:
        """The completion as server-sent chat.completion.chunk events.  The turn is sampled whole
        first (the episode's tokens are recorded as for a plain request), so the events arrive
        together at its end: clients that stream work unchanged, but see no earlier first token."""
        response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in completion_chunks(completion, include_usage=include_usage):
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _end(self, request: web.Request) -> web.Response:
        async def call() -> tuple[dict[str, Any], dict[str, str]]:
            body = await self._json(request) if request.can_read_body else {}
            return await self.end(request.match_info["episode_id"], body), {}
        return await self._answer(call)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "rlbus"}]})

    # --- a turn -----------------------------------------------------------------------------------
    async def complete(self, body: dict[str, Any], headers: Any) -> tuple[dict[str, Any], dict[str, str]]:
        self.requests += 1
        if body.get("model") != self.model:
            raise NotFound(f"model {body.get('model')!r} is not served here: this endpoint serves {self.model!r}",
                           code="model_not_found", param="model")
        if body.get("n", 1) != 1:
            raise ChatError("'n' must be 1: an episode is one conversation (run n episodes for n samples)",
                            code="unsupported", param="n")
        messages = normalise(body.get("messages"))
        tools = body.get("tools") or None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ChatError("'tools' must be a list of tool objects", code="invalid_value", param="tools")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 1e-6, 1.0)
        max_tokens = int(_number(body, "max_completion_tokens", _number(body, "max_tokens", self.options.max_tokens,
                                                                        1, 1 << 20), 1, 1 << 20))
        seed = body.get("seed")
        seed = int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else self.rng.randrange(1 << 31)
        episode, new_ids = self._episode(messages, tools, headers, temperature, top_p)
        if episode.episode_id in self.busy:
            raise Conflict(f"episode {episode.episode_id!r} has a request being sampled: wait for its reply",
                           code="episode_busy")
        prompt = (episode.tokens.ids + new_ids) if episode.turns else new_ids
        try:
            check_fits(prompt, max_tokens, getattr(self.backend, "max_context", None))
        except ChatError:
            context = getattr(self.backend, "max_context", None)
            if episode.turns and context is not None and len(prompt) >= context:  # nothing more can be sampled
                episode.closed = episode.finish_reason = "context"
            elif not episode.turns:
                self.book.open.pop(episode.episode_id, None)
            raise
        self.busy.add(episode.episode_id)
        try:
            sampling = WireSampling(temperature=temperature, top_p=top_p, max_new_tokens=max_tokens)
            out = await asyncio.to_thread(self._sample, prompt, sampling, seed)
        except BaseException:
            if not episode.turns:
                self.book.open.pop(episode.episode_id, None)
            raise
        finally:
            self.busy.discard(episode.episode_id)
        return self._record(episode, messages, new_ids, out, max_tokens), {EPISODE_HEADER: episode.episode_id}

    def _sample(self, prompt: list[int], sampling: WireSampling, seed: int) -> Any:
        with self.model_lock:
            return self.backend.sample([prompt], 1, sampling, [self.template.end_id], seed)[0][0]

    def _episode(self, messages: list[dict[str, Any]], tools: Any, headers: Any, temperature: float,
                 top_p: float) -> tuple[ChatEpisode, list[int]]:
        """The episode this request continues or opens, and the template tokens it adds."""
        episode_id = headers.get(EPISODE_HEADER)
        episode = self.book.open.get(episode_id) if episode_id else self.book.by_prefix(messages)
        if episode is None and episode_id and any(m["role"] == "assistant" for m in messages):
            self.book.get(episode_id)  # raises: continuing an episode this generator does not hold
        if episode is None:
            return self._open(episode_id or self.book.new_id(), messages, tools, headers, temperature, top_p)
        if episode.closed:
            raise Conflict(f"episode {episode.episode_id!r} ended ({episode.closed}): report its end "
                           f"(POST /v1/rlbus/episodes/{episode.episode_id}/end) and start a new one",
                           code="episode_closed")
        if (temperature, top_p) != (episode.temperature, episode.top_p):
            raise ChatError(f"temperature/top_p must stay {episode.temperature}/{episode.top_p} within an episode: "
                            "the trainer recomputes every token under one distribution", code="sampling_changed",
                            param="temperature")
        return episode, episode.conversation.next_ids(messages, tools)

    def _open(self, episode_id: str, messages: list[dict[str, Any]], tools: Any, headers: Any, temperature: float,
              top_p: float) -> tuple[ChatEpisode, list[int]]:
        self.book.check_new_id(episode_id)
        task_id = headers.get("x-rlbus-task") or f"chat-{episode_id}"
        try:
            group_size = int(headers.get("x-rlbus-group-size") or (self.default_group_size
                                                                   if headers.get("x-rlbus-task") else 1))
        except ValueError as exc:
            raise ChatError("x-rlbus-group-size must be an integer", code="invalid_group_size") from exc
        task = TaskRef(task_id=task_id, pool=headers.get("x-rlbus-pool") or self.default_pool,
                       env=headers.get("x-rlbus-env") or self.options.env, group_size=group_size,
                       verifier=headers.get("x-rlbus-verifier") or "")
        task.check()
        self.book.check_task_open(task_id)
        held = self.task_sampling.setdefault(task_id, (temperature, top_p))
        if held != (temperature, top_p):
            raise ChatError(f"task {task_id!r} samples at temperature/top_p {held[0]}/{held[1]}: its episodes form "
                            "one group, which the trainer recomputes under one distribution", code="sampling_changed",
                            param="temperature")
        conversation = Conversation(self.template, tools)
        ids = conversation.first(messages)
        episode = ChatEpisode(episode_id, task, conversation, temperature, top_p)
        episode.tokens.start(ids, int(self.backend.version))
        self.book.open[episode_id] = episode
        return episode, ids

    def _record(self, episode: ChatEpisode, messages: list[dict[str, Any]], new_ids: list[int], out: Any,
                max_tokens: int) -> dict[str, Any]:
        """Append the turn's tokens to the episode; the OpenAI response for it."""
        prompt_tokens = len(episode.tokens.ids) + (len(new_ids) if episode.turns else 0)
        if episode.turns:
            episode.tokens.append_template(new_ids)
        ids = list(out.completion_ids)
        episode.tokens.append_policy(ids, out.behaviour_logprobs, out.token_versions)
        episode.conversation.take(messages)
        episode.turns += 1
        episode.max_new_tokens = max(episode.max_new_tokens, max_tokens)
        episode.last_active = time.monotonic()
        ended = bool(ids) and ids[-1] == self.template.end_id
        episode.finish_reason = "stop" if ended else "length"
        text = self.template.text_of(ids)
        try:
            content, calls = parse_tool_calls(text)
        except PolicyOutputError as exc:
            episode.closed = episode.finish_reason = "policy_error"
            episode.last_text = text
            exc.headers[EPISODE_HEADER] = episode.episode_id
            exc.message += (f"; episode {episode.episode_id!r} ended with finish reason 'policy_error' and its tokens "
                            f"are kept: report its end (POST /v1/rlbus/episodes/{episode.episode_id}/end)")
            raise
        episode.last_text = content
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [{"type": "function", "function": c} for c in calls]
        episode.conversation.answered(reply, ended)
        turn = episode.turns
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{episode.episode_id}_{turn}_{k}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                for k, c in enumerate(calls)]
        finish = "length" if not ended else ("tool_calls" if calls else "stop")
        return {"id": f"chatcmpl-{episode.episode_id}-{turn}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model, "system_fingerprint": f"rlbus-v{int(out.token_versions[-1]) if len(ids) else 0}",
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                          "total_tokens": prompt_tokens + len(ids)}}

    # --- episode end and groups -------------------------------------------------------------------
    async def end(self, episode_id: str, body: dict[str, Any]) -> dict[str, Any]:
        reward = body.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)
                                   or reward != reward or abs(reward) == float("inf")):
            raise ChatError(f"'reward' must be a finite number or null, got {reward!r}", code="invalid_value",
                            param="reward")
        if episode_id in self.busy:
            raise Conflict(f"episode {episode_id!r} has a request being sampled: end it after the reply",
                           code="episode_busy")
        episode = self.book.get(episode_id)
        group = self.book.end(episode_id, None if reward is None else float(reward))
        published = await self._publish(group) if group is not None else False
        return {"episode_id": episode_id, "task_id": episode.task.task_id, "turns": episode.turns,
                "tokens": len(episode.tokens.ids), "finish_reason": episode.finish_reason, "group_published": published}

    async def _publish(self, group: RolloutGroup) -> bool:
        try:
            await self.bus.publish(self.subjects.rollouts(group.task.pool), group.encode(), msg_id=group.msg_id)
        except BusError as exc:
            log.warning("chat_group_publish_failed", task_id=group.task.task_id, error=str(exc))
            self.unpublished.append(group)
            return False
        log.info("chat_group_published", task_id=group.task.task_id, rollouts=len(group.rollouts))
        return True

    async def housekeeping(self) -> None:
        """Publish groups whose timeout passed and retry failed publishes; abandon idle episodes."""
        pending, self.unpublished = self.unpublished + self.book.due(), []
        for group in pending:
            await self._publish(group)
