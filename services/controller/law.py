"""The control law: pure functions from observed state to decisions.  No I/O.

The same code runs in the controller service and in ``bench/controller_sim.py``.

Admission (bounded staleness).  In groups: a new group may start only while
``accepted + running < (V + max_staleness + 1) * B`` where V is the trainer's version (batches
consumed) and B the groups per batch.  ``accepted + running = started - dropped`` (dropped =
zero-variance, stale or invalid groups, which free their slot), so the cumulative number of
groups all generators may have started is ``(V + s + 1) * B + dropped``.  Grants are cumulative
per generator boot, so a lost or repeated control message is harmless, and a silent generator's
unstarted grant is reclaimed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GeneratorView:
    instance: str
    boot: str
    started: int = 0  # groups started by this boot (cumulative)
    published: int = 0
    granted: int = 0  # cumulative groups this boot may start
    last_seen: float = 0.0
    rate: float = 0.0  # groups/s, smoothed
    alive: bool = True

    @property
    def outstanding(self) -> int:
        return max(self.granted - self.started, 0)


@dataclass
class TrainerView:
    version: int = 0
    dropped_groups: int = 0  # zero-variance + stale + invalid, cumulative
    trained_groups: int = 0
    last_seen: float = 0.0
    done: bool = False  # reached its max_steps: the final version gets evaluated too


@dataclass
class AdmissionPlan:
    allowed_total: int
    started_total: int
    grants: dict[tuple[str, str], int] = field(default_factory=dict)  # (instance, boot) -> cumulative grant
    reason: str = ""


def allowed_started(trainer: TrainerView, *, batch_groups: int, max_staleness: int) -> int:
    return (trainer.version + max_staleness + 1) * batch_groups + trainer.dropped_groups


def plan_admission(
    generators: list[GeneratorView], trainer: TrainerView, *, batch_groups: int, max_staleness: int,
    now: float, silent_after: float, max_outstanding: int,
) -> AdmissionPlan:
    """Hand out the admission budget; mutates ``generators`` (alive flags, grants)."""
    allowed = allowed_started(trainer, batch_groups=batch_groups, max_staleness=max_staleness)
    for g in generators:
        g.alive = now - g.last_seen <= silent_after
        if not g.alive:
            # A lost generator's unpublished groups come back as redelivered tasks and are started
            # again elsewhere; only what it published still occupies the window.  (If it was merely
            # partitioned, its late duplicates are deduped by msg id and by the trainer.)
            g.granted = g.started = g.published
    committed = sum(max(g.granted, g.started) for g in generators)
    available = max(allowed - committed, 0)
    live = [g for g in generators if g.alive]
    # Water-filling: the least-loaded live generator gets the next group, so capacity follows
    # whoever is actually draining its grant.
    while available > 0 and live:
        g = min(live, key=lambda x: (x.outstanding, x.instance))
        if g.outstanding >= max_outstanding:
            break
        g.granted = max(g.granted, g.started) + 1
        available -= 1
    started_total = sum(g.started for g in generators)
    reason = (f"allowed=(V={trainer.version}+s={max_staleness}+1)*B={batch_groups}+dropped={trainer.dropped_groups}"
              f"={allowed}; started={started_total}; live={len(live)}")
    return AdmissionPlan(allowed_total=allowed, started_total=started_total,
                         grants={(g.instance, g.boot): g.granted for g in generators}, reason=reason)


def eval_due(version: int, last_evaluated: int, every: int) -> bool:
    """Evaluate at version 0, then whenever ``every`` versions have passed (a skipped multiple still counts)."""
    if every <= 0 or version < 0:
        return False
    return version >= (last_evaluated + every if last_evaluated >= 0 else 0)
