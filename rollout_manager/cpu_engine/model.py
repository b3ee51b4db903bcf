"""A tiny Llama-shaped causal LM on CPU, computed so that results never depend on the neighbours.

Every decoding step is a full forward over the one sequence's whole token list (no KV cache, no
batching across sequences), on a fixed number of intra-op threads. The logits at a step are therefore
a pure function of (weights, tokens so far): a prefix gives the same next token whether it arrived as a
prompt or was generated here, and whatever else the engine is running. That is what exact continuation
needs: a KV-cached decode step and a prefill over the same tokens give slightly different floats, as
does batching with other neighbours, and on a tiny random model a near-tie then flips the argmax
(docs/rollout.md, "Exactness").

Parameter names follow Hugging Face Llama/Qwen (``model.layers.0.self_attn.q_proj.weight``, ...) so
that weight pushes address tensors by the same names as for a real model. With ``num_experts`` > 0 every
layer's MLP is a Qwen3-MoE sparse block (``mlp.gate.weight``, ``mlp.experts.E.{gate,up,down}_proj.weight``)
and a forward also says which experts each token was routed to (routed-expert replay, R3).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# Threads used for every forward. One thread keeps kernel choice and reduction order fixed.
COMPUTE_THREADS = 1


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    eos_token_id: int | None = None
    init_std: float = 0.5
    seed: int = 0
    num_experts: int = 0  # 0: dense MLPs; else every layer routes each token through num_experts_per_tok experts
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding)")
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError("eos_token_id outside the vocabulary")
        if self.num_experts < 0:
            raise ValueError("num_experts must be >= 0 (0: a dense model)")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in [1, num_experts]")
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError("moe_intermediate_size must be at least 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


MODEL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": dict(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=2048,
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seq = x.shape[0]
        q = self.q_proj(x).view(seq, self.n_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(seq, self.n_kv, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(seq, self.n_kv, self.head_dim).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=0)
            v = v.repeat_interleave(rep, dim=0)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        projected: torch.Tensor = self.o_proj(out.transpose(0, 1).reshape(seq, self.n_heads * self.head_dim))
        return projected


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse MLP: a router scores the experts per token (softmax), the top
    ``num_experts_per_tok`` are chosen (likeliest first), their weights renormalised to sum to 1
    (``norm_topk_prob``) and their outputs mixed by those weights. Each expert runs on its tokens only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixed output and the chosen experts (``[tokens, top_k]`` int32)."""
        weights, chosen = torch.topk(torch.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(chosen == e, as_tuple=True)  # a token picks an expert at most once
            if token.numel():
                out[token] = out[token] + weights[token, slot].unsqueeze(-1) * expert(x[token])
        return out, chosen.to(torch.int32)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (SparseMoeBlock(cfg) if cfg.num_experts
                               else MLP(cfg.hidden_size, cfg.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output and, in a MoE layer, each token's chosen experts (else None)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        mixed = self.mlp(self.post_attention_layernorm(x))
        chosen = None
        if isinstance(mixed, tuple):
            mixed, chosen = mixed
        out: torch.Tensor = x + mixed
        return out, chosen


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyCausalLM(nn.Module):
    """``model.*`` backbone plus ``lm_head``; ``logits_last(ids)`` is the one compute entry point."""

    _cos: torch.Tensor  # rotary tables, registered as non-persistent buffers
    _sin: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(pos, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("_cos", angles.cos().to(torch.float32), persistent=False)
        self.register_buffer("_sin", angles.sin().to(torch.float32), persistent=False)

    def logits_last(self, input_ids: Sequence[int]) -> torch.Tensor:
        """Raw float32 logits for the token after ``input_ids`` (a full forward, no cache)."""
        return self.logits_and_routes(input_ids)[0]

    @torch.inference_mode()
    def logits_and_routes(self, input_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`logits_last` and, in a MoE model, the experts every input token was routed to
        (``[tokens, layers, top_k]`` int32, row i for ``input_ids[i]``); None for a dense model."""
        n = len(input_ids)
        if n == 0:
            raise ValueError("empty input")
        if n > self.config.max_position_embeddings:
            raise ValueError("sequence longer than the context")
        with fixed_threads():
            ids = torch.tensor(list(input_ids), dtype=torch.long)
            x, routes = self._layers(ids)
            x = self.model.norm(x[-1:])
            logits: torch.Tensor = self.lm_head(x)[0].float()
            return logits, routes

    @torch.inference_mode()
    def input_logprobs(self, input_ids: Sequence[int], start: int) -> list[float | None]:
        """SGLang's ``input_token_logprobs`` values from prompt position ``start`` on: the log-prob of each
        input token given the ones before it, None for the first (nothing predicts it)."""
        with fixed_threads():
            ids = torch.tensor(list(input_ids), dtype=torch.long)
            x, _ = self._layers(ids)
            logprobs = torch.log_softmax(self.lm_head(self.model.norm(x)).float(), dim=-1)
            picked = logprobs[:-1].gather(1, ids[1:, None])[:, 0].tolist()
        values: list[float | None] = [None, *picked]
        return values[start:]

    def _layers(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = ids.shape[0]
        x = self.model.embed_tokens(ids)
        mask = torch.ones(n, n, dtype=torch.bool, device=ids.device).triu(1)
        chosen: list[torch.Tensor] = []
        for layer in self.model.layers:
            x, layer_chosen = layer(x, self._cos[:n], self._sin[:n], mask)
            if layer_chosen is not None:
                chosen.append(layer_chosen)
        return x, (torch.stack(chosen, dim=1) if chosen else None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of one sequence (``[n] -> [n, vocab]``), with autograd: training only.

        The same computation as :meth:`logits_last`, so a trainer holding these weights scores exactly
        what the engine sampled from.
        """
        x, _ = self._layers(input_ids)
        logits: torch.Tensor = self.lm_head(self.model.norm(x)).float()
        return logits

    # -------------------------------------------------------------- weights by name

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.named_parameters()}

    def load_named_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors in place by name; all are checked before any is written. Returns the count.

        Raises ValueError on an unknown name, a shape mismatch or a non-floating dtype.
        """
        own = self.named_tensors()
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for item in named:
            try:
                name, tensor = item
            except (TypeError, ValueError):
                raise ValueError(f"expected (name, tensor) pairs, got {type(item).__name__}") from None
            if not isinstance(name, str) or name not in own:
                raise ValueError(f"unknown parameter name: {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name}: expected a tensor, got {type(tensor).__name__}")
            target = own[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
            if not (tensor.dtype.is_floating_point):
                raise ValueError(f"{name}: dtype {tensor.dtype} cannot be loaded into {target.dtype}")
            staged.append((target, tensor))
        with torch.no_grad():
            for target, tensor in staged:
                target.copy_(tensor.detach().to(device="cpu", dtype=target.dtype))
        return len(staged)


@contextmanager
def fixed_threads(n: int | None = None) -> Iterator[None]:
    n = COMPUTE_THREADS if n is None else n
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            torch.set_num_threads(before)


def make_config(seed: int = 0, size: str = "tiny", **overrides: Any) -> ModelConfig:
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    base = ModelConfig(seed=seed, **MODEL_SIZES[size])
    cfg = replace(base, **overrides)
    cfg.validate()
    return cfg


def build_model(seed: int = 0, size: str = "tiny", **cfg: Any) -> TinyCausalLM:
    """A model with random float32 weights drawn from ``seed`` (same seed and config, same bits)."""
    config = make_config(seed, size, **cfg)
    gen = torch.Generator().manual_seed(config.seed)
    model = TinyCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[1]
                p.copy_(torch.randn(p.shape, generator=gen) * (config.init_std / math.sqrt(fan_in)) * 2)
    model.eval()
    model.requires_grad_(False)
    return model


# ------------------------------------------------------------------ sampling


@dataclass
class EngineSampling:
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1


def choose_token(logits: torch.Tensor, params: EngineSampling, generator: torch.Generator | None) -> tuple[int, float]:
    """Pick the next token; return it with the log-prob of the raw (temperature-free) logits."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        token = int(torch.argmax(logits).item())  # first maximum: ties go to the lowest id
    else:
        scaled = logits / params.temperature
        if params.top_k is not None and params.top_k > 0 and params.top_k < scaled.numel():
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True, stable=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = (cum - sorted_p) > params.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        token = int(torch.multinomial(probs, 1, generator=generator).item())
    return token, float(logprobs[token].item())


def stop_reason(token: int, n_generated: int, params: EngineSampling, eos_token_id: int | None) -> int | None:
    """The matched stop token when ``token`` ends the sequence, else None."""
    if params.ignore_eos or n_generated < params.min_new_tokens:
        return None
    if token in params.stop_token_ids or (eos_token_id is not None and token == eos_token_id):
        return token
    return None


def reference_generate(
    model: TinyCausalLM,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    stop_token_ids: Sequence[int] = (),
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, computed the same way the engine does (tests' oracle)."""
    params = EngineSampling(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=list(stop_token_ids))
    ids = list(input_ids)
    out: list[int] = []
    lps: list[float] = []
    limit = model.config.max_position_embeddings
    while len(out) < max_new_tokens and len(ids) < limit:
        token, lp = choose_token(model.logits_last(ids), params, None)
        ids.append(token)
        out.append(token)
        lps.append(lp)
        if stop_reason(token, len(out), params, model.config.eos_token_id) is not None:
            break
    return out, lps


# ------------------------------------------------------------------ checksums


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 over dtype, shape and the raw bytes of a CPU tensor."""
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def state_dict_checksums(model: TinyCausalLM) -> dict[str, str]:
    return {name: tensor_checksum(t) for name, t in model.named_tensors().items()}
