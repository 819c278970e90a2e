"""The wire codec: every message round-trips, and any bad payload is one ``SchemaError``.

A dead letter is only useful if the decoder explains itself, and a service only survives a bad
producer if nothing but ``SchemaError`` ever escapes ``decode``; the fuzz tests below feed it
random bytes and randomly damaged valid messages to hold it to that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlbus import schemas
from rlbus.schemas import (
    ALL_MESSAGES,
    Admit,
    AssignPools,
    Concurrency,
    Control,
    DeadLetter,
    DecisionClock,
    Divergence,
    EnvReply,
    EnvReplyBatch,
    EnvReset,
    EnvResetBatch,
    EnvStep,
    EpisodeLimits,
    Evaluate,
    Heartbeat,
    Message,
    Rollout,
    RolloutGroup,
    RunState,
    SamplingParams,
    SchemaError,
    ScoredGroup,
    ScoredRollout,
    SetMix,
    Shard,
    Stall,
    Task,
    TensorMeta,
    WeightManifest,
    spans_from_versions,
)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------
# realistic samples of every message


def sampling() -> SamplingParams:
    return SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=6, stop=["\n", "<eos>"], seed=1234)


def task(**kw) -> Task:
    base = dict(
        run="demo", task_id="add-123-456", pool="train", env="addition", prompt="123+456=",
        env_config={"a": 123, "b": 456}, answer="579", verifier="addition", group_size=2, sampling=sampling(),
        metadata={"split": "train", "difficulty": 0.5, "tags": ["3-digit", "carry"]}, eval=False,
    )
    base.update(kw)
    return Task(**base)


def rollout(index: int = 0, versions=(3, 3, 4, 4), task_id: str = "add-123-456", text: str = "579") -> Rollout:
    prompt = [1, 5, 6, 7, 14, 8, 9, 10, 17]  # <bos>123+456=
    completion = [9, 11, 13, 2][: len(versions)]
    n = len(versions)
    return Rollout(
        rollout_id=f"{task_id}/{index}", task_id=task_id, index=index,
        token_ids=np.array(prompt + completion, dtype="<i4"), prompt_len=len(prompt),
        loss_mask=np.ones(n, dtype="|u1"),
        behaviour_logprobs=np.linspace(-0.1, -2.5, n).astype("<f4"),
        version_spans=spans_from_versions(np.array(versions)),
        finish_reason="stop", text=text, generator_id="gen-0", timings={"sample_s": 0.125, "queue_s": 0.5},
    )


def shard() -> Shard:
    return Shard(name="model.safetensors", sha256=hashlib.sha256(b"weights").hexdigest(), size=4_194_304,
                 location="policy/v3/model.safetensors")


SAMPLES: dict[type[Message], object] = {
    SamplingParams: sampling,
    EpisodeLimits: lambda: EpisodeLimits(max_turns=4, max_total_tokens=512, max_tool_s=2.5),
    Task: task,
    Rollout: rollout,
    RolloutGroup: lambda: RolloutGroup(task=task(), rollouts=[rollout(0), rollout(1, text="578")],
                                       sampling=sampling(), generator_id="gen-0", created_at=1.7e9,
                                       task_published_at=1.7e9 - 3),
    ScoredRollout: lambda: ScoredRollout(rollout=rollout(), reward=1.0, components={"correct": 1.0, "format": 1.0},
                                         verifier_detail="expected '579', got '579'"),
    ScoredGroup: lambda: ScoredGroup(
        task=task(),
        scored=[ScoredRollout(rollout=rollout(0), reward=1.0, components={"correct": 1.0}),
                ScoredRollout(rollout=rollout(1, text="5"), reward=0.0, verifier_error="addition: ValueError('x')")],
        sampling=sampling(), generator_id="gen-1", created_at=1.7e9, scored_at=1.7e9 + 0.25),
    TensorMeta: lambda: TensorMeta(name="model.embed_tokens.weight", dtype="float32", shape=[64, 128]),
    Shard: shard,
    WeightManifest: lambda: WeightManifest(
        model="policy", version=3, transport="objstore", shards=[shard()],
        tensors=[TensorMeta(name="lm_head.weight", dtype="float32", shape=[64, 128])],
        trainer_step=3, created_at=1.7e9, state="uploaded"),
    Admit: lambda: Admit(boot="b1", grant_total=40, min_version=2),
    AssignPools: lambda: AssignPools(pools=["code", "math"], shares={"code": 0.75, "math": 0.25}),
    Concurrency: lambda: Concurrency(max_groups=3),
    Evaluate: lambda: Evaluate(version=10, tasks=200),
    RunState: lambda: RunState(state="drain", boot="b1"),
    SetMix: lambda: SetMix(mix={"code": 0.4, "math": 0.6}),
    Stall: lambda: Stall(cause="trainer_silent", stalled_s=130.5, since=1.7e9,
                         detail="the trainer is silent for 130s (last version 4); start or restart it"),
    Divergence: lambda: Divergence(firing=True, reward_trend=0.25, heldout_trend=-0.125, from_version=10,
                                   to_version=60, heldout_readings=6,
                                   detail="training reward +0.25 while held-out accuracy -0.125"),
    Control: lambda: Control(seq=1_700_000_000_000_007, decision=Admit(boot="b1", grant_total=40, min_version=2),
                             target_service="generator", target_instance="gen-0",
                             reason="allowed=(V=2+s=1+1)*B=8+dropped=3=35",
                             inputs={"version": 2, "dropped": 3, "rates": [1.5, 2.0]}, issued_at=1.7e9,
                             issuer="controller-0"),
    Heartbeat: lambda: Heartbeat(service="trainer", instance="trainer-0", seq=12, ts=1.7e9, state="running",
                                 version=2, metrics={"trainer/loss": 0.125, "trainer/mismatch/k3_kl": 1e-4},
                                 info={"boot": "b1", "pools": ["train"]}),
    DeadLetter: lambda: DeadLetter(origin_subject="rl.demo.rollouts.train", error="SchemaError",
                                   reason="rollout v1 field 'token_ids': ...", data=b"\x93\x01\xc0\xff",
                                   deliveries=5, headers={"Nats-Msg-Id": "rollouts.add-1-2"}, service="reward",
                                   stream_seq=42, ts=1.7e9),
    EnvReset: lambda: EnvReset(task=task()),
    EnvStep: lambda: EnvStep(task=task(), episode_id="add-123-456", action_ids=np.array([9, 11, 13], dtype="<i4"),
                             action_text="579"),
    EnvReply: lambda: EnvReply(episode_id="add-123-456", observation_ids=np.array([1, 5, 6, 7], dtype="<i4"),
                               observation_text="123+", done=False, error="", info={"turn": 1}),
    EnvResetBatch: lambda: EnvResetBatch(tasks=[task(), task()]),
    EnvReplyBatch: lambda: EnvReplyBatch(replies=[
        EnvReply(episode_id="add-123-456", observation_ids=np.array([1, 5, 6, 7], dtype="<i4")),
        EnvReply(episode_id="", error="unknown environment 'chess'")]),
}


def assert_same(a, b, path: str = "") -> None:
    """Deep equality that also checks array dtypes and exact Python types."""
    if isinstance(a, Message):
        assert type(b) is type(a), path
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), path
        assert (b.dtype, b.shape) == (a.dtype, a.shape), path
        assert np.array_equal(a, b), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    else:
        assert type(b) is type(a) and b == a, f"{path}: {a!r} != {b!r}"


def wire(msg: Message) -> dict:
    return msgpack.unpackb(msg.encode(), raw=False)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode_error(cls: type[Message], obj) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        cls.decode(pack(obj))
    return info.value


# ---------------------------------------------------------------------------------------
# round trips


def test_every_message_has_a_sample():
    """A new wire message must get a realistic sample here (and so a round-trip test)."""
    assert set(SAMPLES) == set(ALL_MESSAGES)


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_round_trip(cls):
    msg = SAMPLES[cls]()
    back = cls.decode(msg.encode())
    assert_same(msg, back)
    # A decoded message is itself a valid message that encodes to the same bytes.
    assert back.encode() == msg.encode()


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_wrong_kind_is_refused(cls):
    """A message published on the wrong subject is not silently read as another kind."""
    other = Heartbeat if cls is not Heartbeat else Control
    err = decode_error(cls, wire(SAMPLES[other]()))
    assert err.schema == cls.KIND
    assert err.field == "$k"
    assert repr(other.KIND) in err.got


def test_unknown_fields_are_ignored_at_every_level():
    """A newer producer may append fields; this build decodes what it knows."""
    msg = SAMPLES[ScoredGroup]()
    w = wire(msg)
    w["added_in_v2"] = {"nested": [1, 2, 3]}
    w["task"]["priority"] = 5
    w["scored"][0]["rollout"]["entropy"] = {"dtype": "<f4", "shape": [4], "data": b"\0" * 16}
    assert_same(msg, ScoredGroup.decode(pack(w)))


def test_missing_defaulted_fields_take_their_defaults():
    """An older producer that never sent a newer field still decodes."""
    w = wire(rollout())
    del w["timings"], w["text"], w["generator_id"]
    r = Rollout.decode(pack(w))
    assert (r.timings, r.text, r.generator_id) == ({}, "", "")
    assert np.array_equal(r.token_ids, rollout().token_ids)


def test_decoded_arrays_are_read_only_views_over_the_payload_bytes():
    r = Rollout.decode(rollout().encode())
    for arr in (r.token_ids, r.loss_mask, r.behaviour_logprobs, r.version_spans):
        assert arr.flags.writeable is False
        base = arr
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, bytes)  # a view, not a per-element Python copy
    with pytest.raises(ValueError):
        r.token_ids[0] = 7


def test_big_endian_arrays_are_sent_little_endian():
    r = dataclasses.replace(rollout(), token_ids=rollout().token_ids.astype(">i4"))
    back = Rollout.decode(r.encode())
    assert back.token_ids.dtype.str == "<i4"
    assert back.token_ids.tolist() == rollout().token_ids.tolist()


def test_one_mebibyte_rollout_decodes_intact():
    n = 256 * 1024  # 1 MiB of completion token ids alone
    rng = np.random.default_rng(0)
    versions = np.repeat(np.arange(8), n // 8)
    big = Rollout(
        rollout_id="big/0", task_id="big", index=0,
        token_ids=rng.integers(0, 50_000, n + 16).astype("<i4"), prompt_len=16,
        loss_mask=np.ones(n, dtype="|u1"), behaviour_logprobs=-rng.random(n).astype("<f4"),
        version_spans=spans_from_versions(versions),
    )
    data = big.encode()
    assert len(data) > 1 << 20
    back = Rollout.decode(data)
    assert np.array_equal(back.token_ids, big.token_ids)
    assert np.array_equal(back.behaviour_logprobs, big.behaviour_logprobs)
    assert np.array_equal(back.token_versions(), versions)
    assert back.version_spans.shape == (8, 2)


# ---------------------------------------------------------------------------------------
# specific decode errors: each names schema, version, field, expected and got


def test_wrong_scalar_type_names_field_expected_and_got():
    w = wire(task())
    w["group_size"] = "8"
    err = decode_error(Task, w)
    assert (err.schema, err.version, err.field, err.expected) == ("task", 1, "group_size", "int")
    assert "str" in err.got and "'8'" in err.got
    assert "group_size" in str(err)


def test_bool_is_not_an_int():
    w = wire(task())
    w["group_size"] = True
    assert decode_error(Task, w).field == "group_size"


def test_missing_required_field_is_named():
    w = wire(rollout())
    del w["rollout_id"]
    err = decode_error(Rollout, w)
    assert (err.field, err.expected, err.got) == ("rollout_id", "str", "nothing")


def test_nested_error_names_the_full_path():
    w = wire(SAMPLES[RolloutGroup]())
    w["rollouts"][1]["prompt_len"] = "nine"
    err = decode_error(RolloutGroup, w)
    assert err.field == "rollouts[1].prompt_len"
    assert err.schema == "rollout"


def test_literal_value_outside_the_allowed_set():
    w = wire(Control(seq=1, decision=RunState(state="pause"), target_service="generator"))
    w["decision"]["state"] = "explode"
    err = decode_error(Control, w)
    assert err.field == "decision.state" and "pause" in err.expected


# ---------------------------------------------------------------------------------------
# control decisions: typed, validated on decode, ordered by one clock


def test_a_control_carries_one_typed_decision_and_its_action_follows_from_it():
    back = Control.decode(SAMPLES[Control]().encode())
    assert isinstance(back.decision, Admit) and back.decision.grant_total == 40 and back.action == "admit"
    assert back.msg_id == "ctl.generator.gen-0.admit.1700000000000007"
    actions = {Control(seq=1, decision=d, target_service="generator").action
               for d in (RunState(state="pause"), RunState(state="resume"), RunState(state="drain"),
                         SAMPLES[AssignPools](), SAMPLES[Concurrency](), SAMPLES[Evaluate](), SAMPLES[SetMix](),
                         SAMPLES[Stall](), SAMPLES[Divergence]())}
    assert actions == {"pause", "resume", "drain", "assign_pools", "concurrency", "evaluate", "set_mix", "stall",
                       "divergence"}


def test_an_unknown_decision_kind_is_refused_and_named():
    w = wire(SAMPLES[Control]())
    w["decision"]["$k"] = "stop"
    err = decode_error(Control, w)
    assert err.field == "decision.$k" and "admit" in err.expected and "'stop'" in err.got


@pytest.mark.parametrize(("decision", "field", "value"), [
    (Admit, "grant_total", -1), (Admit, "boot", ""), (Concurrency, "max_groups", 0), (Evaluate, "tasks", -5),
    (AssignPools, "pools", []), (AssignPools, "shares", {"nope": 1.0}), (SetMix, "mix", {"a": 0.0}),
    (SetMix, "mix", {"a": math.nan}), (Divergence, "heldout_trend", math.inf), (Divergence, "to_version", 3),
])
def test_a_decision_that_breaks_its_own_rules_is_refused_on_decode(decision, field, value):
    w = wire(Control(seq=1, decision=SAMPLES[decision](), target_service="generator"))
    w["decision"][field] = value
    err = decode_error(Control, w)
    assert err.field == field and err.schema == decision.KIND


def test_a_version_1_control_with_untyped_params_is_refused():
    w = wire(SAMPLES[Control]())
    del w["decision"]
    w.update({"$v": 1, "action": "admit", "params": {"boot": "b1", "grant_total": 40}})
    err = decode_error(Control, w)
    assert (err.field, err.got) == ("decision", "nothing")


def test_a_run_state_built_in_python_is_checked_too():
    with pytest.raises(SchemaError, match="pause, resume, drain"):
        RunState(state="stop")  # type: ignore[arg-type]


def test_the_decision_clock_follows_wall_time_and_stays_above_every_seq_seen():
    clock = DecisionClock()
    assert clock.next(100.0) == 100_000_000
    assert clock.next(100.0) == 100_000_001  # same microsecond: still increasing
    clock.observe(500_000_000)  # another issuer whose clock runs ahead
    assert clock.next(101.0) == 500_000_001
    clock.observe(7)  # an older seq changes nothing
    assert clock.next(600.0) == 600_000_000


@pytest.mark.parametrize(
    ("array", "why"),
    [
        ({"dtype": "<i8", "shape": [13], "data": b"\0" * 104}, "dtype"),
        ({"dtype": ">i4", "shape": [13], "data": b"\0" * 52}, "dtype"),
        ({"dtype": "<i4", "shape": [13, 1], "data": b"\0" * 52}, "shape"),
        ({"dtype": "<i4", "shape": [-13], "data": b"\0" * 52}, "shape"),
        ({"dtype": "<i4", "shape": [13], "data": b"\0" * 51}, "byte length"),
        ({"dtype": "<i4", "shape": [13], "data": "not bytes"}, "bytes"),
        ({"dtype": "<i4", "shape": [13]}, "map"),
        ([1, 2, 3], "map"),
    ],
)
def test_bad_array_is_refused(array, why):
    w = wire(rollout())
    w["token_ids"] = array
    err = decode_error(Rollout, w)
    assert err.field == "token_ids"
    assert why in str(err)


def test_nan_behaviour_logprob_is_refused_with_its_index():
    w = wire(SAMPLES[RolloutGroup]())
    lp = np.array([-0.5, -1.0, np.nan, -0.1], dtype="<f4")
    w["rollouts"][0]["behaviour_logprobs"]["data"] = lp.tobytes()
    err = decode_error(RolloutGroup, w)
    assert err.field == "rollouts[0].behaviour_logprobs"
    assert "index 2" in str(err) and err.got == "nan"


def test_infinite_behaviour_logprob_is_refused():
    w = wire(rollout())
    w["behaviour_logprobs"]["data"] = np.array([0, -np.inf, 0, 0], dtype="<f4").tobytes()
    assert decode_error(Rollout, w).field == "behaviour_logprobs"


def test_non_finite_reward_is_refused():
    """A NaN reward would turn every advantage of its group into NaN on the trainer."""
    w = wire(SAMPLES[ScoredRollout]())
    w["reward"] = math.nan
    assert decode_error(ScoredRollout, w).field == "reward"
    with pytest.raises(SchemaError):
        ScoredRollout(rollout=rollout(), reward=math.inf)


@pytest.mark.parametrize(("shape", "data"), [([1, 1], b"\0" * 8), ([2, 0], b""), ([1, 3], b"\0" * 24),
                                             ([0, 2**62], b"")])
def test_version_spans_must_be_offset_version_rows(shape, data):
    w = wire(rollout())
    w["version_spans"] = {"dtype": "<i8", "shape": shape, "data": data}
    assert decode_error(Rollout, w).field == "version_spans"


def test_newer_schema_version_is_refused_and_says_upgrade():
    w = wire(rollout())
    w["$v"] = Rollout.VERSION + 1
    err = decode_error(Rollout, w)
    assert err.field == "$v" and err.expected == f"<= {Rollout.VERSION}" and err.got == str(Rollout.VERSION + 1)
    assert "upgrade" in str(err)


def test_newer_nested_schema_version_is_refused():
    w = wire(SAMPLES[RolloutGroup]())
    w["rollouts"][1]["$v"] = 99
    err = decode_error(RolloutGroup, w)
    assert err.schema == "rollout" and err.field == "$v"


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x93\x01", pack([1, 2]), pack("task"), pack(None)])
def test_not_a_message_at_all(payload):
    with pytest.raises(SchemaError) as info:
        Task.decode(payload)
    assert info.value.schema == "task"


def test_cross_field_validation_runs_on_decode():
    """Types alone are not enough: a rollout whose arrays disagree in length is refused."""
    w = wire(rollout())
    w["prompt_len"] = 11  # two completion tokens, but four logprobs
    err = decode_error(Rollout, w)
    assert err.field == "loss_mask"
    assert (err.expected, err.got) == ("2", "4")



@pytest.mark.parametrize("stop", [[""], ["ok", ""]])
def test_empty_stop_strings_are_refused(stop):
    """An empty stop string would end every sample at its first token."""
    w = wire(sampling())
    w["stop"] = stop
    assert decode_error(SamplingParams, w).field == "stop"

# ---------------------------------------------------------------------------------------
# fuzz: nothing but SchemaError ever escapes decode

_ARRAY_LIKE = st.fixed_dictionaries({
    "dtype": st.sampled_from(["<i4", "<i8", "|u1", "<f4", "<f8", ">i4", "i4", "zz"]),
    "shape": st.lists(st.integers(-2, 6) | st.integers(0, 2**62), max_size=3),
    "data": st.binary(max_size=48),
})
_LEAVES = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12)
           | st.binary(max_size=16) | _ARRAY_LIKE)
MSGPACK_VALUES = st.recursive(
    _LEAVES,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _paths(node, prefix=()):
    """Every location in a decoded wire tree (map keys and list indices)."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _decode_or_schema_error(cls: type[Message], data: bytes) -> None:
    try:
        msg = cls.decode(data)
    except SchemaError as exc:
        assert str(exc)  # always explains itself
        return
    # Whatever decoded is a valid message: it survives another trip.
    assert cls.decode(msg.encode()).encode() == msg.encode()


