"""Rollout-box helper for ``scripts/launch_sglang.sh``: the fiddly parts, kept testable and out of bash.

``python -m rollout_manager.launch.box <command> ...``; standard library only, so it runs in SGLang's
environment before anything heavy is imported. Every failure is ONE line on stderr,
``launch_sglang: error: ...``, and a non-zero exit status; results go to stdout.

Commands:

- ``normalize-addr ADDR``: ``1.2.3.4:5000`` -> ``http://1.2.3.4:5000`` (no trailing slash).
- ``detect-host --manager ADDR``: this box's address on the route to the manager (a UDP ``connect``
  sends nothing; the kernel picks the source address of the route).
- ``preflight --manager ADDR --bind H --port P --agent-port A [--wait-for-manager S]``: both ports
  distinct and free, the manager answers ``GET /health`` (waiting up to S seconds for it: boxes and
  trainer often start together); all before anything heavy starts.
- ``exec --parent-pid PID -- CMD ...``: run CMD in its own process group (a terminal's Ctrl-C reaches
  only the launcher, which drains first) that gets SIGTERM if the launcher dies (Linux
  ``PR_SET_PDEATHSIG``), so a killed launcher leaves nothing behind.
- ``wait-ready --url U ... [--auth-url U ...] --pid P ... --timeout S``: until every URL answers 200
  (``--auth-url`` ones asked with the shared token: the receiver agent requires it when one is set);
  fails at once when a watched process exits, or at the deadline.
- ``register --manager ADDR --host H --port P --agent-url URL``: reads the receiver agent's
  ``/info`` (``handshake_port``: Mooncake's RPC port, chosen by Mooncake), registers, prints the
  endpoint the manager files the instance under. A stale registration of the same endpoint (a box
  restarted on the same address) is removed first.
- ``deregister --manager ADDR --endpoint E --timeout S [--state-file F]``: ``POST /shutdown_instances``
  (the manager drains it: no new work, in-flight requests finish), with the box token from F.
- ``watch --manager ADDR --state-file F --interval S``: runs beside the children while the box serves.
  Every S seconds it reads the manager's ``GET /health``; when its ``run_id`` differs from the one
  ``register --state-file F`` saw (the manager restarted and lost its registry) it registers again
  with the same body. Only a new run id does that: an instance an admin removed with
  ``/shutdown_instances`` (same run id, endpoint gone from ``/get_instances_status``) is left out,
  with one log line. While the manager is unreachable the box keeps serving; one line when it goes
  away, one when it is back.

- ``notice-detect [--mode auto|aws|gce|azure]``: which cloud metadata service answers (all asked at once,
  each with ``--timeout``) and whether this machine is a spot one, as one JSON line.
- ``notice-watch --provider P --manager ADDR --state-file F``: runs beside the children; reports a
  preemption notice from P's metadata service with ``POST /evacuate_instance`` (seconds left), and
  ``POST /cancel_evacuation`` when it is withdrawn (``rollout_manager.launch.notice_watch``).
- ``evacuate --manager ADDR --endpoint E --deadline-s S [--since T] [--wait]``: the SIGTERM path; reports
  the box as going S seconds after T and, with ``--wait``, returns once the manager has removed it or
  the time is spent. Exit 1 when the manager did not take it.

- ``wait-wanted --manager ADDR [--preemptible] [--price-per-hour P]``: returns once the manager's scaling
  signal (``fleet_demand`` in ``/get_instances_status``) wants more boxes of this kind (``launch.wanted``).

Metadata base URLs: ``--aws-url``/``--gce-url``/``--azure-url``, else ``$ROLLOUT_AWS_METADATA_URL``,
``$ROLLOUT_GCE_METADATA_URL``, ``$ROLLOUT_AZURE_METADATA_URL``, else ``http://169.254.169.254``.

``ROLLOUT_MANAGER_AUTH_TOKEN``, when set, is sent as ``Authorization: Bearer <token>`` on every call
to the manager but one: deregistration uses the box token the registration answer carried (kept in
the state file, renewed by ``watch`` when it registers again), which removes this instance and no
other. From a manager that issues none (or no longer knows it: 401), the shared token is used.
"""

