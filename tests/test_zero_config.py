"""Zero configuration on LightningModules as libraries write them (issue 37): the package observes and proves what
it used to decide. Each test reduces a library of the third-party matrix (docs/third-party-matrix.md) to a few lines
and fails without its fix.

    what the package decided                                     test
    sizes that never varied in training are fixed (timm, ...)    test_sizes_that_never_varied_stay_dynamic_when_the_model_takes_others
    a constant forward never reads is built in (darts, ...)      test_a_constant_forward_never_reads_takes_any_value
    the steps call submodules: the alphabetically first (smp)    test_the_called_submodule_holding_the_trained_parameters_is_the_target
    an eval forward needing training state stops fit (anomalib)  test_a_model_whose_eval_forward_needs_training_state_is_not_stopped
    an int output that varies: refused, never stale (scvi)       test_an_int_output_that_varies_is_refused_never_returned_stale
    a library deep-copies the callbacks (neuralforecast)          test_a_deep_copied_callback_leaves_its_results_on_the_users_instance
"""

from __future__ import annotations

import copy
import enum
from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_helpers as H
import fx_lightning
from fx_lightning import FXFuseCallback, load_fused
from fx_lightning.errors import ExportError


def test_sizes_that_never_varied_stay_dynamic_when_the_model_takes_others(tmp_path) -> None:
    """timm, lightly, torchgeo, speechbrain: every training image was one size, so height and width were fixed and
    the artifact refused any other (torch's own guard message). A call with them cut shorter runs: they vary."""
    train, val = H.loaders()
    cb = FXFuseCallback(export={"formats": ["pt2", "onnx", "graph_module"]})
    model = H.LitClassifier()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, train, val)
    shape = next(leaf.shape for leaf in cb.outcome.manifest.signature.inputs)
    assert shape[0] == "batch" and isinstance(shape[2], str) and isinstance(shape[3], str), shape
    x = torch.randn(3, 3, 12, 10)
    want = H.fp64_copy(model.backbone)(x.double())
    for fmt in ("pt2", "onnx", "graph_module"):
        got = load_fused(cb.export_dir, fmt)(x)
        assert got.shape == want.shape and H.rel_err(got, want) < 1e-5, fmt
    with pytest.raises(ExportError, match=r"input x \(x\) dim 1 is 4; the artifact was built for 3"):
        load_fused(cb.export_dir, "pt2")(torch.randn(3, 4, 12, 10))  # channels never vary: the package refuses


class Stage(str, enum.Enum):
    TRAIN = "train"
    VALIDATE = "val"
    PREDICT = "predict"


class StagedBackbone(H.TinyBackbone):
    """A library passing its stage to forward (darts' PLModuleInput.stage), which this model never reads."""

    def forward(self, x: torch.Tensor, stage: Stage = Stage.PREDICT) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


class StagedLit(H.LitClassifier):
    def __init__(self) -> None:
        super().__init__(backbone=StagedBackbone(8))

    def forward(self, x: torch.Tensor, stage: Stage = Stage.PREDICT) -> torch.Tensor:  # type: ignore[override]
        return self.head(self.backbone(x, stage=stage))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x, stage=Stage.TRAIN), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x, stage=Stage.VALIDATE), y))


def test_a_constant_forward_never_reads_takes_any_value(tmp_path) -> None:
    """darts: the stage was VALIDATE in every validation call, built in, and every predict call (PREDICT) refused;
    even VALIDATE was refused after the manifest round trip. Every other member gives the same outputs: unread."""
    cb = FXFuseCallback(export={"formats": ["pt2"]})
    model = StagedLit()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *H.loaders())
    (const,) = cb.outcome.manifest.signature.constants
    assert const.path == "stage" and const.unread is not None, const
    x = torch.randn(2, 3, 8, 8)
    loaded = load_fused(cb.export_dir)
    for stage in Stage:
        assert H.rel_err(loaded(x, stage=stage), H.fp64_copy(model.backbone)(x.double(), stage=stage)) < 1e-5


