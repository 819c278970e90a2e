"""The chat stitcher, tool-call parsing, episode groups and the `reported` verifier (no bus, no model).

What a trainer relies on: an episode's token sequence keeps every earlier token exactly as it was
(the policy's sampled ids, even when re-tokenising their text would give others), adds only the
template's rendering of the new messages, and lays out mask, logprobs and versions per token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlbus.schemas import Rollout, RolloutGroup, Task
from rlbus.services.chat.episodes import ChatEpisode, EpisodeBook, TaskRef
from rlbus.services.chat.errors import ChatError, Conflict, NotFound, PolicyOutputError, StitchError
from rlbus.services.chat.stitch import Conversation, EpisodeTokens, check_fits
from rlbus.services.chat.template import ChatTemplate, normalise, parse_tool_calls
from rlbus.services.policy.chat_model import CALCULATOR_TOOL
from rlbus.services.reward.verifiers import VERIFIERS

TOOLS = [CALCULATOR_TOOL]
USER = {"role": "user", "content": "What is 12 + 34?"}
CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 + 34"}}</tool_call>'
REPLY = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 + 34"}}}]}
TOOL_MSG = {"role": "tool", "content": "46"}


def two_turns(template: ChatTemplate, sampled: list[int], ended: bool = True) -> tuple[EpisodeTokens, list[int]]:
    """An episode: first request, the policy's `sampled` ids, then the tool result; (tokens, new ids)."""
    conv = Conversation(template, TOOLS)
    tokens = EpisodeTokens()
    tokens.start(conv.first([USER]), version=3)
    conv.take([USER])
    tokens.append_policy(sampled, np.full(len(sampled), -0.25, np.float32), np.full(len(sampled), 3))
    conv.answered(REPLY, ended)
    new_ids = conv.next_ids([USER, REPLY, TOOL_MSG], TOOLS)
    tokens.append_template(new_ids)
    return tokens, new_ids


def test_stitched_sequence_is_the_rendering_and_keeps_sampled_ids(chat_tokenizer) -> None:
    template = ChatTemplate(chat_tokenizer)
    # The policy sampled the call one character per token: not how its text would re-tokenise.
    sampled = [chat_tokenizer.convert_tokens_to_ids("<tool_call>")]
    sampled += [i for ch in CALL_TEXT[len("<tool_call>"):-len("</tool_call>")]
                for i in chat_tokenizer.encode(ch, add_special_tokens=False)]
    sampled += [chat_tokenizer.convert_tokens_to_ids("</tool_call>"), template.end_id]
    canonical = template.encode(CALL_TEXT) + [template.end_id]
    assert sampled != canonical, "the test needs a non-canonical tokenisation"
    tokens, new_ids = two_turns(template, sampled)
    prompt = template.encode(template.render([USER], TOOLS, generation_prompt=True))
    assert tokens.ids == prompt + sampled + new_ids  # earlier ids untouched
    full = template.render([USER, REPLY, TOOL_MSG], TOOLS, generation_prompt=True)
    assert chat_tokenizer.decode(tokens.ids) == full  # and together they are exactly the template's rendering
    # The template's newline after <|im_end|> was not sampled: it opens the new template tokens.
    assert chat_tokenizer.decode(new_ids).startswith("\n<|im_start|>tool\n<tool_response>46")
    assert chat_tokenizer.decode(new_ids).endswith("<|im_start|>assistant\n")


def test_mask_logprob_and_version_layout(chat_tokenizer) -> None:
    template = ChatTemplate(chat_tokenizer)
    sampled = template.encode(CALL_TEXT) + [template.end_id]
    tokens, new_ids = two_turns(template, sampled)
    tokens.append_policy([5, 6], np.array([-1.0, -2.0], np.float32), np.array([4, 4]))
    n = len(sampled)
    assert tokens.mask == [1] * n + [0] * len(new_ids) + [1, 1]
    assert tokens.logprobs == [-0.25] * n + [0.0] * len(new_ids) + [-1.0, -2.0]
    # Template tokens carry the version before them, so spans break only where the weights did.
    assert tokens.versions == [3] * (n + len(new_ids)) + [4, 4]
    episode = ChatEpisode("ep-1", TaskRef("t", "chat", "chat", 1), Conversation(template, TOOLS), 1.0, 1.0, tokens)
    rollout = Rollout.decode(episode.rollout(0, "gen-0").encode())
    assert rollout.prompt_len == tokens.prompt_len
    assert rollout.loss_mask.tolist() == tokens.mask
    assert rollout.token_versions().tolist() == tokens.versions
    assert rollout.version_spans.tolist() == [[0, 3], [n + len(new_ids), 4]]


