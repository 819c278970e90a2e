"""Seeded hostile payloads for every subject a service consumes (used by test_fuzz.py).

A case is bytes plus what the test needs to account for it: a unique msg id, a kind label, and
whether the real decoder of that subject accepts it (then a service must process or refuse it on
its merits; otherwise it must land in DEAD with a reason).  Malformed kinds break the encoding;
``leaf:*`` puts a hostile value at a random leaf of a valid message's wire map; ``aimed:*`` are the
values that once got past decoding and hurt a service (or could).

Cases are generated lazily from one seed per target, so a failure names a reproducible case.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from rlbus.bus.subjects import Subjects
from rlbus.schemas import (
    Admit,
    Control,
    EnvReset,
    EnvResetBatch,
    EnvStep,
    Heartbeat,
    Message,
    Rollout,
    RolloutGroup,
    SchemaError,
    ScoredGroup,
    ScoredRollout,
    SetMix,
    Shard,
    Task,
    WeightManifest,
)

RUN, POOL, ENV, MODEL = "fuzz", "train", "addition", "policy"
CONTEXT = 64  # positions of the tiny test model
LONG = "x" * 3000
HOSTILE_FLOATS = (float("nan"), float("inf"), float("-inf"), 1e308, -1e308)
HOSTILE_INTS = (-1, 2**63 - 1, -(2**63), 2**64 - 1)
HOSTILE_STRS = ("", ".", "*", ">", " ", "\x00", LONG, "a.b", "\n")
HOSTILE_ANY = (None, True, [], {}, b"\xff", [1, [2, [3]]], {"k": float("nan")})
MALFORMED = ("random_bytes", "empty", "truncated", "non_map", "bad_utf8", "deep_nesting", "trailing_garbage",
             "wrong_type", "missing_field", "wrong_kind", "wrong_version", "oversized")
OVERSIZED_BYTES = 300_000  # under the server's payload limit: the bytes reach the service itself


@dataclass(frozen=True)
class Case:
    target: str
    index: int
    kind: str
    subject: str
    data: bytes
    decodes: bool

    @property
    def msg_id(self) -> str:
        return f"fz.{self.target}.{self.index}"

    @property
    def uid(self) -> str:
        """The id stamped into the message's own id fields (task_id, episode, boot…)."""
        return f"fz-{self.target}-{self.index}"


# --- valid bases -------------------------------------------------------------------------------

def _task(uid: str, **kw: Any) -> Task:
    fields: dict[str, Any] = {"env": ENV, "prompt": "12+34=", **kw}
    return Task(run=RUN, task_id=uid, pool=POOL, answer="46", group_size=2, **fields)


def _rollout(uid: str, i: int = 0) -> Rollout:
    return Rollout(rollout_id=f"{uid}:{i}", task_id=uid, index=i, token_ids=np.arange(1, 9, dtype="<i4"),
                   prompt_len=6, loss_mask=np.ones(2, "u1"), behaviour_logprobs=np.array([-0.5, -0.7], "<f4"),
                   version_spans=np.array([[0, 0]], "<i8"))


def _manifest(uid: str, state: str) -> WeightManifest:
    shard = Shard(name="model.safetensors", sha256="0" * 64, size=4, location=f"weights/{uid}/model.safetensors")
    return WeightManifest(model=MODEL, version=1, transport="objstore", shards=[shard], state=state)  # type: ignore[arg-type]


def _control(uid: str, decision: Any, service: str) -> Control:
    return Control(seq=1, decision=decision, target_service=service, target_instance="all", issuer=uid)


@dataclass(frozen=True)
class Target:
    """One consumed subject: its schema, a valid message per case and the aimed mutations."""

    name: str
    schema: type[Message]
    subject: Callable[[Subjects], str]
    base: Callable[[str], Message]
    aimed: tuple[tuple[str, Callable[[dict[str, Any]], None]], ...] = ()
    request: bool = False  # core request/reply (environment), not a stream
    # Share of cases that are hostile values in a valid encoding (leaf, then aimed).  Small where a
    # decodable case costs real work (a task is sampled, a group trained on), so the run fits CI.
    hostile: tuple[float, float] = (0.35, 0.2)


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(wire: dict[str, Any]) -> None:
        node: Any = wire
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return apply


