"""Helpers for the callback, parity and config tests: tiny LightningModules, data and a Trainer factory.

Everything is tiny (8x8 images, a few batches) so a two-epoch fit takes about a second on one core.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fusion_helpers import count_batchnorms, file_hashes, randomize_batchnorms, rel_err  # noqa: F401  (re-exported)
from fusion_helpers import fingerprint as state_fingerprint  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the examples package lives at the repo root
    sys.path.insert(0, str(REPO))

NUM_CLASSES = 4


# ------------------------------------------------------------------------------------------------ data


def tiny_dataset(n: int = 64, seed: int = 0, size: int = 8) -> TensorDataset:
    """Learnable: the class is which quadrant is bright."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    x = torch.randn(n, 3, size, size, generator=g) * 0.3
    h = size // 2
    for i, label in enumerate(y.tolist()):
        r, c = divmod(label, 2)
        x[i, :, r * h:(r + 1) * h, c * h:(c + 1) * h] += 1.0
    return TensorDataset(x, y)


def loaders(batch_size: int = 16, n_train: int = 64, n_val: int = 32) -> Tuple[DataLoader, DataLoader]:
    return (
        DataLoader(tiny_dataset(n_train, 0), batch_size=batch_size, shuffle=True),
        DataLoader(tiny_dataset(n_val, 1), batch_size=batch_size),
    )


# ---------------------------------------------------------------------------------------------- models


class TinyBackbone(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(width)
        self.drop = nn.Dropout(0.2)
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(x + self.bn2(self.conv2(x)))
        return torch.flatten(self.pool(self.drop(x)), 1)


class DataDependentBackbone(TinyBackbone):
    """A branch on the input's values whose two ways compute differently, both taken by the observed calls: torch.fx
    cannot follow it, and no one graph torch.export captures answers both ways."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if x[0, 0, 0, 0] > 0.3:  # the two validation batches take both ways
            return out * 2
        return out


class ShapeDependentBackbone(TinyBackbone):
    """``torch.zeros(x.shape[0], ...)``: symbolic tracing fails, torch.export captures it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + torch.zeros(x.shape[0], out.shape[1], dtype=out.dtype, device=out.device)


class NoisyBackbone(TinyBackbone):
    """Non-deterministic even in eval mode: no fused model can match it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + torch.randn_like(out)


class LitClassifier(pl.LightningModule):
    """``backbone`` + ``head``; counts training steps so tests can prove none ran."""

    def __init__(self, backbone: Optional[nn.Module] = None, width: int = 8, lr: float = 0.1,
                 val_score: str = "loss") -> None:
        super().__init__()
        self.backbone = backbone if backbone is not None else TinyBackbone(width)
        self.head = nn.Linear(width, NUM_CLASSES)
        self.lr = lr
        self.val_score = val_score
        self.training_steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.training_steps += 1
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))
        # "epoch" score: lowest at epoch 0, so ModelCheckpoint(monitor="score", mode="min") keeps epoch 0.
        self.log("score", float(self.current_epoch))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class CrossEntropySteps(pl.LightningModule):
    """The steps of a classifier trained on ``(x, y)`` batches with SGD at ``lr``: a subclass declares its layers
    and ``forward``."""

    lr = 0.01

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class FlatLit(CrossEntropySteps):
    """No ``backbone``: the whole module is the default target."""

    lr = 0.05

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(4, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def make_trainer(tmp_path: Path, callbacks: List[Any], **kwargs: Any) -> pl.Trainer:
    options: Dict[str, Any] = dict(
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=2,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(tmp_path),
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


# -------------------------------------------------------------------------------------------- checking






def fp64_copy(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module).double().eval()




class HashCheckpoints(pl.Callback):
    """Placed before FXFuseCallback: records the checkpoint files' hashes as fit ends, before fusion."""

    def __init__(self) -> None:
        self.hashes: Dict[str, str] = {}
        self.directory: Optional[Path] = None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cb = trainer.checkpoint_callback
        assert cb is not None and cb.dirpath
        self.directory = Path(cb.dirpath)
        self.hashes = file_hashes(self.directory)



# The preflight's checks that need no model run, made when fit starts: a failure there stops before any step. The
# others need the target's calls, observed in the sanity check or, without one, in the first training step's
# forward: a failure there stops before the first optimizer step (that one forward may have run, nothing trained).
SETTINGS_STAGES = {"device", "target", "weights", "export directory", "export dependencies", "export.preprocess"}


def assert_stopped_before_training(message: str, model: Any, stage: str, before: Any = None) -> None:
    """The preflight stopped fit at ``stage`` before anything was trained, and its message says when. ``before``:
    :func:`snapshot` of the model before fit: unchanged (after the first training forward, only BatchNorm
    statistics may have moved: that forward updates them, as any does; no weight changed)."""
    assert f"stage '{stage}'" in message, message
    if stage in SETTINGS_STAGES:
        assert "before the first training step" in message and model.training_steps == 0, message
    else:
        assert "before the first optimizer step" in message and model.training_steps <= 1, message
    assert model.trainer.global_step == 0  # no optimizer step
    if before is not None:
        state, parameters = before
        if model.training_steps == 0:
            assert state_fingerprint(model) == state
        assert parameters_fingerprint(model) == parameters


def snapshot(model: Any) -> Tuple[Any, str]:
    """The model's state fingerprint and its parameters' own."""
    return state_fingerprint(model), parameters_fingerprint(model)


def parameters_fingerprint(model: Any) -> str:
    """A hash of every parameter's values (not the buffers: BatchNorm statistics move in any training forward)."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode() + p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class TwoHeads(nn.Module):
    """conv-BN-ReLU, pooling, two outputs: class scores (times ``score_scale``) and an embedding."""

    def __init__(self, score_scale: float = 1.0) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)
        self.score_scale = score_scale
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        features = F.adaptive_avg_pool2d(F.relu(self.bn(self.conv(x))), 1).flatten(1)
        scores = self.fc(features)
        return (scores * self.score_scale if self.score_scale != 1.0 else scores), features
