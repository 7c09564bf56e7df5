"""Does an output match its reference? The one comparison, used by the capture check, the module passes'
checks, the export's round trip, the selection's check and the parity gate's structure check.

Structure first (how many tensors, how they nest, their shapes and dtypes), then values: the error of each
floating output is relative to the reference's scale, ``max|got - want| / max|want|`` (the functional core of
:mod:`.metrics`), and NaNs must sit where the reference has them. The tolerances are :mod:`fx_lightning.common.tolerance`'s:
rerunning the same arithmetic stays within float rounding, so anything beyond it means the graph or artifact is
not the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple

import torch

from fx_lightning.common.batches import flat_tensors
from fx_lightning.common.calls import plain
from fx_lightning.parity.metrics import agreement_parts, relative_max_error, relative_max_error_parts
from fx_lightning.common.tolerance import rounding_tolerance

__all__ = [
    "Comparison",
    "compare_outputs",
    "structure_mismatch",
    "relative_error",
    "is_discrete",
    "judged_discrete",
    "agreement",
]

@dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare_outputs`.

    ``mismatch``: how the structures differ (None: they match); ``relative_error``: the worst over the
    outputs (inf on a mismatch); ``tolerance``: the largest allowed; ``failure``: the first output beyond its
    tolerance, in words (None: every output is within)."""

    mismatch: Optional[str]
    relative_error: float
    tolerance: float
    failure: Optional[str] = None
    outputs: int = 0

    @property
    def passed(self) -> bool:
        return self.mismatch is None and self.failure is None

    def describe(self) -> str:
        """Why it failed, or how close it is."""
        return self.mismatch or self.failure or \
            f"relative error {self.relative_error:.3g} (allowed {self.tolerance:.1e})"


def _as_tree(value: Any) -> Any:
    """The nesting of ``value`` (in plain containers: :func:`~fx_lightning.common.calls.plain`) with tensors as
    leaves: sequences as lists; mappings, dataclasses (Hugging Face ``ModelOutput``), objects and
    ``torch.distributions`` objects (their parameters) as dicts; anything else is not an output and is left out."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        return {str(k): _as_tree(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_as_tree(v) for v in value]
    return None


def _nesting(got: Any, want: Any, path: str) -> Optional[str]:
    """Where two trees nest differently (None: the same)."""
    kind = lambda t: "tensor" if isinstance(t, torch.Tensor) else type(t).__name__  # noqa: E731
    if kind(got) != kind(want):
        what = {"tensor": "a tensor", "list": "a sequence", "dict": "a mapping", "NoneType": "no tensor"}
        return f"{path or 'the output'} is {what[kind(got)]}, the reference's is {what[kind(want)]}"
    if isinstance(want, list):
        if len(got) != len(want):
            return f"{path or 'the output'} has {len(got)} items, the reference's {len(want)}"
        return next((m for i, (g, w) in enumerate(zip(got, want)) if (m := _nesting(g, w, f"{path}[{i}]"))), None)
    if isinstance(want, dict):
        if list(got) != list(want):
            return f"{path or 'the output'} has keys {list(got)}, the reference's {list(want)}"
        return next((m for k in want if (m := _nesting(got[k], want[k], f"{path}[{k!r}]"))), None)
    return None


def structure_mismatch(got: Any, want: Any, *, nested: bool = True) -> Optional[str]:
    """How ``got`` differs from ``want`` in structure: tensor count, nesting (``nested``), shapes, dtypes.
    None when they match. ``nested=False`` compares the flat tensor lists only (a runtime such as ONNX Runtime
    returns its outputs flat)."""
    g, w = flat_tensors(got), flat_tensors(want)
    if len(g) != len(w):
        return f"the output has {len(g)} tensor(s), the reference {len(w)}"
    if nested:
        problem = _nesting(_as_tree(plain(got)), _as_tree(plain(want)), "")
        if problem is not None:
            return problem
    for i, (a, b) in enumerate(zip(g, w)):
        if tuple(a.shape) != tuple(b.shape):
            return f"output {i} has shape {tuple(a.shape)}, the reference's {tuple(b.shape)}"
        if a.dtype != b.dtype:
            return f"output {i} is {str(a.dtype).replace('torch.', '')}, the reference's {str(b.dtype).replace('torch.', '')}"
    return None


def is_discrete(t: torch.Tensor) -> bool:
    """A discrete output (labels, a mask, thresholded scores): integer or boolean, or floating with only the
    values 0 and 1. Such outputs are judged by agreement: a value on the threshold flips, it does not drift."""
    if not t.is_floating_point():
        return True
    return t.numel() > 0 and bool(((t == 0) | (t == 1)).all())


def judged_discrete(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether an output is judged by agreement: discrete in the reference and in the output judged. A floating
    output the reference has at 0 and 1 only, but the judged output not, is continuous (a NeRF's opacity, exactly
    1 in fp64, 1 - 6e-8 in fp32): a thresholded output gives 0 and 1 at any precision."""
    return is_discrete(want) and is_discrete(got)


def agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """The fraction of elements of ``got`` equal to ``want``'s (1 for empty tensors)."""
    equal, total = agreement_parts(got.detach().cpu(), want.detach().cpu())
    return float(equal / total) if total else 1.0


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` in float64 (0 for empty tensors; exact equality for non-floating ones)."""
    if want.numel() == 0:
        return 0.0
    if not want.is_floating_point():
        return 0.0 if torch.equal(got.detach().cpu(), want.detach().cpu()) else float("inf")
    diff, scale = relative_max_error_parts(got.detach().cpu().double(), want.detach().cpu().double())
    return float(relative_max_error(diff, scale))


def shared_specials_zeroed(got: torch.Tensor, want: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both with 0 where both hold the same infinity or NaN (a masked logit's -inf: as numbers inf - inf is NaN, and
    the error of an output equal to the reference would be NaN); other NaNs and infinities are left to fail."""
    if not got.is_floating_point() or got.shape != want.shape or bool(torch.isfinite(want).all()):
        return got, want
    shared = ~torch.isfinite(want) & ((got == want) | (torch.isnan(got) & torch.isnan(want)))
    return got.masked_fill(shared, 0.0), want.masked_fill(shared, 0.0)


def compare_outputs(
    got: Any,
    want: Any,
    *,
    rtol: Optional[float] = None,
    own_error: float = 0.0,
    nested: bool = True,
    min_agreement: Optional[float] = None,
) -> Comparison:
    """Compare ``got`` with the reference ``want`` (tensors, nested in sequences, mappings or dataclasses).

    The tolerance of each output is ``rtol`` when given, else :func:`rounding_tolerance` of its dtype and
    ``own_error`` (the reference's own error, for artifacts judged against an fp64 copy). Non-floating outputs
    must be equal, unless ``min_agreement`` is given: then every discrete output (:func:`is_discrete`) must have
    at least that fraction of its elements equal to the reference's. NaNs and infinities must be where the reference
    has them, the same ones (and are then ignored)."""
    mismatch = structure_mismatch(got, want, nested=nested)
    if mismatch is not None:
        return Comparison(mismatch, float("inf"), rtol or 0.0)
    worst, allowed, failure = 0.0, 0.0, None
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = list(zip(flat_tensors(got), flat_tensors(want)))
    for i, (g, w) in enumerate(pairs):
        # Within a tight tolerance an output at 0 and 1 in the reference only is judged by value; a lossy one
        # (``rtol`` given: as large as the output) would then take anything: it keeps the agreement.
        if min_agreement is not None and (judged_discrete(g, w) if rtol is None else is_discrete(w)):
            share = agreement(g, w)
            if share < min_agreement and failure is None:
                failure = f"output {i} (discrete) agrees with the reference on {share:.4%} of its elements " \
                          f"(at least {min_agreement:.2%} wanted)"
            continue
        tol = rtol if rtol is not None else rounding_tolerance(w.dtype, own_error) if w.is_floating_point() else 0.0
        if w.is_floating_point():
            # NaNs and infinities (a masked logit's -inf) where the reference has them, the same ones: then ignored
            # (as numbers, inf - inf is NaN: a model would differ from itself).
            g, w = g.detach(), w.detach()
            special = ~torch.isfinite(w)
            if not torch.equal(~torch.isfinite(g), special) or not torch.equal(
                    torch.nan_to_num(g[special], nan=0.0), torch.nan_to_num(w[special], nan=0.0)):
                failure = failure or f"output {i} has NaNs or infinities where the reference has none (or others)"
                worst = float("inf")
                continue
            g, w = shared_specials_zeroed(g, w)
        err = relative_error(g, w)
        if not err <= tol and failure is None:
            failure = f"output {i} differs from the reference by {err:.3g} (relative; allowed {tol:.1e})"
        worst, allowed = max(worst, err), max(allowed, tol)
    return Comparison(None, worst, allowed, failure, len(pairs))
