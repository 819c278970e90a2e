"""``rlbus status``: every service instance of a run, the queues between them, the last decision
about each, and the controller's balance of trainer consumption C against effective production E.

Built from what is on the bus, so it works from any machine: the last heartbeat of every instance
(METRICS), the last control decision of each kind (CONTROL) and the consumer state of every stream.
A stall the controller reports (its last ``stall`` record on CONTROL, unless progress resumed since)
is shown first among the notes, with its cause and what the controller saw; so is a firing
divergence alarm (its last ``divergence`` record: training reward up while held-out accuracy falls).
``build_snapshot`` and ``render`` are pure (tested without a server); ``--json`` prints the snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from rlbus.schemas.metric_keys import GeneratorKeys as G
from rlbus.schemas.metric_keys import TrainerKeys as T

GEN, TRAINER, CONTROLLER = "generator", "trainer", "controller"
WORK_STREAMS = ("_TASKS", "_ROLLOUTS", "_SCORED")  # where the durable consumers (and queue depths) are


def _num(x: Any, nd: int = 3) -> Any:
    if isinstance(x, float):
        return round(x, nd) if math.isfinite(x) else None
    return x


def decision_fields(decision: Any) -> dict[str, Any]:
    """The fields of a typed decision as plain data (``Admit`` -> boot, grant_total, min_version)."""
    return {f.name: getattr(decision, f.name) for f in dataclasses.fields(decision)}


def describe(decision: Any) -> str:
    """One line for a table cell: ``grant_total=40 min_version=2 boot=b1``."""
    parts = []
    for k, v in decision_fields(decision).items():
        if k == "state" or v in ("", {}, []):  # the state is the action itself; empty fields say nothing
            continue
        if isinstance(v, dict):
            v = ",".join(f"{p}:{_fmt(x)}" for p, x in v.items())
        elif isinstance(v, list):
            v = ",".join(map(str, v))
        elif isinstance(v, str) and len(v) > 60:  # a stall's detail: the full text is under "stalls"
            v = v[:57] + "..."
        parts.append(f"{k}={v}")
    return " ".join(parts)


def _last_decisions(decisions: Iterable[Any], now: float) -> dict[str, dict[str, Any]]:
    """The newest decision per target ``service/instance`` (and per service for ``all``)."""
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    for c in decisions:
        key = f"{c.target_service}/{c.target_instance}"
        if key not in out or c.seq > out[key][0]:
            out[key] = (c.seq, {"action": c.action, "decision": decision_fields(c.decision), "issuer": c.issuer,
                                "seq": c.seq, "reason": c.reason,
                                "age_s": round(now - c.issued_at, 1) if c.issued_at else None,
                                "summary": describe(c.decision)})
    return {k: v for k, (_, v) in sorted(out.items())}


def _pools(metrics: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """Per-pool balance from the controller's heartbeat (``controller/pool/<p>/<what>``, target mix)."""
    pools: dict[str, dict[str, Any]] = {}
    for k, v in metrics.items():
        parts = k.split("/")
        if len(parts) == 4 and parts[:2] == ["controller", "pool"]:
            pools.setdefault(parts[2], {})[parts[3]] = _num(v)
        elif len(parts) == 3 and parts[1] in ("target", "trained_since_target"):
            pools.setdefault(parts[2], {})[parts[1]] = _num(v)
    for p in pools.values():
        c, e = p.get("consumption"), p.get("effective")
        p["e_over_c"] = round(e / c, 3) if c and e is not None else None
    return dict(sorted(pools.items()))


