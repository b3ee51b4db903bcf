"""JSON for the hot paths: orjson (several times faster than the standard library) when installed."""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; this keeps the code importable without it
    orjson = None  # type: ignore[assignment]

if orjson is not None:
    JSONDecodeError: type[ValueError] = orjson.JSONDecodeError

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    def loads(data: bytes | str) -> Any:
        return orjson.loads(data)
else:
    JSONDecodeError = json.JSONDecodeError

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    def loads(data: bytes | str) -> Any:
        return json.loads(data)
