"""Operator decisions on the CONTROL stream, recorded like the controller's own.

``set-mix a=0.2 b=0.8`` asks the controller for a new target mix between pools (a ``SetMix``: it
re-routes the generators at its next step and judges the trained mix from then on; the last request
is re-read when the controller restarts).  ``pause|resume|drain <instance|all>`` (a ``RunState``) go
straight to generators.

Ordering: a receiver applies the decisions of one kind in ``seq`` order, and a generator's drain voids
the admissions with a lower seq.  So an operator's decision takes its seq from a ``DecisionClock``
that has first observed the last decision on every subject it is ordered against (``competing``):
whatever clock skew there is between this machine and the controller's, it sorts after them.  The
controller observes it in turn, so its own later decisions sort after this one.

    python -m rlbus.services.commands.control set-mix --run demo --nats-url nats://127.0.0.1:4222 a=0.2 b=0.8
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rlbus.bus.subjects import Subjects
    from rlbus.schemas import Control

ISSUER = "operator"  # rlbus.schemas.control.OPERATOR: controllers leave an operator's pause or drain to the operator
STATES = ("pause", "resume", "drain")


def parse_mix(items: Sequence[str]) -> dict[str, float]:
    """``["a=0.2", "b=0.8"]`` -> ``{"a": 0.2, "b": 0.8}``, with an error that shows the expected form."""
    mix = {}
    for item in items:
        pool, sep, share = item.partition("=")
        try:
            if not sep or not pool:
                raise ValueError(item)
            mix[pool] = float(share)
        except ValueError:
            raise SystemExit(f"mix entry {item!r} must look like POOL=SHARE, e.g. a=0.2") from None
    if not mix or any(not math.isfinite(x) or x < 0 for x in mix.values()) or sum(mix.values()) <= 0:
        raise SystemExit(f"mix {mix} needs finite, non-negative shares, at least one positive")
    return mix


def competing(subjects: Subjects, service: str, instance: str, action: str) -> list[str]:
    """The subjects whose last decisions this one must sort after: its own subject, and those of every
    decision the receiver orders it against.  A generator orders pause/resume/drain as one kind across
    its own and the ``all`` subjects, and a drain voids the admissions before it; a controller orders
    the mix requests to it and to ``all`` as one kind."""
    kinds = [*STATES, "admit"] if action in STATES else [action]
    targets = [instance] if instance == "all" else [instance, "all"]
    return [subjects.control_action(service, target, kind) for target in targets for kind in kinds
            if not (target == "all" and kind == "admit")]  # admissions are per generator boot


async def decide(bus: Any, service: str, instance: str, decision: Any, *, reason: str,
                 now: float | None = None, issuer: str = ISSUER, also_after: Sequence[str] = ()) -> Control:
    """Publish one operator decision on its subject, with a seq after every competing one (and after
    the last decision of each ``also_after`` instance's competing subjects)."""
    from rlbus.schemas import Control, DecisionClock, SchemaError
    from rlbus.schemas.control import action_of

    clock = DecisionClock()
    subjects = [s for i in (instance, *also_after) for s in competing(bus.subjects, service, i, action_of(decision))]
    for subject in dict.fromkeys(subjects):
        raw = await bus.last(subject)
        if raw is None:
            continue
        try:
            clock.observe(Control.decode(raw).seq)
        except SchemaError:
            continue  # its receivers dead-letter it and never apply it: nothing to sort after
    at = time.time() if now is None else now
    ctl = Control(seq=clock.next(at), decision=decision, target_service=service, target_instance=instance,
                  reason=reason, issued_at=at, issuer=issuer)
    await bus.publish(bus.subjects.control_action(service, instance, ctl.action), ctl.encode(), msg_id=ctl.msg_id)
    return ctl


async def send_mix(bus: Any, mix: dict[str, float], *, reason: str = "operator request", instance: str = "all",
                   now: float | None = None) -> Control:
    """Publish a ``SetMix`` request for the controller (``instance`` or every controller)."""
    from rlbus.schemas import SetMix

    return await decide(bus, "controller", instance, SetMix(mix=dict(mix)), reason=reason, now=now)


async def send_state(bus: Any, state: Literal["pause", "resume", "drain"], instance: str, *,
                     reason: str = "operator request", now: float | None = None) -> Control:
    """Publish a ``RunState`` (pause, resume or drain) to one generator (or ``all``)."""
    from rlbus.schemas import RunState

    return await decide(bus, "generator", instance, RunState(state=state), reason=reason, now=now)


async def new_run(bus: Any, instances: Sequence[str], *, issuer: str = "rlbus-up") -> Control:
    """A run starts: resume every generator, with a seq after every run state stored for ``instances``.

    CONTROL keeps the last decision per subject, and a generator that joins applies the last pause,
    resume and drain it finds there.  When a run name is reused (``rlbus up`` on a run folder that
    already holds a NATS store), those are the previous run's: a pause at its end, or an operator's,
    would hold the new run's generators before anything else happened.  One resume to all, sorted
    after them, says the new run starts running; decisions taken from now on sort after it."""
    from rlbus.schemas import RunState

    return await decide(bus, "generator", "all", RunState(state="resume"), issuer=issuer, also_after=instances,
                        reason="a new run starts: run states decided before it (pause, drain) do not carry over")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="record an operator decision on the CONTROL stream")
    ap.add_argument("--run", default="demo")
    ap.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    ap.add_argument("--reason", default="operator request")
    sub = ap.add_subparsers(dest="cmd", required=True)
    mix = sub.add_parser("set-mix", help="new target mix between pools, e.g. a=0.2 b=0.8")
    mix.add_argument("shares", nargs="+")
    mix.add_argument("--controller", default="all", help="controller instance (default: every one)")
    for action in STATES:
        sub.add_parser(action, help=f"{action} a generator").add_argument("instance", help="generator instance or 'all'")
    args = ap.parse_args(argv)

    async def go() -> Control:
        from rlbus.bus.jetstream import JetStreamBus

        bus = await JetStreamBus.connect(args.nats_url, args.run, name="rlbus-control")
        try:
            if args.cmd == "set-mix":
                return await send_mix(bus, parse_mix(args.shares), reason=args.reason, instance=args.controller)
            return await send_state(bus, args.cmd, args.instance, reason=args.reason)
        finally:
            await bus.close()

    ctl = asyncio.run(go())
    print(f"{ctl.action} -> {ctl.target_service}/{ctl.target_instance} (seq {ctl.seq})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
