"""Speculative decoding in the tail of a sampler call: the last few rows of a batch continue by
draft-and-verify instead of one token per forward.

Why the tail: a plain decode step costs about the same for 1 row as for 8 on this CPU (one
forward of the tiny policy with a cache: ~2.4 ms at 1 row, ~3.2 ms at 8, ~4.4 ms at 32, one
thread), so when a batch is down to its last rows each step is nearly all overhead. A forward
over the last token plus k drafted ones costs little more than over one (1 row: x1.2 for k = 1..4;
8 rows: x1.2 at k = 1, x1.4 at k = 4), so every accepted draft is a step saved. With more rows the
verify forward grows with rows x (k + 1) and the drafts of a group's rows, all at the same
position, have nothing to copy yet: bench/speculative_accept.py puts the crossover between 2 and
4 rows, and a group of 8 decoded in lockstep loses
(docs/measurements/speculative-accept-cpu2-2026-12-05.md).

How (`TailDecoder`): the live rows' KV is taken out of the batch cache (`batch_select_indices`),
left padding and all. Each round every row proposes up to k tokens from `GroupDrafter` (its
siblings' tokens, its own, recent completions of earlier calls); ONE target forward over each
row's last token and its drafts (right-padded, masked, explicit positions) gives the target's
processed distribution at every drafted position; `accept_drafts` keeps a prefix and draws the
correction or bonus token. With drafter "model" / "static" the proposals are sampled instead from a
small draft model (`ModelDrafter`, services/policy/model_drafter.py), and their distributions go to
the acceptance rule, which then keeps the target's distribution exactly; a "model" draft's staged
versions are swapped in before a drafting round. With "model+group" / "static+group" each row
takes the group drafter's proposal when it has one and the draft model's otherwise, in one verify
forward (`RoundDrafts`, services/policy/draft_round.py); `TailStats` counts each source apart. The cache columns of rejected drafts are masked out for the rows that
rejected them and cropped where every row did, so no later token attends to them. A row with no
draft just feeds its last token: a plain decode step. Behaviour log-probs are the target's
processed log-probs of the emitted tokens, and every token is labelled with the version whose
forward produced it, as in plain decoding. A staged weight swap is applied between target
forwards (the same `when_cheaper` rule as the plain loop) and the tail rows' cache is rebuilt
from their full prefixes under the new weights. Stop ids and `max_new_tokens` cut a row exactly
where plain decoding would: drafts never run past the budget and tokens after a stop are dropped.

Adaptive draft length (`DraftLength`): see its docstring.  A combined drafter keeps one per source
(`Speculation.lengths`, keyed "group" and "model"): the two differ in acceptance and in cost (a
suffix lookup is free, a draft model's forwards are not), and one shared rule lets the draft
model's collapse after a policy shift switch the group drafter off with it
(docs/measurements/speculative-drift-cpu2-2026-12-07.md).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from rlbus.services.policy.draft_model import load_draft
from rlbus.services.policy.draft_round import RoundDrafts, Source
from rlbus.services.policy.drafter_names import (
    DRAFTERS,
    GROUP_DRAFTERS,
    MODEL_DRAFTERS,
    ONLINE_DRAFTERS,
    DrafterName,
    drafter_choices,
)
from rlbus.services.policy.drafters import GroupDrafter, RecentCompletions
from rlbus.services.policy.errors import PolicyError
from rlbus.services.policy.model_drafter import ModelDrafter
from rlbus.services.policy.sampling import SamplingParams, processed_logprobs
from rlbus.services.policy.speculative import Verified, accept_drafts
from rlbus.services.policy.weight_slot import WeightSlot

if TYPE_CHECKING:  # the sampler imports this module
    from rlbus.services.policy.sampler import ModelSlot, _Completions


def drafter_sources(drafter: str) -> tuple[Source, ...]:
    """The proposal sources a drafter combines, in the order a round asks them (group first)."""
    sources: list[Source] = []
    if drafter in GROUP_DRAFTERS:
        sources.append("group")
    if drafter in MODEL_DRAFTERS:
        sources.append("model")
    return tuple(sources)


class SpeculationConfigError(PolicyError):
    """A speculative decoding setting is outside its valid range."""


@dataclass(frozen=True)
class SpeculationConfig:
    """What the sampler drafts with and when ([generator.speculative] on the generator)."""

    drafter: DrafterName = "off"
    tail_rows: int = 2
    max_k: int = 4
    # The draft model's folder for the drafters that use one (drafter_names.MODEL_DRAFTERS).
    draft_model_path: str = ""

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise SpeculationConfigError(
                f"drafter={self.drafter!r} is not a drafter: use one of {drafter_choices()} "
                "(a draft model and the group drafter combine only as 'model+group' or 'static+group')")
        if self.tail_rows < 1:
            raise SpeculationConfigError(f"tail_rows={self.tail_rows}: use a value >= 1 (rows left when drafting starts)")
        if not 1 <= self.max_k <= 16:
            raise SpeculationConfigError(f"max_k={self.max_k}: use a value in 1..16 (most tokens drafted per row per round)")

    @classmethod
    def of(cls, options: object) -> SpeculationConfig:
        """[generator.speculative] as backends receive it: a SpeculativeOptions, a dict, or None (off)."""
        if options is None:
            return cls()
        values = options if isinstance(options, dict) else options.model_dump()  # type: ignore[attr-defined]
        return cls(**values)


class DraftLength:
    """How many tokens to draft per row: the k that maximises expected tokens per unit of cost.

    Acceptance: alpha, the chance that a drafted token is kept given the ones before it were,
    estimated as kept / (kept + rejections) over recent verify rounds (counts decayed by `decay`
    per round, plus a prior of `prior_trials` trials at `prior_alpha`: the group drafter's tail
    acceptance on the tiny policy is about 0.4-0.6,
    docs/measurements/speculative-accept-cpu2-2026-12-05.md). A drafter switched off
    decays once per sampler call instead (`Speculation.begin_call`), back towards the prior, so it
    is tried again some tens of calls later instead of staying off for good.

    Rule: a round with k drafts yields (1 - alpha^(k+1)) / (1 - alpha) tokens per row on average
    and costs `1 + overhead + per_token * k * rows` plain decode steps; k is the argmax over
    0..max_k of their ratio, and 0 (a plain step) whenever no k beats 1. Constants from this CPU
    (tiny policy, one thread): a verify forward over 2-5 tokens costs 1.2-1.3x a one-token step at
    1-2 rows and 1.4x at 8 rows with k = 4, and drafting plus the acceptance rule add ~0.1 of a
    step: overhead 0.3, per_token 0.02. Break-even is then alpha ~ 0.35 at 1 row. More rows than
    `tail_rows`: always 0 (the sampler never enters the tail).

    Drafting cost: a draft model's forwards are not free (a 1-layer draft of the 4-layer tiny
    policy cost ~0.35 of a plain target step per drafted token on this CPU, 2 layers ~0.55;
    bench/speculative.py, docs/measurements/draft-model-cpu2-2026-12-06.md), so a round also costs
    `draft_cost * k` steps: the measured drafting seconds per drafted token in units of a plain
    step (a verify forward's seconds over its estimated `verify_steps + per_token * k * rows`
    steps), decayed like the counts towards a prior of 0 (the group drafter's lookups measure
    ~0.01). It is what switches a draft model off where it cannot pay, and lets it be tried again
    later.
    """

    overhead = 0.3
    per_token = 0.02
    verify_steps = 1.2
    decay = 0.95
    prior_alpha = 0.5
    prior_trials = 2.0
    prior_drafted = 2.0

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.kept = 0.0
        self.trials = 0.0
        self.draft_steps = 0.0  # decayed drafting time, in plain steps
        self.drafted = 0.0  # decayed drafted tokens per row that time paid for

    @property
    def draft_cost(self) -> float:
        return self.draft_steps / (self.drafted + self.prior_drafted)

    @property
    def alpha(self) -> float:
        return (self.kept + self.prior_alpha * self.prior_trials) / (self.trials + self.prior_trials)

    def observe(self, kept: int, trials: int) -> None:
        """One verify round: `kept` drafted tokens kept over all rows, `trials` = kept + rejections."""
        self.kept = self.kept * self.decay + kept
        self.trials = self.trials * self.decay + trials
        self.draft_steps *= self.decay
        self.drafted *= self.decay

    def observe_cost(self, draft_s: float, verify_s: float, k: int, rows: int) -> None:
        """One round's timing: `draft_s` proposing k tokens per row, `verify_s` its verify forward."""
        if k < 1 or verify_s <= 0.0:
            return
        step_s = verify_s / (self.verify_steps + self.per_token * k * rows)
        self.draft_steps += draft_s / step_s
        self.drafted += k

    def k(self, rows: int) -> int:
        a = min(self.alpha, 0.999)
        best_k, best = 0, 1.0
        for k in range(1, self.max_k + 1):
            cost = 1.0 + self.overhead + self.per_token * k * rows + self.draft_cost * k
            gain = (1.0 - a ** (k + 1)) / (1.0 - a) / cost
            if gain > best + 1e-9:
                best_k, best = k, gain
        return best_k


