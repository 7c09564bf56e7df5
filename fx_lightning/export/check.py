"""Checking an artifact: the examples and fp64 outputs every artifact is judged against (:class:`Reference`), the
``check.pt`` file that carries a few of them beside the artifacts (so a fresh process verifies any artifact
without the training code), and the comparison of a loaded artifact with them (:func:`check_artifact`,
:func:`check_roundtrip`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning._imports import missing_modules
from fx_lightning.batches import flat_tensors
from fx_lightning.calls import map_leaves, no_distribution_validation
from fx_lightning.errors import ExportError, first_line
from fx_lightning.formats.base import Format, FormatEntry, RoundTrip, WriteContext
from fx_lightning.parity.compare import Comparison, compare_outputs, is_discrete, relative_error, structure_mismatch
from fx_lightning.rows import rows_of, take_rows, with_rows
from fx_lightning.tolerance import DISCRETE_AGREEMENT

__all__ = ["CHECK_FILE", "FUSED_FP64", "Reference", "reference_for", "CheckData", "write_check_file",
           "read_check_file", "check_artifact", "check_roundtrip"]

# A few example inputs and their fp64 reference outputs, saved beside the artifacts.
CHECK_FILE = "check.pt"


def _outputs(model: nn.Module, args: Tuple[Any, ...]) -> List[torch.Tensor]:
    # A fixed RNG: a model that draws random numbers in eval mode must match itself, not fail the check.
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
    with torch.no_grad(), torch.random.fork_rng(devices=devices), no_distribution_validation():
        torch.manual_seed(0)
        return flat_tensors(model(*args))


# What artifacts are judged against by default (WriteContext.reference: something else).
FUSED_FP64 = "an fp64 copy of the fused model"


@dataclass
class Reference:
    """What every artifact is judged against: an fp64 copy of the fused model, or of ``WriteContext.reference``
    (on the example, on one sample when the sample axis is dynamic, on each number of samples an AOTInductor
    package is built for, and on the examples of other sizes), and the fused model's own error against it.
    Another runtime's kernels (ONNX Runtime, Inductor) round differently, so an artifact passes when its error is of
    the order of the fused model's own (:func:`~fx_lightning.tolerance.rounding_tolerance`). ``stochastic``:
    the outputs drawn at random in forward (no other runtime draws the same numbers), left out of the values
    compared."""

    batches: List[Tuple[Any, ...]]
    exact: List[List[torch.Tensor]]
    fused_error: float
    against: str = FUSED_FP64
    axes: List[Optional[int]] = field(default_factory=list)  # the inputs' sample axes (empty: none proven)
    output_axes: List[Optional[int]] = field(default_factory=list)
    stochastic: List[int] = field(default_factory=list)

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
    try:  # the fp64 copy is made, used and freed here: no second copy of the model lives through the export
        exact_model = copy.deepcopy(ctx.reference.model if ctx.reference is not None else ctx.model).double()
        exact = [[_as_double(t) for t in _outputs(exact_model, map_leaves(_as_double, b))] for b in batches]
        del exact_model
    except RuntimeError:  # no fp64 kernel for some op: judge against the fused model itself
        exact = [[_as_double(t) for t in out] for out in fused]
    errors = [relative_error(f.double(), e) for out, ex in zip(fused, exact) for i, (f, e) in enumerate(zip(out, ex))
              if e.is_floating_point() and not is_discrete(f) and i not in stochastic]  # a discrete output flips
    return Reference(batches, exact, max(errors, default=0.0),
                     ctx.reference.against if ctx.reference is not None else FUSED_FP64, list(axes),
                     signature.output_axes() if signature.batched else [], stochastic)


def _as_double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


@dataclass
class CheckData:
    """``check.pt``: example inputs, the fp64 outputs of the fused model on them, its own error, and the outputs
    drawn at random (left out of the values compared)."""

    inputs: List[Any]
    expected: List[torch.Tensor]
    fused_error: float
    stochastic: List[int] = field(default_factory=list)


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
                "stochastic": list(reference.stochastic)}, root / CHECK_FILE)


def read_check_file(root: Path) -> Optional[CheckData]:
    """What :func:`write_check_file` wrote (None when the export has no ``check.pt``); loaded without pickled code."""
    path = Path(root) / CHECK_FILE
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    return CheckData(list(saved["inputs"]), list(saved["expected"]), float(saved.get("fused_error", 0.0)),
                     [int(i) for i in saved.get("stochastic", [])])


def check_artifact(module: nn.Module, inputs: Tuple[Any, ...], expected: List[torch.Tensor],
                   fused_error: float, stochastic: Sequence[int] = ()) -> Comparison:
    """An artifact's outputs on ``inputs`` against the fp64 ``expected`` ones, compared flat (runtimes such as
    ONNX Runtime return their outputs flat). The reference is cast to each output's dtype, so an output is
    allowed its own dtype's rounding, or a few times the fused model's own error when that is larger. The outputs
    listed in ``stochastic`` are compared by structure only."""
    got = _outputs(module, inputs)
    want = expected
    if len(got) == len(expected):
        want = [e.to(g.dtype) if g.is_floating_point() and e.is_floating_point() and g.shape == e.shape else e
                for g, e in zip(got, expected)]
        if stochastic:
            mismatch = structure_mismatch(got, want, nested=False)
            if mismatch is None:
                got = [g for i, g in enumerate(got) if i not in stochastic]
                want = [w for i, w in enumerate(want) if i not in stochastic]
    return compare_outputs(got, want, own_error=fused_error, nested=False, min_agreement=DISCRETE_AGREEMENT)


def check_roundtrip(staging: Path, fmt: Format, entry: FormatEntry, reference: Reference,
                     dynamic: bool) -> RoundTrip:
    """Load ``fmt`` back and judge it against the fp64 reference on each example it must take."""
    missing = missing_modules(fmt.runtime_requires)
    if missing:
        return RoundTrip(False, f"{', '.join(missing)} is not installed")
    # Loaded where it was built, so a GPU model is checked where it runs (ONNX Runtime checks on the CPU).
    try:
        loaded = fmt.load(staging, entry, torch.device(entry.device))
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"written but cannot be loaded back: {type(exc).__name__}: {first_line(exc)}") from exc
    worst, tolerance = 0.0, 0.0
    sizes: List[int] = []
    for batch, want in reference.for_entry(entry, dynamic):
        rows = reference.rows(batch)
        what = f"batch size {rows}" if rows is not None else f"inputs of shapes {_shapes_text(batch)}"
        try:
            comparison = check_artifact(loaded, batch, want, reference.fused_error, reference.stochastic)
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"the loaded model fails on {what}: {type(exc).__name__}: {first_line(exc)}") from exc
        if not comparison.passed:
            raise ExportError(
                f"the loaded model disagrees with the fused model on {what}: "
                f"{comparison.describe()}, against {reference.against}, where the fused model itself "
                f"is at {reference.fused_error:.1e}."
            )
        worst, tolerance = max(worst, comparison.relative_error), max(tolerance, comparison.tolerance)
        if rows is not None and rows not in sizes:
            sizes.append(int(rows))
    return RoundTrip(True, None, sizes, worst, reference.fused_error, tolerance, reference.against)


def _shapes_text(batch: Sequence[Any]) -> str:
    return ", ".join(str(list(a.shape)) for a in batch if isinstance(a, torch.Tensor))
