"""reasoning-gym tasks: any of its seeded procedural datasets as rlbus tasks, scored by its own checker.

A task names a dataset, its settings and the seed and index of its entry
(``{"env": "reasoning_gym", "env_config": {"dataset": "chain_sum", "config": {...}, "seed": 11,
"size": 512, "index": 3}}``): the entry is a pure function of those, so the environment can render the
question and the reward service can rebuild the entry it scores against from the task alone, and
both check the ``prompt`` and ``answer`` the task carries against it.

reasoning-gym has no fixed splits: the train and held-out sets are drawn with different dataset
seeds (derived from the run's seed and the split's name), and a train entry whose question is also a
held-out question is skipped, so no held-out question is ever trained on, whatever the dataset's size.

How an answer is read out of a completion (``extract``) and whether the checker's partial credit
counts (``reward``) are choices of the task; see ``ReasoningGymSettings``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import Field

from rlbus.services.environment.envs import EnvError, SingleTurnEnv
from rlbus.services.reward.verifiers import Verdict
from rlbus.services.runtime.config import Settings
from rlbus.services.runtime.tokens import TokenizerError
from rlbus.services.tasks.addition import TaskError

ENV_NAME = "reasoning_gym"
TASK_PREFIX = "reasoning-gym:"  # `rlbus up --task reasoning-gym:<dataset>`
Extract = Literal["tag", "first_number", "last_number", "full"]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# Entries of one split are drawn from a dataset of this many; a larger request gets a larger dataset.
MIN_SIZE = 512


def _rg() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise TaskError("reasoning-gym is not installed: pip install -e '.[reasoning-gym]'") from None
    return reasoning_gym


def dataset_names() -> list[str]:
    _rg()
    import reasoning_gym.factory as factory

    return sorted(factory.DATASETS)


def check_dataset(name: str) -> None:
    names = dataset_names()
    if name not in names:
        raise TaskError(f"unknown reasoning-gym dataset {name!r}; the {len(names)} datasets are: {', '.join(names)}")


class ReasoningGymSettings(Settings):
    """``[up.reasoning_gym]``: how ``rlbus up --task reasoning-gym:<dataset>`` makes and scores its tasks."""

    config: dict[str, Any] = Field(default_factory=dict, description=(
        "The dataset's own settings (its config class's fields, e.g. min_terms/max_digits for chain_sum); empty = "
        "the recipe's settings for chain_sum, the dataset's defaults for any other."))
    system: str = Field("auto", description=(
        "System message of every prompt: 'auto' (the recipe's for chain_sum, reasoning-gym's 'default' prompt, "
        "which asks for <answer> tags, for any other), 'none' (the chat template's own default), a key of "
        "reasoning_gym.utils.SYSTEM_PROMPTS, or the text itself."))
    extract: Extract | Literal["auto"] = Field("auto", description=(
        "How the answer is read from a completion: 'tag' (inside <answer>...</answer>), 'first_number', "
        "'last_number', 'full' (the whole completion, stripped); 'auto' = last_number for chain_sum, tag otherwise."))
    reward: Reward = Field("binary", description=(
        "'binary': 1 only when the checker gives full marks; 'partial': the checker's score as it is (some "
        "checkers give partial credit to a wrong but well-formed answer, e.g. countdown 0.05)."))


# The default recipe's task (docs/real-model.md): two terms of one or two digits, the answer read as the
# last number of a short completion.  SmolLM2-135M-Instruct restates the sum before answering ("7 + 8 =
# 15"), so the last number scores about twice as many samples as the first at the start, and about half
# of the groups then carry a learning signal (docs/measurements/real-model-base-rate-cpu2-2026-12-07.md).
CHAIN_SUM_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
CHAIN_SUM_SYSTEM = "Answer with the number only."


Reward = Literal["binary", "partial"]


@dataclass(frozen=True)
class Recipe:
    config: dict[str, Any]
    system: str
    extract: Extract
    reward: Reward = "binary"

    @classmethod
    def of(cls, env_config: dict[str, Any]) -> Recipe:
        """The recipe a task's env_config carries (what ``make_split`` wrote into it)."""
        extract = env_config.get("extract", "tag")
        reward = env_config.get("reward", "binary")
        system = env_config.get("system", "")
        if extract not in get_args(Extract):
            raise TaskError(f"env_config extract {extract!r} is not one of {', '.join(get_args(Extract))}")
        if reward not in get_args(Reward):
            raise TaskError(f"env_config reward {reward!r} is not one of {', '.join(get_args(Reward))}")
        if not isinstance(system, str):
            raise TaskError("env_config system must be a string (the system message; '' for the template's own)")
        return cls(config=dict(env_config.get("config") or {}), system=system, extract=extract, reward=reward)