def build_snapshot(run: str, heartbeats: Iterable[Any], streams: Iterable[Any], decisions: Iterable[Any],
                   now: float) -> dict[str, Any]:
    """Everything ``rlbus status`` shows, as plain data (the ``--json`` output)."""
    hbs = {f"{hb.service}/{hb.instance}": hb for hb in heartbeats}
    last = _last_decisions(decisions, now)
    trainer = next((hb for k, hb in sorted(hbs.items()) if hb.service == TRAINER and hb.state != "stopped"), None)
    controller = next((hb for k, hb in sorted(hbs.items()) if hb.service == CONTROLLER), None)
    trainer_version = trainer.version if trainer is not None else None
    ctl = controller.metrics if controller is not None else {}
    instances = {}
    for key, hb in sorted(hbs.items()):
        m = hb.metrics
        row: dict[str, Any] = {"service": hb.service, "instance": hb.instance, "state": hb.state, "version": hb.version,
                               "age_s": round(now - hb.ts, 1), "rate": None, "lag": None, "in_flight": None}
        if hb.service == GEN:
            row |= {"rate": _num(m.get(G.GROUPS_PER_S)), "in_flight": _num(m.get("generator/in_flight")),
                    "concurrency": _num(m.get(G.CONCURRENCY)), "pools": hb.info.get(G.INFO_POOLS, []),
                    "shares": hb.info.get(G.INFO_SHARES, {}), "started": _num(m.get(G.GROUPS_STARTED)),
                    "granted": _num(m.get(G.GRANT_TOTAL)),
                    "effective_rate": _num(ctl.get(f"controller/generator/{hb.instance}/effective_rate")),
                    "latency_s": _num(ctl.get(f"controller/generator/{hb.instance}/latency_s"))}
        elif hb.service == TRAINER:
            row |= {"rate": _num(ctl.get("controller/balance/consumption")),
                    "in_flight": _num(m.get(T.PENDING_GROUPS)), "idle_fraction": _num(m.get(T.IDLE_FRACTION)),
                    "step": _num(m.get(T.STEP)), "trained": _num(m.get(T.GROUPS_TRAINED_TOTAL)),
                    "dropped": _num(m.get(T.GROUPS_DROPPED_TOTAL)), "stale": _num(m.get(T.groups("stale")))}
        elif hb.service == "reward":
            row |= {"rate": _num(m.get("reward/groups_per_s")), "in_flight": _num(m.get("reward/in_flight"))}
        if trainer_version is not None and hb.version >= 0 and hb.service in (GEN, "broadcast"):
            row["lag"] = trainer_version - hb.version
        row["last_decision"] = last.get(key)
        instances[key] = row
    queues = {}
    for s in streams:
        queues[s.name] = {"messages": s.messages, "consumers": {
            c.name: {"pending": c.pending, "ack_pending": c.ack_pending, "redelivered": c.redelivered} for c in s.consumers}}
    balance = {k.rsplit("/", 1)[1]: _num(v) for k, v in ctl.items() if k.startswith("controller/balance/")}
    c, e = balance.get("consumption"), balance.get("effective")
    balance["e_over_c"] = round(e / c, 3) if c and e is not None else None
    if trainer is not None:
        balance["trainer_idle_fraction_total"] = _num(trainer.metrics.get(T.IDLE_FRACTION))
        balance["trainer_version"] = trainer.version
    balance["generator_groups_per_s"] = _num(sum(hb.metrics.get(G.GROUPS_PER_S, 0.0) for hb in hbs.values()
                                                 if hb.service == GEN and hb.state != "stopped"))
    admission = {k.split("/", 1)[1]: _num(v) for k, v in ctl.items()
                 if k in ("controller/allowed_total", "controller/trained_bound", "controller/oversample",
                          "controller/started_total", "controller/live_generators")}
    if ctl:
        admission["mix_measured_on"] = "trainer" if ctl.get("controller/mix_from_trainer", 0.0) else "generators"
    return {"run": run, "at": now, "instances": instances, "queues": queues, "balance": balance,
            "pools": _pools(ctl), "admission": admission,
            "decisions": {k: v for k, v in last.items() if k.endswith("/all")}, "stalls": _stalls(decisions, now),
            "divergences": _divergences(decisions)}


