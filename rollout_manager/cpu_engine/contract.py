"""SGLang 0.5.23's own JSON contract for ``/generate`` (and ``/abort_request``), loaded without SGLang.

SGLang's HTTP server checks every ``/generate`` body with its generated decoder,
``sglang/api/v1/api_types.py`` (``GenerateRequest.from_json_value``), before anything else and answers
``400 {"error": "<the decoder's message>"}`` when it refuses one. That module needs only msgspec, but
importing it as ``sglang.api.v1.api_types`` runs ``sglang/__init__.py``, which pulls in SGLang's GPU
stack; so the file is loaded on its own from the installed wheel (``pip install --no-deps
sglang==0.5.23``, done by scripts/install.sh). The engine refuses to start without it rather than be
more forgiving than the server it stands in for.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

SGLANG_VERSION = "0.5.23"
_MODULE = "rollout_manager_sglang_api_types"
_RELATIVE = "sglang/api/v1/api_types.py"


class ContractUnavailable(RuntimeError):
    """SGLang's contract module is not installed (or is not the expected version)."""


def api_types_path() -> Path:
    """Where the installed sglang wheel keeps ``api_types.py``, found without importing sglang."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise ContractUnavailable(
            f"sglang is not installed; run `pip install --no-deps sglang=={SGLANG_VERSION}` "
            "(scripts/install.sh does) so the CPU engine can check bodies with SGLang's own contract"
        ) from None
    if dist.version != SGLANG_VERSION:
        raise ContractUnavailable(f"sglang {dist.version} is installed; the CPU engine models {SGLANG_VERSION}")
    path = Path(str(dist.locate_file(_RELATIVE)))
    if not path.is_file():
        raise ContractUnavailable(f"{path} is missing from the sglang {dist.version} install")
    return path


@lru_cache(maxsize=1)
def api_types() -> ModuleType:
    """The loaded ``sglang.api.v1.api_types`` module (msgspec only; no torch, no sglang package)."""
    path = api_types_path()
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    if spec is None or spec.loader is None:
        raise ContractUnavailable(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = module  # msgspec resolves the Structs' annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop(_MODULE, None)
        raise
    return module


def _violation(type_name: str, body: Any) -> str | None:
    types = api_types()
    try:
        getattr(types, type_name).from_json_value(body)
    except types.JsonContractError as exc:
        return str(exc)
    return None


def generate_contract_error(body: Any) -> str | None:
    """The contract violation in a parsed ``/generate`` body, or None (SGLang's api_contract.py)."""
    return _violation("GenerateRequest", body)


def abort_contract_error(body: Any) -> str | None:
    """The contract violation in a parsed ``/abort_request`` body, or None."""
    return _violation("AbortRequest", body)