def _arr(path: tuple[Any, ...], values: np.ndarray) -> Callable[[dict[str, Any]], None]:
    return _set(path, {"dtype": values.dtype.str, "shape": list(values.shape), "data": values.tobytes()})


def _task_aims(pre: tuple[Any, ...]) -> tuple[tuple[str, Callable[[dict[str, Any]], None]], ...]:
    return (
        ("pool_dot", _set((*pre, "pool"), "a.b")), ("pool_star", _set((*pre, "pool"), "*")),
        ("pool_gt", _set((*pre, "pool"), ">")), ("pool_space", _set((*pre, "pool"), "a b")),
        ("pool_nul", _set((*pre, "pool"), "\x00")), ("env_dot", _set((*pre, "env"), "add.ition")),
        ("env_unknown", _set((*pre, "env"), "nope")), ("env_long", _set((*pre, "env"), LONG)),
        ("prompt_long", _set((*pre, "prompt"), "1+" * 1500)), ("prompt_ids_neg", _arr((*pre, "prompt_ids"), np.array([-1, 3], "<i4"))),
        ("prompt_ids_vocab", _arr((*pre, "prompt_ids"), np.array([10**6, 3], "<i4"))),
        ("group_size_max", _set((*pre, "group_size"), 1024)), ("max_new_tokens_huge", _set((*pre, "sampling", "max_new_tokens"), 2**63 - 1)),
        ("temperature_huge", _set((*pre, "sampling", "temperature"), 1e308)), ("seed_neg", _set((*pre, "sampling", "seed"), -1)),
        ("env_config_nan", _set((*pre, "env_config"), {"x": float("nan")})),
    )


def _rollout_aims(pre: tuple[Any, ...]) -> tuple[tuple[str, Callable[[dict[str, Any]], None]], ...]:
    return (
        ("token_neg", _arr((*pre, "token_ids"), np.array([1, 2, 3, 4, 5, 6, -1, 7], "<i4"))),
        ("token_vocab", _arr((*pre, "token_ids"), np.array([1, 2, 3, 4, 5, 6, 10**6, 7], "<i4"))),
        ("prompt_len_over", _set((*pre, "prompt_len"), 9)),
        ("past_context", _arr((*pre, "token_ids"), np.arange(CONTEXT + 8, dtype="<i4") % 10 + 1)),
        ("version_huge", _arr((*pre, "version_spans"), np.array([[0, 2**63 - 1]], "<i8"))),
        ("logprob_nan", _arr((*pre, "behaviour_logprobs"), np.array([np.nan, -1], "<f4"))),
        ("logprob_pos_huge", _arr((*pre, "behaviour_logprobs"), np.array([3e38, 1e30], "<f4"))),
        ("mask_wrong_len", _arr((*pre, "loss_mask"), np.ones(5, "u1"))),
    )


