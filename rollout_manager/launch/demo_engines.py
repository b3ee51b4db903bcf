"""What the demo trains and what its boxes serve, per engine.

``cpu``: the CPU engine's own tiny model, in this process and on the boxes. ``sglang``: real SGLang serving a
Hugging Face checkpoint (``--model-path``); the policy is the same checkpoint in ``transformers`` (float32), and
its state dict goes out under its Hugging Face names, which is what SGLang's ``load_weights`` reads.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# SGLang on a machine without a GPU (SGLang's CPU path, float32, a small KV pool; --sleep-on-idle and one
# OpenMP thread per server, or each idle scheduler spins every core): docs/real-sglang.md.
SGLANG_CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                    "--disable-cuda-graph", "--mem-fraction-static", "0.05", "--max-total-tokens", "8192",
                    "--dtype", "float32", "--sleep-on-idle", "--log-level", "warning")
SGLANG_CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}


@dataclass
class Policy:
    """The model the demo trains: its module, vocabulary size and logits for one sequence."""

    module: torch.nn.Module
    vocab_size: int
    logits: Callable[[torch.Tensor], torch.Tensor]  # token ids [T] -> logits [T, vocab]
    skip: frozenset[str] = frozenset()  # state-dict names the boxes do not load (a tied lm_head)

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the weights to push."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items() if k not in self.skip}


def cpu_policy(model_size: str) -> Policy:
    from rollout_manager.cpu_engine.model import build_model

    model = build_model(0, model_size)
    return Policy(model, model.config.vocab_size, model)


def hf_policy(model_path: str) -> Policy:
    """The checkpoint SGLang serves, as a ``transformers`` model (needs transformers: the ``verl`` extra)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise RuntimeError(f"--engine sglang trains the checkpoint with transformers, which is missing ({exc}); "
                           "install the verl extra") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # it would break the progress line
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))

    def logits(ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = model(ids[None]).logits[0]
        return out

    return Policy(model, int(model.config.vocab_size), logits,
                  frozenset({"lm_head.weight"}) if tied else frozenset())


def default_sglang_python() -> str:
    """The interpreter that has SGLang: this checkout's ``.venv-sglang`` (scripts/install.sh), else this one."""
    venv = ROOT / ".venv-sglang" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def sglang_box_flags(model_path: str, python: str) -> tuple[list[str], list[str], dict[str, str]]:
    """The launcher's flags before ``--``, SGLang's after it, and the environment, for one SGLang box (on CPU
    when this machine's torch sees no GPU)."""
    cpu = not torch.cuda.is_available()
    return (["--engine", "sglang", "--model-path", model_path, "--python", python],
            list(SGLANG_CPU_FLAGS) if cpu else [], dict(SGLANG_CPU_ENV) if cpu else {})
