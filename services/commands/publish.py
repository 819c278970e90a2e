"""``rlbus publish``: validate every line first, then publish with msg ids (idempotent)."""

from __future__ import annotations

import asyncio
import sys

from rlbus.services.runtime.taskfile import read_task_file


def publish(path: str, *, pool: str, run: str, nats_url: str, group_size: int | None, skip_invalid: bool) -> int:
    from rich.progress import Progress

    from rlbus.services.environment.envs import check_task

    try:
        tasks, errors = read_task_file(path, run=run, pool=pool, group_size=group_size, check=check_task)
    except FileNotFoundError as exc:
        print(f"rlbus publish: {exc}", file=sys.stderr)
        return 2
    for e in errors:
        print(f"{path}:{e}", file=sys.stderr)
    if errors and not skip_invalid:
        print(f"rlbus publish: {len(errors)} invalid line(s); nothing was published. Fix them or pass --skip-invalid.",
              file=sys.stderr)
        return 1

    async def go() -> None:
        from rlbus.bus.jetstream import JetStreamBus
        from rlbus.bus.subjects import Subjects
        from rlbus.observability.tracing import configure_tracing, shutdown_tracing, task_traces

        configure_tracing("publish", run=run)  # each task's trace starts here (exported if OTEL_* say so)
        subjects = Subjects(run)
        bus = await JetStreamBus.connect(nats_url, run, name="rlbus-publish")
        try:
            with Progress(transient=not sys.stderr.isatty()) as progress:
                bar = progress.add_task(f"publishing to {subjects.tasks(pool)}", total=len(tasks))
                for start in range(0, len(tasks), 512):
                    chunk = tasks[start:start + 512]
                    with task_traces(chunk) as traces:
                        await bus.publish_many([(subjects.tasks(pool), t.encode(), t.msg_id) for t in chunk],
                                               item_headers=traces)
                    progress.advance(bar, len(chunk))
        finally:
            await bus.close()
            shutdown_tracing()

    asyncio.run(go())
    print(f"published {len(tasks)} task(s) to pool {pool!r} of run {run!r}"
          + (f"; skipped {len(errors)} invalid line(s)" if errors else ""))
    return 0
