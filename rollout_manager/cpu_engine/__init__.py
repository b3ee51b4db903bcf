"""An SGLang stand-in on CPU: SGLang's HTTP contract over a tiny random torch causal LM.

It serves the manager's tests, demo and benchmarks where no GPU is available, computes every step
batch-invariantly (so a sequence continued elsewhere equals the uninterrupted one; see
docs/rollout.md, "Exactness") and can inject faults.

    python -m rollout_manager.cpu_engine --port 30000 --seed 0 [--incremental-streaming-output] [faults]
"""

from collections.abc import Sequence

from rollout_manager.cpu_engine.engine import Engine, EngineConfig
from rollout_manager.cpu_engine.faults import Faults
from rollout_manager.cpu_engine.model import (
    EngineSampling,
    ModelConfig,
    TinyCausalLM,
    build_model,
    make_config,
    reference_generate,
    state_dict_checksums,
    tensor_checksum,
)
from rollout_manager.cpu_engine.request import RequestRefused, parse_generate_body
from rollout_manager.cpu_engine.server import create_app, run, serve


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """CLI entry (``rollout-manager cpu-engine ...`` can delegate here)."""
    from rollout_manager.cpu_engine.__main__ import main as _main

    return _main(argv, prog)


__all__ = [
    "Engine",
    "EngineConfig",
    "EngineSampling",
    "Faults",
    "ModelConfig",
    "RequestRefused",
    "TinyCausalLM",
    "build_model",
    "create_app",
    "main",
    "make_config",
    "parse_generate_body",
    "reference_generate",
    "run",
    "serve",
    "state_dict_checksums",
    "tensor_checksum",
]
