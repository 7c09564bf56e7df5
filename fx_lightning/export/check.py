"""Checking an artifact: the examples and fp64 outputs every artifact is judged against (:class:`Reference`), the
``check.pt`` file that carries a few of them beside the artifacts (so a fresh process verifies any artifact
without the training code), and the one judgement of an artifact on them (:func:`check_artifact`, giving an
:class:`~fx_lightning.parity.report.ArtifactCheck`), used by the export (:func:`check_roundtrip`), the selection and
the server alike."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.common.imports import missing_modules
from fx_lightning.common.batches import flat_tensors
from fx_lightning.common.calls import Call, map_leaves, run_seeded
from fx_lightning.errors import ExportError, first_line
from fx_lightning.formats.base import Format, FormatEntry, WriteContext
from fx_lightning.parity.compare import (Comparison, agreement, compare_outputs, is_discrete, relative_error,
                                         structure_mismatch)
from fx_lightning.parity.metrics import sample_cosine
from fx_lightning.parity.report import ArtifactCheck, ParityReport
from fx_lightning.common.rows import rows_of, take_rows, with_rows
from fx_lightning.common.tolerance import DISCRETE_AGREEMENT, LOSSY_MAX_ERROR

__all__ = ["CHECK_FILE", "FUSED_FP64", "Reference", "reference_for", "write_check_file", "read_check_file",
           "check_artifact", "check_roundtrip"]

# A few example inputs and their fp64 reference outputs, saved beside the artifacts.
CHECK_FILE = "check.pt"


def _outputs(model: nn.Module, args: Tuple[Any, ...]) -> List[torch.Tensor]:
    # A fixed RNG: a model that draws random numbers in eval mode must match itself, not fail the check.
    return flat_tensors(run_seeded(model, Call(args)))


# What artifacts are judged against by default (WriteContext.reference: something else).
FUSED_FP64 = "an fp64 copy of the fused model"


# At most this much of a discrete output's elements may flip beyond ``parity.min_discrete_agreement`` where the fused
# model itself flips that often against fp64: more is never excused by it.
_MORE_FLIPS = 0.02


@dataclass
class Reference:
    """What every artifact is judged against: an fp64 copy of the fused model, or of ``WriteContext.reference``
    (on the example, on one sample when the sample axis is dynamic, on each number of samples an AOTInductor
    package is built for, and on the examples of other sizes), and the fused model's own error against it.
    Another runtime's kernels (ONNX Runtime, Inductor) round differently, so an artifact passes when its error is of
    the order of the fused model's own (:func:`~fx_lightning.common.tolerance.rounding_tolerance`). ``stochastic``:
    the outputs drawn at random in forward (no other runtime draws the same numbers), left out of the values
    compared."""

    batches: List[Tuple[Any, ...]]
    exact: List[List[torch.Tensor]]
    fused_error: float
    against: str = FUSED_FP64
    axes: List[Optional[int]] = field(default_factory=list)  # the inputs' sample axes (empty: none proven)
    output_axes: List[Optional[int]] = field(default_factory=list)
    stochastic: List[int] = field(default_factory=list)
    fused_agreement: float = 1.0  # the fused model's own worst agreement with fp64 on a discrete output

    def discrete_agreement(self, wanted: float) -> float:
        """The agreement an artifact's discrete outputs need: ``wanted``, or as many flips as twice the fused model's
        own against fp64 where it has more (another runtime rounds the ties its own way), never below ``wanted``
        less :data:`_MORE_FLIPS`."""
        return min(wanted, max(wanted - _MORE_FLIPS, 1.0 - 2.0 * (1.0 - self.fused_agreement)))

    @property
    def inputs(self) -> Tuple[Any, ...]:
        """The first example's inputs (``check.pt``'s)."""
        return self.batches[0]

    @property
    def expected(self) -> List[torch.Tensor]:
        """The first example's fp64 outputs."""
        return self.exact[0]

    def rows(self, batch: Tuple[Any, ...]) -> Optional[int]:
        return rows_of(batch, self.axes) if self.axes else None

    def for_entry(self, entry: FormatEntry, dynamic: bool) -> List[Tuple[Tuple[Any, ...], List[torch.Tensor]]]:
        """The examples an artifact is checked on: those of the sample counts it is built for, else every example
        when it takes other sizes, else the first."""
        pairs = list(zip(self.batches, self.exact))
        if entry.batch_sizes:
            return [p for p in pairs if self.rows(p[0]) in entry.batch_sizes]
        return pairs if dynamic else pairs[:1]


