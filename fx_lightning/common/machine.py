"""The CPU this process runs on: its model and the instruction-set features that decide whether a lossy variant
runs natively here (each variant declares the flags it needs: :class:`fx_lightning.variants.Variant`; whether it is
faster than fp32 is measured by the selection, not read off the flags).

Read from ``/proc/cpuinfo`` (Linux), or from the file ``$FX_LIGHTNING_CPUINFO`` names; elsewhere from what torch
dispatches to, which says AVX-512 but not VNNI or BF16, so the lossy variants are then made only when asked for
with ``require_cpu_features: false``. Tests fake any CPU with a cpuinfo text (:func:`parse_cpuinfo`, or the
environment variable).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import FrozenSet, List, Optional

import torch

__all__ = ["CpuInfo", "cpu_info", "parse_cpuinfo", "REPORTED_FLAGS", "CPUINFO_ENV"]

CPUINFO_ENV = "FX_LIGHTNING_CPUINFO"

# The flags that change which kernels run (and how fast), in the order worth reading.
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx_vnni", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
                  "amx_int8")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: FrozenSet[str] = field(default_factory=frozenset)
    family: Optional[str] = None
    model_number: Optional[str] = None
    known: bool = True  # False: no cpuinfo was readable, the flags are not known

    def short(self) -> str:
        """E.g. ``AMD EPYC 9R14 (family 25 model 17; avx2 fma avx512f avx512_vnni avx512_bf16)``."""
        shown: List[str] = [f for f in REPORTED_FLAGS if f in self.flags]
        family = f"family {self.family} model {self.model_number}; " if self.family else ""
        flags = " ".join(shown) if self.known else "flags unknown"
        return f"{self.model} ({family}{flags or 'no AVX2'})"


def parse_cpuinfo(text: str) -> CpuInfo:
    """The first processor of a ``/proc/cpuinfo`` text."""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return CpuInfo(fields.get("model name") or platform.processor() or platform.machine(),
                   frozenset(fields.get("flags", "").split()), fields.get("cpu family"), fields.get("model"))


def cpu_info() -> CpuInfo:
    """This machine's CPU: ``/proc/cpuinfo``, or the file ``$FX_LIGHTNING_CPUINFO`` names (the serving machine's
    cpuinfo, copied to the machine that trains: the variants are then made for that CPU; tests fake CPUs so)."""
    return _read(os.environ.get(CPUINFO_ENV) or "/proc/cpuinfo")


@functools.lru_cache(maxsize=8)
def _read(path: str) -> CpuInfo:
    try:
        return parse_cpuinfo(Path(path).read_text())
    except OSError:
        capability = torch.backends.cpu.get_cpu_capability()  # e.g. 'AVX2', 'AVX512': no VNNI/BF16 facts
        return CpuInfo(platform.processor() or platform.machine(), frozenset({capability.lower()}), known=False)
