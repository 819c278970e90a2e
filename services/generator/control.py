"""The controller's decisions for this replica, from CONTROL to the core.

Each action has its own subject (``rl.<run>.control.generator.<instance|all>.<action>``), read
from the last message per subject on join, so a new replica starts from the latest decision of
every kind.  A Control that does not decode, or whose decision does not belong on the subject it
came on, is dead-lettered with the reason and the follower goes on with the next one.
"""

from __future__ import annotations

import asyncio

from rlbus.bus.protocol import Bus, Delivery
from rlbus.bus.subjects import SubjectError, Subjects
from rlbus.observability.logging import get_logger
from rlbus.schemas import Admit, AssignPools, Concurrency, Control, Evaluate, RunState, SchemaError
from rlbus.services.generator.core import Generator
from rlbus.services.generator.status import Status

log = get_logger()

SERVICE = "generator"
# What may arrive on a generator's control subjects: the four it applies, and the record of a
# held-out round (on ``generator.all.evaluate``; weight-broadcast keeps that version readable).
FOR_GENERATORS = (Admit, AssignPools, Concurrency, RunState, Evaluate)


class ControlFollower:
    """Applies the decisions addressed to this instance and to all generators, each subject in order."""

    def __init__(self, bus: Bus, subjects: Subjects, instance: str, gen: Generator, status: Status) -> None:
        self.bus = bus
        self.subjects = subjects
        self.instance = instance
        self.gen = gen
        self.status = status
        self.refused = 0  # decisions dead-lettered

    async def follow(self) -> None:
        async with asyncio.TaskGroup() as tg:
            for instance in (self.instance, "all"):
                tg.create_task(self._watch(self.subjects.control_actions(SERVICE, instance)))

    async def _watch(self, subject: str) -> None:
        async for d in self.bus.watch(subject, deliver="last_per_subject"):
            await self.on_delivery(d)

    async def on_delivery(self, d: Delivery[bytes]) -> None:
        try:
            ctl = Control.decode(d.msg)
        except SchemaError as exc:
            await self._refuse(d, "bad_control", f"{type(exc).__name__}: {exc}")
            return
        misplaced = self.misplaced(ctl, d.subject)
        if misplaced:
            await self._refuse(d, "misplaced_control", misplaced)
            return
        changed = self.gen.on_control(ctl)
        if changed is not None and ctl.action != "admit":  # admits come every few seconds: not worth a line each
            log.info("control_applied", action=ctl.action, seq=ctl.seq, decision=changed, reason=ctl.reason,
                     issuer=ctl.issuer)
        self.status.changed()

    def misplaced(self, ctl: Control, subject: str) -> str:
        """Why ``ctl`` does not belong on ``subject`` ('' when it does): a decision is published on
        the subject of its own target and action, so one found elsewhere was sent by mistake."""
        if not isinstance(ctl.decision, FOR_GENERATORS):
            return (f"a {ctl.action!r} decision is not for generators (it came on {subject!r}); "
                    "send it to the service that applies it")
        try:
            expected = self.subjects.control_action(ctl.target_service, ctl.target_instance, ctl.action)
        except SubjectError as exc:
            return f"the decision's target does not name a subject: {exc}"
        if ctl.target_service != SERVICE or expected != subject:
            return (f"a decision for {ctl.target_service}/{ctl.target_instance} ({ctl.action}) came on {subject!r}; "
                    f"publish it on {expected!r}")
        return ""

    async def _refuse(self, d: Delivery[bytes], reason: str, error: str) -> None:
        self.refused += 1
        self.status.set_metric("generator/control_refused", self.refused)
        log.warning("control_refused", subject=d.subject, reason=reason, error=error)
        await self.bus.dead_letter(d.subject, d.msg, reason=reason, error=error)
