"""Build a tiny chat-capable policy locally: a byte-level BPE tokenizer trained on generated
calculator dialogues, a Hugging Face chat template with tool calls, and a Qwen2 model.

Why it exists: the OpenAI-compatible endpoint (services/chat) needs a model whose tokenizer has
a chat template that renders system, user, assistant and tool messages and assistant tool calls,
and nothing can be downloaded here.  The tokenizer is trained with `tokenizers` on a few thousand
generated dialogues (seconds); the template is saved inside tokenizer_config.json, so
`load_tokenizer(folder).apply_chat_template(messages, tools=...)` works as with
any hub model.  The architecture is the project's tiny one (model_init.TINY_CONFIG) with a longer
context, because a rendered tool schema alone is tens of tokens.

Weights: random by default (the endpoint's tests need exact tokens, not good answers).
`warm_steps` > 0 runs a short supervised pass on the same dialogues so that the policy emits the
template's tool-call format; the endpoint's integration test uses that, so its two-turn episode
really is a tool call followed by an answer.  Same seed, same folder (a fixed data order, one
thread).

Template format (Hermes/Qwen style): each message is `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`;
tools are listed in the system message; an assistant tool call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` inside the assistant's content; a
tool result is `<tool_response>...</tool_response>` in a `tool` message.  `<|im_end|>` is eos:
the policy's turn ends there, and the `\\n` the template puts after it is a template token.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rlbus.services.policy.errors import PolicyError
from rlbus.services.policy.model_info import MODEL_INFO_FILE, install_folder
from rlbus.services.policy.model_init import TINY_CONFIG

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
# Atomic but not special: decoding with skip_special_tokens keeps them, so the tool-call parser
# sees them in the text.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
VOCAB_SIZE = 1024
CONTEXT = 1024
DIALOGUES = 3000

CHAT_TEMPLATE = (
    "{% if messages and messages[0].role == 'system' %}{% set system = messages[0].content %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "{% if tools %}<|im_start|>system\n{% if system %}{{ system }}\n\n{% endif %}Tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call a tool as <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call><|im_end|>\n"
    "{% elif system %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for call in m.tool_calls or [] %}{% set f = call.function if call.function is defined else call %}"
    "<tool_call>{\"name\": {{ f.name | tojson }}, \"arguments\": "
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% elif m.role != 'system' or not loop.first %}"
    "{{ raise_exception('unsupported role ' ~ m.role ~ ' (system only as the first message)') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}

Log = Callable[[str], None]


class ChatModelError(PolicyError):
    """The chat model folder could not be created as asked."""


def calculator_dialogue(rng: random.Random) -> list[dict[str, Any]]:
    """One generated episode: a sum question, a calculator call, its result, the answer."""
    terms = [rng.randint(1, 999) for _ in range(rng.randint(2, 4))]
    expression = " + ".join(str(t) for t in terms)
    value = str(sum(terms))
    return [
        {"role": "user", "content": f"What is {expression}?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]},
        {"role": "tool", "content": value},
        {"role": "assistant", "content": f"The answer is {value}."},
    ]


def _corpus(tokenizer: PreTrainedTokenizerFast, seed: int, n: int) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(n):
        yield str(tokenizer.apply_chat_template(calculator_dialogue(rng), tools=[CALCULATOR_TOOL], tokenize=False))


def build_chat_tokenizer(seed: int = 0, dialogues: int = DIALOGUES) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on rendered dialogues; deterministic for a seed."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])

    def wrap(t: Tokenizer) -> PreTrainedTokenizerFast:
        return PreTrainedTokenizerFast(tokenizer_object=t, eos_token=IM_END, pad_token=PAD,
                                       chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
                                       model_max_length=CONTEXT)

    # The corpus is rendered through the template itself, so frequent template strings merge.
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(wrap(tok), seed, dialogues), trainer)
    return wrap(tok)


def chat_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    return Qwen2Config(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, dtype="float32",
                       **{**TINY_CONFIG, "max_position_embeddings": CONTEXT})


def _warm_start(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, *, seed: int, steps: int,
                log: Log) -> float:
    """Next-token loss on the assistant turns of generated dialogues (the template's other tokens
    are context, not targets); returns the last loss."""
    texts = list(_corpus(tokenizer, seed + 1, 512))
    start_id = tokenizer.convert_tokens_to_ids(IM_START)
    rows = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        target = torch.full((len(ids),), -100, dtype=torch.long)
        inside = False
        for i, t in enumerate(ids):
            # An assistant turn starts after "<|im_start|>assistant\n" (2 tokens) and ends at <|im_end|>.
            if t == start_id:
                inside = tokenizer.decode(ids[i + 1:i + 2]).startswith("assistant")
                begin = i + 3
            if inside and i >= begin:
                target[i] = t
                if t == tokenizer.eos_token_id:
                    inside = False
        rows.append((torch.tensor(ids), target))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    order = random.Random(seed)
    loss = torch.tensor(float("nan"))
    model.train()
    for step in range(steps):
        batch = order.sample(rows, 16)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), int(tokenizer.pad_token_id), dtype=torch.long)
        targets = torch.full((len(batch), width), -100, dtype=torch.long)
        for r, (i, t) in enumerate(batch):
            ids[r, :len(i)] = i
            targets[r, :len(t)] = t
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if (step + 1) % 25 == 0:
            log(f"chat warm-start step {step + 1} loss {loss.item():.4f}")
    model.eval()
    return float(loss.item())


def build_chat_model(out_dir: Path | str, *, seed: int = 0, warm_steps: int = 0, overwrite: bool = False,
                     log: Log = print) -> dict[str, Any]:
    """Write the chat policy folder (model, tokenizer with its chat template) to `out_dir`."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ChatModelError(f"{out} exists and is not empty: pass overwrite=True or choose another folder")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = build_chat_tokenizer(seed)
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(chat_config(tokenizer))
        model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                                   pad_token_id=tokenizer.pad_token_id)
        loss = _warm_start(model, tokenizer, seed=seed, steps=warm_steps, log=log) if warm_steps else None
    finally:
        torch.set_num_threads(previous_threads)
    info = {"seed": seed, "warm_steps": warm_steps, "last_loss": loss, "vocab_size": len(tokenizer),
            "parameters": sum(p.numel() for p in model.parameters())}
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    # In tokenizer_config.json (not a separate .jinja file): one file carries the whole tokenizer contract.
    tokenizer.save_pretrained(staging, save_jinja_files=False)
    (staging / MODEL_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    install_folder(staging, out)
    return info