class FixedDraftLength(DraftLength):
    """Always `max_k` drafts per row, whatever the acceptance and the rows (a measurement at a set k:
    the adaptive rule would stop drafting for a poor drafter and leave nothing to measure)."""

    def k(self, rows: int) -> int:
        return self.max_k


@dataclass
class TailStats:
    """What speculation did in one sampler call (zeros when the call never reached the tail)."""

    rounds: int = 0  # target forwards in the tail
    row_forwards: int = 0  # rows in those forwards
    tokens: int = 0  # tokens emitted in the tail
    drafted: int = 0
    kept: int = 0
    drafting_rows: int = 0  # row-rounds that drafted at least one token
    draft_s: float = 0.0
    verify_s: float = 0.0
    k_last: int = 0
    draft_swaps: int = 0  # new draft versions swapped in during the tail (drafter "model")
    # `drafted` and `kept` by the drafter that proposed them: with "model+group" they say which
    # half pays (each is zero under a drafter that has only the other half).
    group_drafted: int = 0
    group_kept: int = 0
    model_drafted: int = 0
    model_kept: int = 0

    def count(self, source: Source, drafted: int, kept: int) -> None:
        """One row-round's drafts: `drafted` proposed by `source`, the first `kept` of them kept."""
        self.drafting_rows += 1
        self.drafted += drafted
        self.kept += kept
        setattr(self, f"{source}_drafted", getattr(self, f"{source}_drafted") + drafted)
        setattr(self, f"{source}_kept", getattr(self, f"{source}_kept") + kept)

    def add(self, other: TailStats) -> None:
        """Add ``other``'s counts and times to these (an aggregate over calls); ``k_last`` is not a count."""
        for f in dataclasses.fields(self):
            if f.name != "k_last":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def metrics(self) -> dict[str, float]:
        return {
            "acceptance_rate": self.kept / self.drafted if self.drafted else 0.0,
            "mean_accepted_len": self.kept / self.drafting_rows if self.drafting_rows else 0.0,
            "tokens_per_forward": self.tokens / self.row_forwards if self.row_forwards else 0.0,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "tail_tokens": float(self.tokens),
            "k": float(self.k_last),
            "group_acceptance_rate": self.group_kept / self.group_drafted if self.group_drafted else 0.0,
            "group_kept": float(self.group_kept),
            "model_acceptance_rate": self.model_kept / self.model_drafted if self.model_drafted else 0.0,
            "model_kept": float(self.model_kept),
        }


