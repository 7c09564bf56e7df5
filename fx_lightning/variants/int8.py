"""The ``int8`` variant (``passes.quantize_int8``; off by default, on in the serving preset): post-training static
int8 of the verified fused model, accuracy-aware.

torchao's pt2e flow: the fused graph exported with a dynamic batch, ``prepare_pt2e`` with the
``X86InductorQuantizer`` (int8 convs and linears in the patterns Inductor lowers to int8 kernels), calibrated on
``calibration_batches`` batches of data, ``convert_pt2e``. The result is a *variant*: lossy, so it is not compared
like the exact model but gated on accuracy (:mod:`fx_lightning.variants.base`) and exported beside the fp32
artifacts only when it passes (served through Inductor: the ``aoti`` and ``pt2`` formats).

Accuracy-aware: when the all-int8 model misses the gate, some layers are kept in float. Each quantisable layer
(conv, linear) is ranked by how far its int8 rounding alone moves the model's outputs (its input and weights
fake-quantised as the quantiser would, every other layer in float, on ``ranking_batches`` calibration batches);
then the top 1, 2, 4, ... layers stay float until the gate passes (and the smallest passing count is searched
for), at most ``max_float_layers``. The report names the layers kept in float and their measured effect. Needs the
``int8`` extra (``pip install 'fx-lightning[int8]'``: torchao).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from fx_lightning.common.batches import flat_tensors
from fx_lightning.errors import PassError
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.passes.graph_utils import plain_graph_module, unique_module_stacks
from fx_lightning.variants.base import (MadeVariant, Variant, VariantContext, VariantOptions, declare_variant,
                                        export_variant)

if TYPE_CHECKING:
    from fx_lightning.export.progress import Progress

__all__ = ["INT8", "QuantizeInt8Options", "quantize_int8", "calibrate_int8", "FLOAT_LAYERS", "LayerEffect",
           "rank_layers"]

FLOAT_LAYERS = NoteKind(
    "float_layers", "{kept} of {layers} quantisable layers kept in float so the int8 model passes its gate, the "
    "most sensitive first (their int8 rounding alone moved the outputs most: {effects}); {tries} tried")
FLOAT_LAYERS_NOT_ENOUGH = NoteKind(
    "float_layers_not_enough", "with {kept} of {layers} quantisable layers in float (passes.quantize_int8."
    "max_float_layers) the int8 model still misses its gate; {tries} tried")

_QUANTISABLE = {torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default,
                torch.ops.aten.linear.default}


@dataclass
class QuantizeInt8Options(VariantOptions):
    # Batches of the parity data (validation, else training data) run through the model to set the scales.
    calibration_batches: int = 8
    # When the all-int8 model misses the gate: at most this many layers kept in float (0: all-or-nothing).
    max_float_layers: int = 8
    # Calibration batches the layers are ranked on (one run over them per quantisable layer).
    ranking_batches: int = 2

    def calibration_needed(self) -> int:
        return self.calibration_batches

    def for_rehearsal(self) -> "QuantizeInt8Options":
        """The accuracy-aware search on one layer and one batch: the untrained model misses any gate."""
        return dataclasses.replace(self, max_float_layers=min(self.max_float_layers, 1), ranking_batches=1)

    def check(self) -> None:
        super().check()
        if self.calibration_batches < 1:
            raise ValueError(f"calibration_batches: must be >= 1, got {self.calibration_batches}.")
        if self.max_float_layers < 0:
            raise ValueError(f"max_float_layers: must be >= 0, got {self.max_float_layers}.")
        if self.ranking_batches < 1:
            raise ValueError(f"ranking_batches: must be >= 1, got {self.ranking_batches}.")


@dataclass(frozen=True)
class LayerEffect:
    """One quantisable layer: its graph node, the module it came from, and how far its int8 rounding alone moves
    the outputs (relative L2 error over the ranking batches)."""

    node: str
    module: str
    effect: float


def _quantizer(float_nodes: Sequence[str] = ()) -> Any:
    try:
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq
    except ImportError as exc:
        raise PassError(f"quantize_int8 needs torchao: pip install 'fx-lightning[int8]' ({exc})") from None

    keep = set(float_nodes)

    class FloatLayersQuantizer(xiq.X86InductorQuantizer):  # type: ignore[misc, valid-type]
        """The x86 quantizer, with the inputs of the named nodes left unannotated: they run in float."""

        def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
            model = super().annotate(model)
            for node in model.graph.nodes:
                annotation = node.meta.get("quantization_annotation")
                if node.name in keep and annotation is not None:
                    annotation.input_qspec_map = {}
            return model

    quantizer = FloatLayersQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    return quantizer


def calibrate_int8(program: fx.GraphModule, batches: Sequence[tuple], float_nodes: Sequence[str], *,
                   progress: Optional[Progress] = None) -> fx.GraphModule:
    """``program`` quantised to int8 (pt2e, X86InductorQuantizer), its scales set by running ``batches``, the layers
    at ``float_nodes`` kept in float. Every int8 model the pass makes comes from here. ``progress``: told after each
    batch (a calibration on a large model is a long, otherwise quiet step)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    prepared = prepare_pt2e(copy.deepcopy(program), _quantizer(float_nodes))  # type: ignore[arg-type]
    for done, batch in enumerate(batches, 1):
        prepared(*batch)
        if progress is not None:
            progress.advance("calibration", done, len(batches))
    return convert_pt2e(prepared)


