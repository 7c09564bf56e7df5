"""Artifacts built for some batch sizes only, behind the nn.Module interface for any: the runner for the input's
batch size, else the one that takes any, else the batch run as pieces of the sizes there are (largest first; the
last piece padded by repeating its samples, the padding's outputs dropped).

Pieces give the same numbers as one run for a model whose samples do not interact in eval mode (what inference
models are), but cost more than a runner built for that size, so each use says so once.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.errors import ExportError
from fx_lightning.common.calls import tree_of
from fx_lightning.common.rows import concat_rows, rows_of, take_rows, with_rows

__all__ = ["ANY_BATCH", "BatchPieces", "with_pieces", "quiet_pieces"]

LOGGER = logging.getLogger(__name__)

# The key of a runner that takes any batch size.
ANY_BATCH = "dynamic"


class BatchPieces(nn.Module):
    """``runners``: batch size (as text) -> a callable built for it, and optionally :data:`ANY_BATCH` -> one that
    takes any. ``axes``/``output_axes``: the sample axis of each input and output tensor (the signature's: None for a
    tensor that does not carry samples, passed whole to every piece); only a proven sample axis is ever split or
    padded. Left out (an export written before signatures): dim 0 of every tensor, as such exports had it. ``what`` names the runners in the warning about pieces, ``hint`` says how to avoid them;
    ``warn=False``: a server that chose the sizes itself."""

    def __init__(self, runners: Dict[str, Callable[..., Any]], axes: Optional[Sequence[Optional[int]]] = None,
                 output_axes: Optional[Sequence[Optional[int]]] = None, what: str = "artifact",
                 hint: str = "export it for that batch size to serve it at full speed", warn: bool = True) -> None:
        super().__init__()
        self.runners = runners
        self.axes = list(axes) if axes is not None else None
        self.output_axes = list(output_axes) if output_axes is not None else None
        self.what, self.hint, self.warn = what, hint, warn
        self.eval()

    def forward(self, *args: Any) -> Any:
        axes = self._axes(args, self.axes)
        sizes = {int(t.shape[a]) for t, a in zip(args, axes) if a is not None and isinstance(t, torch.Tensor)}
        if len(sizes) > 1:  # pieces of the first input would cut the others wrong
            raise ExportError(f"{self.what}: the inputs on the sample axis hold different numbers of samples "
                              f"({sorted(sizes)}); every input takes the same number")
        size = rows_of(args, axes)
        runner = self.runners.get(str(size)) or self.runners.get(ANY_BATCH)
        if runner is not None or size is None:
            return (runner or next(iter(self.runners.values())))(*args)
        parts = list(self._pieces(args, axes, size))
        tree = tree_of(parts[0])
        leaves = [tree.leaves(p) for p in parts]
        return tree.rebuild(concat_rows(leaves, self._axes(leaves[0], self.output_axes)))

    @staticmethod
    def _axes(tensors: Sequence[Any], axes: Optional[List[Optional[int]]]) -> List[Optional[int]]:
        if axes is not None:
            return axes
        return [0 if isinstance(t, torch.Tensor) and t.dim() > 0 else None for t in tensors]

    def _pieces(self, args: Tuple[Any, ...], axes: List[Optional[int]], size: int) -> Iterator[Any]:
        built = sorted((int(k) for k in self.runners), reverse=True)
        message = (f"no {self.what} for batch size {size} (built for: {', '.join(map(str, built[::-1]))}): "
                   f"running it as pieces of those")
        if self.warn:
            warnings.warn(f"{message}; {self.hint}", stacklevel=3)
        else:
            LOGGER.debug(message)
        start = 0
        while start < size:
            left = size - start
            piece = next((k for k in built if k <= left), built[-1])
            rows = take_rows(args, axes, start, min(piece, left))
            out = self.runners[str(piece)](*with_rows(rows, axes, piece))
            if piece > left:  # the padding's outputs dropped
                tree = tree_of(out)
                leaves = tree.leaves(out)
                out = tree.rebuild(take_rows(leaves, self._axes(leaves, self.output_axes), 0, left))
            yield out
            start += piece


def with_pieces(module: nn.Module, batch_sizes: Optional[Sequence[int]], signature: Any, what: str) -> nn.Module:
    """A loaded artifact built for ``batch_sizes`` only (None or empty: any) as it is called: other numbers of
    samples as pieces along the proven sample axis of ``signature`` (a :class:`~fx_lightning.signature.signature.Signature`);
    without one, as it is (it refuses other sizes itself). Used by ``load_fused`` and by the variant gate alike."""
    if not batch_sizes or isinstance(module, BatchPieces) or not signature.batched:
        return module
    return BatchPieces({str(size): module for size in batch_sizes}, signature.input_axes(), signature.output_axes(),
                       what=what, hint="it was exported for those batch sizes only (see the manifest's notes)")


def quiet_pieces(module: nn.Module) -> nn.Module:
    """``module`` with every :class:`BatchPieces` in it saying so at DEBUG only: for our own internal runs (the
    sweep tries batch sizes nobody asked an artifact for; that it runs them as pieces is not the user's business)."""
    for sub in module.modules() if isinstance(module, nn.Module) else ():
        if isinstance(sub, BatchPieces):
            sub.warn = False
    return module
