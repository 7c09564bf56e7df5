"""The machine a benchmark ran on, in one line: CPU model, family and model number, the instruction-set flags
that decide kernel speed, and what torch dispatches to. Written beside every figure, because the project's
machines do not all have the same CPU."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Dict, List

import torch

# The flags that change which kernels run (and how fast), in the order worth reading.
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_fields() -> Dict[str, str]:
    """The first processor's fields from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: Dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_description() -> str:
    """E.g. ``AMD EPYC (family 25 model 17; avx2 fma avx512f avx512_vnni avx512_bf16; torch: AVX512)``."""
    fields = cpu_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags: List[str] = [f for f in FLAGS if f in fields.get("flags", "").split()]
    family = f"family {fields['cpu family']} model {fields.get('model', '?')}; " if "cpu family" in fields else ""
    return f"{name} ({family}{' '.join(flags) or 'no AVX2'}; torch: {torch.backends.cpu.get_cpu_capability()})"
