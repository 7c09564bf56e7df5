"""Artifacts built for some batch sizes only, behind the nn.Module interface for any: the runner for the input's
batch size, else the one that takes any, else the batch run as pieces of the sizes there are (largest first; the
last piece padded by repeating its samples, the padding's outputs dropped).

Pieces give the same numbers as one run for a model whose samples do not interact in eval mode (what inference
models are), but cost more than a runner built for that size, so each use says so once.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch import nn

from fx_lightning.batches import batch_size_of, concat_outputs, map_tensors, with_batch_size

__all__ = ["ANY_BATCH", "BatchPieces"]

# The key of a runner that takes any batch size.
ANY_BATCH = "dynamic"


class BatchPieces(nn.Module):
    """``runners``: batch size (as text) -> a callable built for it, and optionally :data:`ANY_BATCH` -> one that
    takes any. ``what`` names them in the warning about pieces, ``hint`` says how to avoid them; ``warn=False``: a
    server that chose the sizes itself."""

    def __init__(self, runners: Dict[str, Callable[..., Any]], what: str = "artifact",
                 hint: str = "export it for that batch size to serve it at full speed", warn: bool = True) -> None:
        super().__init__()
        self.runners = runners
        self.what, self.hint, self.warn = what, hint, warn
        self.eval()

    @property
    def batch_sizes(self) -> List[str]:
        return sorted(self.runners)

    def forward(self, *args: Any) -> Any:
        size = batch_size_of(args)
        runner = self.runners.get(str(size)) or self.runners.get(ANY_BATCH)
        if runner is not None or size is None:
            return (runner or next(iter(self.runners.values())))(*args)
        return concat_outputs(list(self._pieces(args, size)))

    def _pieces(self, args: Tuple[Any, ...], size: int) -> Iterator[Any]:
        built = sorted((int(k) for k in self.runners), reverse=True)
        if self.warn:
            warnings.warn(f"no {self.what} for batch size {size} (built for: {', '.join(map(str, built[::-1]))}): "
                          f"running it as pieces of those; {self.hint}", stacklevel=3)
        start = 0
        while start < size:
            left = size - start
            piece = next((k for k in built if k <= left), built[-1])
            rows = tuple(a[start:start + min(piece, left)] if _batched(a, size) else a for a in args)
            out = self.runners[str(piece)](*with_batch_size(rows, piece))
            yield out if piece <= left else map_tensors(lambda t: t[:left] if t.dim() > 0 else t, out)
            start += piece


def _batched(value: Any, size: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size
