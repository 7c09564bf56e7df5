"""A small but real CNN as a LightningModule with a ``backbone`` (what FXFuseCallback fuses) and a ``head``."""

from __future__ import annotations

from typing import Any, Tuple

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

__all__ = ["ResidualBlock", "SmallCNN", "StripesClassifier"]


def conv_bn(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class SmallCNN(nn.Module):
    """Conv/BN/ReLU stem, a residual block, a strided stage, dropout, global pooling: ``(N, 2*width)`` features."""

    def __init__(self, width: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.stem = conv_bn(3, width)
        self.block = ResidualBlock(width)
        self.down = conv_bn(width, 2 * width, stride=2)
        self.dropout = nn.Dropout(dropout)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.out_features = 2 * width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(self.block(self.stem(x)))
        return torch.flatten(self.pool(self.dropout(x)), 1)


class StripesClassifier(pl.LightningModule):
    def __init__(self, width: int = 16, num_classes: int = 4, lr: float = 3e-3, dropout: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = SmallCNN(width, dropout)
        self.head = nn.Linear(self.backbone.out_features, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-4)
