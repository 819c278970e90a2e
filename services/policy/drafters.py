"""The `group` drafter: proposes a row's next tokens from what its siblings already wrote.

Why it exists: the n samples of one GRPO group answer the same prompt, so they share long
stretches (the same reasoning steps, the same answer format), and a row in the long tail of a
batch can often copy the continuation a sibling took. That costs no training and no forward
pass. Recent completions of earlier prompts are a second, weaker source (shared phrasing).

How: every sequence starts with a virtual START token and each n-gram (n <= `max_ngram`)
that something follows is indexed with where it continues. To draft for a row, take
its longest suffix (up to `max_ngram` tokens) that occurs somewhere else and propose up to k
tokens that followed the most recent occurrence. The drafter is deterministic, so to the
acceptance rule (`speculative.accept_drafts`) it is a point mass.

Cost is bounded: indexing a token touches `max_ngram` keys; each key remembers only its most
recent occurrence; a proposal looks up at most `max_ngram` keys; the pool of
recent completions keeps at most `2 * recent` sequences.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rlbus.services.policy.errors import PolicyError

_START = -1  # never a real token id: lets a fresh row copy the opening of a sibling


class DrafterConfigError(PolicyError):
    """A drafter setting is outside its valid range."""


class SuffixIndex:
    """Sequences that grow token by token, with every recent n-gram's continuations indexed."""

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.sequences: list[list[int]] = []
        # n-gram -> (sequence, position right after its most recent occurrence): the most recent
        # is the likeliest to continue the same way, and one entry per key bounds the index.
        self._where: dict[tuple[int, ...], tuple[int, int]] = {}

    def new_sequence(self, tokens: Iterable[int] = ()) -> int:
        self.sequences.append([_START])
        seq = len(self.sequences) - 1
        self.extend(seq, tokens)
        return seq

    def extend(self, seq: int, tokens: Iterable[int]) -> None:
        body = self.sequences[seq]
        for t in tokens:
            body.append(int(t))
            self._index_before_last(seq)

    def _index_before_last(self, seq: int) -> None:
        """Index the n-grams that the newest token continues. An n-gram is indexed only once
        something follows it, so a lookup never lands on a sequence end with nothing to propose
        (a row's own current suffix included)."""
        body = self.sequences[seq]
        cont = len(body) - 1
        for n in range(1, min(self.max_ngram, cont) + 1):
            self._where[tuple(body[cont - n:cont])] = (seq, cont)

    def continuation(self, suffix: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent occurrence of `suffix`."""
        where = self._where.get(tuple(suffix))
        if where is None:
            return []
        seq, cont = where
        return self.sequences[seq][cont:cont + k]


class RecentCompletions:
    """Finished completions of recent prompts, bounded: two generations of `recent` sequences,
    the older dropped whole when the newer fills (no per-entry eviction to keep in step)."""

    def __init__(self, recent: int = 64, *, max_ngram: int = 6) -> None:
        if recent < 1:
            raise DrafterConfigError(f"recent={recent}: keep at least one completion (or pass no pool)")
        self.recent = recent
        self._max_ngram = max_ngram
        self._new = SuffixIndex(max_ngram)
        self._old = SuffixIndex(max_ngram)

    def add(self, completion: Sequence[int]) -> None:
        if len(self._new.sequences) >= self.recent:
            self._old, self._new = self._new, SuffixIndex(self._max_ngram)
        self._new.new_sequence(completion)

    def continuation(self, suffix: Sequence[int], k: int) -> list[int]:
        return self._new.continuation(suffix, k) or self._old.continuation(suffix, k)


class GroupDrafter:
    """Drafts for the rows of one group by suffix matching over the group's own tokens, then
    over `recent` completions of earlier prompts (see the module docstring)."""

    def __init__(self, rows: int, *, max_ngram: int = 6,
                 recent: RecentCompletions | None = None) -> None:
        if rows < 1:
            raise DrafterConfigError(f"rows={rows}: a group has at least one row")
        if max_ngram < 1:
            raise DrafterConfigError(f"max_ngram={max_ngram}: use a value >= 1 (the longest suffix matched)")
        self.max_ngram = max_ngram
        self.recent = recent
        self._index = SuffixIndex(max_ngram)
        self._rows = [self._index.new_sequence() for _ in range(rows)]

    def add_reference(self, completion: Sequence[int]) -> None:
        """A finished sibling completion (e.g. from an earlier call for the same prompt)."""
        self._index.new_sequence(completion)

    def extend(self, row: int, tokens: Iterable[int]) -> None:
        """Tokens the row emitted (accepted drafts and the correction/bonus token)."""
        self._index.extend(self._rows[row], tokens)

    def tokens(self, row: int) -> list[int]:
        return self._index.sequences[self._rows[row]][1:]

    def propose(self, row: int, k: int) -> list[int]:
        """Up to k tokens to draft for `row`; empty when no suffix of it occurs elsewhere."""
        if k < 1:
            return []
        seq = self._rows[row]
        body = self._index.sequences[seq]
        for n in range(min(self.max_ngram, len(body)), 0, -1):
            suffix = body[len(body) - n:]
            found = self._index.continuation(suffix, k)
            if not found and self.recent is not None:
                found = self.recent.continuation(suffix, k)
            if found:
                return found
        return []