def reference_for(ctx: WriteContext) -> Reference:
    """The examples every artifact of ``ctx`` is checked on, and their fp64 outputs (see :class:`Reference`)."""
    signature = ctx.signature
    axes = signature.input_axes() if signature.batched else []
    batches = [ctx.args]
    if ctx.sample_dynamic and signature.sample.any_size:
        batches.append(tuple(take_rows(ctx.args, axes, 0, 1)))
    if signature.batched:
        sizes = {rows_of(b, axes) for b in batches}
        batches += [tuple(with_rows(ctx.args, axes, n)) for n in ctx.aoti_batch_sizes if n not in sizes]
    if ctx.dynamic or ctx.graph_takes_other_sizes:
        batches += ctx.check_args  # examples of other sizes: for the artifacts that take them
    stochastic = [i for i, leaf in enumerate(signature.outputs) if leaf.stochastic]
    fused = [_outputs(ctx.model, b) for b in batches]
    original = ctx.reference.model if ctx.reference is not None else ctx.model
    try:  # the fp64 copy is made, used and freed here: no second copy of the model lives through the export
        exact_model = copy.deepcopy(original).double()
        exact = [[_as_double(t) for t in _outputs(exact_model, map_leaves(_as_double, b))] for b in batches]
        del exact_model
    except RuntimeError:  # no fp64 kernel for some op: judge against the fused model itself
        exact = [[_as_double(t) for t in out] for out in fused]
    for i, (out, ex) in enumerate(zip(fused, exact)):
        if [t.shape for t in out] != [t.shape for t in ex]:
            # fp64 took another branch (a score threshold keeps another number of rows, as NMS does): that example
            # is judged against the original model at the artifacts' precision, which took the same one.
            exact[i] = [_as_double(t) for t in _outputs(original, batches[i])]
    errors = [relative_error(f.double(), e) for out, ex in zip(fused, exact) for i, (f, e) in enumerate(zip(out, ex))
              if e.is_floating_point() and not is_discrete(f) and i not in stochastic  # a discrete output flips
              and f.shape == e.shape]  # fusion took another branch than the model: each artifact's check says so
    # A discrete output (labels, a mask) of the fused model itself flips on ties against fp64 (a detector's labels
    # on random inputs: 1 in 100): an artifact may flip as many, judged against the same fp64 outputs.
    agreements = [agreement(f, e.to(f.dtype)) for out, ex in zip(fused, exact) for i, (f, e) in enumerate(zip(out, ex))
                  if is_discrete(e) and is_discrete(f) and i not in stochastic and f.shape == e.shape]
    return Reference(batches, exact, max(errors, default=0.0),
                     ctx.reference.against if ctx.reference is not None else FUSED_FP64, list(axes),
                     signature.output_axes() if signature.batched else [], stochastic,
                     fused_agreement=min(agreements, default=1.0))


def _as_double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def write_check_file(root: Path, reference: Reference, samples: int = 8) -> None:
    """``check.pt``: a few example inputs (at most ``samples`` along the sample axis, when there is one) and the
    fp64 reference outputs, so a fresh process (``fx-lightning bench``, a serving health check) can verify any
    artifact without the training code."""
    batch, exact = reference.batches[0], reference.exact[0]
    rows = reference.rows(batch)
    if rows is not None and rows > samples:
        batch = tuple(take_rows(batch, reference.axes, 0, samples))
        exact = take_rows(exact, reference.output_axes, 0, samples)
    inputs = [a.detach().cpu() if isinstance(a, torch.Tensor) else a for a in batch]
    torch.save({"inputs": inputs, "expected": [t.cpu() for t in exact], "fused_error": reference.fused_error,
                "stochastic": list(reference.stochastic), "against": reference.against, "axes": list(reference.axes),
                "output_axes": list(reference.output_axes), "fused_agreement": reference.fused_agreement},
               root / CHECK_FILE)


def read_check_file(root: Path) -> Optional[Reference]:
    """What :func:`write_check_file` wrote, as a :class:`Reference` of one example (None when the export has no
    ``check.pt``); loaded without pickled code."""
    path = Path(root) / CHECK_FILE
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    return Reference([tuple(saved["inputs"])], [list(saved["expected"])], float(saved.get("fused_error", 0.0)),
                     str(saved.get("against", FUSED_FP64)), list(saved.get("axes", [])),
                     list(saved.get("output_axes", [])), [int(i) for i in saved.get("stochastic", [])],
                     float(saved.get("fused_agreement", 1.0)))