def test_turn_cut_at_max_tokens_gets_the_end_token_from_the_template(chat_tokenizer) -> None:
    template = ChatTemplate(chat_tokenizer)
    sampled = template.encode(CALL_TEXT)  # no <|im_end|>: cut at max_tokens
    tokens, new_ids = two_turns(template, sampled, ended=False)
    assert new_ids[0] == template.end_id
    assert chat_tokenizer.decode(tokens.ids) == template.render([USER, REPLY, TOOL_MSG], TOOLS, generation_prompt=True)


def test_template_that_rewrites_earlier_turns_is_refused(chat_tokenizer) -> None:
    # A template that shows only the latest assistant turn (as reasoning-stripping templates do).
    tok = chat_tokenizer.__class__(tokenizer_object=chat_tokenizer.backend_tokenizer, eos_token="<|im_end|>",
                                   chat_template=(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    template = ChatTemplate(tok)
    conv = Conversation(template, None)
    conv.take([USER])
    conv.answered({"role": "assistant", "content": "Let me see."}, True)
    with pytest.raises(StitchError) as err:
        conv.next_ids([USER, {"role": "assistant", "content": "Let me see."}, {"role": "user", "content": "go"}], None)
    assert err.value.code == "template_not_stitchable" and "re-tokenise" in err.value.message


def test_divergent_conversation_and_changed_tools_are_refused(chat_tokenizer) -> None:
    conv = Conversation(ChatTemplate(chat_tokenizer), TOOLS)
    conv.take([USER])
    conv.answered(REPLY, True)
    edited = {**REPLY, "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                                       "arguments": {"expression": "1"}}}]}
    with pytest.raises(StitchError, match=r"messages\[1\] differs") as err:
        conv.next_ids([USER, edited, TOOL_MSG], TOOLS)
    assert err.value.code == "conversation_diverged"
    with pytest.raises(StitchError) as err:
        conv.next_ids([USER, REPLY, TOOL_MSG], None)
    assert err.value.code == "tools_changed"
    with pytest.raises(StitchError, match="repeats 2 messages"):
        conv.next_ids([USER, REPLY], TOOLS)


def test_echoed_openai_message_normalises_to_the_reply() -> None:
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "12 + 34"}'}}]}
    assert normalise([USER, echoed, TOOL_MSG]) == [USER, REPLY, TOOL_MSG]
    with pytest.raises(ChatError, match="arguments are not JSON"):
        normalise([{**echoed, "tool_calls": [{"function": {"name": "x", "arguments": "{oops"}}]}])
    with pytest.raises(ChatError, match="non-empty list"):
        normalise([])
    with pytest.raises(ChatError, match="needs a role"):
        normalise([{"role": "robot", "content": "x"}])


def test_tool_call_parsing() -> None:
    assert parse_tool_calls("The answer is 46.") == ("The answer is 46.", [])
    content, calls = parse_tool_calls("Checking. " + CALL_TEXT + '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "Checking."
    assert calls == [{"name": "calculator", "arguments": {"expression": "12 + 34"}}, {"name": "f", "arguments": {}}]
    for bad, why in [('<tool_call>{"name": "f"', "never closed"), ("<tool_call>{name: f}</tool_call>", "not JSON"),
                     ('<tool_call>{"arguments": {}}</tool_call>', "needs a name"),
                     ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "object arguments")]:
        with pytest.raises(PolicyOutputError, match=why) as err:
            parse_tool_calls(bad)
        assert err.value.status == 422 and err.value.code == "malformed_tool_call"


def test_context_check() -> None:
    check_fits([1] * 10, 6, 16)
    with pytest.raises(ChatError, match="exceeds the model's context of 16") as err:
        check_fits([1] * 10, 7, 16)
    assert err.value.code == "context_length_exceeded"


def _ended(book: EpisodeBook, template: ChatTemplate, eid: str, task: TaskRef, reward: float | None,
           now: float) -> RolloutGroup | None:
    ep = ChatEpisode(eid, task, Conversation(template, None), 1.0, 1.0)
    ep.tokens.start([1, 2], 0)
    ep.tokens.append_policy([3], np.array([-0.1], np.float32), np.array([0]))
    ep.turns = 1
    book.open[eid] = ep
    return book.end(eid, reward, now=now)


def test_groups_publish_when_full_or_after_the_timeout(chat_tokenizer) -> None:
    template = ChatTemplate(chat_tokenizer)
    book = EpisodeBook(run="r", generator_id="g", episode_ttl_s=100.0, group_timeout_s=10.0)
    task = TaskRef("t1", "chat", "chat", 3)
    assert _ended(book, template, "a", task, 1.0, now=0.0) is None
    assert _ended(book, template, "b", task, None, now=1.0) is None
    group = _ended(book, template, "c", task, 0.0, now=2.0)
    assert group is not None and [r.rollout_id for r in group.rollouts] == ["a", "b", "c"]
    assert group.task.verifier == "reported" and group.task.metadata["reported_rewards"] == {"a": 1.0, "c": 0.0}
    assert RolloutGroup.decode(group.encode()).task.group_size == 3
    with pytest.raises(Conflict, match="already published"):
        book.check_task_open("t1")
    with pytest.raises(NotFound, match="no open episode 'a'"):
        book.end("a", None)
    # Short groups: two ended -> published at the timeout; one -> dropped as lone.
    _ended(book, template, "d", TaskRef("t2", "chat", "chat", 4), None, now=0.0)
    _ended(book, template, "e", TaskRef("t2", "chat", "chat", 4), None, now=5.0)
    _ended(book, template, "f", TaskRef("t3", "chat", "chat", 4), None, now=0.0)
    assert book.due(now=9.0) == []
    due = book.due(now=10.5)
    assert [g.task.task_id for g in due] == ["t2"] and len(due[0].rollouts) == 2 and due[0].task.verifier == ""
    assert book.dropped["lone"] == 1 and "t3" in book.published_tasks


def test_prefix_lookup_skips_episodes_without_an_answered_turn(chat_tokenizer) -> None:
    # Found by bench/chat_endpoint.py at concurrency 4: a fresh conversation arriving while another
    # episode's first request was sampling was joined to that episode.
    template = ChatTemplate(chat_tokenizer)
    book = EpisodeBook(run="r", generator_id="g", episode_ttl_s=100.0, group_timeout_s=10.0)
    sampling = ChatEpisode("busy", TaskRef("t", "chat", "chat", 1), Conversation(template, TOOLS), 1.0, 1.0)
    book.open["busy"] = sampling
    assert book.by_prefix([USER]) is None
    answered = ChatEpisode("a", TaskRef("t", "chat", "chat", 1), Conversation(template, TOOLS), 1.0, 1.0, turns=1)
    answered.conversation.take([USER])
    answered.conversation.answered(REPLY, True)
    book.open["a"] = answered
    assert book.by_prefix([USER, REPLY, TOOL_MSG]) is answered and book.by_prefix([USER]) is None


def test_reported_verifier() -> None:
    verifier = VERIFIERS.create("reported")
    task = Task(run="r", task_id="t", pool="chat", env="chat", prompt="p", metadata={"reported_rewards": {"a": 0.5}})
    rollout = Rollout(rollout_id="a", task_id="t", index=0, token_ids=np.array([1, 2], "<i4"), prompt_len=1,
                      loss_mask=np.ones(1, "|u1"), behaviour_logprobs=np.zeros(1, "<f4"),
                      version_spans=np.array([[0, 0]], "<i8"))
    assert verifier(task, rollout).reward == 0.5
    with pytest.raises(ValueError, match="no reported reward"):
        verifier(task, Rollout(**{**rollout.__dict__, "rollout_id": "b"}))


def test_the_chat_folder_loads_the_tokenizer_it_was_trained_with(chat_model_warm: Path, chat_tokenizer: Any) -> None:
    from rlbus.services.policy.load import load_tokenizer

    text = "What is 12 + 345? calc(12+345) = 357, so the answer is 357."
    assert load_tokenizer(chat_model_warm).encode(text) == chat_tokenizer.encode(text)
