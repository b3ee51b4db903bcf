"""SGLang's answer keys are named in ``rollout_manager/sglang/`` only, so one module knows SGLang's contract.

The packages that run the manager's own logic (a sequence's life, placement, instances, weights, the HTTP
layer) read what SGLang said through the sglang package's typed values; a string literal there that is one
of SGLang's ``meta_info`` keys means the contract leaked. Read with ``ast``, docstrings left out. Clients of
the manager's own API (the demo, the CLI), which mirrors SGLang's ``/generate``, and the CPU engine, which
plays SGLang, are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

from rollout_manager.sglang.piece_meta import FIRST_META, LENGTH_META, LOGPROBS_KEY, SUMMED_META

ROOT = Path(__file__).resolve().parent.parent / "rollout_manager"
CHECKED = ("rollout", "instances", "weights", "api")
# SGLang 0.5.23's final meta_info keys the manager reads or merges (tokenizer_manager's answer).
META_KEYS = {"meta_info", "cached_tokens", "completion_tokens", "prompt_tokens", "finish_reason", "e2e_latency",
             "input_token_logprobs", "output_top_logprobs", "spec_accept_rate", "spec_accept_length",
             LOGPROBS_KEY, *SUMMED_META, *FIRST_META, *LENGTH_META, *LENGTH_META.values()}


def _named(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in META_KEYS
            and id(node) not in docs]


def test_no_package_but_sglang_names_sglangs_answer_keys() -> None:
    leaks = [f"{path.relative_to(ROOT.parent)}:{line} names {key!r}"
             for package in CHECKED for path in sorted((ROOT / package).rglob("*.py"))
             for line, key in _named(path)]
    assert not leaks, "SGLang's keys belong in rollout_manager/sglang/: " + "; ".join(leaks)


def test_the_check_finds_a_leak(tmp_path: Path) -> None:
    leaky = tmp_path / "leaky.py"
    leaky.write_text('"""Says cached_tokens in its docstring only."""\nX = {"cached_tokens": 1}\n')
    assert _named(leaky) == [(2, "cached_tokens")]