@dataclass
class TailRows:
    """The batch's state at the hand-over, for the rows still decoding.

    `cache` holds every batch row's prompt (left-padded to `width` columns) and its completion
    tokens but the newest (`last`, not fed yet); `mask` covers those columns (None: no padding).
    """

    rows: list[int]  # batch row indices still decoding
    cache: DynamicCache
    mask: torch.Tensor | None
    next_pos: torch.Tensor  # [batch] position of `last`
    last: torch.Tensor  # [batch] newest token of each row
    prompt_ids: torch.Tensor  # [prompts, width] left-padded
    prompt_lens: torch.Tensor  # [prompts]
    n: int  # rows per prompt


SwapRule = Callable[[int, int], bool]


class Speculation:
    """The sampler's speculative tail: configuration, the per-drafter draft length, the pool of
    recent completions, the draft model's slot (the drafters in MODEL_DRAFTERS) and the last
    call's statistics.

    `draft`: for "static" / "static+group" a slot that never changes (the draft frozen at its first
    version); for "model" / "model+group" a `WeightSlot` whose staged versions (`stage_draft`) are
    swapped in between target forwards, so a running generator follows a draft that keeps being
    distilled."""

    def __init__(self, config: SpeculationConfig, *, recent: int = 64, draft: ModelSlot | None = None,
                 lengths: DraftLength | None = None) -> None:
        if config.drafter in MODEL_DRAFTERS and draft is None:
            raise SpeculationConfigError(
                f"drafter={config.drafter!r} needs a draft model: set draft_model_path (build one with "
                "rlbus.services.policy.draft_model.build_draft) or use drafter = 'group'")
        self.config = config
        self.recent = RecentCompletions(recent=recent)
        # `lengths`: a fixed rule instead of the adaptive one (measurements at a set k), one copy per source.
        self.lengths: dict[Source, DraftLength] = {
            source: copy.deepcopy(lengths) if lengths is not None else DraftLength(config.max_k)
            for source in drafter_sources(config.drafter)}
        self.last_call = TailStats()
        self.draft = draft
        self.model_drafter = ModelDrafter(draft) if draft is not None else None

    @classmethod
    def build(cls, config: SpeculationConfig, policy: PreTrainedModel) -> Speculation:
        """The tail as [generator.speculative] describes it, the draft loaded from draft_model_path
        and checked against `policy` (DraftModelError says what does not fit)."""
        if config.drafter not in MODEL_DRAFTERS:
            return cls(config)
        if not config.draft_model_path:
            raise SpeculationConfigError(
                f"drafter={config.drafter!r} needs draft_model_path, the draft model's folder: build one with "
                "rlbus.services.policy.draft_model.build_draft / save_draft, or use drafter = 'group'")
        from rlbus.services.policy.sampler import StaticSlot  # the sampler imports this module

        draft = load_draft(config.draft_model_path, policy)
        online = config.drafter in ONLINE_DRAFTERS
        slot: ModelSlot = WeightSlot(draft, 0) if online else StaticSlot(draft)
        return cls(config, draft=slot)

    def stage_draft(self, version: int, weights: bytes | memoryview | Mapping[str, torch.Tensor]) -> None:
        """Stage a new draft version; the tail swaps it in before its next drafting round."""
        if not isinstance(self.draft, WeightSlot):
            raise SpeculationConfigError(
                f"drafter={self.config.drafter!r} holds no swappable draft: new draft versions need "
                "drafter = 'model' or 'model+group'")
        self.draft.stage(version, weights)

    @property
    def enabled(self) -> bool:
        return self.config.drafter != "off"

    def wants_tail(self, live_rows: int) -> bool:
        """Hand the rest of the call to the tail now? Only with few rows left and a drafter whose
        measured acceptance makes some k worth drafting at this row count."""
        return self.enabled and 0 < live_rows <= self.config.tail_rows and \
            any(length.k(live_rows) > 0 for length in self.lengths.values())

    def begin_call(self) -> None:
        self.last_call = TailStats()
        # A staged draft also goes in at every call's start, as the policy's does: calls that form
        # no tail (most of them, on short answers) would otherwise leave the draft in use, and the
        # lag the generator reports, as old as the last call that drafted.
        if isinstance(self.draft, WeightSlot) and self.draft.maybe_swap():
            self.last_call.draft_swaps += 1
        for length in self.lengths.values():
            if length.k(1) == 0:
                # Switched off, so no round measures it: let it drift back to the prior, so it
                # is tried again after some calls instead of staying off for good.
                length.observe(0, 0)

    def end_call(self, completions: Sequence[Sequence[int]]) -> None:
        if not self.enabled:
            return
        for c in completions:
            if c:
                self.recent.add(c)

    def decode_tail(self, slot: ModelSlot, state: TailRows, out: _Completions, params: SamplingParams,
                    generator: torch.Generator, stop: set[int], swap_rule: SwapRule) -> None:
        TailDecoder(self, slot, state, out, params, generator, stop, swap_rule).run()


