"""The calculator task: a sum of four 3-digit numbers, with an arithmetic tool.

Why it exists: the tiny policy adds two 3-digit numbers well but four poorly, so a policy that
learns to call the tool (and then to state the tool's value as its answer) earns reward it
could not earn alone.  It is the episodic learning task, the way ``addition`` is the single-turn one.

The text format is fixed here, once, for the environment (which runs the tool) and the verifier
(which finds the final answer); every character is in the tiny model's vocabulary
(``rlbus.services.policy.tokenizer.CHARACTERS``: no ``<``, ``/`` or newline there):

- a *tool turn* ends with one call ``calc(EXPR)`` (text before it is allowed, none after it);
  ``EXPR`` is integers, ``+ - * /``, parentheses and spaces (``/`` is exact: ``7/2`` stays ``7/2``);
- the environment answers it with the observation ``=VALUE `` (equals sign, the value, one space),
  appended right after the call: a tool round reads ``calc(123+456)=579 `` in the completion;
- a turn with no call is the *final answer*: it ends the episode.  The answer is the text after
  the last tool round, and it must be the bare integer (``score``).

The expression is evaluated by a small recursive-descent parser over exact rationals, never by
``eval``: anything outside the grammar is refused with a message saying what was wrong.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

ENV_NAME = "calculator"
TERMS = 4
CALL_OPEN = "calc("
MAX_EXPR_CHARS = 200
MAX_DEPTH = 32
MAX_ABS = 10**18  # values past it are refused: a chain of products must not grow without bound
# A tool round as it appears in a completion: the call, then (adjacent) its observation.  ``EXPR``
# holds no '=', so the match cannot run from one round into the next.
_ROUND = re.compile(r"calc\(([^=]*)\)=(-?\d+(?:/\d+)?) ")


OPERAND_MIN, OPERAND_MAX = 100, 999
HELDOUT_MODULUS = 10  # one multiset of terms in ten is held out
Split = Literal["train", "heldout"]


class CalcError(ValueError):
    """The tool call cannot be evaluated; the message says what was wrong (shown to the policy)."""


@dataclass(frozen=True)
class ToolCall:
    expression: str
    before: str  # the turn's text before the call (the policy's own working)


@dataclass(frozen=True)
class CalculatorTask:
    task_id: str
    terms: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return render_prompt(list(self.terms))

    @property
    def answer(self) -> str:
        return answer_of(list(self.terms))

    def record(self, sampling: dict[str, object] | None = None) -> dict[str, object]:
        """The rlbus task-file shape of this task (one JSON line of a task file)."""
        out: dict[str, object] = {"task_id": self.task_id, "prompt": self.prompt, "env": ENV_NAME,
                                  "env_config": {"terms": list(self.terms)}, "answer": self.answer}
        if sampling:
            out["sampling"] = dict(sampling)
        return out


def split_of(terms: tuple[int, ...]) -> Split:
    """Which split a multiset of terms belongs to: by a hash of the sorted terms, so a held-out sum's
    reorderings are held out too, for every seed and size."""
    digest = hashlib.blake2b("+".join(map(str, sorted(terms))).encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "big") % HELDOUT_MODULUS == 0 else "train"


def make_split(split: Split, n: int, seed: int) -> list[CalculatorTask]:
    """``n`` distinct tasks of ``split``: the same list for the same (split, n, seed)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}: use 'train' or 'heldout'")
    if not 0 <= n <= 100_000:
        raise ValueError(f"n={n} is out of range: use 0 <= n <= 100000")
    rng = random.Random(f"{ENV_NAME}:{split}:{seed}")
    seen: set[tuple[int, ...]] = set()
    tasks = []
    while len(tasks) < n:
        terms = tuple(rng.randint(OPERAND_MIN, OPERAND_MAX) for _ in range(TERMS))
        if terms in seen or split_of(terms) != split:
            continue
        seen.add(terms)
        tasks.append(CalculatorTask(task_id="calc-" + "-".join(map(str, terms)), terms=terms))
    return tasks


def render_prompt(terms: list[int]) -> str:
    """The prompt for a sum: ``123+456+789+101=`` (the addition task's shape, with more terms)."""
    return "+".join(str(int(t)) for t in terms) + "="


def answer_of(terms: list[int]) -> str:
    return str(sum(int(t) for t in terms))


def observation(value: Fraction) -> str:
    """The observation text for a value: ``=579 `` (``=7/2 `` for a non-integer)."""
    text = str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    return f"={text} "


