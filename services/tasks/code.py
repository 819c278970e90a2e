"""The text format of code turns, shared by the ``python`` environment and the ``code-tests`` verifier.

Code is a fenced block: a line that opens with three backticks (optionally ``python``, ``py`` or
``python3`` after them), the code, and three backticks closing it.  A turn of the ``python``
environment with blocks runs them, in order, as one program; a turn without any is the final
answer.  A ``code-tests`` submission is the last block of the completion (the whole text when it
has none), so a policy that tried code with the ``python`` tool submits the last program it wrote.
"""

from __future__ import annotations

import re

FENCE = "```"
PYTHON_TAGS = ("", "python", "py", "python3")
_BLOCK = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)


class CodeFormatError(ValueError):
    """The text's code blocks are malformed; the message says how to write them."""


def code_blocks(text: str) -> list[str]:
    """The Python blocks of ``text``, in order ([] when it has no fence at all)."""
    if FENCE not in text:
        return []
    if text.count(FENCE) % 2:
        raise CodeFormatError("a code block is not closed: end it with ``` on its own line")
    blocks = []
    for m in _BLOCK.finditer(text):
        tag = m.group(1).strip().lower()
        if tag not in PYTHON_TAGS:
            raise CodeFormatError(f"unknown tool {tag!r}: only python blocks run (```python)")
        blocks.append(m.group(2))
    if not blocks:
        raise CodeFormatError("malformed code block: put ``` (or ```python) on its own line, then the code, then ```")
    return blocks


def submission(text: str) -> str:
    """The program a completion submits: its last Python block, or the whole text when it has none."""
    blocks = [m.group(2) for m in _BLOCK.finditer(text) if m.group(1).strip().lower() in PYTHON_TAGS]
    return blocks[-1] if blocks else text