def check_artifact(module: nn.Module, reference: Reference,
                   examples: Optional[Sequence[Tuple[Tuple[Any, ...], List[torch.Tensor]]]] = None, *,
                   min_agreement: float = DISCRETE_AGREEMENT, gate: Optional[ParityReport] = None) -> ArtifactCheck:
    """The one judgement of an artifact, at export, in the selection and in a server: ``module`` run on each of
    ``examples`` (default: every example of ``reference``; at least one) against their fp64 outputs.

    An exact artifact passes when every output has the reference's structure and is within its dtype's rounding or
    a few times the fused model's own error, and every discrete output agrees on at least ``min_agreement`` of its
    elements (``parity.min_discrete_agreement``). A lossy variant (``gate``: its accuracy gate at export) passes
    when that gate passed and, here, its outputs have the reference's structure, are finite, are not unrelated to
    the model (relative error below 1), have a worst per-sample cosine within the gate's ``min_cosine`` and discrete
    outputs within ``min_agreement``: a lossy artifact that raises or returns NaN on this machine is never served."""
    pairs = list(zip(reference.batches, reference.exact)) if examples is None else list(examples)
    lossy = gate is not None
    record = dict(fused_error=reference.fused_error, against=reference.against, lossy=lossy)
    if not pairs:
        return ArtifactCheck(False, "no example to run it on (none of the check's examples has a batch size it is "
                                    "built for)", **record)
    if gate is not None and not gate.passed:
        return ArtifactCheck(False, "lossy variant: it missed its accuracy gate at export", **record)
    worst, allowed, sizes = 0.0, 0.0, []
    for batch, want in pairs:
        rows = reference.rows(batch)
        where = (f"batch size {rows}" if rows is not None else "inputs of shapes "
                 + ", ".join(str(list(a.shape)) for a in batch if isinstance(a, torch.Tensor)))
        try:
            got = _outputs(module, batch)
        except Exception as exc:  # noqa: BLE001 - the artifact's own failure, in words
            return ArtifactCheck(False, f"raises on {where}: {type(exc).__name__}: {first_line(exc)[:200]}",
                                 batch_sizes=sizes, **record)
        comparison = _compare(got, want, reference, min_agreement, gate)
        if not comparison.passed:
            return ArtifactCheck(False, f"on {where}: {comparison.describe()}, against {reference.against}, where "
                                        f"the fused model itself is at {reference.fused_error:.1e}",
                                 comparison.relative_error, comparison.tolerance, batch_sizes=sizes, **record)
        worst, allowed = max(worst, comparison.relative_error), max(allowed, comparison.tolerance)
        if rows is not None and rows not in sizes:
            sizes.append(int(rows))
    return ArtifactCheck(True, None, worst, allowed, batch_sizes=sizes, **record)


def _compare(got: List[torch.Tensor], expected: List[torch.Tensor], reference: Reference, min_agreement: float,
             gate: Optional[ParityReport]) -> Comparison:
    """``got`` against the fp64 ``expected`` outputs, compared flat (runtimes such as ONNX Runtime return their
    outputs flat), the outputs drawn at random by structure only. The reference is cast to each output's dtype, so
    an output is allowed its own dtype's rounding (or a few times the fused model's own error when larger); a lossy
    one the gate's agreement."""
    want = expected
    if len(got) == len(expected):
        want = [e.to(g.dtype) if g.is_floating_point() and e.is_floating_point() and g.shape == e.shape else e
                for g, e in zip(got, expected)]
        if reference.stochastic and structure_mismatch(got, want, nested=False) is None:
            got = [g for i, g in enumerate(got) if i not in reference.stochastic]
            want = [w for i, w in enumerate(want) if i not in reference.stochastic]
    if gate is None:
        return compare_outputs(got, want, own_error=reference.fused_error, nested=False,
                               min_agreement=reference.discrete_agreement(min_agreement))
    comparison = compare_outputs(got, want, rtol=LOSSY_MAX_ERROR, nested=False, min_agreement=min_agreement)
    if comparison.mismatch is not None or comparison.failure is not None:
        return comparison
    min_cosine = gate.thresholds.get("cosine_similarity_min")
    cosine = min((float(sample_cosine(g.detach(), w.detach()).min()) for g, w in zip(got, want)
                  if w.is_floating_point() and not is_discrete(w) and w.numel()), default=1.0)
    if min_cosine is not None and not cosine >= min_cosine:
        return dataclasses.replace(comparison, failure=f"worst cosine similarity {cosine:.4f} is below its gate's "
                                                       f"min_cosine {min_cosine:.4f}")
    return comparison


def check_roundtrip(staging: Path, fmt: Format, entry: FormatEntry, reference: Reference, dynamic: bool,
                    min_agreement: float = DISCRETE_AGREEMENT) -> ArtifactCheck:
    """Load ``fmt`` back and judge it (:func:`check_artifact`) on each example it must take; raises
    :class:`ExportError` with the reason when it fails (the format is then dropped, or the export fails)."""
    missing = missing_modules(fmt.runtime_requires)
    if missing:
        return ArtifactCheck(False, f"{', '.join(missing)} is not installed: loaded and checked where it is",
                             fused_error=reference.fused_error, against=reference.against)
    # Loaded where it was built, so a GPU model is checked where it runs (ONNX Runtime checks on the CPU).
    try:
        loaded = fmt.load(staging, entry, torch.device(entry.device))
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"written but cannot be loaded back: {type(exc).__name__}: {first_line(exc)}") from exc
    check = check_artifact(loaded, reference, reference.for_entry(entry, dynamic), min_agreement=min_agreement)
    if not check.passed:
        what = "fails: it" if check.relative_error is None else "disagrees with the fused model"
        raise ExportError(f"the loaded model {what} {check.reason}.")
    return check
