"""``rlbus serve <service>``: parse config cheaply, set the thread budget, then import and run.

Thread variables must be set before torch is imported (its pools size themselves at import),
which is why heavy imports happen only after config parsing.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys

from services.catalog import SERVICES, ServiceEntry
from services.runtime.config import ConfigError, RunSettings, Settings, load


def _settings_class(path: str) -> type[Settings]:
    mod, cls = path.split(":")
    return getattr(importlib.import_module(mod), cls)  # type: ignore[no-any-return]


def resolve(service: str, config: str | None) -> tuple[ServiceEntry, RunSettings, Settings]:
    if service not in SERVICES:
        raise ConfigError(f"unknown service {service!r}; choose one of {', '.join(SERVICES)}")
    entry = SERVICES[service]
    run_cfg, cfg = load(config, _settings_class(entry.settings), entry.name)
    return entry, run_cfg, cfg


def set_thread_budget(threads: int) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)


async def _main(entry: ServiceEntry, run_cfg: RunSettings, cfg: Settings, nats_url: str | None) -> None:
    from bus.jetstream import JetStreamBus
    from observability.logging import configure_logging
    from observability.metrics import serve_metrics, stop_metrics
    from observability.tracing import configure_tracing, shutdown_tracing
    from services.runtime.lifecycle import Lifecycle

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
        finally:
            await bus.close()
            shutdown_tracing()
            log.info("stopped")
    finally:
        stop_metrics()


def serve(service: str, config: str | None, nats_url: str | None = None) -> int:
    try:
        entry, run_cfg, cfg = resolve(service, config)
    except ConfigError as exc:
        print(f"rlbus serve {service}: {exc}", file=sys.stderr)
        return 2
    if entry.torch:
        set_thread_budget(int(getattr(cfg, "threads", 1)))
    from observability.metrics import MetricsError

    try:
        asyncio.run(_main(entry, run_cfg, cfg, nats_url))
    except MetricsError as exc:
        print(f"rlbus serve {service}: {exc}", file=sys.stderr)
        return 2
    return 0
