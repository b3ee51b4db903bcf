"""Fault injection for the CPU engine: set from the command line, changed at runtime via /debug/faults."""

from __future__ import annotations

import logging
import os
import random
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

log = logging.getLogger("rollout_manager.cpu_engine")

@dataclass
class Faults:
    die_after_tokens: int | None = None  # os._exit(1) once this many tokens were emitted to clients
    stall_after_tokens: int | None = None  # stop generating after this many tokens; connections stay open
    slowdown: float = 1.0  # each decoding round takes this many times its compute time
    token_delay_s: float = 0.0  # extra sleep per decoding round (every running sequence: one token)
    fail_rate: float = 0.0  # probability that /generate answers fail_status at once
    fail_status: int = 503
    health_fail: bool = False  # /health and /health_generate answer 503
    load_delay_s: float = 0.0  # a weight load takes this long; health answers 503 meanwhile (a busy box)
    load_fail: bool = False  # /update_weights_from_tensor fails (a load that breaks half-way)
    # Silent corruption (a GPU's bad memory, a write from nowhere): once more than perturb_after_requests client
    # requests came in, noise of perturb_scale times the tensor's mean magnitude is added to the tensor named
    # perturb_tensor, once; nothing says so (a weight load that rewrites the tensor heals it).
    perturb_tensor: str | None = None
    perturb_after_requests: int = 0
    perturb_scale: float = 0.05
    # A scripted answer: every client sequence's first generated tokens are these ids, in place of its samples
    # (the log-prob reported is the model's for the id), so a test makes the tiny random model write a given
    # text (a tool call); counted from the sequence's first token on this engine (a continuation restarts it).
    script_tokens: list[int] | None = None
    loading: bool = field(default=False)
    requests: int = field(default=0)  # client /generate calls since start or since perturb_tensor was armed
    perturbed: bool = field(default=False)  # the perturbation happened
    # Counters, since start or since the matching fault was last armed.
    emitted_tokens: int = field(default=0)
    generated_tokens: int = field(default=0)
    _rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False)

    SETTABLE = (
        "die_after_tokens",
        "stall_after_tokens",
        "slowdown",
        "token_delay_s",
        "fail_rate",
        "fail_status",
        "health_fail",
        "load_delay_s",
        "load_fail",
        "perturb_tensor",
        "perturb_after_requests",
        "perturb_scale",
        "script_tokens",
    )

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        for name in ("die_after_tokens", "stall_after_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be a non-negative integer or null")
        if not isinstance(self.slowdown, (int, float)) or self.slowdown < 1.0:
            raise ValueError("slowdown must be a number >= 1")
        if not isinstance(self.token_delay_s, (int, float)) or self.token_delay_s < 0:
            raise ValueError("token_delay_s must be >= 0")
        if not isinstance(self.fail_rate, (int, float)) or not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("fail_rate must be within [0, 1]")
        if not isinstance(self.fail_status, int) or not 400 <= self.fail_status <= 599:
            raise ValueError("fail_status must be an HTTP error status (400..599)")
        if not isinstance(self.health_fail, bool):
            raise ValueError("health_fail must be a boolean")
        if not isinstance(self.load_fail, bool):
            raise ValueError("load_fail must be a boolean")
        if not isinstance(self.load_delay_s, (int, float)) or self.load_delay_s < 0:
            raise ValueError("load_delay_s must be >= 0")
        if self.perturb_tensor is not None and not isinstance(self.perturb_tensor, str):
            raise ValueError("perturb_tensor must be a tensor's name or null")
        v = self.perturb_after_requests
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError("perturb_after_requests must be a non-negative integer")
        if not isinstance(self.perturb_scale, (int, float)) or self.perturb_scale <= 0:
            raise ValueError("perturb_scale must be > 0")
        v = self.script_tokens
        if v is not None and (not isinstance(v, list)
                              or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)):
            raise ValueError("script_tokens must be a list of token ids or null")

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a runtime change; arming die/stall restarts its counter. Raises ValueError."""
        unknown = set(changes) - set(self.SETTABLE) - {"seed"}
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}; settable: {list(self.SETTABLE)}")
        backup = {f.name: getattr(self, f.name) for f in fields(self) if f.name in self.SETTABLE}
        for key, value in changes.items():
            if key == "seed":
                continue
            is_int = isinstance(value, int) and not isinstance(value, bool)
            if key in ("slowdown", "token_delay_s", "fail_rate", "perturb_scale") and is_int:
                value = float(value)
            setattr(self, key, value)
        try:
            self._check()
        except ValueError:
            for k, v in backup.items():
                setattr(self, k, v)
            raise
        if "seed" in changes:
            self._rng.seed(changes["seed"])
        if "die_after_tokens" in changes:
            self.emitted_tokens = 0
        if "stall_after_tokens" in changes:
            self.generated_tokens = 0
        if "perturb_tensor" in changes:
            self.requests, self.perturbed = 0, False

    def snapshot(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_rng", None)
        return d

    # ------------------------------------------------------------ hooks used by the engine

    def should_fail_request(self) -> bool:
        return self.fail_rate > 0 and self._rng.random() < self.fail_rate

    @property
    def stalled(self) -> bool:
        return self.stall_after_tokens is not None and self.generated_tokens >= self.stall_after_tokens

    def generation_budget(self) -> int | None:
        """How many more tokens may be generated before the stall fault bites (None: no limit)."""
        if self.stall_after_tokens is None:
            return None
        return max(self.stall_after_tokens - self.generated_tokens, 0)

    def scripted(self, position: int) -> int | None:
        """The id a client sequence's ``position``-th generated token is made to be (None: its own sample)."""
        script = self.script_tokens
        return script[position] if script is not None and position < len(script) else None

    def note_request(self) -> None:
        self.requests += 1

    def perturb_due(self, named: dict[str, torch.Tensor]) -> None:
        """Perturb the armed tensor of ``named`` in place once its request count is passed (call it where no
        forward runs: the engine's compute thread, before a forward)."""
        if self.perturb_tensor is None or self.perturbed or self.requests <= self.perturb_after_requests:
            return
        self.perturbed = True
        tensor = named.get(self.perturb_tensor)
        if tensor is None:
            log.warning("fault perturb_tensor: the model has no tensor %r; nothing perturbed", self.perturb_tensor)
            return
        gen = torch.Generator().manual_seed(self.requests)
        noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32).to(tensor.dtype)
        with torch.no_grad():
            tensor.add_(noise * (self.perturb_scale * float(tensor.abs().mean())))

    def note_generated(self, n: int) -> None:
        self.generated_tokens += n

    def note_emitted(self, n: int) -> None:
        """Count tokens that reached a client; die at once when the budget is spent."""
        self.emitted_tokens += n
        if self.die_after_tokens is not None and self.emitted_tokens >= self.die_after_tokens:
            sys.stderr.write(f"cpu-engine: fault die_after_tokens={self.die_after_tokens} reached; exiting\n")
            sys.stderr.flush()
            os._exit(1)