def _stalls(decisions: Iterable[Any], now: float) -> dict[str, dict[str, Any]]:
    """Per controller instance, the stall it reports now (its last ``stall`` record, unless that says
    progress resumed): cause, how long, since when, and what it saw."""
    last: dict[str, Any] = {}
    for c in decisions:
        if c.action == "stall" and (c.target_instance not in last or c.seq > last[c.target_instance].seq):
            last[c.target_instance] = c
    return {i: {"cause": c.decision.cause, "stalled_s": _num(c.decision.stalled_s), "since": c.decision.since,
                "for_s": round(now - c.decision.since, 1) if c.decision.since else None,
                "detail": c.decision.detail, "inputs": c.inputs}
            for i, c in sorted(last.items()) if c.decision.cause}


def _divergences(decisions: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Per controller instance, the divergence alarm it reports now (its last ``divergence`` record,
    unless that one cleared it): both trends, the versions they span, and what to check."""
    last: dict[str, Any] = {}
    for c in decisions:
        if c.action == "divergence" and (c.target_instance not in last or c.seq > last[c.target_instance].seq):
            last[c.target_instance] = c
    return {i: {"reward_trend": _num(c.decision.reward_trend, 4), "heldout_trend": _num(c.decision.heldout_trend, 4),
                "versions": [c.decision.from_version, c.decision.to_version],
                "heldout_readings": c.decision.heldout_readings, "detail": c.decision.detail, "inputs": c.inputs}
            for i, c in sorted(last.items()) if c.decision.firing}


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def render(snap: dict[str, Any]) -> list[Any]:
    """The snapshot as rich renderables: instances, pools (C vs E), queues, admission."""
    from rich.table import Table

    inst = Table(title=f"run {snap['run']!r}: instances")
    for col in ("instance", "state", "version", "lag", "rate/s", "in flight", "detail", "last decision"):
        inst.add_column(col)
    for key, r in snap["instances"].items():
        if r["service"] == GEN:
            detail = (f"pools {','.join(r.get('pools') or [])} x{_fmt(r.get('concurrency'))} "
                      f"lat {_fmt(r.get('latency_s'))}s eff {_fmt(r.get('effective_rate'))}/s")
        elif r["service"] == TRAINER:
            detail = (f"step {_fmt(r.get('step'))} idle {_fmt(r.get('idle_fraction'))} trained {_fmt(r.get('trained'))} "
                      f"dropped {_fmt(r.get('dropped'))} (stale {_fmt(r.get('stale'))})")
        else:
            detail = ""
        d = r.get("last_decision")
        decision = _decision_line(d) if d else "-"
        inst.add_row(key, r["state"], _fmt(r["version"]), _fmt(r["lag"]), _fmt(r["rate"]), _fmt(r["in_flight"]),
                     detail, decision)
    out: list[Any] = [inst]
    b = snap["balance"]
    pools = Table(title=(f"balance: C {_fmt(b.get('consumption'))}/s vs E {_fmt(b.get('effective'))}/s "
                         f"(E/C {_fmt(b.get('e_over_c'))}, P {_fmt(b.get('production'))}/s, kept "
                         f"{_fmt(b.get('kept_fraction'))}, usable {_fmt(b.get('usable_fraction'))}, trainer idle "
                         f"{_fmt(b.get('trainer_idle'))})"))
    for col in ("pool", "C/s", "E/s", "E/C", "P/s", "kept", "target", "trained since target"):
        pools.add_column(col)
    for p, x in snap["pools"].items():
        pools.add_row(p, _fmt(x.get("consumption")), _fmt(x.get("effective")), _fmt(x.get("e_over_c")),
                      _fmt(x.get("production")), _fmt(x.get("kept_fraction")), _fmt(x.get("target")),
                      _fmt(x.get("trained_since_target")))
    out.append(pools)
    queues = Table(title="queues")
    for col in ("stream", "messages", "consumer", "pending", "ack pending", "redelivered"):
        queues.add_column(col)
    for name, q in snap["queues"].items():
        consumers = q["consumers"]
        if not name.endswith(WORK_STREAMS) and consumers:  # watchers only (ephemeral ordered consumers)
            consumers = {f"{len(consumers)} watchers": {"pending": None, "ack_pending": None, "redelivered": None}}
        consumers = consumers or {"-": {"pending": None, "ack_pending": None, "redelivered": None}}
        for i, (c, st) in enumerate(consumers.items()):
            queues.add_row(name if i == 0 else "", _fmt(q["messages"]) if i == 0 else "", c, _fmt(st["pending"]),
                           _fmt(st["ack_pending"]), _fmt(st["redelivered"]))
    out.append(queues)
    notes = [f"STALLED ({controller}): {st['cause']} for {_fmt(st['for_s'])}s: {st['detail']}"
             for controller, st in snap.get("stalls", {}).items()]
    # The record's detail names both trends, their versions and what to check.
    notes += [f"DIVERGING ({controller}): {d['detail']}" for controller, d in snap.get("divergences", {}).items()]
    if snap["admission"]:
        notes.append("admission: " + ", ".join(f"{k}={_fmt(v)}" for k, v in snap["admission"].items()))
    # Decisions addressed to every instance of a service (a mix request, a held-out round).
    notes += [f"last decision to {target}: {_decision_line(d)}" for target, d in snap["decisions"].items()]
    if notes:
        out.append("\n".join(notes))
    return out


def _decision_line(d: dict[str, Any]) -> str:
    """``admit grant_total=40 min_version=2 boot=x (controller-0, 2s ago): allowed=...``"""
    head = " ".join(x for x in (d["action"], d["summary"]) if x)
    return f"{head} ({d['issuer'] or 'issuer unknown'}, {_fmt(d['age_s'])}s ago): {d['reason'][:70]}"


async def snapshot(bus: Any, run: str, seconds: float) -> dict[str, Any]:
    from rlbus.bus.subjects import Subjects
    from rlbus.schemas import Control, Heartbeat, SchemaError

    subjects = Subjects(run)
    seen: dict[str, Heartbeat] = {}
    decisions: list[Control] = []

    async def listen(subject: str, decode: Any, keep: Any) -> None:
        async for d in bus.watch(subject, deliver="last_per_subject"):
            try:
                keep(decode(d.msg))
            except SchemaError:
                continue

    async def both() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(listen(subjects.all_of("metrics"), Heartbeat.decode,
                                  lambda hb: seen.__setitem__(f"{hb.service}/{hb.instance}", hb)))
            tg.create_task(listen(subjects.all_of("control"), Control.decode, decisions.append))

    try:
        await asyncio.wait_for(both(), timeout=seconds)
    except TimeoutError:
        pass
    return build_snapshot(run, seen.values(), await bus.streams(), decisions, time.time())


def status(run: str, nats_url: str, *, as_json: bool, seconds: float, watch: float = 0.0) -> int:
    """One snapshot (``--json``: as JSON); ``watch`` > 0 redraws the tables every ``watch`` seconds."""
    async def go() -> dict[str, Any]:
        from rlbus.bus.jetstream import JetStreamBus

        bus = await JetStreamBus.connect(nats_url, run, name="rlbus-status")
        try:
            return await snapshot(bus, run, seconds)
        finally:
            await bus.close()

    if as_json:
        print(json.dumps(asyncio.run(go()), indent=2))
        return 0
    from rich.console import Console, Group

    if watch <= 0:
        Console().print(*render(asyncio.run(go())))
        return 0
    from rich.live import Live

    with Live(Group(*render(asyncio.run(go()))), refresh_per_second=1) as live:
        try:
            while True:
                time.sleep(watch)
                live.update(Group(*render(asyncio.run(go()))))
        except KeyboardInterrupt:
            pass
    return 0
