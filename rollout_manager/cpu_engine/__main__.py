"""``python -m rollout_manager.cpu_engine --port 30000 --seed 0 [faults...]`` (also ``rollout-manager cpu-engine``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from rollout_manager.cpu_engine.engine import EngineConfig
from rollout_manager.cpu_engine.faults import Faults
from rollout_manager.cpu_engine.model import MODEL_SIZES, make_config


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "python -m rollout_manager.cpu_engine",
        description="SGLang-compatible HTTP engine running a tiny random causal LM on CPU (tests, demo, benchmarks).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument(
        "--model-config",
        type=json.loads,
        default={},
        metavar="JSON",
        help='overrides of the model config, e.g. \'{"eos_token_id": 2, "max_position_embeddings": 512}\'',
    )
    p.add_argument("--eos-token-id", type=int, default=None, help="stop on this token unless ignore_eos")
    p.add_argument("--num-experts", type=int, default=None,
                   help="a MoE model: every layer routes each token through --num-experts-per-tok of N experts")
    p.add_argument("--num-experts-per-tok", type=int, default=None, help="experts chosen per token (top-k; default 2)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="answer return_routed_experts with meta_info.routed_experts (needs --num-experts)")
    p.add_argument("--weight-version", default="0", help="initial weight_version reported in meta_info")
    p.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="stream deltas instead of cumulative chunks (SGLang's flag)",
    )
    p.add_argument("--stream-interval", type=int, default=1,
                   help="stream a chunk every N tokens (SGLang's flag; sampling_params.stream_interval overrides)")
    p.add_argument("--context-length", type=int, default=None,
                   help="the model's context length (default: its max_position_embeddings), as SGLang's flag")
    p.add_argument("--max-running-requests", type=int, default=None, help="decode at most this many at once")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--health-generate-timeout-s", type=float, default=20.0)
    p.add_argument("--sglang-version", default="0.5.23",
                   help="the SGLang to emulate: /server_info's version; before 0.5.21 there are no "
                        "weight-update sessions (/begin_weight_update answers 404)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor parallelism to report: weight loads need one payload per TP rank")
    p.add_argument("--dp-size", type=int, default=1,
                   help="data parallelism to report: above 1, weight loads are refused as SGLang refuses them")
    p.add_argument("--log-level", default="INFO")
    f = p.add_argument_group("fault injection (also settable at runtime: POST /debug/faults)")
    f.add_argument("--die-after-tokens", type=int, default=None, help="os._exit(1) after N tokens reached clients")
    f.add_argument("--stall-after-tokens", type=int, default=None,
                   help="stop generating after N tokens; keep connections open")
    f.add_argument("--slowdown", type=float, default=1.0, help="each decoding round takes F times its compute time")
    f.add_argument("--token-delay-s", type=float, default=0.0,
                   help="extra delay per decoding round (one token per sequence)")
    f.add_argument("--fail-rate", type=float, default=0.0, help="probability that /generate answers --fail-status")
    f.add_argument("--fail-status", type=int, default=503)
    f.add_argument("--fault-seed", type=int, default=0, help="seed of the fail-rate coin")
    f.add_argument("--health-fail", action="store_true", help="/health and /health_generate answer 503")
    f.add_argument("--load-delay-s", type=float, default=0.0,
                   help="each weight load takes this long, health answering 503 meanwhile")
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides = dict(args.model_config or {})
    if not isinstance(overrides, dict):
        raise ValueError("--model-config must be a JSON object")
    if args.eos_token_id is not None:
        overrides["eos_token_id"] = args.eos_token_id
    if args.num_experts is not None:
        overrides["num_experts"] = args.num_experts
    if args.num_experts_per_tok is not None:
        overrides["num_experts_per_tok"] = args.num_experts_per_tok
    model_config = make_config(args.seed, args.model_size, **overrides)  # fail early on a bad config
    if args.context_length is not None and not 8 <= args.context_length <= model_config.max_position_embeddings:
        raise ValueError(f"--context-length must be in [8, {model_config.max_position_embeddings}] "
                         "(the model's max_position_embeddings)")
    if args.enable_return_routed_experts and not model_config.num_experts:
        raise ValueError("--enable-return-routed-experts needs a MoE model (--num-experts)")
    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be at least 1")
    if args.tp_size < 1 or args.dp_size < 1:
        raise ValueError("--tp-size and --dp-size must be at least 1")
    faults = Faults(
        die_after_tokens=args.die_after_tokens,
        stall_after_tokens=args.stall_after_tokens,
        slowdown=args.slowdown,
        token_delay_s=args.token_delay_s,
        fail_rate=args.fail_rate,
        fail_status=args.fail_status,
        health_fail=args.health_fail,
        load_delay_s=args.load_delay_s,
    )
    faults.update({"seed": args.fault_seed})
    return EngineConfig(
        seed=args.seed,
        model_size=args.model_size,
        model_overrides=overrides,
        incremental_streaming_output=args.incremental_streaming_output,
        stream_interval=args.stream_interval,
        context_length=args.context_length,
        weight_version=str(args.weight_version),
        max_running_requests=args.max_running_requests,
        health_generate_timeout_s=args.health_generate_timeout_s,
        served_model_name=args.served_model_name,
        faults=faults,
        sglang_version=str(args.sglang_version),
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        enable_return_routed_experts=args.enable_return_routed_experts,
    )


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    if prog is None and sys.argv and sys.argv[0].endswith("rollout-manager"):
        prog = "rollout-manager cpu-engine"
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    import torch

    from rollout_manager.cpu_engine.model import COMPUTE_THREADS
    from rollout_manager.cpu_engine.server import run

    torch.set_num_threads(COMPUTE_THREADS)
    return run(args.host, args.port, config)


if __name__ == "__main__":
    sys.exit(main())
