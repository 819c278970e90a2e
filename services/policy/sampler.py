"""Group sampler of the PyTorch backend: n completions per prompt, token by token.

Why it exists: GRPO-style training needs n samples of the same prompt, each token with the
behaviour log-prob it was sampled with and the weight version that produced it (design
invariants 2–4). vLLM does this on real clusters; this sampler is the reference backend that
runs anywhere, and its deterministic mode is what makes generator and trainer bit-identical.

How it samples: the prompts of a call are left-padded into one batch and prefilled once; the
KV cache is then repeated n times (`DynamicCache.batch_repeat_interleave`), so the n samples
of a prompt share one prefill. Decoding feeds one token per row per step; rows that stopped
keep decoding (their tokens are discarded) so the batch never has to be re-packed.

Weight swaps: between decode steps the sampler calls `slot.maybe_swap()`. When it returns
True the cache is rebuilt by one forward of every row's full prefix under the new weights,
so each later token is sampled from exactly the new policy given its prefix (unlike keeping
old-weight KV, whose log-probs would match neither version). Every token records the version
whose forward produced its distribution. That rebuild costs a forward of the whole prefix, so
with `mid_sequence_swap="when_cheaper"` the sampler only swaps mid-sequence while the tokens
still to decode outnumber the prefix to recompute: short completions then finish on the weights
they started with (their tokens say so) and the next call starts on the new ones, while long
generations still move to new weights within the sequence.

Speculative tail (`speculation`, off unless given): once no more than `tail_rows` rows are still
decoding, the sampler hands them, their KV and their tokens to `spec_tail.TailDecoder`, which
finishes them by draft-and-verify: same distribution, same behaviour log-probs (the target's),
same version labels and swap points, fewer target forwards when the drafts are good.

Deterministic mode: the sampler decodes in the trainer's key layout with the attention kernel of
`exact_attention` (`_decode_exact`, `exact_decode.DecodeGroup`), so each token's behaviour
log-prob is already the trainer's, bit for bit (`logprobs_source="decoded"`). A sample whose
keys pass `DECODE_EXACT_KEYS`, or that was decoded with the speculative tail, is recomputed
after sampling with the trainer's own function (`"recomputed"`). Neither is possible for a
sample whose tokens span a swap: it keeps its incremental values and says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from rlbus.services.policy.errors import PolicyError
from rlbus.services.policy.exact import deterministic_shapes
from rlbus.services.policy.exact_attention import EXACT_ATTN
from rlbus.services.policy.exact_decode import DecodeGroup
from rlbus.services.policy.logprobs import completion_logprobs
from rlbus.services.policy.sampling import SamplingParams, processed_logprobs
from rlbus.services.policy.sequences import attention, outside_vocab
from rlbus.services.policy.spec_tail import Speculation, TailRows

FinishReason = Literal["stop", "length"]
# "decoded": decoded in the trainer's layout, already its values; "recomputed": recomputed after.
LogprobSource = Literal["incremental", "decoded", "recomputed"]
MidSequenceSwap = Literal["next_step", "when_cheaper"]


class SamplerInputError(PolicyError):
    """The prompts or parameters given to the sampler cannot be sampled from."""


class ModelSlot(Protocol):
    """Where the sampler finds the current weights; the generator's weight updater is one."""

    @property
    def model(self) -> PreTrainedModel: ...

    @property
    def version(self) -> int: ...

    def maybe_swap(self) -> bool:
        """Install pending weights if any; True when `model`/`version` changed."""
        ...


class StaticSlot:
    """A slot whose weights never change (evaluation, tests, the warm start)."""

    def __init__(self, model: PreTrainedModel, version: int = 0) -> None:
        self.model = model
        self.version = version

    def maybe_swap(self) -> bool:
        return False


@dataclass
class SampleOut:
    """One sampled completion and what the trainer needs to correct for staleness."""

    completion_ids: list[int]  # includes the stop token when one was produced
    behaviour_logprobs: np.ndarray  # float32, log-prob of each token under the sampled distribution
    token_versions: np.ndarray  # int64, weight version that produced each token
    finish_reason: FinishReason
    logprobs_source: LogprobSource = "incremental"

    @property
    def exact(self) -> bool:
        """Whether `behaviour_logprobs` are the trainer's deterministic values, bit for bit."""
        return self.logprobs_source != "incremental"


