"""What a lossy serving variant is, declared once per precision like a :class:`~fx_lightning.formats.base.Format`.

A :class:`Variant` says everything about one precision (``int8``, ``bf16``): the name its artifacts carry
(``aoti-int8``), its options (:class:`VariantOptions`: the gate it must pass on validation data, its calibration),
the function that makes it from the verified fused graph, the modules a process imports to load it, and the CPU
features that run it natively. It is not a graph pass: a pass edits the graph it is given (graph -> graph); a
variant makes a *new*, lossy model beside the exact one, which the export side writes, gates loaded back and keeps
only when it passes (:mod:`fx_lightning.export.write.variants`). Its options keep the config key they have always had,
``passes.<key>`` (``passes.quantize_int8``): the config schema reads the declarations.

The gate, declared once here: top-1 agreement with the fp32 model and the accuracy drop against labels on the
parity batches (validation data, the held-out split), and a floor on each sample's cosine similarity with the fp32
outputs (catches scores that drift while the top class holds: regression heads, embeddings). The defaults are what
a user serving a classifier expects: the lossy model agrees with fp32 on 99% of samples and loses at most half a
point of accuracy.
"""

from __future__ import annotations

import dataclasses
import statistics
import timeit
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Generic, List, Optional, Sequence, Tuple, Type,
                    TypeVar)

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.common.calls import Call
from fx_lightning.errors import PassError, raised_in_pass, require_inputs
from fx_lightning.common.machine import CpuInfo
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.parity.options import GateThresholds, ParityConfig
from fx_lightning.signature.program import Program, export_program, signature_dims
from fx_lightning.common.rows import rows_of, with_rows
from fx_lightning.signature.signature import Signature

if TYPE_CHECKING:  # the reporter is handed down by the export; variants never import the export at run time
    from fx_lightning.export.progress import Progress

__all__ = ["Variant", "VariantOptions", "VariantContext", "MadeVariant", "VARIANTS", "declare_variant",
           "enabled_variants", "export_variant", "VARIANT_STATIC"]

VARIANT_STATIC = NoteKind("variant_static", "the {variant} model exports for the example's sizes only ({reason})")


@dataclass
class VariantOptions(GateThresholds):
    """Options every variant has: off by default, and the gate it must pass (the thresholds parity has, with a lossy
    model's defaults). A variant's own options subclass this."""

    min_cosine: float = 0.99
    min_top1_agreement: float = 0.99
    # A fraction: 0.005 = half a point of accuracy.
    max_accuracy_drop: float = 0.005
    enabled: bool = False
    # Made only where the CPU runs it natively (Variant.native_flags: int8 needs SIMD integer dot products, bf16
    # bf16 ones); elsewhere skipped with the reason. Where it is made, the selection times it against the fp32
    # artifacts and serves it only when it is faster. false: made and judged anyway (for another CPU).
    require_cpu_features: bool = True

    def calibration_needed(self) -> int:
        """How many data batches the variant is made from (besides its gate): one by default (its example)."""
        return 1

    def for_rehearsal(self) -> "VariantOptions":
        """The options the preflight makes the variant with on the untrained model (which misses any gate): enough
        to prove that making it runs. By default the same."""
        return self

    def gate_of(self, parity: ParityConfig) -> ParityConfig:
        """``parity`` (the exact model's gate) with this variant's thresholds: the one gate a lossy artifact is
        judged by."""
        fields = dataclasses.fields(GateThresholds)
        return dataclasses.replace(parity, **{f.name: getattr(self, f.name) for f in fields})


@dataclass
class VariantContext:
    """What making a variant may use: the fused graph's example inputs and its inputs on data batches
    (``calibration``, as many as the options' ``calibration_needed()``), how the graph is called (which dimensions
    carry samples and vary), and the gate (a candidate module -> its ParityReport) an accuracy-aware variant tries
    candidates against (None: no data to judge on). ``progress``: where a long loop (the calibration) says how far
    it is (None: nowhere)."""

    example_inputs: Optional[tuple] = None
    calibration: List[tuple] = field(default_factory=list)
    signature: Optional[Signature] = None
    gate: Optional[Callable[[Any], Any]] = None
    progress: Optional["Progress"] = None


@dataclass
class MadeVariant:
    """What making a variant gives: the lossy ``model`` (the fused graph is left as it was) and ``notes`` on how it
    was made (layers kept in float, a static export...)."""

    model: nn.Module
    notes: List[Note] = field(default_factory=list)


OptionsT = TypeVar("OptionsT", bound=VariantOptions)
MakeVariant = Callable[[fx.GraphModule, Any, VariantContext], MadeVariant]