def quantize_int8(gm: fx.GraphModule, options: QuantizeInt8Options, ctx: VariantContext) -> MadeVariant:
    """Post-training static int8 (torchao pt2e, X86InductorQuantizer), calibrated on data batches; accuracy-aware
    (layers kept in float until the gate passes)."""
    _quantizer()  # first: without torchao it says what to install
    batches = ctx.calibration[: options.calibration_batches]
    if not batches:
        raise PassError("passes.quantize_int8: no calibration batches (the model's inputs on data batches are needed)")
    made, notes = export_variant(plain_graph_module(gm), tuple(batches[0]), ctx.signature, "int8")
    with torch.no_grad():
        program = made.program.module()
        unique_module_stacks(program)  # pt2e needs one module per call site
        variant = calibrate_int8(program, batches, (), progress=ctx.progress)
        if ctx.gate is not None and options.max_float_layers > 0 and not ctx.gate(variant).passed:
            variant = _keep_sensitive_layers_float(program, batches, options, ctx.gate, notes, ctx.progress)
    return MadeVariant(variant, notes)


INT8 = declare_variant(Variant(
    "int8", "quantize_int8", QuantizeInt8Options, quantize_int8,
    # int8 dot products in SIMD: AVX2's (VPMADDUBSW, which ONNX Runtime, OpenVINO and oneDNN use), VNNI's or AMX's.
    # Whether int8 beats fp32 is not assumed from them: the selection times it against fp32 on the machine at hand
    # (on a Zen 3 with AVX2 only, ONNX Runtime's and OpenVINO's int8 ran resnet18 1.9-2.1x faster than their fp32).
    native_flags=frozenset({"avx2", "avx512_vnni", "avx_vnni", "amx_int8"}),
    native_text="AVX2, VNNI or AMX-INT8",
    without_native="int8 would run without SIMD integer dot products",
    imports=("torchao",),  # its quantize/dequantize ops: a saved program needs them imported to load
    extra="int8"))