@FUZZ
@given(cls=st.sampled_from(ALL_MESSAGES), data=st.binary(max_size=256))
def test_fuzz_random_bytes(cls, data):
    _decode_or_schema_error(cls, data)


@FUZZ
@given(cls=st.sampled_from(ALL_MESSAGES), value=MSGPACK_VALUES)
def test_fuzz_random_msgpack_structures(cls, value):
    _decode_or_schema_error(cls, pack(value))


@FUZZ
@given(cls=st.sampled_from(ALL_MESSAGES), data=st.data())
def test_fuzz_random_fields_under_the_right_header(cls, data):
    names = [f.name for f in dataclasses.fields(cls)]
    fields = data.draw(st.dictionaries(st.sampled_from(names) | st.text(max_size=6), MSGPACK_VALUES, max_size=6))
    version = data.draw(st.sampled_from([cls.VERSION, cls.VERSION + 1, 0, -1, "1", None]))
    _decode_or_schema_error(cls, pack({**fields, "$k": cls.KIND, "$v": version}))


@FUZZ
@given(cls=st.sampled_from(ALL_MESSAGES), data=st.data())
def test_fuzz_damaged_valid_messages(cls, data):
    """Replace, delete or add one node anywhere in a valid message (arrays included)."""
    w = wire(SAMPLES[cls]())
    paths = [p for p in _paths(w) if p]
    path = data.draw(st.sampled_from(paths))
    parent = w
    for key in path[:-1]:
        parent = parent[key]
    op = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if op == "replace":
        parent[path[-1]] = data.draw(MSGPACK_VALUES)
    elif op == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(max_size=6))] = data.draw(MSGPACK_VALUES)
    else:
        parent.append(data.draw(MSGPACK_VALUES))
    _decode_or_schema_error(cls, pack(w))