# This module is the entry point only: the command-line parser and main (the docstring above is the
# --help text). The commands live in box_local (detect-host, preflight, exec, wait-ready) and
# box_registration (register, deregister, watch), both on the shared helpers of box_common; the
# preemption notices in notice_watch (notice-detect, notice-watch, evacuate) on notices' providers; wait-wanted
# in wanted.

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rollout_manager.launch.box_common import BoxError, fail, normalize_addr
from rollout_manager.launch.box_local import cmd_exec, cmd_preflight, cmd_wait_ready, detect_host
from rollout_manager.launch.box_registration import cmd_deregister, cmd_register, cmd_watch
from rollout_manager.launch.notice_watch import add_metadata_args, cmd_evacuate, cmd_notice_detect, cmd_notice_watch
from rollout_manager.launch.wanted import cmd_wait_wanted

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rollout_manager.launch.box", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("normalize-addr")
    s.add_argument("addr")
    s.set_defaults(func=lambda a: print(normalize_addr(a.addr)))

    s = sub.add_parser("detect-host")
    s.add_argument("--manager", required=True)
    s.set_defaults(func=lambda a: print(detect_host(a.manager)))

    s = sub.add_parser("preflight")
    s.add_argument("--manager", required=True)
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--agent-port", type=int, required=True)
    s.add_argument("--timeout", type=float, default=5.0)
    s.add_argument("--modules", default="", help="comma-separated modules the children need")
    s.add_argument("--wait-for-manager", type=float, default=0.0,
                   help="seconds to wait for the manager to answer healthy (0: fail at once)")
    s.set_defaults(func=cmd_preflight)

    s = sub.add_parser("exec")
    s.add_argument("--parent-pid", type=int, default=0)
    s.add_argument("command", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_exec)

    s = sub.add_parser("wait-ready")
    s.add_argument("--url", action="append", default=[])
    s.add_argument("--auth-url", action="append", help="a URL asked with the shared token (the receiver agent)")
    s.add_argument("--pid", type=int, action="append")
    s.add_argument("--pid-name", action="append", help="names of the --pid processes, in order")
    s.add_argument("--timeout", type=float, required=True)
    s.add_argument("--interval", type=float, default=0.2)
    s.set_defaults(func=cmd_wait_ready)

    s = sub.add_parser("register")
    s.add_argument("--manager", required=True)
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--agent-url", required=True)
    s.add_argument("--agent-port", type=int, required=True)
    s.add_argument("--model-path", help="the served model, whose config.json gives the vocabulary size")
    s.add_argument("--vocab-size", type=int, help="the vocabulary size to register (default: from --model-path)")
    s.add_argument("--timeout", type=float, default=60.0, help="keep retrying an unreachable manager this long")
    s.add_argument("--endpoint-file", help="also write the registered endpoint here")
    s.add_argument("--state-file", help="also write the body, endpoint and manager run id here (for watch)")
    s.add_argument("--preemptible", action="store_true", help="register the box as one its cloud may take back")
    s.add_argument("--price-per-hour", type=float, help="what the box costs per hour (registered as price_per_hour)")
    s.set_defaults(func=cmd_register)

    s = sub.add_parser("watch")
    s.add_argument("--manager", required=True)
    s.add_argument("--state-file", required=True, help="written by register --state-file")
    s.add_argument("--interval", type=float, default=5.0, help="seconds between checks of the manager")
    s.set_defaults(func=cmd_watch)

    s = sub.add_parser("deregister")
    s.add_argument("--manager", required=True)
    s.add_argument("--endpoint", required=True)
    s.add_argument("--timeout", type=float, default=60.0)
    s.add_argument("--state-file", help="written by register --state-file: its box token authorises the call")
    s.set_defaults(func=cmd_deregister)

    s = sub.add_parser("notice-detect")
    s.add_argument("--mode", choices=("auto", "aws", "gce", "azure"), default="auto")
    add_metadata_args(s)
    s.set_defaults(func=cmd_notice_detect)

    s = sub.add_parser("notice-watch")
    s.add_argument("--provider", choices=("aws", "gce", "azure"), required=True)
    s.add_argument("--manager", required=True)
    s.add_argument("--state-file", required=True, help="written by register --state-file (endpoint, box token)")
    s.add_argument("--endpoint", help="the registered endpoint (default: from the state file)")
    s.add_argument("--outlive-s", type=float, default=60.0,
                   help="alive this long past a notice's deadline: the evacuation is cancelled")
    add_metadata_args(s)
    s.set_defaults(func=cmd_notice_watch)

    s = sub.add_parser("evacuate")
    s.add_argument("--manager", required=True)
    s.add_argument("--endpoint", required=True)
    s.add_argument("--deadline-s", type=float, required=True, help="seconds the box has left, from --since")
    s.add_argument("--since", type=float, default=0.0, help="wall-clock time the countdown started (default now)")
    s.add_argument("--source", default="sigterm")
    s.add_argument("--state-file", help="written by register --state-file: its box token authorises the call")
    s.add_argument("--wait", action="store_true", help="return once the manager removed the box, or at the deadline")
    s.set_defaults(func=cmd_evacuate)

    s = sub.add_parser("wait-wanted")
    s.add_argument("--manager", required=True)
    s.add_argument("--preemptible", action="store_true", help="this box's kind: preemptible")
    s.add_argument("--price-per-hour", type=float, help="this box's kind: its price per hour")
    s.add_argument("--interval", type=float, default=5.0, help="seconds between reads of the manager's status")
    s.set_defaults(func=cmd_wait_wanted)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except BoxError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
