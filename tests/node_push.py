"""One training rank of a simulated multi-node job, for tests/test_trainer_plugin_weights.py.

Each process stands for one node (its node id is its sender IP): it joins a gloo group with the others, then
hands a model's full weights to the plugin's default weight-push hook for each requested version
(seed ``S`` -> ``build_model(S)``), with its own node IP. Prints one JSON line per push.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import torch.distributed as dist

from rollout_manager.cpu_engine.model import build_model
from trainer_plugin import weight_push


async def main(args: argparse.Namespace) -> None:
    config = {"custom": {"rollout_manager": {"sender_ips": [args.sender_ip], "weight_push_timeout_s": 60}}}
    try:
        for version, seed in enumerate(args.seeds, start=1):
            ctx = weight_push.WeightPushContext(rank=args.rank, world_size=args.world, manager_url=args.manager,
                                                rollout_config=config, node_id=args.sender_ip)
            weights = iter(build_model(seed).state_dict().items())
            result = await weight_push.push_to_rollout_manager(weights, version, ctx)
            print(json.dumps({"rank": args.rank, "version": version, **result}), flush=True)
    finally:
        if weight_push._PUSHER is not None:
            pusher, client = weight_push._PUSHER
            if pusher is not None:
                pusher.stop()
            await client.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--manager", required=True)
    p.add_argument("--sender-ip", required=True)
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.master_port}", rank=a.rank, world_size=a.world)
    try:
        asyncio.run(main(a))
    finally:
        dist.destroy_process_group()