@dataclass(frozen=True)
class Variant(Generic[OptionsT]):
    """One lossy precision, declared once (:func:`declare_variant`).

    ``name`` names its artifacts and its manifest record (``int8``: ``aoti-int8``); ``key`` its options under
    ``passes`` in the config; ``make`` makes it from the fused graph (written in the torch formats, pt2 and aoti);
    the formats that make it from their own fp32 artifact say so themselves (``Format.variants``); ``imports``: the
    modules a process imports to load it (those registering its ops); ``native_flags``: the CPU flags (any one) that
    run it natively (``native_text`` names them for people), ``without_native`` what happens without them;
    ``extra``: the pip extra it needs, if any."""

    name: str
    key: str
    options_type: Type[OptionsT]
    make: MakeVariant
    native_flags: FrozenSet[str]
    native_text: str
    without_native: str
    imports: Tuple[str, ...] = ()
    extra: Optional[str] = None
    # A quick stand-in of the variant in eager PyTorch (the fused model -> a model computing at its precision),
    # timed against fp32 when the CPU lacks the flags, so the skip reason carries a figure measured here.
    probe: Optional[Callable[[nn.Module], nn.Module]] = None

    def lacks(self, cpu: CpuInfo) -> Optional[str]:
        """Why this variant cannot be fast on ``cpu``, or None when it can."""
        if self.native_flags & cpu.flags:
            return None
        return f"this CPU has no {self.native_text} ({cpu.short()}): {self.without_native}"

    def measured_here(self, fused: nn.Module, inputs: Sequence[Any]) -> Optional[str]:
        """The :attr:`probe` and ``fused`` timed on ``inputs`` (medians of three calls after one warm-up each), as a
        phrase for a skip reason; None without a probe or when the probe cannot run."""
        if self.probe is None:
            return None
        try:
            slow = self.probe(fused)
            fp32, variant = _median_s(fused, inputs), _median_s(slow, inputs)
        except Exception:  # noqa: BLE001 - a figure for the report only; the skip stands without it
            return None
        return (f"measured here in eager PyTorch on one example: {self.name} {1e3 * variant:.2f} ms against fp32 "
                f"{1e3 * fp32:.2f} ms ({variant / fp32:.1f}x)")

    def build(self, fused: fx.GraphModule, options: OptionsT, ctx: VariantContext) -> MadeVariant:
        """The variant made from ``fused``; any failure is a PassError naming the options' key."""
        require_inputs(bool(ctx.calibration) or ctx.example_inputs is not None, f"the {self.name} model",
                       key=f"passes.{self.key}")
        with raised_in_pass(f"passes.{self.key}"):
            made = self.make(fused, options, ctx)
        if not isinstance(made, MadeVariant) or not isinstance(made.model, nn.Module):
            raise PassError(f"passes.{self.key} made {type(made).__name__}, not a MadeVariant with a model")
        return made


def _median_s(module: nn.Module, inputs: Sequence[Any]) -> float:
    with torch.no_grad():
        module(*inputs)
        return statistics.median(timeit.repeat(lambda: module(*inputs), number=1, repeat=3))


# Every variant, by name, in the order they are made (and their options listed in the config).
VARIANTS: Dict[str, Variant] = {}


def declare_variant(variant: Variant) -> Variant:
    """Register ``variant``; its name and its key are each taken once."""
    clash = [v.name for v in VARIANTS.values() if variant.name == v.name or variant.key == v.key]
    if clash:
        raise ValueError(f"variant {variant.name!r} (passes.{variant.key}): name or key already declared by "
                         f"{clash[0]!r}")
    VARIANTS[variant.name] = variant
    return variant


def enabled_variants(passes: Any) -> List[Tuple[Variant, VariantOptions]]:
    """The (variant, options) a ``PassesConfig`` enables, in declaration order."""
    pairs = [(v, getattr(passes, v.key)) for v in VARIANTS.values()]
    return [(v, options) for v, options in pairs if options.enabled]


def export_variant(model: nn.Module, inputs: Tuple[Any, ...], signature: Optional[Signature],
                   name: str) -> Tuple[Program, List[Note]]:
    """The ``name`` variant's model exported with the dimensions the signature says vary (the sample axis repeated to
    two samples when the example has one), else for the example's sizes (a model that fixes a size is fixed in its
    variants too), and a note when its program is fixed to the example's sizes."""
    if signature is None:  # no observed calls (made by hand): dim 0 of every tensor
        dims = [{0: torch.export.Dim("batch", min=1)} if isinstance(a, torch.Tensor) and a.dim() else None
                for a in inputs]
        axes = [0 if d else None for d in dims]
    else:
        dims, axes = signature_dims(signature), (signature.input_axes() if signature.batched else [])
    dynamic_inputs = tuple(with_rows(inputs, axes, 2)) if axes and rows_of(inputs, axes) == 1 else inputs
    made = export_program(model, Call(dynamic_inputs), dims if any(dims) else None, allow_static=True,
                          static_call=Call(tuple(inputs)))
    return made, [] if made.dynamic else [VARIANT_STATIC(variant=name, reason=made.static_reason or "unknown")]
