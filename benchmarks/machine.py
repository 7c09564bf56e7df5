"""The machine a benchmark ran on, in one line: CPU model, family and model number, the instruction-set flags
that decide kernel speed (read by the library, :mod:`fx_lightning.common.machine`, which decides with them whether a
lossy variant can be fast), and what torch dispatches to. Written beside every figure, because the project's
machines do not all have the same CPU."""

from __future__ import annotations

import torch

from fx_lightning.common.machine import cpu_info


def cpu_description() -> str:
    """E.g. ``AMD EPYC (family 25 model 17; avx2 fma avx512f avx512_vnni avx512_bf16; torch: AVX512)``."""
    return f"{cpu_info().short()[:-1]}; torch: {torch.backends.cpu.get_cpu_capability()})"
