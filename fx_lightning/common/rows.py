"""Rows along a sample axis: count them, cut them, pad them (by repeating rows), join pieces. The only way the
package splits or pads a tensor, and only along an axis the signature proved (:mod:`fx_lightning.signature.signature`)."""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from fx_lightning.errors import ExportError

__all__ = ["rows_of", "take_rows", "with_rows", "concat_rows", "same_shape_groups", "split_rows"]


def rows_of(leaves: Sequence[Any], axes: Sequence[Optional[int]]) -> Optional[int]:
    """The number of rows of flat ``leaves`` on their sample axes (None: no leaf has one)."""
    return next((int(t.shape[a]) for t, a in zip(leaves, axes) if a is not None and isinstance(t, torch.Tensor)),
                None)


def take_rows(leaves: Sequence[Any], axes: Sequence[Optional[int]], start: int, count: int) -> List[Any]:
    """Rows ``start .. start+count`` of every leaf on its sample axis (the others whole)."""
    return [t.narrow(a, start, count) if a is not None else t for t, a in zip(leaves, axes)]


def with_rows(leaves: Sequence[Any], axes: Sequence[Optional[int]], n: int) -> List[Any]:
    """Every leaf cut or padded to ``n`` rows on its sample axis, padding by repeating its rows."""
    out = []
    for t, a in zip(leaves, axes):
        if a is None or t.shape[a] == n:
            out.append(t)
            continue
        index = torch.arange(n, device=t.device) % t.shape[a]
        out.append(t.index_select(a, index))
    return out


def concat_rows(parts: Sequence[Sequence[torch.Tensor]], axes: Sequence[Optional[int]]) -> List[torch.Tensor]:
    """Output leaves of consecutive pieces joined along their sample axes."""
    return [torch.cat([p[i] for p in parts], dim=a) if a is not None else parts[0][i] for i, a in enumerate(axes)]


def same_shape_groups(calls: Sequence[Sequence[Any]]) -> List[List[int]]:
    """The places of a server's requests (each its inputs, tensors or arrays, samples on dim 0) grouped by the
    shapes beyond dim 0: those one batch can join (sizes that vary elsewhere, a sequence length, cannot)."""
    groups: Dict[Tuple[Tuple[int, ...], ...], List[int]] = {}
    for i, call in enumerate(calls):
        groups.setdefault(tuple(tuple(a.shape[1:]) for a in call), []).append(i)
    return list(groups.values())


def split_rows(outputs: Sequence[Any], sizes: Sequence[int]) -> List[List[Any]]:
    """Each request's rows of every output (tensors or arrays) of the batch that joined requests of ``sizes``
    samples: a batching server's outputs all carry the sample axis on dim 0 (it batches only then)."""
    total = sum(sizes)
    if any(o.ndim == 0 or o.shape[0] != total for o in outputs):
        raise ExportError(f"an output does not hold the batch's {total} samples on dim 0: "
                          f"{[list(o.shape) for o in outputs]}")
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [[o[bounds[i]:bounds[i + 1]] for o in outputs] for i in range(len(sizes))]
