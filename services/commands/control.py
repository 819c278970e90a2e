"""Operator decisions on the CONTROL stream, recorded like the controller's own.

``set-mix a=0.2 b=0.8`` asks the controller for a new target mix between pools (it re-routes the
generators at its next step and judges the trained mix from then on; the last request is re-read
when the controller restarts).  ``pause|resume|drain <instance|all>`` go straight to generators.

    python -m services.commands.control set-mix --run demo --nats-url nats://127.0.0.1:4222 a=0.2 b=0.8
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any


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
    if not mix or any(x < 0 for x in mix.values()) or sum(mix.values()) <= 0:
        raise SystemExit(f"mix {mix} needs non-negative shares, at least one positive")
    return mix


def mix_request(mix: dict[str, float], *, reason: str = "operator request", instance: str = "all") -> Any:
    from schemas import Control

    return Control(seq=int(time.time() * 1e6), action="set_mix", target_service="controller", target_instance=instance,
                   params={"mix": dict(mix)}, reason=reason, issued_at=time.time())


async def send_mix(bus: Any, mix: dict[str, float], *, reason: str = "operator request", instance: str = "all") -> None:
    """Publish a 'set_mix' request for the controller (``instance`` or every controller)."""
    ctl = mix_request(mix, reason=reason, instance=instance)
    await bus.publish(bus.subjects.control_action("controller", instance, "set_mix"), ctl.encode(),
                      msg_id=f"ctl.op.{ctl.seq}")


async def send_state(bus: Any, action: str, instance: str, *, reason: str = "operator request") -> None:
    """Publish 'pause', 'resume' or 'drain' to one generator (or ``all``)."""
    from schemas import Control

    ctl = Control(seq=int(time.time() * 1e6), action=action, target_service="generator",  # type: ignore[arg-type]
                  target_instance=instance, reason=reason, issued_at=time.time())
    await bus.publish(bus.subjects.control_action("generator", instance, action), ctl.encode(),
                      msg_id=f"ctl.op.{ctl.seq}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="record an operator decision on the CONTROL stream")
    ap.add_argument("--run", default="demo")
    ap.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    ap.add_argument("--reason", default="operator request")
    sub = ap.add_subparsers(dest="cmd", required=True)
    mix = sub.add_parser("set-mix", help="new target mix between pools, e.g. a=0.2 b=0.8")
    mix.add_argument("shares", nargs="+")
    mix.add_argument("--controller", default="all", help="controller instance (default: every one)")
    for action in ("pause", "resume", "drain"):
        sub.add_parser(action, help=f"{action} a generator").add_argument("instance", help="generator instance or 'all'")
    args = ap.parse_args(argv)

    async def go() -> None:
        from bus.jetstream import JetStreamBus

        bus = await JetStreamBus.connect(args.nats_url, args.run, name="rlbus-control")
        try:
            if args.cmd == "set-mix":
                await send_mix(bus, parse_mix(args.shares), reason=args.reason, instance=args.controller)
            else:
                await send_state(bus, args.cmd, args.instance, reason=args.reason)
        finally:
            await bus.close()

    asyncio.run(go())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