def resolve(dataset: str, settings: ReasoningGymSettings) -> Recipe:
    """The settings with their 'auto' values filled in for ``dataset``."""
    chain = dataset == "chain_sum"
    config = dict(settings.config) or (dict(CHAIN_SUM_CONFIG) if chain else {})
    if settings.system == "auto":
        system = CHAIN_SUM_SYSTEM if chain else _system_prompts()["default"]
    elif settings.system == "none":
        system = ""
    else:
        system = _system_prompts().get(settings.system, settings.system)
    extract: Extract = settings.extract if settings.extract != "auto" else ("last_number" if chain else "tag")
    return Recipe(config=config, system=system, extract=extract, reward=settings.reward)


def _system_prompts() -> dict[str, str]:
    _rg()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return dict(SYSTEM_PROMPTS)


class _Datasets:
    """Built datasets by (name, settings, seed, size), and their entries by index: building a dataset
    can cost a moment, an entry is generated on each access, and the reward service asks for one
    entry once per sample of its group."""

    def __init__(self, capacity: int = 16, entries: int = 4096) -> None:
        self.capacity, self.entries = capacity, entries
        self._built: OrderedDict[str, Any] = OrderedDict()
        self._entries: OrderedDict[tuple[str, int], dict[str, Any]] = OrderedDict()

    def entry(self, name: str, config: dict[str, Any], seed: int, size: int, index: int) -> dict[str, Any]:
        key = (json.dumps([name, config, seed, size], sort_keys=True), index)
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        entry = self.get(name, config, seed, size)[index]
        self._entries[key] = entry
        while len(self._entries) > self.entries:
            self._entries.popitem(last=False)
        return entry

    def get(self, name: str, config: dict[str, Any], seed: int, size: int) -> Any:
        key = json.dumps([name, config, seed, size], sort_keys=True)
        if key in self._built:
            self._built.move_to_end(key)
            return self._built[key]
        rg = _rg()
        check_dataset(name)
        try:
            dataset = rg.create_dataset(name, seed=seed, size=size, **config)
        except (TypeError, ValueError, AssertionError) as exc:
            raise TaskError(f"reasoning-gym dataset {name!r} refused settings {config}: {exc}; use the fields of "
                            f"its config class") from None
        self._built[key] = dataset
        while len(self._built) > self.capacity:
            self._built.popitem(last=False)
        return dataset


DATASETS = _Datasets()


