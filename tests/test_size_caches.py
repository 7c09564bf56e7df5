"""State a module keeps from its last call's size (fair-esm's rotary embedding caches its tables with the length they
were made for, ``if seq_len != self._seq_len_cached:``): capture/working_copy.py forget_size_caches."""

from __future__ import annotations

from pathlib import Path
from typing import List

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lightning_helpers as H
from fx_lightning import FXFuseCallback, load_fused


class CachedPositions(nn.Module):
    """Position tables made for a length and kept until a call of another length comes, in the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.bn = nn.Conv1d(4, 6, 1), nn.BatchNorm1d(6)
        self._length_cached = None
        self._table = torch.zeros(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[2]
        if length != self._length_cached:
            self._length_cached = length
            self._table = torch.sin(torch.arange(length, dtype=x.dtype) / 7)
        return self.bn(self.proj(x)) + self._table


class Lit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = CachedPositions()

    def training_step(self, x: torch.Tensor, index: int) -> torch.Tensor:
        return F.mse_loss(self.model(x), torch.zeros(()))

    def validation_step(self, x: torch.Tensor, index: int) -> None:
        self.log("val", F.mse_loss(self.model(x), torch.zeros(())))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), 0.01)


def _batches(lengths: List[int], seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, n, generator=g) for n in lengths]


def test_a_size_a_module_caches_from_its_last_call_stays_dynamic(tmp_path: Path) -> None:
    """The cached length is the last call's, so capture compared the dynamic length with it and fixed it (torch.export
    refused the dynamic length, symbolic tracing cannot follow the branch): nothing was exported. Shown to follow the
    calls' lengths on two of them, it is set to a length no call has for capture: every length is served, the
    BatchNorm folded, the trained module untouched."""
    torch.manual_seed(0)
    lit, cb = Lit(), FXFuseCallback()
    H.make_trainer(tmp_path, [cb], max_epochs=1, num_sanity_val_steps=2).fit(
        lit, DataLoader(_batches([10, 12, 14, 16], 0), batch_size=None),
        DataLoader(_batches([11, 13], 1), batch_size=None))
    assert any(n.kind.name == "size_caches_forgotten" and "_length_cached" in str(n) for n in cb.result.report.notes)
    assert cb.result.report.after.batchnorms == 0
    assert lit.model._length_cached != -1  # the user's module keeps its own cache
    reference = H.fp64_copy(lit.model)
    fused = load_fused(cb.export_dir)
    for x in (torch.randn(1, 4, 5), torch.randn(2, 4, 31)):
        with torch.no_grad():
            want = reference(x.double())
        got = fused(x)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert H.rel_err(got, want) < 1e-5
