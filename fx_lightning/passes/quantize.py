"""``quantize_int8`` (off by default): post-training static int8 of the verified fused model.

torchao's pt2e flow: the fused graph exported with a dynamic batch, ``prepare_pt2e`` with the
``X86InductorQuantizer`` (int8 convs and linears in the patterns Inductor lowers to int8 kernels),
calibrated on ``calibration_batches`` batches of data, ``convert_pt2e``. The result is a *variant*: lossy, so
it is not compared like the exact model but gated on accuracy (top-1 agreement with the fp32 model and the
accuracy drop against labels, on validation data) and exported beside the fp32 artifacts only when it passes
(served through Inductor: the ``aoti`` and ``pt2`` formats, ``load_fused(dir, compile=True)``). When it fails,
the fp32 artifacts stand alone and the report says by how much int8 missed. Needs the ``int8`` extra
(``pip install 'fx-lightning[int8]'``: torchao). On CPUs without VNNI int8 gains less: gate on measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from fx_lightning.batches import batch_at_least_two
from fx_lightning.errors import PassError
from fx_lightning.passes.base import PassContext, PassOptions, PassResult, Stage, builtin_pass
from fx_lightning.passes.graph_utils import plain_graph_module, unique_module_stacks

__all__ = ["QuantizeInt8Options", "quantize_int8"]


@dataclass
class QuantizeInt8Options(PassOptions):
    enabled: bool = False
    # Batches of the parity data (validation, else training data) run through the model to set the scales.
    calibration_batches: int = 8
    # The gate, on validation data: top-1 agreement with the fp32 model, and the accuracy drop against labels.
    min_top1_agreement: float = 0.98
    max_accuracy_drop: float = 0.01
    # A floor on the cosine similarity of each sample's outputs with the fp32 model's: catches an int8 model
    # whose scores drift while the top class holds (regression heads, embeddings).
    min_cosine: float = 0.99

    def check(self) -> None:
        if self.calibration_batches < 1:
            raise ValueError(f"calibration_batches: must be >= 1, got {self.calibration_batches}.")
        if not 0.0 <= self.min_top1_agreement <= 1.0:
            raise ValueError(f"min_top1_agreement: must be in [0, 1], got {self.min_top1_agreement}.")
        if not -1.0 <= self.min_cosine <= 1.0:
            raise ValueError(f"min_cosine: must be in [-1, 1], got {self.min_cosine}.")
        if not math.isfinite(self.max_accuracy_drop) or self.max_accuracy_drop < 0:
            raise ValueError(f"max_accuracy_drop: must be a finite number >= 0, got {self.max_accuracy_drop}.")


def _quantizer() -> object:
    try:
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq
    except ImportError as exc:
        raise PassError(f"quantize_int8 needs torchao: pip install 'fx-lightning[int8]' ({exc})") from None
    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    return quantizer


@builtin_pass("quantize_int8", options=QuantizeInt8Options, stage=Stage.variant,
              preserves_computation=False)
def quantize_int8(gm: fx.GraphModule, options: QuantizeInt8Options, ctx: PassContext) -> PassResult:
    """Post-training static int8 (torchao pt2e, X86InductorQuantizer), calibrated on data batches."""
    quantizer = _quantizer()  # first: without torchao it says what to install
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    result = PassResult()
    batches = ctx.calibration[: options.calibration_batches]
    if not batches:
        raise PassError("quantize_int8: no calibration batches (the model's inputs on data batches are needed)")
    plain = plain_graph_module(gm)
    args = batch_at_least_two(batches[0])
    dynamic = tuple({0: torch.export.Dim("batch", min=1)} if isinstance(a, torch.Tensor) and a.dim() else None
                    for a in args)
    with torch.no_grad():
        program = torch.export.export(plain, args, strict=False, dynamic_shapes=dynamic).module()
        renamed = unique_module_stacks(program)  # pt2e needs one module per call site
        prepared = prepare_pt2e(program, quantizer)  # type: ignore[arg-type]
        for batch in batches:
            prepared(*batch)
        result.variant = convert_pt2e(prepared)
    result.variant_name = "int8"
    result.variant_imports = ["torchao"]  # its quantize/dequantize ops: a saved program needs them to load
    result.change("<graph>", "quantized to int8", calibration_batches=len(batches), calls_made_unique=renamed)
    return result
