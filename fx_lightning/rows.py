"""Rows along a sample axis: count them, cut them, pad them (by repeating rows), join pieces. The only way the
package splits or pads a tensor, and only along an axis the signature proved (:mod:`fx_lightning.signature`)."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

__all__ = ["rows_of", "take_rows", "with_rows", "concat_rows"]



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