def _array_paths(node, prefix=()):
    if isinstance(node, dict) and set(node) == {"dtype", "shape", "data"}:
        yield prefix
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _array_paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _array_paths(v, (*prefix, i))


ARRAY_MESSAGES = [c for c in ALL_MESSAGES if list(_array_paths(wire(SAMPLES[c]())))]


@FUZZ
@given(cls=st.sampled_from(ARRAY_MESSAGES), data=st.data())
def test_fuzz_arrays_of_any_shape_with_consistent_bytes(cls, data):
    """Arrays whose bytes match their dtype and shape pass the codec's own checks, so only the
    message's validation stands between them and the services: it must hold."""
    w = wire(SAMPLES[cls]())
    path = data.draw(st.sampled_from(list(_array_paths(w))))
    node = w
    for key in path:
        node = node[key]
    ndim = len(node["shape"])  # mostly the right rank: that is where validation has to catch it
    shape = data.draw(st.lists(st.integers(0, 5) | st.just(2**62), min_size=max(ndim - 1, 0), max_size=ndim + 1))
    count = math.prod(shape)
    if count > 64:
        shape = [0, *shape]
        count = 0
    node["shape"] = shape
    node["data"] = data.draw(st.binary(min_size=count * np.dtype(node["dtype"]).itemsize,
                                       max_size=count * np.dtype(node["dtype"]).itemsize))
    _decode_or_schema_error(cls, pack(w))