def find_call(turn_text: str) -> ToolCall | None:
    """The tool call a turn ends with; None when the turn has no call (a final answer).

    Raises ``CalcError`` when the turn has a call that is malformed: unclosed, or followed by text."""
    start = turn_text.find(CALL_OPEN)
    if start < 0:
        return None
    depth, i = 1, start + len(CALL_OPEN)
    while i < len(turn_text) and depth:
        depth += {"(": 1, ")": -1}.get(turn_text[i], 0)
        i += 1
    if depth:
        raise CalcError(f"the call {turn_text[start:start + 40]!r} is not closed: end it with ')'")
    if turn_text[i:].strip():
        raise CalcError(f"text after the call ({turn_text[i:i + 40]!r}): end the turn with the call "
                        "and answer in a later turn")
    return ToolCall(expression=turn_text[start + len(CALL_OPEN):i - 1], before=turn_text[:start])


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (integers, + - * /, parentheses, unary minus)."""
    if len(expression) > MAX_EXPR_CHARS:
        raise CalcError(f"the expression has {len(expression)} characters; at most {MAX_EXPR_CHARS} are evaluated")
    return _Parser(expression).parse()


class _Parser:
    """expr := term (('+'|'-') term)* ; term := unary (('*'|'/') unary)* ;
    unary := '-' unary | atom ; atom := INTEGER | '(' expr ')'"""

    def __init__(self, text: str) -> None:
        self.tokens = self._tokens(text)
        self.pos = 0
        self.depth = 0

    @staticmethod
    def _tokens(text: str) -> list[str]:
        out, i = [], 0
        while i < len(text):
            c = text[i]
            if c.isspace():
                i += 1
            elif c in "+-*/()":
                out.append(c)
                i += 1
            elif c.isascii() and c.isdigit():
                j = i
                while j < len(text) and text[j].isascii() and text[j].isdigit():
                    j += 1
                out.append(text[i:j])
                i = j
            else:
                raise CalcError(f"{c!r} at position {i} is not part of an expression "
                                "(integers, + - * /, parentheses)")
        if not out:
            raise CalcError("the call is empty: put an expression between the parentheses")
        return out

    def parse(self) -> Fraction:
        value = self._expr()
        if self.pos != len(self.tokens):
            raise CalcError(f"unexpected {self.tokens[self.pos]!r} after a complete expression")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        tok = self._peek()
        if tok is None:
            raise CalcError("the expression ends too early (an operator or '(' with nothing after it)")
        self.pos += 1
        return tok

    def _expr(self) -> Fraction:
        value = self._term()
        while self._peek() in ("+", "-"):
            value = _bounded(value + self._term() if self._take() == "+" else value - self._term())
        return value

    def _term(self) -> Fraction:
        value = self._unary()
        while self._peek() in ("*", "/"):
            if self._take() == "*":
                value = _bounded(value * self._unary())
            else:
                divisor = self._unary()
                if divisor == 0:
                    raise CalcError("division by zero")
                value = _bounded(value / divisor)
        return value

    def _unary(self) -> Fraction:
        if self._peek() == "-":
            self._take()
            return -self._nested(self._unary)
        return self._atom()

    def _atom(self) -> Fraction:
        tok = self._take()
        if tok == "(":
            value = self._nested(self._expr)
            if self._peek() != ")":
                raise CalcError("a '(' is not closed")
            self._take()
            return value
        if tok.isdigit():
            return _bounded(Fraction(int(tok)))
        raise CalcError(f"expected a number or '(', got {tok!r}")

    def _nested(self, parse) -> Fraction:  # type: ignore[no-untyped-def]
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalcError(f"the expression nests deeper than {MAX_DEPTH} levels")
        try:
            return parse()
        finally:
            self.depth -= 1


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_ABS or value.denominator > MAX_ABS:
        raise CalcError(f"a value exceeds {MAX_ABS:.0e} in magnitude; the calculator works with smaller numbers")
    return value


def final_answer(completion_text: str) -> str:
    """The text after the last tool round (the whole text when no tool was called)."""
    rounds = list(_ROUND.finditer(completion_text))
    return completion_text[rounds[-1].end():] if rounds else completion_text


def score(task_answer: str, completion_text: str) -> float:
    """1.0 when the final answer (not a tool's output) is exactly ``task_answer``."""
    from rlbus.services.tasks.addition import parse_answer

    return 1.0 if parse_answer(final_answer(completion_text)) == task_answer.strip() else 0.0