def _targets() -> dict[str, Target]:
    scored_pre = ("scored", 0, "rollout")
    t = [
        Target("tasks", Task, lambda s: s.tasks(POOL), _task, _task_aims(()), hostile=(0.02, 0.03)),
        Target("rollouts", RolloutGroup, lambda s: s.rollouts(POOL),
               lambda u: RolloutGroup(task=_task(u), rollouts=[_rollout(u, 0), _rollout(u, 1)]),
               _task_aims(("task",)) + _rollout_aims(("rollouts", 0)), hostile=(0.03, 0.04)),
        Target("scored", ScoredGroup, lambda s: s.scored(POOL),
               lambda u: ScoredGroup(task=_task(u), scored=[ScoredRollout(rollout=_rollout(u, 0), reward=1.0),
                                                             ScoredRollout(rollout=_rollout(u, 1), reward=0.0)]),
               _rollout_aims(scored_pre) + (("reward_huge", _set(("scored", 0, "reward"), 1e308)),
                                            ("reward_nan", _set(("scored", 0, "reward"), float("nan"))),
                                            ("pool_dot", _set(("task", "pool"), "a.b"))), hostile=(0.03, 0.04)),
        Target("uploads", WeightManifest, lambda s: s.weight_uploads(MODEL), lambda u: _manifest(u, "uploaded"),
               _manifest_aims()),
        Target("weights", WeightManifest, lambda s: s.weights(MODEL), lambda u: _manifest(u, "published"),
               _manifest_aims()),
        Target("control_gen", Control, lambda s: s.control_action("generator", "all", "admit"),
               lambda u: _control(u, Admit(boot=u, grant_total=1), "generator"),
               (("seq_max", _set(("seq",), 2**64 - 1)), ("seq_ahead", _set(("seq",), 2**62)),
                ("grant_huge", _set(("decision", "grant_total"), 2**63 - 1)),
                ("target_dot", _set(("target_instance",), "a.b")), ("kind_unknown", _set(("decision", "$k"), "evil")))),
        Target("control_ctl", Control, lambda s: s.control_action("controller", "all", "set_mix"),
               lambda u: _control(u, SetMix(mix={POOL: 1.0}), "controller"),
               (("mix_inf", _set(("decision", "mix"), {POOL: float("inf")})),
                ("mix_huge", _set(("decision", "mix"), {POOL: 1e308, "b": 1e308})),
                ("mix_unknown_pool", _set(("decision", "mix"), {"nope": 1.0})),
                ("mix_bad_pool", _set(("decision", "mix"), {"a.b": 1.0})), ("seq_max", _set(("seq",), 2**64 - 1)))),
        Target("metrics", Heartbeat, lambda s: s.metrics("fuzz", "fz"),
               lambda u: Heartbeat(service="fuzz", instance="fz", seq=1, ts=1.0, info={"id": u}),
               (("metric_inf", _set(("metrics",), {"generator/tokens_per_s": float("inf")})),
                ("metric_nan", _set(("metrics",), {"trainer/step": float("nan")})),
                ("metric_huge", _set(("metrics",), {"generator/queue": 1e308})),
                ("version_max", _set(("version",), 2**63 - 1)), ("seq_max", _set(("seq",), 2**64 - 1)),
                ("info_wrong_types", _set(("info",), {"pools": 3, "boot": [1], "grant": "x", "id": None})),
                ("service_other", _set(("service",), "generator")))),
        Target("env_reset", EnvReset, lambda s: s.env(ENV, "reset"), lambda u: EnvReset(task=_task(u)),
               _task_aims(("task",)), request=True),
        Target("env_reset_batch", EnvResetBatch, lambda s: s.env(ENV, "reset_batch"),
               lambda u: EnvResetBatch(tasks=[_task(u), _task(u + "b")]), _task_aims(("tasks", 0)), request=True),
        Target("env_step", EnvStep, lambda s: s.env(ENV, "step"),
               lambda u: EnvStep(task=_task(u), episode_id=u, action_ids=np.array([3, 4], "<i4"), action_text="46"),
               _task_aims(("task",)) + (("action_neg", _arr(("action_ids",), np.array([-1], "<i4"))),
                                        ("episode_long", _set(("episode_id",), LONG))), request=True),
        # An episode's later turns go to the replica holding it (the run's one environment, 'env-0'):
        # the base opens a calculator episode there; the aims send turns it never opened, turns out
        # of order, hostile limits and actions.
        Target("env_step_replica", EnvStep, lambda s: s.env_step("calculator", "env-0"),
               lambda u: EnvStep(task=_task(u, env="calculator", prompt="100+200+300+400="), episode_id=u,
                                 action_text="calc(100+200+300+400)", turn=1),
               _task_aims(("task",)) + (
                   ("turn_unopened", _set(("turn",), 2)), ("turn_zero", _set(("turn",), 0)),
                   ("turn_neg", _set(("turn",), -5)), ("turn_huge", _set(("turn",), 2**63 - 1)),
                   ("max_tool_s_nan", _set(("task", "limits", "max_tool_s"), float("nan"))),
                   ("max_turns_zero", _set(("task", "limits", "max_turns"), 0)),
                   ("calc_deep", _set(("action_text",), "calc(" + "(" * 5000 + "1" + ")" * 5000 + ")")),
                   ("calc_huge", _set(("action_text",), "calc(" + "9" * 5000 + "*" + "9" * 5000 + ")")),
                   ("calc_div0", _set(("action_text",), "calc(1/0)")),
                   ("episode_long", _set(("episode_id",), LONG))), request=True),
    ]
    return {x.name: x for x in t}