def _stop_ids(model: torch.nn.Module, params: SamplingParams) -> list[int]:
    """The caller's stop ids plus the model's eos id(s)."""
    ids = set(params.stop_token_ids)
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return sorted(ids)


def _check_prompts(model: PreTrainedModel, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
    """Raise `SamplerInputError` when a prompt plus `max_new_tokens` does not fit the model's
    context or a prompt holds an id outside its vocabulary."""
    max_positions = getattr(model.config, "max_position_embeddings", None)
    width = max(len(p) for p in prompts)
    if max_positions is not None and width + params.max_new_tokens > max_positions:
        raise SamplerInputError(
            f"longest prompt ({width}) + max_new_tokens ({params.max_new_tokens}) exceeds "
            f"max_position_embeddings={max_positions}: lower max_new_tokens or shorten prompts"
        )
    vocab_size = getattr(model.config, "vocab_size", None)
    for i, prompt in enumerate(prompts):
        if (bad := outside_vocab(prompt, vocab_size)) is not None:
            raise SamplerInputError(
                f"prompt {i} has token id {bad} outside the vocabulary (size {vocab_size}): "
                "encode prompts with the policy's own tokenizer"
            )


def _left_pad(model: PreTrainedModel, prompts: Sequence[Sequence[int]], params: SamplingParams,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Prompts left-padded into one batch: (ids, attention mask or None, prompt lengths).

    Left padding keeps every row's last prompt token in the last column, so one decode step
    appends one column for all rows.  A mask (and explicit positions) is needed only when
    lengths differ; without one SDPA stays on its causal fast path."""
    _check_prompts(model, prompts, params)
    prompt_lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    width = int(prompt_lens.max())
    prompt_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
    mask: torch.Tensor | None = None
    if bool((prompt_lens != width).any()):
        mask = (torch.arange(width) >= (width - prompt_lens)[:, None]).long().to(device)
    return prompt_ids.to(device), mask, prompt_lens


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from the processed distribution, and that distribution's log-probs."""
    lp = processed_logprobs(logits, params.temperature, params.top_p)
    if params.temperature == 0.0:
        return lp.argmax(dim=-1), lp
    # A generator lives on one device; draw where it lives so seeds replay exactly.
    draw = torch.multinomial(lp.exp().to(generator.device), 1, generator=generator)
    return draw.squeeze(-1).to(device), lp


class _Completions:
    """The rows being decoded: tokens, their behaviour log-probs and versions, lengths, done.
    Rows that stopped keep decoding (their later tokens are cut by ``length``)."""

    def __init__(self, rows: int, max_new_tokens: int, device: torch.device) -> None:
        self.tokens = torch.zeros((rows, max_new_tokens), dtype=torch.long, device=device)
        self.logps = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
        self.versions = np.zeros((rows, max_new_tokens), dtype=np.int64)
        self.length = torch.zeros(rows, dtype=torch.long, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.new_column = torch.ones((rows, 1), dtype=torch.long, device=device)

    def record(self, step: int, tok: torch.Tensor, lp: torch.Tensor, version: int, stop: torch.Tensor) -> None:
        self.tokens[:, step] = tok
        self.logps[:, step] = lp.gather(-1, tok[:, None]).squeeze(-1)
        self.versions[:, step] = version
        self.length += (~self.done).long()
        self.done |= torch.isin(tok, stop)

    def record_rows(self, rows: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, version: int,
                    stop: torch.Tensor) -> None:
        """One token for each of `rows` (all still decoding) at its own length: the speculative
        tail's rounds without drafts, whose rows stand at different lengths."""
        at = self.length[rows]
        self.tokens[rows, at] = tok
        self.logps[rows, at] = lp.gather(-1, tok[:, None]).squeeze(-1)
        self.versions[rows.cpu().numpy(), at.cpu().numpy()] = version
        self.length[rows] = at + 1
        self.done[rows] = torch.isin(tok, stop)

    def samples(self) -> list[SampleOut]:
        tokens_l = self.tokens.tolist()
        logps_np = self.logps.cpu().numpy()
        length_l = self.length.tolist()
        done_l = self.done.tolist()
        return [
            SampleOut(
                completion_ids=tokens_l[r][: length_l[r]],
                behaviour_logprobs=logps_np[r, : length_l[r]].copy(),
                token_versions=self.versions[r, : length_l[r]].copy(),
                finish_reason="stop" if done_l[r] else "length",
            )
            for r in range(len(length_l))
        ]


def _prefill(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[DynamicCache, torch.Tensor]:
    """Fresh KV cache for `ids` and the logits of each row's last position."""
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.past_key_values, out.logits[:, -1]


class GroupSampler:
    """Samples groups of completions through a `ModelSlot` (see the module docstring)."""

    def __init__(self, model_slot: ModelSlot, *, deterministic: bool = False,
                 mid_sequence_swap: MidSequenceSwap = "next_step", speculation: Speculation | None = None) -> None:
        self.slot = model_slot
        self.deterministic = deterministic
        self.mid_sequence_swap = mid_sequence_swap
        # None or drafter "off": plain decoding to the end of every call.
        self.speculation = speculation

    def _swap_worthwhile(self, prefix_len: int, remaining: int) -> bool:
        return self.mid_sequence_swap == "next_step" or remaining >= prefix_len

    def sample_groups(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[list[SampleOut]]:
        """For each prompt (token ids, `<bos>` included), `n` samples, in prompt order.

        Randomness comes only from `generator` (or, when it is None, from `params.seed`), so
        the same weights, prompts and seed replay the same samples.
        """
        if n < 1:
            raise SamplerInputError(f"n={n}: ask for at least one sample per prompt")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise SamplerInputError(f"prompt {i} is empty: encode it with a leading <bos>")
        if not prompts:
            return []
        if generator is None:
            generator = torch.Generator(device=next(self.slot.model.parameters()).device)
            if params.seed is not None:
                generator.manual_seed(params.seed)
            else:
                generator.seed()
        self.slot.maybe_swap()
        if self.speculation is not None:
            self.speculation.begin_call()
        with torch.no_grad():
            if self.deterministic and self.speculation is None:
                rows = self._decode_exact(prompts, n, params, generator)
            else:
                rows = self._decode(prompts, n, params, generator)
        if self.speculation is not None:
            self.speculation.end_call([s.completion_ids for s in rows])
        if self.deterministic:
            self._recompute(prompts, n, rows, params)
        return [rows[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _decode(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> list[SampleOut]:
        model, version = self.slot.model, self.slot.version
        device = next(model.parameters()).device
        prompt_ids, mask, prompt_lens = _left_pad(model, prompts, params, device)
        width = prompt_ids.shape[1]
        cache, logits = _prefill(model, prompt_ids, mask)
        # One prefill per prompt, then n rows per prompt share copies of its KV cache.
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        if mask is not None:
            mask = mask.repeat_interleave(n, dim=0)
        out = _Completions(len(prompts) * n, params.max_new_tokens, device)
        next_pos = prompt_lens.to(device).repeat_interleave(n)
        stop = torch.tensor(_stop_ids(model, params), dtype=torch.long, device=device)
        for step in range(params.max_new_tokens):
            tok, lp = _draw(logits, params, generator, device)
            out.record(step, tok, lp, version, stop)
            if step + 1 == params.max_new_tokens or bool(out.done.all()):
                break
            if self.speculation is not None and self.speculation.wants_tail(int((~out.done).sum())):
                # The few rows left finish by draft-and-verify (services/policy/spec_tail.py).
                live = (~out.done).nonzero().squeeze(-1).tolist()
                self.speculation.decode_tail(
                    self.slot, TailRows(live, cache, mask, next_pos, tok, prompt_ids, prompt_lens, n), out, params,
                    generator, set(stop.tolist()), self._swap_worthwhile)
                break
            if mask is not None:
                mask = torch.cat([mask, out.new_column], dim=1)  # now covers `tok`
            if self._swap_worthwhile(width + step + 1, params.max_new_tokens - step - 1) and self.slot.maybe_swap():
                model, version = self.slot.model, self.slot.version
                # Old-weight KV would give log-probs of neither version: rebuild the cache
                # under the new weights from every row's full prefix.
                prefix = torch.cat([prompt_ids.repeat_interleave(n, dim=0), out.tokens[:, : step + 1]], dim=1)
                cache, logits = _prefill(model, prefix, mask)
            else:
                fwd = model(
                    input_ids=tok[:, None],
                    attention_mask=mask,
                    position_ids=None if mask is None else next_pos[:, None],
                    past_key_values=cache,
                    use_cache=True,
                )
                cache, logits = fwd.past_key_values, fwd.logits[:, -1]
            next_pos = next_pos + 1
        return out.samples()

    def _decode_exact(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> list[SampleOut]:
        """`_decode` in the trainer's layout (`exact_decode`): rows whose every token came from one
        version and whose keys stay within `DECODE_EXACT_KEYS` carry the trainer's log-probs
        already (`logprobs_source="decoded"`); the rest are left for `_recompute`."""
        model, version = self.slot.model, self.slot.version
        device = next(model.parameters()).device
        _check_prompts(model, prompts, params)
        shapes = deterministic_shapes(model)
        by_width: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_width.setdefault(shapes.bucket_len(len(p)), []).append(i)
        with ExitStack() as pinned:
            pinned.enter_context(attention(model, EXACT_ATTN))
            groups = [DecodeGroup(model, [prompts[i] for i in idx], n, width, params.max_new_tokens, shapes, device)
                      for width, idx in by_width.items()]
            sizes = [g.rows for g in groups]
            out = _Completions(len(prompts) * n, params.max_new_tokens, device)
            logits = torch.cat([g.logits for g in groups])
            stop = torch.tensor(_stop_ids(model, params), dtype=torch.long, device=device)
            for step in range(params.max_new_tokens):
                tok, lp = _draw(logits, params, generator, device)
                out.record(step, tok, lp, version, stop)
                if step + 1 == params.max_new_tokens or bool(out.done.all()):
                    break
                if self._swap_worthwhile(max(by_width) + step + 1, params.max_new_tokens - step - 1) and self.slot.maybe_swap():
                    model, version = self.slot.model, self.slot.version
                    pinned.enter_context(attention(model, EXACT_ATTN))
                    done = out.tokens[:, : step + 1].split(sizes)
                    logits = torch.cat([g.restart(model, t) for g, t in zip(groups, done, strict=True)])
                else:
                    logits = torch.cat([g.extend(model, t[:, None]) for g, t in zip(groups, tok.split(sizes), strict=True)])
        return self._in_prompt_order(out.samples(), groups, list(by_width.values()), n)

    @staticmethod
    def _in_prompt_order(samples: list[SampleOut], groups: list[DecodeGroup], members: list[list[int]],
                         n: int) -> list[SampleOut]:
        """Samples come group by group; put them back in prompt order and label the exact ones."""
        ordered: list[SampleOut] = list(samples)
        first = 0
        for group, idx in zip(groups, members, strict=True):
            for k in range(group.rows):
                sample = samples[first + k]
                if (len(sample.completion_ids) and len(set(sample.token_versions.tolist())) == 1
                        and group.covers(len(sample.completion_ids))):
                    sample.logprobs_source = "decoded"
                ordered[idx[k // n] * n + k % n] = sample
            first += group.rows
        return ordered

    def _recompute(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        rows: list[SampleOut],
        params: SamplingParams,
    ) -> None:
        """Replace behaviour log-probs by the trainer's batch-invariant values where valid."""
        current = self.slot.version
        eligible = [r for r, s in enumerate(rows) if len(s.completion_ids) and s.logprobs_source == "incremental"
                    and (s.token_versions == current).all()]
        if not eligible:
            return
        pairs = [(prompts[r // n], rows[r].completion_ids) for r in eligible]
        values = completion_logprobs(self.slot.model, pairs, params, deterministic=True)
        for r, v in zip(eligible, values, strict=True):
            rows[r].behaviour_logprobs = v.detach().cpu().numpy().astype(np.float32, copy=False)
            rows[r].logprobs_source = "recomputed"
