"""Names of the heartbeat metrics that one service emits and another reads.

A ``Heartbeat`` carries path-like metric names (``trainer/groups_trained_total``).  Most are for
people (``rlbus status``, metrics.jsonl); the ones below are also read by another service (the
controller's admission and routing, weight-broadcast's retention, ``rlbus up``'s monitor), so
both sides spell them from here and a test checks that every name a reader uses is emitted.
"""

from __future__ import annotations

# Per-group outcomes the trainer judges (services/trainer/batch.py); ``duplicate`` is not an
# outcome of its own (the original's outcome counts).
OUTCOMES = ("train", "filtered", "invalid", "stale")
# The part of ``stale`` that had passed the filter and went stale while held for a batch.
STALE_HELD = "stale_held"


class GeneratorKeys:
    """Emitted by the generator; read by the controller (state.py) and ``rlbus status``."""

    GROUPS_STARTED = "generator/groups_started"
    GROUPS_PUBLISHED = "generator/groups_published"
    GRANT_TOTAL = "generator/grant_total"  # cumulative grant of this boot (1 << 40 with admission off)
    GROUPS_PER_S = "generator/groups_per_s"
    CONCURRENCY = "generator/concurrency"  # groups per batch now
    # Heartbeat ``info`` keys (not metrics): what the controller routes by.
    INFO_BOOT = "boot"
    INFO_POOLS = "pools"
    INFO_SHARES = "shares"
    INFO_MAX_BATCH_GROUPS = "max_batch_groups"

    @staticmethod
    def pool_published(pool: str) -> str:
        return f"generator/pool/{pool}/published"

    @staticmethod
    def parse_pool_published(key: str) -> str | None:
        """The pool of a ``pool_published`` key, None for any other key."""
        parts = key.split("/")
        if len(parts) == 4 and parts[:2] == ["generator", "pool"] and parts[3] == "published":
            return parts[2]
        return None


class SpeculativeKeys:
    """Emitted by the torch generator backend with [generator.speculative] drafter on: what the last
    sampler call's tail did (services/policy/spec_tail.py TailStats); read by ``rlbus status`` and
    metrics.jsonl. Zeros when the call had no tail (its rows finished together)."""

    ACCEPTANCE_RATE = "generator/spec/acceptance_rate"  # drafted tokens kept / drafted
    MEAN_ACCEPTED_LEN = "generator/spec/mean_accepted_len"  # kept per row-round that drafted
    TOKENS_PER_FORWARD = "generator/spec/tokens_per_forward"  # tail tokens per row per target forward
    DRAFT_S = "generator/spec/draft_s"  # seconds proposing drafts
    VERIFY_S = "generator/spec/verify_s"  # seconds in verify forwards and the acceptance rule
    TAIL_TOKENS = "generator/spec/tail_tokens"  # tokens emitted by the tail
    K = "generator/spec/k"  # draft length of the last round
    # By the drafter that proposed the tokens (drafter "model+group" / "static+group" has both;
    # the others report zeros for the half they do not have).
    GROUP_ACCEPTANCE_RATE = "generator/spec/group_acceptance_rate"
    GROUP_KEPT = "generator/spec/group_kept"  # drafted tokens kept, proposed by the group drafter
    MODEL_ACCEPTANCE_RATE = "generator/spec/model_acceptance_rate"
    MODEL_KEPT = "generator/spec/model_kept"  # drafted tokens kept, proposed by the draft model

    @staticmethod
    def key(name: str) -> str:
        """The key of a ``TailStats.metrics()`` entry."""
        return f"generator/spec/{name}"


class DraftKeys:
    """Emitted by a generator with [generator.speculative] drafter = "model" only (so not in
    ``GeneratorKeys``, which every generator emits): the draft version in its drafting rounds,
    read by weight-broadcast's retention, and how far that draft lags the policy it drafts for."""

    VERSION = "generator/draft_version"
    # The generator's policy version minus the policy version the draft in use was distilled on.
    VERSION_LAG = "generator/draft_version_lag"


class SpeculatorKeys:
    """Emitted by the speculator (services/speculator): the online distillation of the draft model."""

    STEPS = "speculator/steps"  # distillation steps of this process
    LOSS = "speculator/distill_loss"  # mean loss per trained token of the latest step (nats)
    SAMPLES = "speculator/samples"  # rollouts taken into the buffer
    SAMPLES_DROPPED = "speculator/samples_dropped"  # buffered rollouts pushed out by newer ones, never trained
    GROUPS = "speculator/groups"  # scored groups taken in
    GROUPS_SKIPPED = "speculator/groups_skipped"  # valid groups not trained on (another temperature, no token)
    GROUPS_DEAD = "speculator/groups_dead"  # groups dead-lettered (cannot be trained on)
    PUBLISHED_VERSION = "speculator/published_version"  # newest draft version handed to weight-broadcast
    POLICY_VERSION = "speculator/policy_version"  # newest policy version seen in a scored group
    # The newest policy version seen minus the one the newest published draft was distilled on.
    POLICY_VERSION_LAG = "speculator/policy_version_lag"


class TrainerKeys:
    """Emitted by the trainer; read by the controller (state.py, divergence.py), ``rlbus up`` and
    ``rlbus status``."""

    VERSION = "trainer/version"
    STEP = "trainer/step"
    GROUPS_TRAINED_TOTAL = "trainer/groups_trained_total"
    GROUPS_DROPPED_TOTAL = "trainer/groups_dropped_total"
    PENDING_GROUPS = "trainer/pending_groups"  # kept, waiting for the next batch (now)
    IDLE_FRACTION = "trainer/idle_fraction"  # of wall time since start
    IDLE_S = "trainer/idle_s"  # cumulative seconds waiting for a batch (this process)
    # Mean reward of the batch that made the heartbeat's version (step.py); the controller's
    # divergence alarm reads it as the training reward.
    REWARD_MEAN = "batch/reward_mean"

    @staticmethod
    def groups(outcome: str) -> str:
        """Groups of one outcome (``OUTCOMES`` or ``STALE_HELD``) judged by this process."""
        return f"trainer/groups_{outcome}"

    @staticmethod
    def pool_groups(pool: str, outcome: str) -> str:
        return f"trainer/pool/{pool}/groups_{outcome}"

    @staticmethod
    def generator_groups(instance: str, outcome: str) -> str:
        return f"trainer/generator/{instance}/groups_{outcome}"

    @staticmethod
    def parse_breakdown(key: str) -> tuple[str, str, str] | None:
        """``("pool" | "generator", name, outcome)`` of a breakdown key, None for any other key."""
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "trainer" and parts[1] in ("pool", "generator") \
                and parts[3].startswith("groups_"):
            return parts[1], parts[2], parts[3].removeprefix("groups_")
        return None