def _manifest_aims() -> tuple[tuple[str, Callable[[dict[str, Any]], None]], ...]:
    loc = ("shards", 0, "location")
    return (
        ("loc_empty", _set(loc, "")), ("loc_slash", _set(loc, "/")), ("loc_long", _set(loc, LONG)),
        ("loc_dotdot", _set(loc, "../x")), ("transport_file", _set(("transport",), "file")),
        ("file_etc", lambda w: (_set(("transport",), "file")(w), _set(loc, "/etc/passwd")(w))),
        ("version_max", _set(("version",), 2**63 - 1)), ("size_huge", _set(("shards", 0, "size"), 2**63 - 1)),
        ("size_neg", _set(("shards", 0, "size"), -1)), ("model_other", _set(("model",), "other")),
        ("tensors_bogus", _set(("tensors",), [{"$k": "tensor", "$v": 1, "name": "x", "dtype": "f4", "shape": [-1]}])),
    )


TARGETS = _targets()


# --- mutation ----------------------------------------------------------------------------------

def _leaves(node: Any, path: tuple[Any, ...], out: list[tuple[Any, ...]]) -> None:
    if isinstance(node, dict) and set(node) == {"dtype", "shape", "data"}:
        out.append(path)  # an encoded array is one leaf
    elif isinstance(node, dict):
        for k, v in node.items():
            _leaves(v, (*path, k), out)
    elif isinstance(node, list) and node:
        for i, v in enumerate(node):
            _leaves(v, (*path, i), out)
    else:
        out.append(path)


def _hostile_value(old: Any, rng: random.Random) -> tuple[str, Any]:
    if isinstance(old, dict) and "dtype" in old:  # an array: wrong length, NaNs, wrong dtype, lying shape
        choice = rng.randrange(4)
        if choice == 0:
            return "array_short", {**old, "data": old["data"][:-1]}
        if choice == 1:
            n = old["shape"][0] if old["shape"] else 1
            return "array_nan", {"dtype": "<f4", "shape": [n], "data": np.full(n, np.nan, "<f4").tobytes()}
        if choice == 2:
            return "array_shape", {**old, "shape": [2**31, 2**31]}
        return "array_wrong_len", {**old, "shape": [old["shape"][0] + 3] + old["shape"][1:]}
    if isinstance(old, bool):
        pool: tuple[Any, ...] = HOSTILE_ANY
    elif isinstance(old, float):
        pool = HOSTILE_FLOATS
    elif isinstance(old, int):
        pool = HOSTILE_INTS + HOSTILE_FLOATS
    elif isinstance(old, str):
        pool = HOSTILE_STRS
    else:
        pool = HOSTILE_ANY + HOSTILE_STRS
    value = rng.choice(pool)
    return type(value).__name__, value


