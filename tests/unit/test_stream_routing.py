"""Which stream stores each subject of a run, and the declarations that follow from it: uploads on
their own work queue, no two streams overlapping, one advisory durable per consumed durable."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from rlbus.bus.retention import RETENTION_KEYS, Retention
from rlbus.bus.routing import WORK_QUEUES, stream_kind_of, subject_matches

# nats types through rlbus.bus.streams: only bus/ imports nats (tests/unit/test_imports.py)
from rlbus.bus.streams import (
    NotFoundError,
    advisory_consumer_config,
    advisory_declaration,
    api,
    declarations,
    ensure_advisory_consumer,
    limit_key,
)
from rlbus.bus.subjects import STREAM_KINDS, SubjectError, Subjects

S = Subjects("r")


def test_uploads_have_a_work_queue_of_their_own_refusing_new_at_the_limit():
    assert stream_kind_of(S.weight_uploads("policy")) == "UPLOADS"
    assert stream_kind_of(S.weights("policy")) == "WEIGHTS"
    decl = {d.kind: d for d in declarations(S, retention=Retention(queue_max_msgs=7))}["UPLOADS"]
    assert "UPLOADS" in WORK_QUEUES
    assert decl.config.retention == api.RetentionPolicy.WORK_QUEUE
    assert (decl.config.max_msgs, decl.config.discard) == (7, api.DiscardPolicy.NEW)
    assert decl.config.max_msgs_per_subject in (None, -1)  # no per-subject cap that drops an unread upload
    why = "maximum messages exceeded"
    assert limit_key(S, S.stream("UPLOADS"), why) == RETENTION_KEYS["queue_max_msgs"]


def test_no_two_streams_of_a_run_store_the_same_subject():
    """JetStream refuses overlapping stream subjects; and each subject the run builds lands in the
    stream ``stream_kind_of`` names."""
    decls = [*declarations(S), advisory_declaration(S)]
    assert {d.kind for d in decls} == {*STREAM_KINDS, "ADVISORIES"}
    built = [S.tasks("p"), S.rollouts("p"), S.scored("p"), S.weights("m"), S.weight_uploads("m"),
             S.control_action("generator", "0", "admit"), S.metrics("trainer", "0"), S.dead("tasks")]
    for subject in built:
        owners = [d.kind for d in decls if any(subject_matches(p, subject) for p in d.config.subjects)]
        assert owners == [stream_kind_of(subject)], subject
    # The old uploads subject (inside WEIGHTS) is not inside UPLOADS: the two may coexist in a run.
    old = f"{S.root}.weights.policy.upload"
    assert stream_kind_of(old) == "WEIGHTS" and not subject_matches(S.all_of("uploads"), old)


def test_each_durable_has_its_own_advisory_durable_and_subject():
    pairs = [("TASKS", "generator_math"), ("TASKS", "generator_eval"), ("SCORED", "trainer"),
             ("ROLLOUTS", "reward"), ("UPLOADS", "broadcast")]
    cfgs = [advisory_consumer_config(S, k, d) for k, d in pairs]
    assert len({c.durable_name for c in cfgs}) == len(pairs)
    assert cfgs[2].filter_subject == f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{S.stream('SCORED')}.trainer"
    for a, b in itertools.combinations(cfgs, 2):  # a work queue refuses overlapping filters
        assert not subject_matches(a.filter_subject, b.filter_subject)
    captured = advisory_declaration(S).config.subjects
    for c in cfgs:  # every one is inside what ADVISORIES captures
        assert any(subject_matches(p, c.filter_subject) for p in captured), c.filter_subject
    with pytest.raises(SubjectError):
        S.advisory_durable("TASKS", "a.b")
    with pytest.raises(SubjectError):
        S.advisory_durable("ADVISORIES", "x")


class FakeJS:
    """consumer_info answers ``have`` (or NotFound); add_consumer records what it is given."""

    def __init__(self, have: Any = None) -> None:
        self.have = have
        self.added: list[api.ConsumerConfig] = []

    async def consumer_info(self, stream: str, name: str) -> Any:
        if self.have is None:
            raise NotFoundError()
        return self.have

    async def add_consumer(self, stream: str, cfg: api.ConsumerConfig) -> None:
        self.added.append(cfg)


async def test_an_advisory_durable_gets_the_runs_replicas_new_or_existing():
    js = FakeJS()
    await ensure_advisory_consumer(js, S, "SCORED", "trainer", replicas=3)
    assert js.added[0].num_replicas == 3
    assert js.added[0].filter_subject.endswith(".trainer")

    one = advisory_consumer_config(S, "SCORED", "trainer", 1)
    js = FakeJS(SimpleNamespace(config=one, cluster=None))
    await ensure_advisory_consumer(js, S, "SCORED", "trainer", replicas=3)  # raised in place
    assert [c.num_replicas for c in js.added] == [3] and js.added[0].filter_subject == one.filter_subject
    js = FakeJS(SimpleNamespace(config=one, cluster=None))
    await ensure_advisory_consumer(js, S, "SCORED", "trainer", replicas=None)  # a tool: kept as it is
    assert js.added == []