def _keep_sensitive_layers_float(program: fx.GraphModule, batches: Sequence[tuple], options: QuantizeInt8Options,
                                 gate: Callable[[Any], Any], notes: List[Note],
                                 progress: Optional[Progress] = None) -> fx.GraphModule:
    """The int8 model with the fewest most-sensitive layers in float that passes ``gate`` (counts 1, 2, 4, ...
    up to ``max_float_layers``, then bisected down), or, when none passes, the one with the most in float."""
    ranking = rank_layers(program, batches[: options.ranking_batches])
    bound = min(options.max_float_layers, len(ranking))
    tried: Dict[int, Tuple[bool, fx.GraphModule]] = {}

    def attempt(count: int) -> bool:
        if count not in tried:
            candidate = calibrate_int8(program, batches, [layer.node for layer in ranking[:count]], progress=progress)
            tried[count] = (bool(gate(candidate).passed), candidate)
        return tried[count][0]

    failing, count = 0, 1
    while count < bound and not attempt(count):
        failing, count = count, min(2 * count, bound)
    if not attempt(count):  # even the bound misses the gate
        notes.append(FLOAT_LAYERS_NOT_ENOUGH(kept=count, layers=len(ranking), tries=len(tried) + 1))
        return tried[count][1]
    passing = count
    while passing - failing > 1:  # the fewest float layers that pass
        middle = (failing + passing) // 2
        if attempt(middle):
            passing = middle
        else:
            failing = middle
    kept = ranking[:passing]
    notes.append(FLOAT_LAYERS(
        kept=passing, layers=len(ranking), tries=len(tried) + 1, float_layers=[layer.module for layer in kept],
        effects=", ".join(f"{layer.module} {layer.effect:.2g}" for layer in kept)))
    return tried[passing][1]


def rank_layers(program: fx.GraphModule, batches: Sequence[tuple]) -> List[LayerEffect]:
    """Every quantisable layer of ``program`` (an exported, unquantised graph), most sensitive first: the relative
    L2 error of the outputs when only that layer's input (per-tensor, uint8, its observed range) and weights
    (per output channel, int8, symmetric) are rounded as the quantiser would."""
    nodes = [n for n in program.graph.nodes if n.op == "call_function" and n.target in _QUANTISABLE]
    ranges: Dict[str, Tuple[float, float]] = {}
    with torch.no_grad():
        references = [flat_tensors(_Run(program, ranges=ranges).run(*b)) for b in batches]
        effects = []
        for node in nodes:
            error = squared = 0.0
            for batch, reference in zip(batches, references):
                got = flat_tensors(_Run(program, fake_quantised=node.name, ranges=ranges).run(*batch))
                for g, r in zip(got, reference):
                    if r.is_floating_point():
                        error += float((g.double() - r.double()).pow(2).sum())
                        squared += float(r.double().pow(2).sum())
            effects.append(LayerEffect(node.name, _module_path(node), (error / squared) ** 0.5 if squared else 0.0))
    return sorted(effects, key=lambda e: -e.effect)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = str(list(stack.values())[-1][0]) if stack else ""
    return path.split("@")[0] or node.name


class _Run(fx.Interpreter):
    """Runs the graph; records each quantisable node's input range (when ``fake_quantised`` is None), or rounds
    the input and weights of node ``fake_quantised`` to int8 with the ranges recorded."""

    def __init__(self, program: fx.GraphModule, ranges: Dict[str, Tuple[float, float]],
                 fake_quantised: Optional[str] = None) -> None:
        super().__init__(program)
        self.ranges, self.fake_quantised = ranges, fake_quantised

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "call_function" or n.target not in _QUANTISABLE:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        x, weight = args[0], args[1]
        if self.fake_quantised is None:
            low, high = self.ranges.get(n.name, (0.0, 0.0))
            self.ranges[n.name] = (min(low, float(x.min())), max(high, float(x.max())))
        elif n.name == self.fake_quantised:
            args = (_round_activation(x, *self.ranges[n.name]), _round_weight(weight), *args[2:])
        return n.target(*args, **kwargs)


def _round_activation(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    scale = max(high - low, 1e-12) / 255.0
    zero = round(-low / scale)
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale


def _round_weight(weight: torch.Tensor) -> torch.Tensor:
    scale = weight.detach().abs().flatten(1).amax(1).clamp_min(1e-12) / 127.0
    scale = scale.view(-1, *([1] * (weight.dim() - 1)))
    return torch.clamp(torch.round(weight / scale), -128, 127) * scale