def _required(schema: type[Message]) -> list[str]:
    """Fields without a default: dropping one of these must fail decoding (dropping another is valid)."""
    return [f.name for f in dataclasses.fields(schema)  # type: ignore[arg-type]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def _malformed(kind: str, packed: bytes, wire: dict[str, Any], required: list[str], rng: random.Random) -> bytes:
    if kind == "random_bytes":
        return rng.randbytes(rng.randrange(1, 200))
    if kind == "empty":
        return b""
    if kind == "truncated":
        return packed[: rng.randrange(1, len(packed))]
    if kind == "non_map":
        return msgpack.packb(rng.choice([[1, 2], "task", 7, None, 1.5, b"x"]))
    if kind == "bad_utf8":  # the kind string re-encoded as invalid UTF-8 of the same length
        kind_str = wire["$k"].encode()
        return packed.replace(msgpack.packb(wire["$k"]), bytes([0xA0 | len(kind_str)]) + b"\xff" * len(kind_str), 1)
    if kind == "deep_nesting":
        return b"\x91" * 5_000 + b"\xc0"  # far past the decoder's nesting limit
    if kind == "trailing_garbage":
        return packed + rng.randbytes(8)
    if kind == "wrong_type":
        return msgpack.packb({**wire, rng.choice([k for k in wire if not k.startswith("$")]): {"nested": [1]}})
    if kind == "missing_field":
        gone = rng.choice(required)
        return msgpack.packb({k: v for k, v in wire.items() if k != gone})
    if kind == "wrong_kind":
        return msgpack.packb({**wire, "$k": rng.choice([k for k in ("task", "heartbeat", "evil", 3) if k != wire["$k"]])})
    if kind == "wrong_version":
        return msgpack.packb({**wire, "$v": rng.choice([99, 0, -1, "1", 2**64 - 1])})
    return rng.randbytes(OVERSIZED_BYTES)  # oversized


def _decodes(schema: type[Message], data: bytes) -> bool:
    try:
        schema.decode(data)
    except SchemaError:
        return False
    return True


def cases(target: str, n: int, subjects: Subjects, *, seed: int = 0) -> Iterator[Case]:
    """``n`` cases for ``target``: ``Target.hostile`` shares of hostile leaves and aimed values (cycled),
    the rest malformed encodings."""
    t = TARGETS[target]
    subject = t.subject(subjects)
    rng = random.Random(f"{seed}:{target}")
    aimed = t.aimed
    malformed = 1.0 - sum(t.hostile)
    n_aimed = 0  # aimed mutations are cycled, so each is tried about equally often
    for i in range(n):
        uid = f"fz-{target}-{i}"
        wire = t.base(uid)._to_wire()
        packed = msgpack.packb(wire, use_bin_type=True)
        roll = rng.random()
        if roll < malformed:
            kind = rng.choice(MALFORMED)
            if kind == "oversized" and i % 200:  # a few only: each is 300 kB
                kind = "random_bytes"
            data = _malformed(kind, packed, wire, _required(t.schema), rng)
        elif roll < malformed + t.hostile[0] or not aimed:
            leaves: list[tuple[Any, ...]] = []
            _leaves(wire, (), leaves)
            path = rng.choice(leaves)
            old: Any = wire
            for key in path:
                old = old[key]
            label, value = _hostile_value(old, rng)
            _set(path, value)(wire)
            kind = f"leaf:{'.'.join(map(str, path))}={label}"
            data = msgpack.packb(wire, use_bin_type=True)
        else:
            label, mutate = aimed[n_aimed % len(aimed)]
            n_aimed += 1
            mutate(wire)
            kind = f"aimed:{label}"
            data = msgpack.packb(wire, use_bin_type=True)
        yield Case(target, i, kind, subject, data, _decodes(t.schema, data))


def valid_tasks(n: int, *, seed: int) -> list[Task]:
    """Well-formed addition tasks the run must score despite the fuzz."""
    from rlbus.services.tasks.addition import make_split

    return [Task(run=RUN, task_id=f"ok-{seed}-{t.task_id}", pool=POOL, env=ENV, prompt=t.prompt, answer=t.answer,
                 group_size=8) for t in make_split("train", n, seed=seed)]
