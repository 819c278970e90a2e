"""``rlbus serve <unit>``: parse config cheaply, set the thread budget, then import and run.

``<unit>`` is a service name (``generator``: its instance comes from the config, ``gen-0`` by
default) or a service name with a suffix (``generator-1``: the generator whose instance is
``generator-1``).  The second form is what a systemd template passes (``rlbus@generator-1`` runs
``rlbus serve %i``), so one unit file serves every replica and the unit name is the instance name
seen on the bus.

Thread variables must be set before torch is imported (its pools size themselves at import),
which is why heavy imports happen only after config parsing.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys

from rlbus.bus.subjects import SubjectError, Subjects
from rlbus.services.catalog import SERVICES, ServiceEntry
from rlbus.services.runtime.config import ConfigError, RunSettings, Settings, load


def _settings_class(path: str) -> type[Settings]:
    mod, cls = path.split(":")
    return getattr(importlib.import_module(mod), cls)  # type: ignore[no-any-return]


def parse_unit(unit: str) -> tuple[ServiceEntry, str | None]:
    """``generator`` -> (the generator, None: the config's instance); ``generator-1`` -> (the
    generator, ``"generator-1"``).  The role is the longest catalog name followed by ``-`` and a
    non-empty suffix; the instance is the whole unit name, so it stays unique across roles."""
    if unit in SERVICES:
        return SERVICES[unit], None
    roles = sorted((n for n in SERVICES if unit.startswith(f"{n}-") and len(unit) > len(n) + 1), key=len)
    if not roles:
        raise ConfigError(f"unknown service {unit!r}: name one of {', '.join(SERVICES)}, or one of them with a "
                          "suffix for a named instance (generator-1 runs the generator with instance generator-1)")
    return SERVICES[roles[-1]], unit


def _with_instance(cfg: Settings, entry: ServiceEntry, instance: str) -> Settings:
    """``cfg`` with the unit name's instance.  A config that names another instance is an error,
    not silently overridden: two sources disagreeing about a replica's identity is a mistake."""
    if "instance" not in type(cfg).model_fields:
        raise ConfigError(f"service {entry.name!r} has no instance setting; run it as `rlbus serve {entry.name}`")
    try:
        Subjects("run").metrics(entry.name, instance)  # the instance is a token of its metrics subject
    except SubjectError as exc:
        raise ConfigError(f"instance from the unit name: {exc}") from None
    configured = getattr(cfg, "instance", None)
    if "instance" in cfg.model_fields_set and configured != instance:
        raise ConfigError(
            f"[{entry.name}] instance = {configured!r} (config file or RLBUS_{entry.name.upper()}__INSTANCE) "
            f"disagrees with the unit name's instance {instance!r}: drop that key, or serve plain "
            f"`{entry.name}` to take the instance from the config")
    return cfg.model_copy(update={"instance": instance})


def resolve(unit: str, config: str | None) -> tuple[ServiceEntry, RunSettings, Settings]:
    entry, instance = parse_unit(unit)
    run_cfg, cfg = load(config, _settings_class(entry.settings), entry.name)
    if instance is not None:
        cfg = _with_instance(cfg, entry, instance)
    return entry, run_cfg, cfg


def set_thread_budget(threads: int) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)


async def _main(entry: ServiceEntry, run_cfg: RunSettings, cfg: Settings, nats_url: str | None) -> None:
    from rlbus.bus.jetstream import JetStreamBus
    from rlbus.observability.logging import configure_logging
    from rlbus.observability.metrics import serve_metrics, stop_metrics
    from rlbus.observability.tracing import configure_tracing, shutdown_tracing
    from rlbus.services.runtime.lifecycle import Lifecycle

    instance = getattr(cfg, "instance", "0")
    log = configure_logging(service=entry.name, run=run_cfg.run, instance=instance)
    configure_tracing(entry.name, instance=instance, run=run_cfg.run)
    log.info("config", run=run_cfg.redacted(), service=cfg.redacted())
    if entry.torch:
        import torch

        torch.set_num_threads(int(getattr(cfg, "threads", 1)))
    module = importlib.import_module(entry.module)
    life = Lifecycle()
    life.install_signal_handlers()
    if run_cfg.metrics_port:
        # Before the bus: a port another replica holds fails the start at once, not after connecting.
        serve_metrics(run_cfg.metrics_port, run=run_cfg.run)
        log.info("metrics_endpoint", url=f"http://0.0.0.0:{run_cfg.metrics_port}/metrics")
    # A server that is down when the service starts is waited for like an outage mid-run
    # ([run] publish_outage_s), so services and servers can start in any order.
    try:
        bus = await JetStreamBus.connect(nats_url or run_cfg.nats_url, run_cfg.run, name=f"{entry.name}-{instance}",
                                         connect_timeout=run_cfg.publish_outage_s, **run_cfg.bus_options())
        try:
            await module.run(run_cfg, cfg, bus=bus, life=life)
        except Exception:
            # Logged before the bus closes: a close that fails too (the server gone) would
            # otherwise be the error the exit status and the journal show.
            log.exception("service_failed")
            raise
        finally:
            await bus.close()
            shutdown_tracing()
            log.info("stopped")
    finally:
        stop_metrics()


def serve(unit: str, config: str | None, nats_url: str | None = None) -> int:
    """Run one service until stopped; ``unit`` is ``<service>`` or ``<service>-<suffix>`` (see the
    module docstring).  Exit status 2: the unit name or the config is wrong (no restart helps)."""
    try:
        entry, run_cfg, cfg = resolve(unit, config)
    except ConfigError as exc:
        print(f"rlbus serve {unit}: {exc}", file=sys.stderr)
        return 2
    if entry.torch:
        set_thread_budget(int(getattr(cfg, "threads", 1)))
    from rlbus.observability.metrics import MetricsError

    try:
        asyncio.run(_main(entry, run_cfg, cfg, nats_url))
    except MetricsError as exc:
        print(f"rlbus serve {unit}: {exc}", file=sys.stderr)
        return 2
    # A rank of a torchrun job ends here without interpreter finalisation (leave_job says why);
    # looked up, not imported, so the other services never load torch.distributed.
    if (distributed := sys.modules.get("rlbus.services.trainer.distributed")) is not None:
        distributed.leave_job(0)
    return 0
