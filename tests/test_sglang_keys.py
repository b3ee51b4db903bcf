"""SGLang's answer keys are named in ``rollout_manager/sglang/`` only, so one module knows SGLang's contract.

Every module that runs the manager's own logic (a sequence's life, placement, instances, weights, the HTTP
layer, the OpenAI front, the top-level modules) reads what SGLang said through the sglang package's typed
values; a string literal there that is one of SGLang's ``meta_info`` keys means the contract leaked. Read with
``ast``, docstrings left out. Every package is checked unless :data:`NOT_CHECKED` names it, so a new package is
checked from its first module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from rollout_manager.sglang.piece_meta import FIRST_META, LENGTH_META, LOGPROBS_KEY, SUMMED_META

ROOT = Path(__file__).resolve().parent.parent / "rollout_manager"
# Packages not checked: sglang/ owns the keys; cpu_engine/ plays SGLang; launch/ runs on the box and the demo,
# a client of the manager's API, which mirrors SGLang's /generate.
NOT_CHECKED = {"sglang", "cpu_engine", "launch"}
# Keys a package writes as its own API's, spelled as SGLang spells its own: OpenAI's answer and usage fields.
OWN_KEYS = {"openai_front": {"finish_reason", "prompt_tokens", "completion_tokens"}}
# SGLang 0.5.23's final meta_info keys (tokenizer_manager's answer): those the manager reads or merges, and the
# per-token lists and figures it passes through untouched.
META_KEYS = {"meta_info", "cached_tokens", "completion_tokens", "prompt_tokens", "finish_reason", "e2e_latency",
             "input_token_logprobs", "output_top_logprobs", "spec_accept_rate", "spec_accept_length",
             "input_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs",
             "output_token_sampling_logprobs", "spec_block_accept_length", "hidden_states",
             LOGPROBS_KEY, *SUMMED_META, *FIRST_META, *LENGTH_META, *LENGTH_META.values()}


def _checked() -> list[Path]:
    """The modules of ``rollout_manager/`` outside :data:`NOT_CHECKED`, the top-level ones included."""
    return [path for path in sorted(ROOT.rglob("*.py"))
            if path.relative_to(ROOT).parts[0] not in NOT_CHECKED]


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
             for path in _checked() for line, key in _named(path)
             if key not in OWN_KEYS.get(path.relative_to(ROOT).parts[0], set())]
    assert not leaks, "SGLang's keys belong in rollout_manager/sglang/: " + "; ".join(leaks)


def test_every_package_that_runs_the_managers_logic_is_checked() -> None:
    checked = {path.relative_to(ROOT).parts[0] for path in _checked()}
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert packages - NOT_CHECKED <= checked
    assert {"rollout", "placement", "openai_front", "instances", "weights", "api", "manager.py"} <= checked
    assert not NOT_CHECKED & checked
    assert NOT_CHECKED <= packages, "NOT_CHECKED names a package that is gone"


def test_the_pieces_meta_merge_lives_in_sglang() -> None:
    """Divided rollouts fold their pieces' final meta in sglang/piece_meta.py; rollout/pieces.py only calls it."""
    merge = ROOT / "sglang" / "piece_meta.py"
    assert _named(merge), "piece_meta.py should name the meta keys it merges"
    assert not _named(ROOT / "rollout" / "pieces.py")


def test_the_check_finds_a_leak(tmp_path: Path) -> None:
    leaky = tmp_path / "leaky.py"
    leaky.write_text('"""Says cached_tokens in its docstring only."""\nX = {"cached_tokens": 1}\n')
    assert _named(leaky) == [(2, "cached_tokens")]
