"""The ``rlbus`` command line.  Thin: parse arguments, then call one command function.

Imports are deferred into each command so ``rlbus status`` does not pay for torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from rlbus.services.catalog import SERVICES


def _add_up(sub: Any) -> None:
    up = sub.add_parser("up", help="run a whole pipeline on an embedded NATS server (the main job)")
    up.add_argument("config", nargs="?", help="run config TOML (optional; defaults learn 3-digit addition)")
    up.add_argument("--backend", choices=["torch", "vllm"], default=None, help="generator backend")
    up.add_argument("--steps", type=int, default=None, help="stop after this many trainer steps")
    up.add_argument("--run-dir", default=None, help="where the run folder goes (default runs/<run>-<time>)")
    up.add_argument("--no-view", action="store_true", help="plain log lines instead of the live view")
    up.add_argument("--task", default=None, metavar="TASK",
                    help="the learning task (overrides [up] task): addition, calculator (multi-turn tool episodes), "
                         "or reasoning-gym:<dataset> (e.g. reasoning-gym:chain_sum; needs --model)")
    up.add_argument("--model", default=None, metavar="NAME",
                    help="a pretrained policy fetched and converted on first use (smollm2-135m-instruct)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlbus", description="Asynchronous RL post-training over NATS JetStream.")
    sub = p.add_subparsers(dest="cmd", required=True)

    _add_up(sub)

    serve = sub.add_parser("serve", help="run one service")
    # Not argparse choices: a named instance (generator-1, what systemd's rlbus@generator-1 passes)
    # is checked by rlbus.services.serve, whose error lists the services.
    serve.add_argument("service", metavar="SERVICE[-SUFFIX]",
                       help=f"which service to run ({', '.join(SERVICES)}); with a suffix, the instance name "
                            "(generator-1 runs a generator with instance generator-1)")
    serve.add_argument("--config", default=None, help="run config TOML")
    serve.add_argument("--nats-url", default=None, help="override [run].nats_url")

    nats = sub.add_parser("nats", help="run the embedded nats-server with JetStream in the foreground")
    nats.add_argument("--store", default="runs/nats", help="JetStream store directory")
    nats.add_argument("--port", type=int, default=4222, help="client port (-1 = random)")

    pub = sub.add_parser("publish", help="validate and publish a JSONL task file")
    pub.add_argument("file")
    pub.add_argument("--pool", required=True)
    pub.add_argument("--run", default="demo")
    pub.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    pub.add_argument("--group-size", type=int, default=None, help="default group size for lines without one")
    pub.add_argument("--skip-invalid", action="store_true", help="publish the valid lines even if some are bad")

    streams = sub.add_parser("streams", help="stream and consumer state of a run")
    streams.add_argument("--run", default="demo")
    streams.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    streams.add_argument("--json", action="store_true")

    status = sub.add_parser("status", help="live table of every service instance of a run")
    status.add_argument("--run", default="demo")
    status.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    status.add_argument("--json", action="store_true", help="one JSON snapshot and exit")
    status.add_argument("--seconds", type=float, default=2.0, help="how long to listen for heartbeats")
    status.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                        help="redraw every SECONDS until Ctrl-C (0 = one snapshot)")

    sub.add_parser("control", add_help=False,
                   help="send a decision to a running controller or generator: set-mix a=0.2 b=0.8 | pause|resume|drain INSTANCE")

    auth = sub.add_parser("auth", help="NATS users of a run: one per role, least privilege")
    auth_init = auth.add_subparsers(dest="auth_cmd", required=True).add_parser(
        "init", help="write auth.conf (bcrypt hashes) and one 0600 password file per role; prints no secret")
    auth_init.add_argument("--out", required=True, help="folder for auth.conf and the per-role secret files")
    auth_init.add_argument("--config", default=None, help="run config TOML (its [run] names the subjects granted)")
    auth_init.add_argument("--run", default=None, help="run name (overrides [run] run)")
    auth_init.add_argument("--force", action="store_true", help="replace an existing auth.conf (new passwords)")

    init = sub.add_parser("init-model", help="build the small warm-started policy, or fetch a pretrained one "
                                             "(--from), as a Hugging Face folder")
    init.add_argument("--from", dest="pretrained", default=None, metavar="NAME",
                      help="fetch and convert a pretrained model instead (smollm2-135m-instruct); default --out "
                           "models/NAME")
    init.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                      help="with --from: the dtype of the saved weights")
    init.add_argument("--task", choices=["addition", "calculator"], default="addition",
                      help="what the warm start teaches: addition answers, or calculator tool episodes")
    init.add_argument("--out", default=None, help="model folder (default models/tiny-<task>)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--target", type=float, default=0.30, help="held-out accuracy at which the warm start stops")
    init.add_argument("--overwrite", action="store_true", help="replace an existing model folder")

    draft = sub.add_parser("init-draft", help="build a draft model (the policy's first layers) for "
                                              "[generator.speculative] drafter = \"model\" or \"static\"")
    draft.add_argument("--policy", required=True, help="the policy's Hugging Face folder")
    draft.add_argument("--out", required=True, help="the draft's folder")
    draft.add_argument("--layers", type=int, default=1, help="decoder layers kept (fewer draft faster, accept less)")
    draft.add_argument("--overwrite", action="store_true", help="replace an existing model folder")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["control"]:  # its own parser (subcommands of its own)
        from rlbus.services.commands.control import main as control_main

        return control_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.cmd == "serve":
        from rlbus.services.serve import serve

        return serve(args.service, args.config, args.nats_url)
    if args.cmd == "up":
        from rlbus.services.up.main import up

        return up(args.config, backend=args.backend, steps=args.steps, run_dir=args.run_dir, view=not args.no_view,
                  task=args.task, model=args.model)
    if args.cmd == "nats":
        from rlbus.services.commands.nats import run_nats

        return run_nats(args.store, args.port)
    if args.cmd == "publish":
        from rlbus.services.commands.publish import publish

        return publish(args.file, pool=args.pool, run=args.run, nats_url=args.nats_url, group_size=args.group_size,
                       skip_invalid=args.skip_invalid)
    if args.cmd == "streams":
        from rlbus.services.commands.streams import streams

        return streams(args.run, args.nats_url, as_json=args.json)
    if args.cmd == "status":
        from rlbus.services.commands.status import status

        return status(args.run, args.nats_url, as_json=args.json, seconds=args.seconds, watch=args.watch)
    if args.cmd == "auth":
        from rlbus.services.commands.auth import auth_init_cmd

        return auth_init_cmd(args.out, args.config, run=args.run, force=args.force)
    if args.cmd == "init-model":
        from rlbus.services.commands.init_model import init_model_cmd

        if args.pretrained:
            from rlbus.services.commands.init_model import fetch_model_cmd

            return fetch_model_cmd(args.pretrained, args.out, dtype=args.dtype, overwrite=args.overwrite)
        return init_model_cmd(args.out or f"models/tiny-{args.task}", seed=args.seed, target=args.target,
                              overwrite=args.overwrite, task=args.task)
    if args.cmd == "init-draft":
        from rlbus.services.commands.init_model import init_draft_cmd

        return init_draft_cmd(args.policy, args.out, layers=args.layers, overwrite=args.overwrite)
    return 2


if __name__ == "__main__":
    sys.exit(main())