@dataclass(frozen=True)
class EntryRef:
    """Where one task's entry comes from: everything needed to rebuild it."""

    dataset: str
    config: dict[str, Any]
    seed: int
    size: int
    index: int

    @classmethod
    def of(cls, env_config: dict[str, Any], task_id: str = "") -> EntryRef:
        try:
            ref = cls(dataset=str(env_config["dataset"]), config=dict(env_config.get("config") or {}),
                      seed=int(env_config["seed"]), size=int(env_config["size"]), index=int(env_config["index"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise TaskError(f"reasoning_gym task {task_id!r} needs env_config {{dataset, config, seed, size, index}} "
                            f"({type(exc).__name__}: {exc})") from None
        if not 0 <= ref.index < ref.size:
            raise TaskError(f"reasoning_gym task {task_id!r}: index {ref.index} is outside the dataset's size {ref.size}")
        return ref

    def entry(self) -> dict[str, Any]:
        return DATASETS.entry(self.dataset, self.config, self.seed, self.size, self.index)

    def score(self, answer: str | None, entry: dict[str, Any]) -> float:
        return float(DATASETS.get(self.dataset, self.config, self.seed, self.size).score_answer(answer, entry))


def split_seed(seed: int, split: str) -> int:
    """The dataset seed of one split of a run: train and held-out never share one."""
    digest = hashlib.blake2b(f"{ENV_NAME}:{split}:{seed}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def task_id_for(dataset: str, split: str, seed: int, index: int) -> str:
    return f"rg-{dataset}-{split}-{seed}-{index}"


def make_split(dataset: str, split: Literal["train", "heldout"], n: int, seed: int, recipe: Recipe,
               *, exclude_questions: set[str] | None = None) -> list[dict[str, Any]]:
    """``n`` task records of ``split`` (the same list for the same arguments), skipping any entry whose
    question is in ``exclude_questions`` (the held-out set's, for the train split)."""
    if split not in ("train", "heldout"):
        raise TaskError(f"unknown split {split!r}: use 'train' or 'heldout'")
    exclude = exclude_questions or set()
    ds_seed = split_seed(seed, split)
    size = max(MIN_SIZE, 2 * n + len(exclude))
    ds = DATASETS.get(dataset, recipe.config, ds_seed, size)
    records: list[dict[str, Any]] = []
    for index in range(size):
        if len(records) == n:
            break
        entry = ds[index]
        if entry["question"] in exclude:
            continue
        records.append({
            "task_id": task_id_for(dataset, split, ds_seed, index),
            "prompt": entry["question"],
            "answer": str(entry["answer"]),
            "env": ENV_NAME,
            "env_config": {"dataset": dataset, "config": recipe.config, "seed": ds_seed, "size": size,
                           "index": index, "system": recipe.system, "extract": recipe.extract,
                           "reward": recipe.reward},
        })
    if len(records) < n:
        raise TaskError(f"reasoning-gym dataset {dataset!r} with settings {recipe.config} gave only {len(records)} "
                        f"distinct {split} tasks of the {n} asked (its space is small): ask for fewer or widen the "
                        "settings")
    return records


def extract_answer(text: str, how: Extract) -> str | None:
    """The answer a completion states, read as ``how`` says; None when it states none."""
    if how == "full":
        return text.strip() or None
    if how == "tag":
        found = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
        return found[-1].strip() if found else None
    numbers = NUMBER.findall(text)
    if not numbers:
        return None
    return numbers[0] if how == "first_number" else numbers[-1]


def checked_entry(task: Any) -> tuple[EntryRef, dict[str, Any]]:
    """The task's dataset entry, rebuilt from its env_config; a task whose prompt or answer is not
    that entry's is refused (a task copy that was changed on the way is not scored or shown)."""
    ref = EntryRef.of(task.env_config, task.task_id)
    entry = ref.entry()
    if task.prompt and task.prompt != entry["question"]:
        raise TaskError(f"reasoning_gym task {task.task_id!r}: its prompt is not entry {ref.index} of {ref.dataset} "
                        f"(seed {ref.seed}): republish it from the task generator")
    if task.answer and task.answer != str(entry["answer"]):
        raise TaskError(f"reasoning_gym task {task.task_id!r}: its answer is not entry {ref.index}'s of {ref.dataset}")
    return ref, entry


class ReasoningGymEnv(SingleTurnEnv):
    """The entry's question as one user turn (after the task's system message, if any), written with the
    policy's own chat template; one completion, done.  Registered as environment ``reasoning_gym``
    through the ``rlbus.environments`` entry point."""

    @staticmethod
    def check_task(task: Any) -> None:
        """At publish: the dataset exists, its settings are accepted, the entry is the task's."""
        try:
            Recipe.of(task.env_config)
            checked_entry(task)
        except TaskError as exc:
            raise ValueError(str(exc)) from None

    def render(self, task: Any) -> str:
        try:
            system = Recipe.of(task.env_config).system
            _, entry = checked_entry(task)
        except TaskError as exc:
            raise EnvError(str(exc)) from None
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": entry["question"]})
        try:
            return self.codec.render_chat(messages)
        except TokenizerError as exc:
            raise EnvError(f"reasoning_gym task {task.task_id!r}: {exc}") from None


class ReasoningGymVerifier:
    """The dataset's own checker (``score_answer``) on the answer read from the completion, against the
    entry rebuilt from the task's env_config.  Registered as verifier ``reasoning_gym``."""

    def __call__(self, task: Any, rollout: Any) -> Verdict:
        try:
            recipe = Recipe.of(task.env_config)
            ref, entry = checked_entry(task)
        except TaskError as exc:
            raise ValueError(str(exc)) from None
        extract = recipe.extract
        answer = extract_answer(rollout.text, extract)
        score = ref.score(answer, entry)
        correct = 1.0 if score >= 1.0 else 0.0
        reward = score if recipe.reward == "partial" else correct
        return Verdict(reward, {"correct": correct, "score": score, "answered": 0.0 if answer is None else 1.0},
                       f"expected {str(entry['answer'])!r}, read {answer!r} ({extract}) from {rollout.text.strip()[:80]!r}")
