"""JSON-safe views of what fx-lightning records (reports, manifests, parity figures)."""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import Any, Dict

import torch

__all__ = ["JsonObject", "json_safe", "dtype_name"]

# A JSON object as json.loads gives it: the JSON view of a typed record (a config dump, a report), or a format's
# own fields for its loader. Records are dataclasses; this is their serialised form only.
JsonObject = Dict[str, Any]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def json_safe(value: Any) -> Any:
    """Plain JSON types only: tensors and numpy scalars become numbers, enums their values, non-finite
    floats strings (JSON has no NaN), objects with ``to_dict()`` their dict, anything else its ``str``."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [json_safe(v) for v in value]
    if isinstance(value, enum.Enum):
        return json_safe(value.value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, torch.Tensor):
        return json_safe(value.detach().cpu().tolist())
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return json_safe(value.to_dict())
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return json_safe(value.item())
        except (TypeError, ValueError):
            pass
    return str(value)
