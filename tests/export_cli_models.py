"""A tiny LightningModule and DataModule for the CLI tests, importable as ``export_cli_models:Class``."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_helpers import TinyBackbone, tiny_dataset

NUM_CLASSES = 4


class CliBackbone(TinyBackbone):
    """TinyBackbone plus a Linear + BatchNorm1d head (the Linear/BN1d fold needs shapes)."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.fc = nn.Linear(width, 16)
        self.bn3 = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn3(self.fc(super().forward(x))))


class CliClassifier(pl.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = CliBackbone(width)
        self.head = nn.Linear(16, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class CliClassifierWithExample(CliClassifier):
    def __init__(self, width: int = 8, lr: float = 0.05) -> None:
        super().__init__(width, lr)
        self.example_input_array = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(5))


class CliData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 16, n_train: int = 64, n_val: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str | None = None) -> None:
        self.train_set = tiny_dataset(self.hparams.n_train, 0)
        self.val_set = tiny_dataset(self.hparams.n_val, 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class CompiledInSetupClassifier(CliClassifier):
    """Compiles its backbone in setup("fit"), as lightning-hydra-template does with `compile: true`: its
    checkpoints carry "backbone._orig_mod." keys, which an uncompiled instance does not expect."""

    def setup(self, stage: str) -> None:
        if stage == "fit" and type(self.backbone).__name__ != "OptimizedModule":
            self.backbone = torch.compile(self.backbone, backend="eager")
