"""A synthetic, learnable image dataset, generated on the fly from a fixed seed: no downloads.

Each image is a sinusoidal stripe pattern in a random colour with noise; the class is the stripe
orientation: 0 horizontal, 1 vertical, 2 diagonal, 3 anti-diagonal. A small CNN learns it in an
epoch or two on CPU, so a fused model's accuracy is meaningful.
"""

from __future__ import annotations

import math
from typing import Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["CLASSES", "make_stripes", "StripesDataModule"]

CLASSES = ("horizontal", "vertical", "diagonal", "anti-diagonal")


def make_stripes(n: int, image_size: int = 24, seed: int = 0, noise: float = 0.5) -> TensorDataset:
    """``n`` images ``(3, image_size, image_size)`` and their labels, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(CLASSES), (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(image_size, dtype=torch.float32),
                            torch.arange(image_size, dtype=torch.float32), indexing="ij")
    coords = torch.stack([yy, xx, (xx + yy) / math.sqrt(2), (xx - yy) / math.sqrt(2)])  # (4, S, S)
    freq = torch.empty(n).uniform_(0.5, 1.3, generator=g)
    phase = torch.empty(n).uniform_(0, 2 * math.pi, generator=g)
    pattern = torch.sin(freq[:, None, None] * coords[labels] + phase[:, None, None])  # (n, S, S)
    colour = torch.empty(n, 3).uniform_(0.3, 1.0, generator=g) * torch.where(
        torch.rand(n, 3, generator=g) < 0.5, -1.0, 1.0)
    images = pattern[:, None] * colour[:, :, None, None]
    images = images + noise * torch.randn(images.shape, generator=g)
    return TensorDataset(images, labels)


class StripesDataModule(pl.LightningDataModule):
    """Train/validation splits of :func:`make_stripes` (different seeds)."""

    def __init__(self, batch_size: int = 64, num_train: int = 2048, num_val: int = 512, image_size: int = 24,
                 noise: float = 0.5, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def setup(self, stage: str) -> None:
        h = self.hparams
        if self.train_set is None:
            self.train_set = make_stripes(h.num_train, h.image_size, h.seed, h.noise)
            self.val_set = make_stripes(h.num_val, h.image_size, h.seed + 1, h.noise)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True,
                          num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