@dataclass
class _Live:
    """Per tail row (aligned with the tensors of the tail batch)."""

    rows: list[int]
    mask: torch.Tensor
    next_pos: torch.Tensor
    last: torch.Tensor
    cache: DynamicCache


class TailDecoder:
    """One call's tail: draft-and-verify rounds until every tail row stopped (module docstring)."""

    def __init__(self, spec: Speculation, slot: ModelSlot, state: TailRows, out: _Completions, params: SamplingParams,
                 generator: torch.Generator, stop: set[int], swap_rule: SwapRule) -> None:
        self.spec, self.slot, self.out, self.params, self.gen = spec, slot, out, params, generator
        self.stop, self.swap_rule, self.state = stop, swap_rule, state
        self.stop_ids = torch.tensor(sorted(stop), dtype=torch.long, device=state.last.device)
        self.lengths = spec.lengths
        self.stats = spec.last_call
        self.model, self.version = slot.model, slot.version
        self.device = state.last.device
        idx = torch.tensor(state.rows, dtype=torch.long, device=self.device)
        cache = state.cache
        cache.batch_select_indices(idx)
        width = cache.get_seq_length()
        mask = state.mask[idx] if state.mask is not None else \
            torch.ones((len(state.rows), width), dtype=torch.long, device=self.device)
        self.live = _Live(list(state.rows), mask, state.next_pos[idx], state.last[idx], cache)
        self._compact()
        self.model_drafter = spec.model_drafter
        self.drafters = self._drafters() if spec.config.drafter in GROUP_DRAFTERS else {}

    def _compact(self) -> None:
        """Drop cache columns no tail row attends to (left padding of prompts longer than every
        tail row's): a single row then has no masked column at all, and its verify forwards run
        without a mask, on the attention fast path the plain loop uses."""
        live = self.live
        used = live.mask.bool().any(dim=0)
        if bool(used.all()) or not live.rows:
            return
        cols = used.nonzero().squeeze(-1)
        for layer in live.cache.layers:
            layer.keys = layer.keys.index_select(2, cols)
            layer.values = layer.values.index_select(2, cols)
        live.mask = live.mask[:, cols]

    def _drafters(self) -> dict[int, tuple[GroupDrafter, int]]:
        """One GroupDrafter per prompt with a tail row, holding all n rows' tokens so far: a tail
        row drafts from its finished siblings and itself, then from recent completions."""
        n, out = self.state.n, self.out
        lengths = out.length.tolist()
        by_prompt: dict[int, GroupDrafter] = {}
        found: dict[int, tuple[GroupDrafter, int]] = {}
        for row in self.live.rows:
            p = row // n
            if p not in by_prompt:
                drafter = GroupDrafter(n, recent=self.spec.recent)
                for j in range(n):
                    r = p * n + j
                    drafter.extend(j, out.tokens[r, : lengths[r]].tolist())
                by_prompt[p] = drafter
            found[row] = (by_prompt[p], row % n)
        return found

    def run(self) -> None:
        while self.live.rows:
            if self._swap_due():
                self._rebuild()
            rows = len(self.live.rows)
            ks = {source: length.k(rows) for source, length in self.lengths.items()}
            self.stats.k_last = max(ks.values())
            if self.stats.k_last > 0:
                self._round(ks)
            else:
                self._plain_round()

    def _lengths(self) -> list[int]:
        return [int(self.out.length[r]) for r in self.live.rows]

    def _swap_due(self) -> bool:
        lengths = self._lengths()
        prefix = int(self.state.prompt_lens.max()) + max(lengths)
        remaining = self.params.max_new_tokens - min(lengths)
        return self.swap_rule(prefix, remaining) and self.slot.maybe_swap()

    def _rebuild(self) -> None:
        """New weights: every tail row's prefix (prompt + completion but its newest token) is
        prefilled again under them, so later tokens come from exactly the new policy."""
        self.model, self.version = self.slot.model, self.slot.version
        n, out = self.state.n, self.out
        seqs = []
        for r in self.live.rows:
            p = r // n
            plen = int(self.state.prompt_lens[p])
            prompt = self.state.prompt_ids[p, self.state.prompt_ids.shape[1] - plen:]
            seqs.append(torch.cat([prompt, out.tokens[r, : int(out.length[r]) - 1]]))
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long, device=self.device)
        mask = torch.zeros((len(seqs), width), dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = s
            mask[i, width - len(s):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        fwd = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=DynamicCache(config=self.model.config), use_cache=True, logits_to_keep=1)
        self.live.cache, self.live.mask = fwd.past_key_values, mask
        self.live.next_pos = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=self.device)

    def _drafts(self, ks: Mapping[Source, int]) -> tuple[RoundDrafts, dict[Source, float]]:
        """Each row's proposal: the group drafter's (at its own k) where it has one, else the draft
        model's (at its k); and the seconds each source spent proposing."""
        seconds: dict[Source, float] = {}
        t0 = time.perf_counter()
        group: list[list[int]] = [[] for _ in self.live.rows]
        if self.drafters and ks.get("group", 0) > 0:
            for i, (r, room) in enumerate(zip(self.live.rows, self._rooms(ks["group"]), strict=True)):
                drafter, j = self.drafters[r]
                group[i] = drafter.propose(j, room) if room > 0 else []
            seconds["group"] = time.perf_counter() - t0
        if self.model_drafter is None:
            return RoundDrafts.of_group(group), seconds
        if self.model_drafter.slot.maybe_swap():
            self.stats.draft_swaps += 1
        # Every row without a group proposal (all of them for "model"/"static", so those draw
        # exactly as a draft model alone would).
        need = [i for i, g in enumerate(group) if not g]
        if not need or ks.get("model", 0) == 0:
            return RoundDrafts.of_group(group), seconds
        t1 = time.perf_counter()
        rows = [self.live.rows[i] for i in need]
        rooms = self._rooms(ks["model"])
        drafts = self.model_drafter.propose(self._contexts(rows), [rooms[i] for i in need], self.params, self.gen)
        seconds["model"] = time.perf_counter() - t1
        return RoundDrafts.mixed(group, need, drafts), seconds

    def _rooms(self, k: int) -> list[int]:
        """Drafts per live row at most k, within the budget (the correction/bonus token needs one place)."""
        return [max(0, min(k, self.params.max_new_tokens - int(self.out.length[r]) - 1)) for r in self.live.rows]

    def _contexts(self, rows: list[int]) -> list[torch.Tensor]:
        """These tail rows' prompts and completions so far (the newest token included)."""
        n, out, state = self.state.n, self.out, self.state
        seqs = []
        for r in rows:
            plen = int(state.prompt_lens[r // n])
            prompt = state.prompt_ids[r // n, state.prompt_ids.shape[1] - plen:]
            seqs.append(torch.cat([prompt, out.tokens[r, : int(out.length[r])]]))
        return seqs

    def _round(self, ks: Mapping[Source, int]) -> None:
        live, stats = self.live, self.stats
        t0 = time.perf_counter()
        rows = len(live.rows)
        proposed, draft_seconds = self._drafts(ks)
        drafts, draft_probs = proposed.ids, proposed.probs
        t1 = time.perf_counter()
        width = max(len(d) for d in drafts)
        if draft_probs is not None:
            draft_probs = draft_probs[:, :width]
        draft_ids = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long,
                                 device=self.device).reshape(rows, width)
        lens = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=self.device)
        block = torch.arange(width + 1, device=self.device)
        # No mask when no column is masked out (every row sees the whole cache and drafts the
        # same number of tokens): positions then equal cache columns for every row.
        dense = bool(live.mask.all()) and bool((lens == width).all())
        fwd = self.model(input_ids=torch.cat([live.last[:, None], draft_ids], 1),
                         attention_mask=None if dense else
                         torch.cat([live.mask, (block[None, :] <= lens[:, None]).long()], 1),
                         position_ids=live.next_pos[:, None] + block[None, :], past_key_values=live.cache,
                         use_cache=True)
        target = processed_logprobs(fwd.logits, self.params.temperature, self.params.top_p)
        verified = accept_drafts(target, draft_ids, lens, self.gen, draft_probs=draft_probs,
                                 greedy=self.params.temperature == 0.0)
        live.cache = fwd.past_key_values
        # Columns past the longest kept prefix hold only rejected drafts: drop them; shorter
        # rows' rejected columns stay masked out.
        keep_cols = int(verified.accepted.max()) + 1
        if keep_cols < width + 1:
            live.cache.crop(-(width + 1 - keep_cols))
        live.mask = torch.cat([live.mask, (block[None, :keep_cols] <= verified.accepted[:, None]).long()], 1)
        live.next_pos = live.next_pos + verified.emitted
        live.last = verified.tokens.gather(1, verified.accepted[:, None]).squeeze(-1)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        for source, seconds in draft_seconds.items():
            self.lengths[source].observe_cost(seconds, t2 - t1, ks[source], rows)
        self._record(proposed, verified, ks)

    def _plain_round(self) -> None:
        """No source drafts at this row count (switched off, or too many rows): one token per row,
        vectorised as the plain loop decodes it.  A verify round without drafts draws from the same
        distribution but cost ~25% more per step in Python bookkeeping (8 rows of the tiny policy)."""
        from rlbus.services.policy.sampler import _draw  # the sampler imports this module

        live, stats, out = self.live, self.stats, self.out
        t0 = time.perf_counter()
        dense = bool(live.mask.all())
        live.mask = torch.cat([live.mask, torch.ones_like(live.mask[:, :1])], 1)
        fwd = self.model(input_ids=live.last[:, None], attention_mask=None if dense else live.mask,
                         position_ids=live.next_pos[:, None], past_key_values=live.cache, use_cache=True)
        tok, lp = _draw(fwd.logits[:, -1], self.params, self.gen, self.device)
        rows = torch.tensor(live.rows, dtype=torch.long, device=self.device)
        out.record_rows(rows, tok, lp, self.version, self.stop_ids)
        live.cache, live.next_pos, live.last = fwd.past_key_values, live.next_pos + 1, tok
        stats.rounds += 1
        stats.row_forwards += len(live.rows)
        stats.tokens += len(live.rows)
        stats.verify_s += time.perf_counter() - t0
        if self.drafters:  # a later round with fewer rows may draft again
            for r, t in zip(live.rows, tok.tolist(), strict=True):
                drafter, j = self.drafters[r]
                drafter.extend(j, [t])
        going = ~out.done[rows] & (out.length[rows] < self.params.max_new_tokens)
        if not bool(going.all()):
            self._keep(going.nonzero().squeeze(-1).tolist())

    def _record(self, proposed: RoundDrafts, verified: Verified, ks: Mapping[Source, int]) -> None:
        stats, out = self.stats, self.out
        accepted = verified.accepted.tolist()
        stats.rounds += 1
        kept = dict.fromkeys(ks, 0)
        trials = dict.fromkeys(ks, 0)
        still = []
        for i, (r, (tokens, logps)) in enumerate(zip(self.live.rows, verified.rows(), strict=True)):
            stats.row_forwards += 1
            source, drafted = proposed.sources[i], len(proposed.ids[i])
            if source is not None:
                stats.count(source, drafted, accepted[i])
                kept[source] += accepted[i]
                trials[source] += accepted[i] + (accepted[i] < drafted)
            emitted = self._append(r, tokens, logps)
            stats.tokens += emitted
            if self.drafters:
                drafter, j = self.drafters[r]
                drafter.extend(j, tokens[:emitted])
            if not bool(out.done[r]) and int(out.length[r]) < self.params.max_new_tokens:
                still.append(i)
        # A source asked for drafts this round is measured on what it proposed (nothing proposed
        # decays it towards its prior); one switched off waits for `begin_call`'s decay instead.
        for source, k in ks.items():
            if k > 0:
                self.lengths[source].observe(kept[source], trials[source])
        if len(still) < len(self.live.rows):
            self._keep(still)

    def _append(self, r: int, tokens: list[int], logps: np.ndarray) -> int:
        """Write row r's emitted tokens, cut at a stop id or the budget; how many were written."""
        out = self.out
        at = int(out.length[r])
        written = 0
        for t, lp in zip(tokens, logps, strict=True):
            if at >= self.params.max_new_tokens:
                break
            out.tokens[r, at] = t
            out.logps[r, at] = float(lp)
            out.versions[r, at] = self.version
            at += 1
            written += 1
            if t in self.stop:
                out.done[r] = True
                break
        out.length[r] = at
        return written

    def _keep(self, still: list[int]) -> None:
        live = self.live
        idx = torch.tensor(still, dtype=torch.long, device=self.device)
        if still:
            live.cache.batch_select_indices(idx)
        live.rows = [live.rows[i] for i in still]
        live.mask, live.next_pos, live.last = live.mask[idx], live.next_pos[idx], live.last[idx]
        self._compact()