@FUZZ
@given(data=st.data())
def test_fuzz_deleting_a_required_field_names_it(data):
    cls = data.draw(st.sampled_from(ALL_MESSAGES))
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if not required:
        return
    name = data.draw(st.sampled_from(required))
    w = wire(SAMPLES[cls]())
    del w[name]
    err = decode_error(cls, w)
    assert (err.field, err.got) == (name, "nothing")


# ---------------------------------------------------------------------------------------
# version spans

VERSION_RUNS = st.lists(st.integers(0, 2**40), max_size=200)


@given(VERSION_RUNS)
def test_spans_round_trip_through_a_rollout(versions):
    """Per-token versions -> spans -> wire -> spans -> per-token versions is the identity."""
    v = np.array(versions, dtype=np.int64)
    spans = spans_from_versions(v)
    # Run-length: offsets start at 0, strictly increase, and no two neighbours share a version.
    if len(v):
        assert spans[0, 0] == 0
        assert (np.diff(spans[:, 0]) > 0).all()
        assert (spans[1:, 1] != spans[:-1, 1]).all()
    assert len(spans) == (0 if not len(v) else 1 + int((v[1:] != v[:-1]).sum()))
    n = len(v)
    r = Rollout(rollout_id="r", task_id="t", index=0, token_ids=np.zeros(n + 1, dtype="<i4"), prompt_len=1,
                loss_mask=np.ones(n, dtype="|u1"), behaviour_logprobs=np.zeros(n, dtype="<f4"),
                version_spans=spans)
    back = Rollout.decode(r.encode())
    assert back.token_versions().tolist() == versions
    if versions:
        assert (back.oldest_version, back.newest_version) == (min(versions), max(versions))


def test_version_spans_must_cover_the_first_completion_token():
    w = wire(rollout())
    w["version_spans"] = {"dtype": "<i8", "shape": [1, 2], "data": np.array([[1, 3]], dtype="<i8").tobytes()}
    assert decode_error(Rollout, w).field == "version_spans"


def test_public_names():
    assert set(schemas.__all__) >= {c.__name__ for c in ALL_MESSAGES} | {"SchemaError", "spans_from_versions"}
