"""The drafters of [generator.speculative] drafter, and what each one needs.

Kept apart from spec_tail.py (which imports torch) so that settings validation, the service
catalog and `rlbus up` can ask "does this drafter need a draft model / the speculator?" with
cheap imports, and so every one of them reads the same answer.

  off           plain decoding
  group         suffix matching over the group's siblings and recent completions (drafters.py)
  model         a small draft model, distilled online by the speculator role (model_drafter.py)
  static        the same draft model frozen at its first version
  model+group   per row per round: the group drafter's proposal when it has one, else the
                online draft model's
  static+group  the same with the frozen draft (the baseline that says what online distillation
                adds to the combination)
"""

from __future__ import annotations

from typing import Literal, get_args

DrafterName = Literal["off", "group", "model", "static", "model+group", "static+group"]
DRAFTERS: tuple[str, ...] = get_args(DrafterName)
# Need a draft model folder (draft_model_path).
MODEL_DRAFTERS: tuple[str, ...] = ("model", "static", "model+group", "static+group")
# Follow the speculator's draft versions: the speculator role must run, the generator must
# subscribe to the draft's weight subject.
ONLINE_DRAFTERS: tuple[str, ...] = ("model", "model+group")
# Draft from the group's suffix index (alone or first).
GROUP_DRAFTERS: tuple[str, ...] = ("group", "model+group", "static+group")


def drafter_choices() -> str:
    """The valid names as an error message lists them."""
    return ", ".join(repr(d) for d in DRAFTERS)