class DirectForward(H.LitClassifier):
    """smp's and torch-uncertainty's steps: ``self.forward(x)`` (no hook fires on the module), a batch transform and
    a loss module called beside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(self.backbone, self.head)
        del self.backbone, self.head
        self.format_batch = nn.Identity()
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.forward(self.format_batch(x)), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss_fn(self.forward(self.format_batch(x)), y))


def test_the_called_submodule_holding_the_trained_parameters_is_the_target(tmp_path) -> None:
    """Before: refused, suggesting the alphabetically first called submodule (format_batch, a transform)."""
    cb = FXFuseCallback(export={"formats": ["pt2"]})
    model = DirectForward()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *H.loaders())
    assert cb.outcome.manifest.provenance.target == "model"
    assert any(n.kind.name == "target_called_by_steps" and n["target"] == "model" for n in cb.outcome.notes)
    x = torch.randn(3, 3, 8, 8)
    assert H.rel_err(load_fused(cb.export_dir)(x), H.fp64_copy(model.model)(x.double())) < 1e-5


class FittedAtEpochEnd(nn.Module):
    """anomalib's PaDiM: in training it returns embeddings; in eval it scores them against statistics fitted at the
    end of the epoch (empty before: its eval forward raises on the untrained model)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = H.TinyBackbone(8)
        self.register_buffer("mean", torch.empty(0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding = self.features(x)
        if self.training:
            return embedding
        return (embedding - self.mean).pow(2).sum(1)


class Padim(H.LitClassifier):
    def __init__(self) -> None:
        super().__init__(backbone=FittedAtEpochEnd())
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        embedding = self(batch[0])
        self.seen.append(embedding.detach())
        return embedding.pow(2).mean()

    def on_train_epoch_end(self) -> None:
        self.backbone.mean = torch.cat(self.seen).mean(0, keepdim=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        pass


def test_a_model_whose_eval_forward_needs_training_state_is_not_stopped(tmp_path) -> None:
    """Before: 'preflight failed at stage parity input: RuntimeError: The size of tensor a ... b (0)' stopped fit."""
    cb = FXFuseCallback(export={"formats": ["pt2"]})
    model = Padim()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *H.loaders())
    assert cb.preflight is not None and cb.preflight.unproven is not None and "eval mode" in cb.preflight.unproven
    x = torch.randn(3, 3, 8, 8)
    assert H.rel_err(load_fused(cb.export_dir)(x), H.fp64_copy(model.backbone)(x.double())) < 1e-5


class WithCount(H.TinyBackbone):
    """scvi-tools' LossOutput: the outputs carry the batch's row count as an int."""

    def forward(self, x: torch.Tensor) -> Dict[str, Any]:  # type: ignore[override]
        return {"z": super().forward(x), "n_obs": x.shape[0]}


class CountingLit(H.LitClassifier):
    def __init__(self) -> None:
        super().__init__(backbone=WithCount(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x)["z"])


def test_an_int_output_that_varies_is_refused_never_returned_stale(tmp_path) -> None:
    """scvi-tools' LossOutput carries the batch's row count as an int. Taken as not part of the structure, the artifact
    answered with values computed for another count (kl_global_sum at 5 cells: relative error 835). Refused, naming
    the structure change, until such an output can be proven to follow the batch."""
    from fx_lightning.errors import ModelError

    cb = FXFuseCallback(export={"formats": ["pt2"]})
    model = CountingLit()
    train, val = H.loaders(n_val=40)  # 16, 16 and 8 rows
    with pytest.raises(ModelError, match="outputs change structure from call to call"):
        H.make_trainer(tmp_path, [cb], max_epochs=1, limit_val_batches=3).fit(model, train, val)
    assert cb.export_dir is None


def test_a_deep_copied_callback_leaves_its_results_on_the_users_instance(tmp_path) -> None:
    """neuralforecast trains deep copies of its models, callbacks included: the user's instance stayed empty."""
    mine = FXFuseCallback(export={"formats": ["pt2"]})
    ran = copy.deepcopy(mine)
    H.make_trainer(tmp_path, [ran], max_epochs=1).fit(H.LitClassifier(), *H.loaders())
    assert ran.export_dir is not None and mine.export_dir == ran.export_dir
    assert mine.outcome is ran.outcome and mine.summary == ran.summary
