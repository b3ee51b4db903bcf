"""Command line: ``rollout-manager serve | demo | receiver-agent | cpu-engine``, and the operator's
``status | drain | evacuate | push-status | watch`` (rollout_manager/ops.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from rollout_manager import __version__, ops
from rollout_manager.config import ConfigError, load_config, parse_set_option
from rollout_manager.extras import missing_extra_message


def _serve(args: argparse.Namespace) -> int:
    from rollout_manager.api.server import StartupError, serve
    from rollout_manager.logs import setup_logging
    from rollout_manager.manager import RelayPlace, Role
    from rollout_manager.osutil import tune_gc

    overrides: dict[str, str] = {}
    try:
        for item in args.set or []:
            key, value = parse_set_option(item)
            overrides[key] = value
        for key in ("bind", "log_level", "log_format"):
            if getattr(args, key) is not None:
                overrides[key] = getattr(args, key)
        config = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"rollout-manager: {exc}", file=sys.stderr)
        return 2
    process = "" if args.role in (None, "single") else args.role if args.role == "control" \
        else f"relay {args.relay_index}"
    setup_logging(config.log_level, config.log_format, process)
    if config.relays and args.role is None:  # a control process and relays (docs/relays.md)
        from rollout_manager.launch.relays import supervise

        return supervise(config, args.passed)
    # Here, not in serve(): the collector is the process's, and serve() also runs inside other programs.
    logging.getLogger("rollout_manager.api.server").info(tune_gc(config.gc_young_threshold))
    role = Role(args.role or "single")
    place = None
    if role is Role.RELAY:
        if args.relay_index is None or not args.control_url or not args.relay_private:
            print("rollout-manager: --role relay needs --relay-index, --control-url and --relay-private",
                  file=sys.stderr)
            return 2
        place = RelayPlace(args.relay_index, config.relays or 1, args.control_url, args.relay_private,
                           args.front_url)
    try:
        run_async(serve(config, role=role, run_id=args.run_id, place=place))
    except StartupError as exc:
        print(f"rollout-manager: {exc}", file=sys.stderr)
        return 1
    return 0


def run_async(main: Coroutine[Any, Any, None]) -> None:
    """asyncio.run, on uvloop when it is installed (the ``fast`` extra): the daemon is syscall-bound."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def _cpu_engine(argv: Sequence[str]) -> int:
    from rollout_manager.cpu_engine.__main__ import main as engine_main

    return engine_main(list(argv)) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-manager",
        description="Async disaggregated rollout manager for RL training with remote SGLang instances.",
    )
    parser.add_argument("--version", action="version", version=f"rollout-manager {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the manager daemon",
        description="Run the manager. Settings: command line > ROLLOUT_MANAGER_<KEY> environment "
        "variables > --config file > built-in defaults (the shipped config.toml).",
    )
    serve.add_argument("--config", help="TOML file (see config.toml for every key)")
    serve.add_argument("--bind", help="HOST:PORT to listen on (default 0.0.0.0:5000; port 0: any free "
                       "port, logged as 'listening on http://HOST:PORT')")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                       help="log threshold (default info; key log_level)")
    serve.add_argument("--log-format", choices=["text", "json"],
                       help="text lines, or one JSON object per line for log collectors (default text; "
                       "key log_format); logs go to stderr")
    serve.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key")
    # One process of a manager with relays (docs/relays.md); `serve` with relays = N starts them with these.
    serve.add_argument("--role", choices=["single", "control", "relay"], help=argparse.SUPPRESS)
    serve.add_argument("--run-id", help=argparse.SUPPRESS)
    serve.add_argument("--relay-index", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--relay-private", help=argparse.SUPPRESS)
    serve.add_argument("--control-url", help=argparse.SUPPRESS)
    serve.add_argument("--front-url", help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)

    sub.add_parser("demo", help="the whole system on this machine: manager, CPU boxes, a training loop "
                   "(extra: demo)", add_help=False)
    sub.add_parser("receiver-agent", help="the weight receiver that runs beside SGLang on a rollout box "
                   "(extra: cuda or cpu)", add_help=False)
    sub.add_parser(
        "cpu-engine",
        help="run the SGLang-compatible CPU engine (tests, demo; extra: cpu-engine)",
        add_help=False,
    )
    ops.add_subcommands(sub)  # status, drain, evacuate, push-status, watch: talk to a running manager
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and (missing := missing_extra_message(argv[0])) is not None:
        print(missing, file=sys.stderr)
        return 1
    if argv and argv[0] == "cpu-engine":
        return _cpu_engine(argv[1:])
    if argv and argv[0] == "demo":
        from rollout_manager.launch.demo import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "receiver-agent":
        from rollout_manager.weights.receiver_agent import main as receiver_main

        return receiver_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.passed = argv[1:]  # what serve was given, for the processes a supervisor starts (launch.relays)
    return int(args.func(args))
