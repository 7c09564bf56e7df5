"""The ``bf16`` variant (``passes.cast_bf16``; off by default, on in the serving preset): the verified fused model
computing in bfloat16.

Weights and activations in bf16 (8 bits of mantissa: about 3 significant digits), the inputs cast on the way
in and the outputs back to their fp32 dtype on the way out, so the artifact takes and returns what the fp32 one
does. Served through Inductor (``aoti``, ``pt2``), which runs bf16 convolutions and matmuls with oneDNN; fast only
where the CPU has AVX512-BF16 or AMX-BF16 (elsewhere skipped, see ``require_cpu_features``). OpenVINO's bf16 is
the same variant of the ``openvino`` format (its inference precision hint), made beside it. Gated like every
lossy variant (:mod:`fx_lightning.variants.base`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.passes.graph_utils import plain_graph_module
from fx_lightning.variants.base import (MadeVariant, Variant, VariantContext, VariantOptions, declare_variant,
                                        export_variant)

__all__ = ["BF16", "cast_bf16"]


class _InBf16(nn.Module):
    """``model`` in bf16 behind the fp32 interface: floating inputs cast to bf16, floating outputs back."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> Any:
        cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        return torch.utils._pytree.tree_map(
            lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t, self.model(*cast))


def in_bf16(gm: nn.Module) -> nn.Module:
    """A copy of ``gm`` computing in bf16 behind its fp32 interface (``gm`` is left as it was)."""
    return _InBf16(copy.deepcopy(plain_graph_module(gm) if isinstance(gm, fx.GraphModule) else gm)
                   .to(torch.bfloat16)).eval()


def cast_bf16(gm: fx.GraphModule, options: VariantOptions, ctx: VariantContext) -> MadeVariant:
    """The fused model in bfloat16 (inputs and outputs stay fp32), exported with a dynamic batch."""
    model = in_bf16(gm)
    made, notes = export_variant(model, tuple(ctx.calibration[0] if ctx.calibration else ctx.example_inputs),
                                 ctx.signature, "bf16")
    return MadeVariant(made.program.module(), notes)


BF16 = declare_variant(Variant(
    "bf16", "cast_bf16", VariantOptions, cast_bf16,  # the gate's options only: bf16 needs no calibration
    native_flags=frozenset({"avx512_bf16", "amx_bf16"}),
    native_text="AVX512-BF16 or AMX-BF16",
    without_native="bf16 would run emulated",
    probe=in_bf16))
