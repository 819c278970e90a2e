"""Episode engine of the PyTorch backend: many episodes decode together, each keeping its KV
cache while it waits for the environment (docs/environments.md, "The generator's side").

Why it exists: in a multi-turn episode the policy speaks, the environment answers, the policy
speaks again. Recomputing the whole conversation at every turn costs a prefill that grows with
the episode; keeping the row's KV cache and prefilling only the environment's tokens costs what
is new. And episodes progress independently: one waiting on a slow tool must not hold the
others, so rows join and leave the decode batch between calls (continuous batching).

Model of a row: one episode's token sequence (`tokens`), the KV of its first `cached` tokens
(per layer, batch dimension 1), and at most one turn in progress. The tokens after `cached`
are "pending": at least the last one, whose forward gives the distribution of the next token.
A row's cache is only valid for the weight version it was computed with; a swap makes it stale
and the row's whole sequence is prefilled again under the new weights the next time it decodes
(as the group sampler's mid-sequence swaps do: old-weight KV would give log-probs of neither
version).

How `run` batches: (1) `slot.maybe_swap()`; stale caches are dropped (a version staged during
a run reaches the rows at the next one, at most `max_steps` tokens later). (2) Start: rows
without a cache and with the same sequence (the n rows of one prompt) are one prefill unit.
When every unit has more than one pending token, one batched forward of the units gives their
first logits and the cache is repeated to the rows (the group sampler's single-turn shape);
otherwise the long pending parts are prefilled apart (rows that only continue would be padded
to them) and every row then feeds its one pending token. (3) Decode: one batched forward per
step over the rows still in their turn. The rows' caches are left-padded into one
`DynamicCache` with an attention mask and explicit positions, and copied back out (the real
columns of each row) when a row finishes its turn or the call ends. Re-assembling costs a copy
of the active rows' KV per call, amortised over `max_steps` steps; it keeps each row's state
independent of who it was batched with, which is what makes joining and leaving free.

Memory: a waiting row holds its KV until it is closed or a swap drops it; there is no eviction,
so the caller bounds memory by how many episodes it keeps open (a row's KV is
2 x layers x kv_heads x head_dim x tokens floats).

Threads: the engine is not thread-safe. One thread at a time calls it (the generator's episode
driver serialises its calls and runs `run` in a worker thread); weights are staged by other
threads only through the slot, which the engine reads in `run`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from rlbus.services.policy.errors import PolicyError
from rlbus.services.policy.logprobs import completion_logprobs
from rlbus.services.policy.sampler import FinishReason, ModelSlot, _draw, _stop_ids
from rlbus.services.policy.sampling import SamplingParams
from rlbus.services.policy.sequences import outside_vocab

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (1, heads, len, head_dim)


class EpisodeEngineError(PolicyError):
    """The engine was asked something it cannot do with the model or rows it has."""


class EpisodeInputError(EpisodeEngineError, ValueError):
    """A call named an unknown row, or its tokens do not fit the model (vocabulary, context)."""


@dataclass
class Turn:
    """One finished policy turn of one episode."""

    ids: list[int]  # sampled ids (stop token included when produced)
    logprobs: np.ndarray  # float32, behaviour logprob of each id (processed distribution)
    versions: np.ndarray  # int64, weight version whose forward produced each id
    finish_reason: FinishReason  # "stop" | "length"
    recomputed: bool = False  # deterministic mode replaced the logprobs by the batch-invariant values


@dataclass
class _TurnInProgress:
    params: SamplingParams
    stop: frozenset[int]
    max_new_tokens: int  # already capped by the room left in the context
    start: int  # length of the row's sequence when the turn began (its prefix)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    final: bool = False  # the episode ends with this turn: its cache need not be kept
    recomputed: bool = False

    def record(self, token: int, logprob: float, version: int) -> None:
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.stop:
            self.finish_reason = "stop"
        elif len(self.ids) >= self.max_new_tokens:
            self.finish_reason = "length"

    def result(self) -> Turn:
        assert self.finish_reason is not None, "result() of an unfinished turn"
        return Turn(ids=list(self.ids), logprobs=np.asarray(self.logprobs, dtype=np.float32),
                    versions=np.asarray(self.versions, dtype=np.int64), finish_reason=self.finish_reason,
                    recomputed=self.recomputed)


@dataclass
class _Row:
    key: str
    tokens: list[int]
    kv: LayerKV | None = None  # covers tokens[:cached]
    cached: int = 0
    kv_version: int = -1
    turn: _TurnInProgress | None = None

    def pending(self) -> int:
        return len(self.tokens) - self.cached

    def drop_cache(self) -> None:
        self.kv, self.cached, self.kv_version = None, 0, -1


class _Batch:
    """Rows' caches left-padded into one `DynamicCache`; `mask` marks each row's real columns
    (pads are never attended to), `next_pos` the position of each row's next fed token."""

    def __init__(self, model: PreTrainedModel, rows: list[_Row], device: torch.device) -> None:
        self.model, self.rows, self.device = model, rows, device
        lens = torch.tensor([r.cached for r in rows], dtype=torch.long)
        width = int(lens.max()) if rows else 0
        self.cache = DynamicCache(config=model.config)
        source = next((r.kv for r in rows if r.kv is not None and r.cached), None)
        if width and source is not None:
            for layer, (k0, v0) in enumerate(source):
                keys = k0.new_zeros((len(rows), k0.shape[1], width, k0.shape[3]))
                values = v0.new_zeros((len(rows), v0.shape[1], width, v0.shape[3]))
                for i, r in enumerate(rows):
                    if r.cached and r.kv is not None:
                        keys[i, :, width - r.cached :] = r.kv[layer][0][0]
                        values[i, :, width - r.cached :] = r.kv[layer][1][0]
                self.cache.update(keys, values, layer)
        self.mask = (torch.arange(width)[None, :] >= (width - lens)[:, None]).long().to(device)
        self.next_pos = lens.to(device)

    def feed(self, chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Forward each row's chunk (left-padded so every row ends in the last column) on top of
        its cache; returns the logits of each row's last chunk token, shape (rows, vocab)."""
        sizes = [len(c) for c in chunks]
        width = max(sizes)
        ids = torch.tensor([[0] * (width - len(c)) + list(c) for c in chunks], dtype=torch.long, device=self.device)
        lens = torch.tensor(sizes, dtype=torch.long, device=self.device)
        offsets = torch.arange(width, device=self.device)[None, :] - (width - lens)[:, None]
        chunk_mask = (offsets >= 0).long()
        mask = torch.cat([self.mask, chunk_mask], dim=1)
        positions = (self.next_pos[:, None] + offsets).clamp(min=0)
        # Without pads SDPA keeps its causal fast path (the mask is then implied).
        out = self.model(input_ids=ids, attention_mask=None if bool(mask.all()) else mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache, self.mask, self.next_pos = out.past_key_values, mask, self.next_pos + lens
        return out.logits[:, -1]

    def row_kv(self, i: int) -> LayerKV:
        """Row i's real columns, copied out (a view would pin the whole batch's storage while
        the row waits for its environment)."""
        real = self.mask[i].nonzero().squeeze(-1)
        return [(layer.keys[i : i + 1].index_select(2, real), layer.values[i : i + 1].index_select(2, real))
                for layer in self.cache.layers]

    def select(self, indices: list[int], rows: list[_Row] | None = None) -> None:
        """Keep (or repeat) batch rows `indices`; `rows` names the rows they now hold (by
        default the same rows)."""
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask, self.next_pos = self.mask[index], self.next_pos[index]
        self.rows = rows if rows is not None else [self.rows[i] for i in indices]


@dataclass
class _Stats:
    prefill_tokens: int = 0  # tokens forwarded to build caches (beyond the one fed per decode step)
    reused_tokens: int = 0  # tokens a turn did not prefill because the row's cache was kept
    rebuilds: int = 0  # row caches dropped by a weight swap (rebuilt when the row decodes again)
    decode_steps: int = 0  # batched decode forwards
    decode_tokens: int = 0  # tokens sampled


class EpisodeEngine:
    """Rows of episodes, their caches and turns (see the module docstring)."""

    def __init__(self, slot: ModelSlot, *, deterministic: bool = False, keep_kv: bool = True) -> None:
        """`keep_kv=False` drops a row's cache at every turn start (the whole sequence is
        prefilled again): the recompute baseline `bench/episode_kv.py` compares against."""
        self.slot = slot
        self.deterministic = deterministic
        self.keep_kv = keep_kv
        self._rows: dict[str, _Row] = {}
        self._stats = _Stats()
        # Read once: a weight swap keeps the architecture, and the config's attribute lookup is slow
        # enough (about 15% of single-turn sampling when read per row) to matter on the hot path.
        config = slot.model.config
        self._context: int | None = getattr(config, "max_position_embeddings", None)
        self._vocab: int | None = getattr(config, "vocab_size", None)
        self._stops: dict[tuple[int, ...], frozenset[int]] = {}
        sliding = [i for i, layer in enumerate(DynamicCache(config=config).layers) if layer.is_sliding]
        if sliding:
            raise EpisodeEngineError(
                f"layers {sliding} use sliding-window attention, whose cache the engine cannot split "
                "into rows; serve this model with the vLLM backend"
            )

    # --- rows ------------------------------------------------------------------------------

    def _row(self, key: str) -> _Row:
        row = self._rows.get(key)
        if row is None:
            raise EpisodeInputError(f"no open episode row {key!r}: open it first (closed rows are gone)")
        return row

    def _check_ids(self, what: str, ids: Sequence[int]) -> None:
        if (bad := outside_vocab(ids, self._vocab)) is not None:
            raise EpisodeInputError(
                f"{what} has token id {bad} outside the vocabulary (size {self._vocab}): "
                "encode it with the policy's own tokenizer"
            )

    def open(self, keys: list[str], prompt_ids: list[int]) -> None:
        """Rows for n episodes of one prompt; they share one prefill (done at the next run)."""
        if not prompt_ids:
            raise EpisodeInputError("empty prompt: encode it with a leading <bos>")
        self._check_ids("prompt", prompt_ids)
        limit = self._context
        if limit is not None and len(prompt_ids) >= limit:
            raise EpisodeInputError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the model's context of {limit}: shorten it"
            )
        taken = [k for k in keys if k in self._rows]
        if taken or len(set(keys)) != len(keys):
            raise EpisodeInputError(f"episode keys {taken or keys} are already open or repeated: use fresh keys")
        for key in keys:
            self._rows[key] = _Row(key, list(prompt_ids))

    def append(self, key: str, ids: list[int]) -> None:
        """Environment tokens after the row's last turn; with a current cache only these are
        prefilled at the next run."""
        row = self._row(key)
        if row.turn is not None:
            raise EpisodeInputError(f"row {key!r} has a turn in progress: append after it finishes")
        self._check_ids(f"observation for {key!r}", ids)
        limit = self._context
        if limit is not None and len(row.tokens) + len(ids) > limit:
            raise EpisodeInputError(
                f"row {key!r} holds {len(row.tokens)} tokens; {len(ids)} more would exceed the model's "
                f"context of {limit}: end the episode (context limit) or truncate the observation"
            )
        row.tokens.extend(int(t) for t in ids)

    def start_turn(self, key: str, params: SamplingParams, stop_ids: list[int], max_new_tokens: int,
                   *, final: bool = False) -> None:
        """The row decodes a new turn from its current end at the next run(s); the turn ends at a
        stop id (or the model's eos), after `max_new_tokens`, or at the end of the context.

        `final=True` says no turn follows (a single-turn task, the last allowed turn): the row's
        cache is then not copied out when the turn ends (about 7% of single-turn sampling time
        on the tiny model). The row stays usable; a later turn would rebuild its cache."""
        row = self._row(key)
        if row.turn is not None:
            raise EpisodeInputError(f"row {key!r} already has a turn in progress")
        if max_new_tokens < 1:
            raise EpisodeInputError(f"max_new_tokens={max_new_tokens} for {key!r}: use a value >= 1")
        room = self.room(key)
        if room is not None and room < 1:
            raise EpisodeInputError(
                f"row {key!r} fills the model's context ({len(row.tokens)} of {self._context}): "
                "end the episode (context limit)"
            )
        stop = self._stops.get(tuple(stop_ids))
        if stop is None:
            stop = self._stops[tuple(stop_ids)] = frozenset(
                _stop_ids(self.slot.model, SamplingParams(stop_token_ids=tuple(stop_ids))))
        cap = max_new_tokens if room is None else min(max_new_tokens, room)
        if not self.keep_kv:
            row.drop_cache()
        row.turn = _TurnInProgress(params=params, stop=stop, max_new_tokens=cap, start=len(row.tokens), final=final)

    def truncate(self, key: str, length: int) -> None:
        """Keeps the row's first ``length`` tokens (a turn cut at a stop string after it ended: the
        tokens past the stop are no part of the episode).  The kept cache is cut with it, so the
        next observation is still the only prefill."""
        row = self._row(key)
        if row.turn is not None:
            raise EpisodeInputError(f"row {key!r} has a turn in progress: truncate after it finishes")
        if not 1 <= length <= len(row.tokens):
            raise EpisodeInputError(f"row {key!r} holds {len(row.tokens)} tokens: cannot keep {length}")
        del row.tokens[length:]
        if row.kv is not None and row.cached > length:
            row.kv = [(k[:, :, :length], v[:, :, :length]) for k, v in row.kv]
            row.cached = length

    def close(self, key: str) -> None:
        """Frees the row (finished, failed or abandoned episode); closing twice is harmless."""
        self._rows.pop(key, None)

    def tokens(self, key: str) -> list[int]:
        """The row's whole sequence so far (prompt, turns, observations)."""
        return list(self._row(key).tokens)

    def room(self, key: str) -> int | None:
        """Positions left in the model's context (None when the model does not say)."""
        limit = self._context
        return None if limit is None else limit - len(self._row(key).tokens)

    @property
    def stats(self) -> dict[str, float]:
        """Cumulative counters, plus `rows` (open now)."""
        s = self._stats
        return {"prefill_tokens": s.prefill_tokens, "reused_tokens": s.reused_tokens, "rebuilds": s.rebuilds,
                "rows": len(self._rows), "decode_steps": s.decode_steps, "decode_tokens": s.decode_tokens}

    def episode_logprobs(self, episodes: Sequence[tuple[list[int], list[int], SamplingParams, int]]
                         ) -> list[np.ndarray | None]:
        """Deterministic mode, at episodes' ends: for each (prompt, everything after it, sampling
        params, the one version its policy tokens came from), the trainer's batch-invariant logprob
        of every token after the prompt (observation tokens too; the caller keeps the policy's), or
        None when the slot holds another version now (its weights are gone: the sampled labels
        stay, honestly not exact).  Blocking: call it from the engine's thread, between runs."""
        if not self.deterministic:
            raise EpisodeEngineError("episode_logprobs is deterministic mode's: build the engine with deterministic=True")
        version = self.slot.version
        out: list[np.ndarray | None] = [None] * len(episodes)
        by_params: dict[tuple[float, float], list[int]] = {}
        for i, (_, completion, params, v) in enumerate(episodes):
            if v == version and completion:
                by_params.setdefault((params.temperature, params.top_p), []).append(i)
        with torch.no_grad():
            for (temperature, top_p), members in by_params.items():
                values = completion_logprobs(self.slot.model, [(episodes[i][0], episodes[i][1]) for i in members],
                                             SamplingParams(temperature=temperature, top_p=top_p), deterministic=True)
                for i, v in zip(members, values, strict=True):
                    out[i] = v.detach().cpu().numpy().astype(np.float32)
        return out

    # --- running ---------------------------------------------------------------------------

    def run(self, generator: torch.Generator, max_steps: int = 16) -> list[tuple[str, Turn]]:
        """Advance every row with a turn in progress by up to `max_steps` tokens; the turns that
        finished in this call, in the order they finished. Blocking: call it from a worker thread."""
        if max_steps < 1:
            raise EpisodeInputError(f"max_steps={max_steps}: use a value >= 1")
        self.slot.maybe_swap()
        version = self.slot.version
        for row in self._rows.values():
            if row.kv is not None and row.kv_version != version:
                row.drop_cache()
                self._stats.rebuilds += 1
        active = [r for r in self._rows.values() if r.turn is not None]
        if not active:
            return []
        for row in active:
            if row.turn is not None and not row.turn.ids and row.kv is not None:
                self._stats.reused_tokens += row.cached
        try:
            with torch.no_grad():
                batch, logits = self._start(active, version)
                finished = self._decode(batch, logits, generator, max_steps, version)
        except BaseException:
            # A row's tokens and turn always agree, but its cache may be half-way: rebuilding it
            # at the next run keeps the rows usable after, say, an out-of-memory error.
            for row in active:
                row.drop_cache()
            raise
        if self.deterministic:
            self._recompute(finished, version)
        return [(row.key, turn.result()) for row, turn in finished]

    def _device(self) -> torch.device:
        return next(self.slot.model.parameters()).device

    def _start(self, active: list[_Row], version: int) -> tuple[_Batch, torch.Tensor]:
        """The decode batch of the active rows and the logits of their next token.

        Rows without a cache and with the same sequence (one prompt's n rows) are one prefill
        unit. When every unit has more than one pending token (a fresh batch, or every row
        starting a turn after its observation), one forward of the units gives their first
        logits and the cache is repeated to the rows, as the group sampler does. Otherwise rows
        that only continue would be padded to the longest pending part: the long ones are
        prefilled apart (all but their last token) and all rows then feed one token each."""
        units: dict[object, list[_Row]] = {}
        for row in active:
            key: object = tuple(row.tokens) if row.kv is None else id(row)
            units.setdefault(key, []).append(row)
        groups = list(units.values())
        if all(g[0].pending() > 1 for g in groups):
            batch = _Batch(self.slot.model, [g[0] for g in groups], self._device())
            chunks = [g[0].tokens[g[0].cached :] for g in groups]
            logits = batch.feed(chunks)
            self._stats.prefill_tokens += sum(len(c) - 1 for c in chunks)
            if len(groups) < len(active):
                owner = [u for u, g in enumerate(groups) for _ in g]
                batch.select(owner, [row for g in groups for row in g])
                logits = logits[owner]
            for row in batch.rows:
                row.cached = len(row.tokens)
            return batch, logits
        self._prefill([g for g in groups if g[0].pending() > 1], version)
        batch = _Batch(self.slot.model, active, self._device())
        logits = batch.feed([[r.tokens[-1]] for r in active])
        for row in active:
            row.cached += 1
        return batch, logits

    def _prefill(self, groups: list[list[_Row]], version: int) -> None:
        """Bring the rows of `groups` (one prefill per group) to exactly one pending token."""
        if not groups:
            return
        batch = _Batch(self.slot.model, [g[0] for g in groups], self._device())
        chunks = [g[0].tokens[g[0].cached : -1] for g in groups]
        batch.feed(chunks)
        self._stats.prefill_tokens += sum(len(c) for c in chunks)
        for i, group in enumerate(groups):
            kv = batch.row_kv(i)
            for row in group:
                row.kv, row.cached, row.kv_version = kv, len(row.tokens) - 1, version

    def _decode(self, batch: _Batch, logits: torch.Tensor, generator: torch.Generator, max_steps: int,
                version: int) -> list[tuple[_Row, _TurnInProgress]]:
        """Up to `max_steps` tokens per row, the first from `logits`; each row's cache is copied
        out when its turn ends or the call does."""
        finished: list[tuple[_Row, _TurnInProgress]] = []
        live = list(range(len(batch.rows)))  # batch indices of rows still in their turn
        for step in range(max_steps):
            # Rows whose turn ended stay in the batch (their outputs are ignored) until they are
            # half of it: compacting the cache at every finish would copy it once per row.
            if step:
                logits = batch.feed([[r.tokens[-1]] for r in batch.rows])
                for i in live:
                    batch.rows[i].cached += 1  # the fed token is now in the cache
            rows = [batch.rows[i] for i in live]
            tokens, logprobs = self._sample(rows, logits[live] if len(live) < len(batch.rows) else logits, generator)
            self._stats.decode_steps += 1
            self._stats.decode_tokens += len(rows)
            going: list[int] = []
            for i, row, token, logprob in zip(live, rows, tokens, logprobs, strict=True):
                assert row.turn is not None
                row.tokens.append(token)
                row.turn.record(token, logprob, version)
                if row.turn.finish_reason is None:
                    going.append(i)
                else:
                    if row.turn.final:
                        row.drop_cache()
                    else:
                        row.kv, row.kv_version = batch.row_kv(i), version
                    finished.append((row, row.turn))
                    row.turn = None
            if not going:
                return finished
            live = going
            if 2 * len(live) <= len(batch.rows):
                batch.select(live)
                live = list(range(len(live)))
        for i in live:  # unfinished turns continue at the next run
            row = batch.rows[i]
            row.kv, row.kv_version = batch.row_kv(i), version
        return finished

    def _sample(self, rows: list[_Row], logits: torch.Tensor,
                generator: torch.Generator) -> tuple[list[int], list[float]]:
        """One token per row; rows are processed in groups of equal temperature and top-p, since
        those change the distribution (and the sampled one is what the logprob describes)."""
        groups: dict[tuple[float, float], list[int]] = {}
        for i, row in enumerate(rows):
            assert row.turn is not None
            groups.setdefault((row.turn.params.temperature, row.turn.params.top_p), []).append(i)
        tokens = [0] * len(rows)
        logprobs = [0.0] * len(rows)
        for (temperature, top_p), members in groups.items():
            if len(groups) == 1:  # the usual case: no copy of the logits
                own = logits
            else:
                own = logits[torch.tensor(members, dtype=torch.long, device=logits.device)]
            params = SamplingParams(temperature=temperature, top_p=top_p)
            tok, lp = _draw(own, params, generator, logits.device)
            chosen = lp.gather(-1, tok[:, None]).squeeze(-1).tolist()
            for i, t, c in zip(members, tok.tolist(), chosen, strict=True):
                tokens[i], logprobs[i] = t, c
        return tokens, logprobs

    def _recompute(self, finished: list[tuple[_Row, _TurnInProgress]], version: int) -> None:
        """Deterministic mode: a final turn (a single-turn task, the last turn allowed) whose tokens
        all come from the weights in the slot gets the trainer's batch-invariant logprobs of (its
        prefix, its tokens); one that spans a swap cannot.  Only final turns: the trainer sees any
        other turn inside the whole episode, whose completion is padded to another shape, so the
        caller recomputes those episodes whole at their end (`episode_logprobs`).  One call for the
        run: the values do not depend on the batch, and the fixed shapes would fill a lone turn's
        batch with padding rows."""
        eligible = [(row, turn) for row, turn in finished
                    if turn.final and turn.ids and all(v == version for v in turn.versions)]
        # Only the temperature and top-p shape the processed distribution (turns differ in max tokens).
        by_params: dict[tuple[float, float], list[tuple[_Row, _TurnInProgress]]] = {}
        for row, turn in eligible:
            by_params.setdefault((turn.params.temperature, turn.params.top_p), []).append((row, turn))
        for (temperature, top_p), members in by_params.items():
            values = completion_logprobs(self.slot.model, [(row.tokens[: turn.start], turn.ids) for row, turn in members],
                                         SamplingParams(temperature=temperature, top_p=top_p), deterministic=True)
            for (_, turn), v in zip(members, values, strict=True):
                turn.logprobs = v.detach().cpu().tolist()
                turn.recomputed = True
