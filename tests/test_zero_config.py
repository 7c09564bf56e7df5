"""Zero configuration on LightningModules as libraries write them (issue 37): the package observes and proves what
it used to decide. Each test reduces a library of the third-party matrix (docs/third-party-matrix.md) to a few lines
and fails without its fix.

    what the package decided                                     test
    sizes that never varied in training are fixed (timm, ...)    test_sizes_that_never_varied_stay_dynamic_when_the_model_takes_others
    a constant forward never reads is built in (darts, ...)      test_a_constant_forward_never_reads_takes_any_value
    the steps call submodules: the alphabetically first (smp)    test_the_called_submodule_holding_the_trained_parameters_is_the_target
    an eval forward needing training state stops fit (anomalib)  test_a_model_whose_eval_forward_needs_training_state_is_not_stopped
    an int output that counts the samples (scvi)                 test_an_int_output_that_counts_the_samples_is_the_count_of_each_call
    a library deep-copies the callbacks (neuralforecast)          test_a_deep_copied_callback_leaves_its_results_on_the_users_instance
    labels in the calls are required inputs (transformers)       test_the_artifact_answers_the_call_a_server_makes_without_labels
    an input the model never reads is required (darts)           test_an_input_the_graph_never_reads_may_be_left_out
    a 1x1 feature map fixes the sizes again (lightly, torchgeo)  test_a_trunk_whose_feature_map_collapses_to_one_pixel_stays_dynamic
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

import pytest
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import lightning_helpers as H
import fx_lightning
from fx_lightning import FXFuseCallback, load_fused
from fx_lightning.errors import ExportError
from fx_lightning.export.manifest import read_manifest
from fx_lightning.serve.artifact import artifact_for
from fx_lightning.serve.server import ServeOptions


def test_sizes_that_never_varied_stay_dynamic_when_the_model_takes_others(tmp_path) -> None:
    """timm, lightly, torchgeo, speechbrain: every training image was one size, so height and width were fixed and
    the artifact refused any other (torch's own guard message). With trace.probe_sizes a call with them resized
    runs: they vary."""
    train, val = H.loaders()
    cb = FXFuseCallback(export={"formats": ["pt2", "onnx", "graph_module"]})  # trace.probe_sizes: on by default
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



class CollapsingTrunk(nn.Module):
    """lightly's and torchgeo's ResNet trunks at 32x32: the last feature map is 1x1 at the training size, so
    torch.export guards on that size being 1 (traced at 8x8) or above 1 (traced bigger) and no one example covers
    both."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(3 if i == 0 else width, width, 3, 2, 1, bias=False),
                                                    nn.BatchNorm2d(width), nn.ReLU()) for i in range(3)])
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.blocks(x)).flatten(1)


def test_a_trunk_whose_feature_map_collapses_to_one_pixel_stays_dynamic(tmp_path) -> None:
    """lightly, torchgeo: sizes shown to vary by experiment were fixed again because torch.export specialised on a
    1x1 feature map; the size-oblivious route keeps them dynamic and every artifact takes other sizes."""
    train, val = H.loaders()
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    model = H.LitClassifier(backbone=CollapsingTrunk())
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, train, val)
    manifest = cb.outcome.manifest
    assert "probed_fixed" not in [n.kind.name for n in manifest.notes], manifest.notes
    reference = H.fp64_copy(model.backbone)
    for shape in ((1, 3, 8, 8), (3, 3, 16, 16), (2, 3, 12, 20)):
        x = torch.randn(*shape)
        want = reference(x.double())
        for fmt in ("pt2", "graph_module"):
            got = load_fused(cb.export_dir, fmt)(x)
            assert got.shape == want.shape and got.dtype == torch.float32, (fmt, shape)
            assert H.rel_err(got, want) < 1e-5, (fmt, shape)


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


class LossAroundModel(pl.LightningModule):
    """sentence-transformers: the steps call a loss built around the model (``MultipleNegativesRankingLoss(model)``),
    which calls the model inside; the loss holds no weights of its own."""

    class InBatchNegatives(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ea, eb = self.model(a), self.model(b)
            return F.cross_entropy(ea @ eb.T / 0.05, torch.arange(len(a)))

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        self.loss_fn = self.InBatchNegatives(self.model)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss_fn(*batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss_fn(*batch))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), 1e-3)


def test_a_loss_built_around_the_model_is_not_taken_for_the_model(tmp_path) -> None:
    """Refused before ("more than one holds trained parameters"), advising target: loss_fn, which exports the loss."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x + 0.1 * torch.randn(64, 8)), batch_size=16)
    cb, module = FXFuseCallback(), LossAroundModel()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    assert cb.outcome.manifest.provenance.target == "model"
    for rows in (1, 5):
        a = torch.randn(rows, 8)
        assert H.rel_err(load_fused(cb.export_dir)(a), H.fp64_copy(module.model)(a.double())) < 1e-5


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
    """scvi-tools' LossOutput: the outputs carry the batch's row count as an int, and a sum over the batch."""

    def forward(self, x: torch.Tensor) -> Dict[str, Any]:  # type: ignore[override]
        z = super().forward(x)
        return {"z": z, "n_obs": x.shape[0], "kl_sum": z.pow(2).sum()}


class CountingLit(H.LitClassifier):
    def __init__(self) -> None:
        super().__init__(backbone=WithCount(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x)["z"])


def test_an_int_output_that_counts_the_samples_is_the_count_of_each_call(tmp_path) -> None:
    """scvi-tools' LossOutput carries the batch's row count as an int. Taken as not part of the structure, the
    artifact answered with values computed for another count (kl_global_sum at 5 cells: relative error 835); then it
    was refused after training. An int equal to the number of samples in every call observed (16, 16 and 8 rows) is
    that number: the artifact gives each call's own, and every other output is computed on the call's own rows."""
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    model = CountingLit()
    train, val = H.loaders(n_val=40)  # 16, 16 and 8 rows
    H.make_trainer(tmp_path, [cb], max_epochs=1, limit_val_batches=3).fit(model, train, val)
    assert cb.outcome.manifest.signature.output_tree["items"][1] == {"kind": "const", "value": None, "samples": True}
    reference = H.fp64_copy(model.backbone)
    for rows in (1, 3, 16, 21):
        x = torch.randn(rows, 3, 8, 8)
        want = reference(x.double())
        for fmt in ("pt2", "graph_module"):
            got = load_fused(cb.export_dir, fmt)(x)
            assert type(got) is dict and list(got) == ["z", "n_obs", "kl_sum"], (fmt, got)
            assert got["n_obs"] == rows and type(got["n_obs"]) is int, (fmt, rows)
            assert got["z"].shape == want["z"].shape and got["kl_sum"].shape == want["kl_sum"].shape
            assert H.rel_err(got["z"], want["z"]) < 1e-5 and H.rel_err(got["kl_sum"], want["kl_sum"]) < 1e-5, fmt


class NotACount(WithCount):
    """An int that varies but is not the number of samples: still refused, never returned stale."""

    def forward(self, x: torch.Tensor) -> Dict[str, Any]:  # type: ignore[override]
        out = super().forward(x)
        out["n_obs"] = x.shape[0] + 1
        return out


def test_an_int_output_that_varies_and_is_not_the_count_is_refused_never_returned_stale(tmp_path) -> None:
    from fx_lightning.errors import ModelError

    cb = FXFuseCallback(export={"formats": ["pt2"]})
    model = CountingLit()
    model.backbone = NotACount(8)
    train, val = H.loaders(n_val=40)
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


class TextLit(pl.LightningModule):
    """A text classifier as its users write it: ``forward(self, **inputs)`` computes the loss when ``labels`` are
    given (Hugging Face's models), the steps pass the whole batch dict."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.classify = nn.Embedding(50, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def forward(self, **inputs: torch.Tensor) -> Dict[str, torch.Tensor]:  # type: ignore[override]
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        logits = self.classify(self.norm((self.embed(inputs["input_ids"]) * mask).sum(1) / mask.sum(1)))
        out = {"logits": logits}
        if "labels" in inputs:
            out["loss"] = F.cross_entropy(logits, inputs["labels"])
        return out

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(**batch)["loss"]

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(**batch)["loss"])


def _token_batches(n: int, batch: int, length: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    data = [{"input_ids": torch.randint(0, 50, (length,), generator=g), "attention_mask": torch.ones(length).long(),
             "labels": torch.randint(0, 4, (), generator=g)} for _ in range(n)]
    return torch.utils.data.DataLoader(data, batch_size=batch)


def test_the_artifact_answers_the_call_a_server_makes_without_labels(tmp_path) -> None:
    """transformers: the calls carried labels (the loss computed in forward), so labels were a required input, the
    loss hid the sample axis and batch 8, length 16 were fixed: batch 1 and a call without labels were refused."""
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    model = TextLit()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, _token_batches(32, 8, 16, 0), _token_batches(16, 8, 16, 1))
    assert any(n.kind.name == "labels_left_out" for n in cb.outcome.notes)
    assert [leaf.path for leaf in cb.outcome.manifest.signature.inputs] == ["input_ids", "attention_mask"]
    reference = copy.deepcopy(model).double().eval()
    for batch, length in ((1, 7), (3, 23)):
        ids = torch.randint(0, 50, (batch, length))
        mask = torch.ones(batch, length, dtype=torch.long)
        want = reference(input_ids=ids, attention_mask=mask)
        for fmt in ("pt2", "graph_module"):
            got = load_fused(cb.export_dir, fmt)(input_ids=ids, attention_mask=mask)
            assert set(got) == {"logits"} and H.rel_err(got["logits"], want["logits"]) < 1e-5, fmt
    # A call with labels (as the validation step makes it) is refused, and the advice is the call above.
    with pytest.raises(ExportError, match="labels given; the artifact's call leaves it out .* call it without labels"):
        load_fused(cb.export_dir)(input_ids=ids, attention_mask=mask, labels=torch.zeros(3, dtype=torch.long))


class CausalLMLit(TextLit):
    """A causal LM as transformers trains one: ``labels`` are the ``input_ids`` themselves (the loss shifts them)."""

    def forward(self, **inputs: torch.Tensor) -> Dict[str, torch.Tensor]:  # type: ignore[override]
        logits = self.classify(self.norm(self.embed(inputs["input_ids"]).transpose(1, 2)).transpose(1, 2))
        out = {"logits": logits * inputs["attention_mask"].unsqueeze(-1)}
        if "labels" in inputs:
            out["loss"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), inputs["labels"][:, 1:].flatten() % 4)
        return out


def test_a_causal_lms_labels_equal_to_its_input_ids_are_left_out_and_the_input_ids_kept(tmp_path) -> None:
    """Held-out check 8 (Mixtral, trained as Lightning's transformers examples do): the labels are the input_ids,
    so both keywords were taken for labels, the call without either failed, and the artifact kept ``labels`` as an
    input: the generation call without labels was refused (KeyError: 'labels')."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (32, 10), generator=g)
    data = [{"input_ids": i, "attention_mask": torch.ones(10).long(), "labels": i.clone()} for i in ids]
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, model = FXFuseCallback(export={"formats": ["pt2", "graph_module"]}), CausalLMLit()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    assert [leaf.path for leaf in cb.outcome.manifest.signature.inputs] == ["input_ids", "attention_mask"]
    reference = copy.deepcopy(model).double().eval()
    x, mask = torch.randint(0, 50, (1, 7)), torch.ones(1, 7, dtype=torch.long)
    for fmt in ("pt2", "graph_module"):
        got = load_fused(cb.export_dir, fmt)(input_ids=x, attention_mask=mask)
        want = reference(input_ids=x, attention_mask=mask)["logits"]
        assert set(got) == {"logits"} and H.rel_err(got["logits"], want) < 1e-5, fmt


class SetPredictionLit(pl.LightningModule):
    """DETR fine-tuned as its tutorial does: the steps call the model with ``labels``, a list of per-image dicts of
    boxes (a tensor cannot hold them), and its loss matches predictions to them in Python, which no tracer follows."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 5 * 4)

    def forward(self, pixel_values: torch.Tensor, labels: Optional[List[Dict[str, torch.Tensor]]] = None) -> Any:
        boxes = self.head(self.bn(self.conv(pixel_values)).relu().mean((2, 3))).view(-1, 5, 4).sigmoid()
        if labels is None:
            return {"pred_boxes": boxes}
        matched = [b[torch.cdist(b, t["boxes"]).argmin(0).tolist()] for b, t in zip(boxes, labels)]
        loss = sum(float(t["boxes"].shape[0] > 0) * (m - t["boxes"]).abs().sum() for m, t in zip(matched, labels))
        return {"loss": loss / len(labels), "pred_boxes": boxes}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(pixel_values=batch["pixel_values"], labels=batch["labels"])["loss"]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(pixel_values=batch["pixel_values"], labels=batch["labels"])["loss"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_labels_a_tensor_cannot_hold_are_left_out_by_name(tmp_path) -> None:
    """Held-out check 8 (DETR): ``labels`` a list of per-image dicts was never taken for labels (only tensors were):
    the artifact was built for the labelled call, whose Python matching no tracer follows, and the preflight
    stopped the training. Left out, proven as tensor labels are, the artifact takes ``pixel_values`` alone."""
    g = torch.Generator().manual_seed(0)
    items = [(torch.randn(3, 16, 16, generator=g), torch.rand(1 + i % 3, 4, generator=g)) for i in range(16)]
    loader = torch.utils.data.DataLoader(items, batch_size=4, collate_fn=lambda b: {
        "pixel_values": torch.stack([i[0] for i in b]), "labels": [{"boxes": i[1]} for i in b]})
    cb, model = FXFuseCallback(export={"formats": ["pt2", "graph_module"]}), SetPredictionLit()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    assert any(n.kind.name == "labels_left_out" for n in cb.outcome.notes)
    assert [leaf.path for leaf in cb.outcome.manifest.signature.inputs] == ["pixel_values"]
    reference, x = copy.deepcopy(model).double().eval(), torch.randn(1, 3, 20, 20)
    got = load_fused(cb.export_dir)(pixel_values=x)
    want = reference(pixel_values=x.double())["pred_boxes"]
    assert set(got) == {"pred_boxes"} and H.rel_err(got["pred_boxes"], want) < 1e-5


class PositionalLabels(pl.LightningModule):
    """Hugging Face's image classifiers as their users write the module: ``forward(pixel_values, labels=None)``
    returns the loss with the logits when labels are given, and the steps pass them by position, ``self(x, y)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, pixel_values: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        logits = self.fc(torch.relu(self.bn(self.conv(pixel_values))).mean((2, 3)))
        return {"logits": logits, **({"loss": F.cross_entropy(logits, labels)} if labels is not None else {})}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0], batch[1])["loss"]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(batch[0], batch[1])["loss"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_labels_passed_by_position_are_left_out_of_the_served_call(tmp_path) -> None:
    """transformers' ResNetForImageClassification: every inference call without labels was refused ("takes 2
    input(s) (pixel_values, labels); got 1"), since only labels passed by name were shown to be left out."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3, 16, 16), torch.randint(0, 4, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, model = FXFuseCallback(), PositionalLabels()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    assert [leaf.path for leaf in cb.outcome.manifest.signature.inputs] == ["pixel_values"]
    reference = H.fp64_copy(model)
    for name in cb.outcome.manifest.formats:
        fused = load_fused(cb.export_dir, name)
        for x in (torch.randn(1, 3, 16, 16), torch.randn(3, 3, 16, 16)):
            got = fused(x)
            assert set(got) == {"logits"} and H.rel_err(got["logits"], reference(x.double())["logits"]) < 1e-5, name
        with pytest.raises(ExportError, match="labels given; the artifact's call leaves it out .* call it without"):
            fused(x, torch.zeros(3, dtype=torch.long))


class ReturnLoss(pl.LightningModule):
    """transformers' CLIP as its users train it: ``model(**batch, return_loss=True)`` in every step; the loss only
    when the flag is set (and labels given)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None,
                return_loss: Optional[bool] = None) -> Dict[str, torch.Tensor]:
        out = {"logits": self.f(x)}
        if return_loss:
            out["loss"] = F.cross_entropy(out["logits"], y)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0], batch[1], return_loss=True)["loss"]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(batch[0], batch[1], return_loss=True)["loss"])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), 1e-3)


def test_a_flag_asking_for_the_loss_is_left_out_with_the_labels(tmp_path) -> None:
    """CLIP: every call without return_loss (its predict and zero-shot calls) was refused: the artifact was built
    with return_loss=True."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, model = FXFuseCallback(), ReturnLoss()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    reference = H.fp64_copy(model)
    for rows in (1, 5):
        x = torch.randn(rows, 8)
        got = load_fused(cb.export_dir)(x)
        assert set(got) == {"logits"} and H.rel_err(got["logits"], reference(x.double())["logits"]) < 1e-5
    with pytest.raises(ExportError, match="return_loss given; the artifact's call leaves it out"):
        load_fused(cb.export_dir)(x, return_loss=True)


class Forecaster(nn.Module):
    """darts' models take past and future targets; most never read the future ones (None at predict time)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm, self.out = nn.Linear(12, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)

    def forward(self, past_target: torch.Tensor, future_target: Any = None) -> torch.Tensor:
        return self.out(self.norm(self.proj(past_target)))


class ForecastLit(H.LitClassifier):
    def __init__(self) -> None:
        super().__init__(backbone=Forecaster())

    def forward(self, past: torch.Tensor, future: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.backbone(past_target=past, future_target=future)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        past, future = batch
        return F.mse_loss(self(past, future), future)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        past, future = batch
        self.log("val_loss", F.mse_loss(self(past, future), future))


def test_an_input_the_graph_never_reads_may_be_left_out(tmp_path) -> None:
    """darts: the future targets the training steps pass (and the model never reads) were a required input, so every
    predict call (future_target=None) was refused."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 12, generator=g), torch.randn(64, 4, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    model = ForecastLit()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    unread = [leaf.path for leaf in cb.outcome.manifest.signature.inputs if leaf.unread]
    assert unread == ["future_target"], cb.outcome.manifest.signature.inputs
    past = torch.randn(3, 12)
    want = H.fp64_copy(model.backbone)(past.double())
    for fmt in ("pt2", "graph_module"):
        loaded = load_fused(cb.export_dir, fmt)
        assert H.rel_err(loaded(past_target=past, future_target=None), want) < 1e-5, fmt
        assert H.rel_err(loaded(past_target=past), want) < 1e-5, fmt
        assert H.rel_err(loaded(past_target=past, future_target=torch.randn(3, 4)), want) < 1e-5, fmt


@dataclasses.dataclass
class ModuleInput:
    """darts' PLModuleInput: the batch as one dataclass, its future targets None at predict time."""

    past_target: torch.Tensor
    future_target: Optional[torch.Tensor] = None
    stage: Stage = Stage.PREDICT


class TimeNorm(nn.BatchNorm1d):
    """darts' TimeBatchNorm2d: a BatchNorm whose forward branches on its input's rank, which symbolic tracing
    cannot follow: the target is captured with torch.export, through a flat interface."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if x.dim() == 2:
            return super().forward(x)
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class RecordForecaster(Forecaster):
    def __init__(self) -> None:
        super().__init__()
        self.norm = TimeNorm(8)

    def forward(self, x_in: ModuleInput) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x_in.past_target)


class RecordForecastLit(ForecastLit):
    def __init__(self) -> None:
        H.LitClassifier.__init__(self, backbone=RecordForecaster())

    def forward(self, past: torch.Tensor, future: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.backbone(ModuleInput(past, future, Stage.TRAIN if self.training else Stage.VALIDATE))


def test_a_field_of_a_record_input_the_graph_never_reads_may_be_left_out(tmp_path) -> None:
    """darts (TSMixer, the real library): the batch is one dataclass whose future targets the model never reads;
    the capture takes the record whole, so no placeholder told they were unread and every predict call
    (future_target=None) was refused."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 12, generator=g), torch.randn(64, 4, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    model = RecordForecastLit()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    unread = [leaf.path for leaf in cb.outcome.manifest.signature.inputs if leaf.unread]
    assert unread == ["x_in.future_target"], cb.outcome.manifest.signature.inputs
    past = torch.randn(3, 12)
    want = H.fp64_copy(model.backbone)(ModuleInput(past.double()))
    for fmt in ("pt2", "graph_module"):
        loaded = load_fused(cb.export_dir, fmt)
        got = loaded(ModuleInput(past))
        assert got.shape == want.shape and H.rel_err(got, want) < 1e-5, fmt
        assert H.rel_err(loaded(ModuleInput(past, torch.randn(3, 4), Stage.VALIDATE)), want) < 1e-5, fmt


class Handle:
    """Something a model may hold that copies but no pickler writes (an open handle)."""

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Handle":
        return self

    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle an open Handle")


class Opaque(nn.Module):
    """A leaf the graph calls whole, holding something no pickler can write."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.handle = Handle()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class OpaqueBackbone(H.TinyBackbone):
    def __init__(self) -> None:
        super().__init__(8)
        self.opaque = Opaque()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.opaque(super().forward(x))


def test_when_every_format_fails_no_advice_to_drop_one_is_given(tmp_path) -> None:
    """pytorch-forecasting (before graph_module pickled local classes by value): 'no format could be written ... Fix:
    drop the failing format from export.formats': advice that cannot work when every format failed. The reasons are the advice; the training is stopped before it starts."""
    cb = FXFuseCallback(export={"formats": ["graph_module"]}, trace={"leaf_modules": ["test_zero_config:Opaque"]})
    model = H.LitClassifier(backbone=OpaqueBackbone())
    with pytest.raises(ExportError) as info:
        H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *H.loaders())
    text = str(info.value)
    assert "no format could be written" in text and "format 'graph_module'" in text and "pickle" in text, text
    assert "Fix:" not in text and "drop the failing format" not in text, text
    assert "before the first optimizer step" in text, text


class CachedOutputClass(nn.Module):
    """pytorch-forecasting's TemporalFusionTransformer, which the capture leaves whole: on its first call it builds its
    output named tuple's class inside a method and caches it on itself (TupleOutputMixIn.to_network_output)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        if not hasattr(self, "_output_class"):
            class Output(collections.namedtuple("output", ["prediction", "scale"])):
                pass

            self._output_class = Output
        y = self.lin(x)
        return self._output_class(y, y.abs().mean(dim=-1))


class CachedOutputBackbone(H.TinyBackbone):
    def __init__(self) -> None:
        super().__init__(8)
        self.tft = CachedOutputClass()

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        return self.tft(super().forward(x))


def _fit_cached_output_class(tmp_path) -> Any:
    cb = FXFuseCallback(export={"formats": ["graph_module"]},
                        trace={"leaf_modules": ["test_zero_config:CachedOutputClass"]})
    model = H.LitClassifier(backbone=CachedOutputBackbone())
    model.forward = lambda x: model.head(model.backbone(x).prediction)  # type: ignore[method-assign]
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *H.loaders())
    return cb, model


def test_a_leaf_caching_a_class_defined_in_a_function_is_pickled_by_value(tmp_path, monkeypatch) -> None:
    """pytorch-forecasting: graph_module failed with "Can't pickle local object
    'TupleOutputMixIn.to_network_output.<locals>.Output'"; cloudpickle writes such a class by value."""
    cb, model = _fit_cached_output_class(tmp_path)
    assert fx_lightning.export.read_manifest(cb.export_dir).formats["graph_module"].imports == ["cloudpickle"]
    x = torch.randn(3, 3, 8, 8)
    want = H.fp64_copy(model.backbone)(x.double())
    got = load_fused(cb.export_dir, "graph_module")(x)
    assert type(got).__name__ == "Output" and got._fields == ("prediction", "scale"), type(got)
    assert got.prediction.dtype == torch.float32 and got.prediction.shape == want.prediction.shape
    assert H.rel_err(got.prediction, want.prediction) < 1e-5 and H.rel_err(got.scale, want.scale) < 1e-5
    # In a fresh process, where the class defined in forward was never made: rebuilt from its pickled value.
    torch.save({"x": x, "want": tuple(want)}, tmp_path / "call.pt")
    script = ("import sys, torch; from fx_lightning import load_fused; d = torch.load(sys.argv[2]); "
              "got = load_fused(sys.argv[1], 'graph_module')(d['x']); "
              "err = max(float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, d['want'])); "
              "print(type(got).__name__, ','.join(got._fields), err)")
    done = subprocess.run([sys.executable, "-c", script, str(cb.export_dir), str(tmp_path / "call.pt")],
                          capture_output=True, text=True, cwd=os.path.dirname(__file__), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    name, fields, err = done.stdout.split()
    assert (name, fields) == ("Output", "prediction,scale") and float(err) < 1e-5, done.stdout
    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # where it is not installed: the install line
    with pytest.raises(ExportError, match="pip install cloudpickle"):
        load_fused(cb.export_dir, "graph_module")


def test_without_cloudpickle_a_local_class_is_refused_with_the_install_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # import cloudpickle raises ImportError
    with pytest.raises(ExportError) as info:
        _fit_cached_output_class(tmp_path)
    assert "CachedOutputClass.forward.<locals>.Output" in str(info.value) and "pip install cloudpickle" in str(info.value), str(info.value)


class MuNormal(torch.distributions.Normal):
    """scvi-tools' own Normal: its constructor takes ``mu`` where torch's takes ``loc``."""

    def __init__(self, mu: torch.Tensor, scale: torch.Tensor, validate_args: Optional[bool] = None) -> None:
        super().__init__(mu, scale, validate_args=validate_args)


class Encoder(H.TinyBackbone):
    """scvi-tools' VAE: the inference outputs hold torch.distributions objects (qz: Normal, an Independent, its own
    Normal subclass) and an empty dict (LossOutput.extra_metrics)."""

    def forward(self, x: torch.Tensor) -> Dict[str, Any]:  # type: ignore[override]
        h = super().forward(x)
        normal = torch.distributions.Normal(h, F.softplus(h) + 1e-3)
        return {"z": h, "qz": normal, "qzi": torch.distributions.Independent(normal, 1),
                "pz": MuNormal(torch.zeros_like(h), torch.ones_like(h)), "extra": {}}


def test_distribution_outputs_come_back_as_distributions_from_every_loaded_artifact(tmp_path) -> None:
    """scvi-tools: load_fused gave qz back as a dict of its parameters (19 outputs became 25 with other types), and
    LossOutput.extra_metrics ({}) as None."""
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module", "onnx"]})
    model = H.LitClassifier(backbone=Encoder(8))
    model.forward = lambda x: model.head(model.backbone(x)["z"])  # type: ignore[method-assign]
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *H.loaders())
    x = torch.randn(3, 3, 8, 8)
    want = H.fp64_copy(model.backbone)(x.double())
    for fmt in ("pt2", "graph_module", "onnx"):
        got = load_fused(cb.export_dir, fmt)(x)
        assert type(got) is dict and list(got) == ["z", "qz", "qzi", "pz", "extra"], (fmt, got)
        assert type(got["pz"]) is MuNormal and got["pz"].batch_shape == want["pz"].batch_shape, fmt
        assert H.rel_err(got["pz"].scale, want["pz"].scale) < 1e-6 and got["extra"] == {}, fmt
        assert type(got["qz"]) is torch.distributions.Normal, (fmt, type(got["qz"]))
        assert type(got["qzi"]) is torch.distributions.Independent and got["qzi"].reinterpreted_batch_ndims == 1
        assert H.rel_err(got["qz"].loc, want["qz"].loc) < 1e-5 and H.rel_err(got["qz"].scale, want["qz"].scale) < 1e-5
        assert H.rel_err(got["qzi"].base_dist.scale, want["qzi"].base_dist.scale) < 1e-5, fmt


class LengthPooled(nn.Module):
    """speechbrain's ECAPA_TDNN: ``forward(x, lengths=None)``, relative lengths masking the statistics pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        if lengths is None:
            return h.mean(dim=-1)
        mask = (torch.arange(h.shape[-1]) < (lengths * h.shape[-1]).unsqueeze(1)).to(h.dtype).unsqueeze(1)
        return (h * mask).sum(dim=-1) / mask.sum(dim=-1)


class SpeakerLit(pl.LightningModule):
    """A speaker-id recipe: the steps call the encoder with or without the relative lengths."""

    def __init__(self, pass_lengths: bool) -> None:
        super().__init__()
        self.encoder = LengthPooled()
        self.head = nn.Linear(8, 3)
        self.pass_lengths = pass_lengths

    def _loss(self, batch: Any) -> torch.Tensor:
        x, lengths, y = batch
        emb = self.encoder(x, lengths) if self.pass_lengths else self.encoder(x)
        return F.cross_entropy(self.head(emb), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _speech_loader(seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(4, 20, generator=g), torch.rand((), generator=g) * 0.5 + 0.5, torch.randint(3, (), generator=g))
            for _ in range(32)]
    return torch.utils.data.DataLoader(data, batch_size=8)


def test_an_argument_no_observed_call_passed_is_refused_by_position_and_the_advice_works(tmp_path) -> None:
    """speechbrain: encode_batch passes wav_lens, which its training recipe never passes; the artifact answered
    "takes 1 input(s) (x); got 2" without saying why or what to do."""
    with pytest.raises(fx_lightning.errors.ConfigError) as info:  # encoder and head: which one is served?
        H.make_trainer(tmp_path, [FXFuseCallback()], max_epochs=1).fit(SpeakerLit(False), _speech_loader(0),
                                                                      _speech_loader(1))
    assert "encoder (120 trained parameters), head (27 trained parameters)" in str(info.value), str(info.value)
    assert "Fix: set target to the one to fuse (e.g. target: encoder)" in str(info.value), str(info.value)
    x, lengths = torch.randn(2, 4, 30), torch.tensor([1.0, 0.63])  # 18.9 of 30 frames: far from a mask edge
    for pass_lengths in (False, True):  # the advice taken: target: encoder
        cb = FXFuseCallback(target="encoder", export={"formats": ["pt2"]})
        model = SpeakerLit(pass_lengths)
        H.make_trainer(tmp_path / str(pass_lengths), [cb], max_epochs=1).fit(model, _speech_loader(0), _speech_loader(1))
        loaded = load_fused(cb.export_dir, "pt2")
        encoder = H.fp64_copy(model.encoder)
        if not pass_lengths:
            with pytest.raises(ExportError) as info:
                loaded(x, lengths)
            assert "no call the export was built from" in str(info.value), str(info.value)
            assert "passed an argument from position 2 on" in str(info.value), str(info.value)
            assert H.rel_err(loaded(x), encoder(x.double())) < 1e-5
        else:  # the advice: the steps pass it, and the artifact takes it
            got = loaded(x, lengths)
            assert got.shape == (2, 8) and H.rel_err(got, encoder(x.double(), lengths.double())) < 1e-5


class FeatureMaps(H.TinyBackbone):
    """torchvision's IntermediateLayerGetter / FPN: the features as an OrderedDict."""

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        h = super().forward(x)
        return collections.OrderedDict([("0", h), ("pool", h.abs().mean(dim=-1, keepdim=True))])


def test_an_ordered_dict_output_comes_back_as_an_ordered_dict_from_every_format(tmp_path) -> None:
    """torchvision's backbones: every format gave a plain dict for the OrderedDict the model returns."""
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module", "onnx"]})
    model = H.LitClassifier(backbone=FeatureMaps(8))
    model.forward = lambda x: model.head(model.backbone(x)["0"])  # type: ignore[method-assign]
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *H.loaders())
    x = torch.randn(3, 3, 8, 8)
    want = H.fp64_copy(model.backbone)(x.double())
    for fmt in ("pt2", "graph_module", "onnx"):
        got = load_fused(cb.export_dir, fmt)(x)
        assert type(got) is collections.OrderedDict and list(got) == ["0", "pool"], (fmt, type(got))
        assert all(got[k].shape == want[k].shape and H.rel_err(got[k], want[k]) < 1e-5 for k in want), fmt


class KeepsItsOutput(H.LitClassifier):
    """Lightning's GAN tutorial: ``self.generated_imgs = self(z)``, a tensor with autograd history kept on the module,
    which copy.deepcopy refuses."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.last_logits = self(batch[0])
        return F.cross_entropy(self.last_logits, batch[1])


def test_a_module_keeping_a_tensor_with_autograd_history_is_fused_and_left_as_it_was(tmp_path) -> None:
    cb = FXFuseCallback(export={"formats": ["pt2"]})
    model = KeepsItsOutput()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *H.loaders())
    assert model.last_logits.grad_fn is not None  # the user's module untouched
    x = torch.randn(3, 3, 8, 8)
    got, want = load_fused(cb.export_dir, "pt2")(x), H.fp64_copy(model.backbone)(x.double())
    assert got.shape == want.shape and got.dtype == torch.float32 and H.rel_err(got, want) < 1e-5


class M5(H.CrossEntropySteps):
    """torchaudio's speech-command tutorial (M5): ``F.avg_pool1d(x, x.shape[-1])``, a kernel torch.export cannot keep
    dynamic, on clips of one length: the length is shown to vary only by experiment."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 16, stride=4)
        self.bn = nn.BatchNorm1d(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool1d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(F.avg_pool1d(h, h.shape[-1]).squeeze(-1))


def test_a_length_torch_export_cannot_keep_dynamic_is_fixed_only_in_the_formats_made_with_it(tmp_path) -> None:
    """torchaudio's M5: the probed length was fixed for every format, graph_module included, whose graph is right at
    every length: it refused a clip of another length."""
    data = torch.utils.data.TensorDataset(torch.randn(32, 1, 400), torch.randint(0, 3, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    model = M5()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    assert "probed_fixed" in {n.kind.name for n in cb.outcome.manifest.notes}
    reference = H.fp64_copy(model)
    for length in (400, 600, 272):
        x = torch.randn(2, 1, length)
        got = load_fused(cb.export_dir, "graph_module")(x)
        assert got.shape == (2, 3) and H.rel_err(got, reference(x.double())) < 1e-5, length
    x = torch.randn(2, 1, 400)
    assert H.rel_err(load_fused(cb.export_dir, "pt2")(x), reference(x.double())) < 1e-5
    with pytest.raises(ExportError, match=r"built for 400 there \(a size shown to vary by a call resized, only 400 "
                                          r"seen, exported for that size only\)"):  # refused by name, never wrong
        load_fused(cb.export_dir, "pt2")(torch.randn(2, 1, 600))
    # The default pick (load_fused(dir), serve) passes over the artifact built for one length: the call users serve
    # has other lengths (MONAI's DenseNet121 at other volume sizes was refused by the default pick).
    x = torch.randn(1, 1, 600)
    assert H.rel_err(load_fused(cb.export_dir)(x), reference(x.double())) < 1e-5
    assert artifact_for(read_manifest(cb.export_dir), ServeOptions()) == ("graph_module", "")


class ScoreFiltered(pl.LightningModule):
    """Detection's score threshold (NMS, box filtering): how many rows come out depends on values, and at x = 0.1 the
    fp64 copy keeps a row fp32 drops (0.1 * 10 - 1 is 1.5e-8 in fp64, 0 in fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))[x[:, 0] * 10 - 1 > 0]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_an_output_whose_length_fp64_changes_is_checked_against_the_model_at_its_precision(tmp_path) -> None:
    """torchvision's detection models: the export's check subtracted fp64 outputs from fp32 ones of another length
    and crashed, stopping the training before it started."""
    x = torch.randn(32, 4)
    x[::2, 0] = 0.1
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    model = ScoreFiltered()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    clear = torch.randn(6, 4).abs() + 0.2  # no row on the threshold: fp64 is the reference
    for fmt in ("pt2", "graph_module"):
        got, want = load_fused(cb.export_dir, fmt)(clear), H.fp64_copy(model)(clear.double())
        assert got.shape == want.shape == (6, 4) and H.rel_err(got, want) < 1e-5, fmt
        on_edge = x[:8]
        got, want = load_fused(cb.export_dir, fmt)(on_edge), copy.deepcopy(model).eval()(on_edge)
        assert got.shape == want.shape and H.rel_err(got, want) < 1e-5, fmt  # the model's own rows at fp32


class WithWeightsTransforms(H.CrossEntropySteps):
    """torchvision's deployment pattern: the weights' own preprocessing (``weights.transforms()``: resize, centre
    crop, normalise) inside forward. Symbolic tracing fails in it (``F_pil.get_dimensions`` on a Proxy, a call fx
    does not patch when told to keep the function whole) and torch.export on ``(std == 0).any()``: the module is
    kept whole, so the rest is captured and its BatchNorm folded."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models import ResNet18_Weights

        self.preprocess = ResNet18_Weights.DEFAULT.transforms()  # only the transform's settings: no download
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(self.preprocess(images))


def test_a_module_symbolic_tracing_cannot_follow_is_kept_whole_and_the_rest_fused(tmp_path) -> None:
    data = torch.utils.data.TensorDataset(torch.rand(16, 3, 64, 96), torch.randint(0, 5, (16,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb = FXFuseCallback()
    model = WithWeightsTransforms()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    report = cb.outcome.result.report
    assert report.batchnorms_folded == 1 and report.after.batchnorms == 0
    assert "ImageClassification" in cb.summary  # it says what was kept whole
    model.eval()
    net = H.fp64_copy(model.net)  # the transform itself casts to float32: the fp64 copy starts after it
    fused = load_fused(cb.export_dir)
    for shape in ((1, 3, 64, 96), (3, 3, 80, 80), (2, 3, 120, 90)):  # sizes and batches never seen
        x = torch.rand(*shape)
        with torch.no_grad():
            want = net(model.preprocess(x).double())
        got = fused(x)
        assert got.shape == want.shape == (shape[0], 5) and got.dtype == torch.float32, shape
        assert H.rel_err(got, want) < 1e-5, shape


class ColumnsByFlag(nn.Module):
    """tabnet's EmbeddingGenerator: a Python branch on the values of a tensor it holds (no tracer follows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.continuous = torch.tensor([True, False, True, True])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, j:j + 1] if flag else x[:, j:j + 1].round() for j, flag in enumerate(self.continuous)], 1)


class TabNetLike(H.CrossEntropySteps):
    """tabnet's FeatTransformer builds a module inside forward (``nn.ReLU()(x)``): the refusal's advice was
    ``trace.leaf_modules: ['<unregistered>']``, which no one can apply."""

    def __init__(self) -> None:
        super().__init__()
        self.columns, self.lin, self.bn, self.out = ColumnsByFlag(), nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.ReLU()(self.bn(self.lin(self.columns(x)))))


def test_a_module_made_inside_forward_is_traced_inline(tmp_path) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, model = FXFuseCallback(), TabNetLike()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    assert cb.outcome.result.report.batchnorms_folded == 1
    reference = H.fp64_copy(model)
    for x in (torch.randn(1, 4), torch.randn(5, 4)):
        assert H.rel_err(load_fused(cb.export_dir)(x), reference(x.double())) < 1e-5


class Refined(pl.LightningModule):
    """torchvision's RAFT: ``forward(..., num_flow_updates=4)``, validated (and served by its predict) with 8."""

    def __init__(self, validation_steps: Optional[int]) -> None:
        super().__init__()
        self.validation_steps = validation_steps
        self.inp = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16))
        self.step, self.out = nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, steps: int = 2) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(steps):
            h = torch.tanh(self.step(h)) + h
        return self.out(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0], steps=2), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        out = self(batch[0]) if self.validation_steps is None else self(batch[0], steps=self.validation_steps)
        self.log("val_loss", F.mse_loss(out, batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("validation_steps", [6, None])
def test_an_argument_left_out_means_forwards_default_never_the_value_observed(tmp_path, validation_steps) -> None:
    """Validated with steps=6, the artifact called without steps computed 6 steps where the model computes its
    default 2 (held out: RAFT's final flow off by 120%). Without call forms leaving it out is refused, and the
    advice works both ways; with them (the default) the steps=2 form, which the training calls made, answers it."""
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    for call_forms in (False, True):
        cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"], "call_forms": call_forms})
        model = Refined(validation_steps)
        H.make_trainer(tmp_path / str(call_forms), [cb], max_epochs=1).fit(model, loader, loader)
        reference, x = H.fp64_copy(model), torch.randn(3, 4)
        for fmt in ("pt2", "graph_module"):
            fused = load_fused(cb.export_dir, fmt)
            if validation_steps is None or call_forms:  # left out: forward's default, the artifact's or its form's
                got, want = fused(x), reference(x.double())
                assert got.shape == want.shape == (3, 1) and H.rel_err(got, want) < 1e-5, fmt
            if validation_steps is None:
                continue
            if not call_forms:
                with pytest.raises(ExportError, match=r"steps left out, which the model takes as 2 \(forward's "
                                                      r"default\); the artifact was built with steps=6 .*: pass steps=6"):
                    fused(x)
            got, want = fused(x, steps=6), reference(x.double(), steps=6)  # the advice: the call it computes
            assert got.shape == want.shape == (3, 1) and H.rel_err(got, want) < 1e-5, fmt


class EmbeddedBackbone(H.CrossEntropySteps):
    """pytorch-tabular's model: ``embed`` -> ``backbone`` -> ``head`` in the LightningModule's forward; the default
    target ``backbone`` takes the embedded features, not the batch, and leaves the head out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.backbone = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, H.NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(self.embed(x)))


def _table_loaders() -> Any:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, H.NUM_CLASSES, (32,),
                                                                                          generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8), torch.utils.data.DataLoader(data, batch_size=8)


def test_the_default_backbone_says_what_the_forward_runs_beside_it_and_the_advice_exports_all(tmp_path) -> None:
    """Before: the artifact was the backbone alone (it takes the embedded features) and nothing said so."""
    cb = FXFuseCallback(export={"formats": ["pt2"]})
    model = EmbeddedBackbone()
    H.make_trainer(tmp_path / "default", [cb], max_epochs=1).fit(model, *_table_loaders())
    assert cb.outcome.manifest.provenance.target == "backbone"
    (note,) = [n for n in cb.outcome.notes if n.kind.name == "backbone_only"]
    assert "embed (56 trained parameters), head" in str(note) and "target: ''" in str(note), str(note)
    # The advice: the whole forward, from the batch's columns to the classes, and no note.
    cb = FXFuseCallback(target="", export={"formats": ["pt2"]})
    H.make_trainer(tmp_path / "whole", [cb], max_epochs=1).fit(model, *_table_loaders())
    assert cb.outcome.manifest.provenance.target == ""
    assert not [n for n in cb.outcome.notes if n.kind.name == "backbone_only"]
    x = torch.randn(5, 6)
    got = load_fused(cb.export_dir)(x)
    assert got.shape == (5, H.NUM_CLASSES) and got.dtype == torch.float32
    assert H.rel_err(got, H.fp64_copy(model)(x.double())) < 1e-5


def test_a_backbone_the_forward_runs_alone_gets_no_note(tmp_path) -> None:
    cb = FXFuseCallback(export={"formats": ["pt2"]})
    model = H.LitClassifier()
    model.head = nn.Identity()  # forward: the backbone alone (an identity holds no trained parameters)
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *H.loaders())
    assert cb.outcome.manifest.provenance.target == "backbone"
    assert not [n for n in cb.outcome.notes if n.kind.name == "backbone_only"], cb.outcome.notes


class KeywordNet(nn.Module):
    """Hugging Face's ``self.model(**batch)``: the steps give every argument by name."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.bn, self.head = nn.Embedding(50, 16), nn.BatchNorm1d(16), nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.head(self.bn((self.emb(input_ids) * attention_mask.unsqueeze(-1)).sum(1)))


class CalledByKeyword(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = KeywordNet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.model(input_ids=batch[0], attention_mask=batch[1]), batch[2])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.model(input_ids=batch[0], attention_mask=batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_argument_the_steps_gave_by_name_may_be_given_by_position(tmp_path) -> None:
    """The steps call ``model(input_ids=..., attention_mask=...)``; ``model(ids, attention_mask=m)`` is the same call
    to the model, and was refused ('args[0] given, which the artifact was not built for')."""
    data = torch.utils.data.TensorDataset(torch.randint(0, 50, (32, 7)), torch.ones(32, 7, dtype=torch.long),
                                          torch.randint(0, 3, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, module = FXFuseCallback(export={"formats": ["pt2"]}), CalledByKeyword()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    fused, reference = load_fused(cb.export_dir), H.fp64_copy(module.model)
    ids, mask = torch.randint(0, 50, (3, 7)), torch.randint(0, 2, (3, 7))
    want = reference(ids, attention_mask=mask)
    for got in (fused(ids, attention_mask=mask), fused(ids, mask), fused(input_ids=ids, attention_mask=mask)):
        assert got.shape == want.shape and got.dtype == torch.float32 and H.rel_err(got, want) < 1e-5
    with pytest.raises(ExportError, match="not built for"):  # a third argument forward does not take
        fused(ids, mask, mask)


@dataclasses.dataclass
class ClassifierOutput(collections.OrderedDict):
    """Hugging Face's ModelOutput pattern: a dataclass that is also a mapping, registered with torch's pytree."""

    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


torch.utils._pytree.register_pytree_node(
    ClassifierOutput, lambda o: (list(o.values()), list(o.keys())),
    lambda values, keys: ClassifierOutput(**dict(zip(keys, values))),
    serialized_type_name=f"{__name__}.ClassifierOutput")


class ReturnsModelOutput(H.CrossEntropySteps):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> ClassifierOutput:
        h = self.body(x)
        return ClassifierOutput(logits=self.head(h), hidden=h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]).logits, batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


def test_a_dataclass_that_is_a_mapping_comes_back_as_its_class(tmp_path) -> None:
    """A ModelOutput came back as a plain dict: ``out.logits`` raised AttributeError."""
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, module = FXFuseCallback(export={"formats": ["pt2", "graph_module"]}), ReturnsModelOutput()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    x = torch.randn(3, 8)
    want = H.fp64_copy(module)(x.double())
    for fmt in ("pt2", "graph_module"):
        got = load_fused(cb.export_dir, fmt)(x)
        assert type(got) is ClassifierOutput and list(got.keys()) == ["logits", "hidden"], (fmt, type(got))
        for key in ("logits", "hidden"):
            assert getattr(got, key).shape == want[key].shape and H.rel_err(got[key], want[key]) < 1e-5, (fmt, key)


class KeepsNoBox(nn.Module):
    """A detector's score threshold that keeps no row on the validation data (a trained Mask R-CNN kept no box on
    a validation image): the parity metrics crashed on the [0, 4] outputs ('cannot reshape tensor of 0 elements')."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.score, self.box = nn.Conv2d(8, 1, 1), nn.Conv2d(8, 4, 1)

    def forward(self, images: torch.Tensor) -> Any:
        f = self.body(images)
        scores, boxes = self.score(f).sigmoid().flatten(1), self.box(f).flatten(2).transpose(1, 2)
        return [{"boxes": b[s > 2.0], "scores": s[s > 2.0]} for s, b in zip(scores, boxes)]  # a sigmoid is < 2


class DetectorSteps(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = KeepsNoBox()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        f = self.model.body(batch[0])
        return self.model.score(f).mean() + self.model.box(f).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.model(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_outputs_with_no_rows_are_compared_without_a_crash_and_said_unproven(tmp_path) -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.rand(16, 3, 16, 16)), batch_size=4)
    cb, module = FXFuseCallback(export={"formats": ["pt2"]}), DetectorSteps()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    assert "empty_outputs" in {n.kind.name for n in cb.outcome.parity.notes}
    x = torch.rand(4, 3, 16, 16)
    got, want = load_fused(cb.export_dir)(x), H.fp64_copy(module.model)(x.double())
    assert type(got) is list and len(got) == len(want) == 4
    assert all(g["boxes"].shape == (0, 4) and g["scores"].shape == (0,) for g in got)


class WritesIntoItsInput(nn.Module):
    """sentence-transformers' modules: ``features["sentence_embedding"] = ...; return features``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.proj = nn.Embedding(30, 16), nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))

    def forward(self, features: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        tokens = self.emb(features["input_ids"])
        features["token_embeddings"] = tokens
        mask = features["attention_mask"].unsqueeze(-1).to(tokens.dtype)
        features["sentence_embedding"] = self.proj((tokens * mask).sum(1) / mask.sum(1))
        return features


class EncoderSteps(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = WritesIntoItsInput()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        e = self.model({"input_ids": batch[0], "attention_mask": batch[1]})["sentence_embedding"]
        return F.cross_entropy(e @ e.T, torch.arange(len(e)))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.model({"input_ids": batch[0], "attention_mask": batch[1]})

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_forward_that_writes_into_its_input_dict_is_fused(tmp_path) -> None:
    """The recorded call was run as it was, so the keys forward added to its dict made the next run's call another
    structure: the preflight stopped training with KeyError: 'token_embeddings'."""
    data = torch.utils.data.TensorDataset(torch.randint(0, 30, (32, 6)), torch.ones(32, 6, dtype=torch.long))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, module = FXFuseCallback(export={"formats": ["pt2"]}), EncoderSteps()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    ids, mask = torch.randint(0, 30, (3, 9)), torch.randint(0, 2, (3, 9))
    mask[:, 0] = 1
    got = load_fused(cb.export_dir)({"input_ids": ids, "attention_mask": mask})
    want = H.fp64_copy(module.model)({"input_ids": ids, "attention_mask": mask})
    assert type(got) is dict and set(got) == set(want), (type(got), list(got))
    for key in ("token_embeddings", "sentence_embedding"):
        assert got[key].shape == want[key].shape and got[key].dtype == torch.float32
        assert H.rel_err(got[key], want[key]) < 1e-5, key


class ReturnDictFlag(H.CrossEntropySteps):
    """diffusers' ``forward(sample, timestep, return_dict=True)``: the same tensors, in an output object by default
    and in a tuple with ``return_dict=False`` (what its training loops pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        h = self.body(x)
        return ClassifierOutput(logits=self.head(h), hidden=h) if return_dict else (self.head(h), h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0], return_dict=False)[0], batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0], return_dict=False)


def test_a_flag_that_changes_only_the_outputs_containers_is_read(tmp_path) -> None:
    """The flag's experiment compared the output tensors alone, found them equal with return_dict=True, and took the
    flag as unread: the artifact answered ``fused(x)`` with the tuple where the model returns its output object."""
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    for call_forms in (False, True):
        cb, module = FXFuseCallback(export={"formats": ["pt2"], "call_forms": call_forms}), ReturnDictFlag()
        H.make_trainer(tmp_path / str(call_forms), [cb], max_epochs=1).fit(module, loader, loader)
        fused, x, reference = load_fused(cb.export_dir), torch.randn(3, 8), H.fp64_copy(module)
        got, want = fused(x, return_dict=False), reference(x.double(), return_dict=False)
        assert type(got) is tuple and len(got) == 2 and all(H.rel_err(g, w) < 1e-5 for g, w in zip(got, want))
        if not call_forms:
            with pytest.raises(ExportError, match="return_dict left out, which the model takes as True"):
                fused(x)
            continue
        got, want = fused(x), reference(x.double())  # the default: its call form, the model's output object
        assert type(got) is ClassifierOutput and H.rel_err(got.logits, want.logits) < 1e-5
        assert H.rel_err(got.hidden, want.hidden) < 1e-5


class PackedGRU(H.CrossEntropySteps):
    """Padded token batches through ``pack_padded_sequence`` and a GRU, as text and speech classifiers write it: no
    tracer follows the packing (torch.fx fails inside torch's own code; torch.export on ``lengths.cpu()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.gru = nn.Embedding(50, 16), nn.GRU(16, 32, batch_first=True)
        self.norm, self.head = nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, hidden = self.gru(packed)
        return self.head(self.norm(hidden[-1]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0], batch[1]), batch[2])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0], batch[1])


def test_a_library_function_no_tracer_follows_is_kept_whole_and_the_artifact_takes_every_length(tmp_path) -> None:
    """pack_padded_sequence is torch's own Python: it was never kept whole (only the user's functions were), so
    the preflight stopped training with "Neither capture mode worked" and advice (trace.mode: export) that had just
    failed. Kept whole, it is called by name in the saved graph: torch.fx writes a kept-whole torch function as a
    dotted wrap() its own unpickler cannot find, and that entry broke every later trace in the process."""
    torch.manual_seed(0)
    lengths = torch.randint(3, 13, (48,))
    data = torch.utils.data.TensorDataset(torch.randint(1, 50, (48, 12)), lengths, torch.randint(0, 4, (48,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    cb, module = FXFuseCallback(), PackedGRU()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    assert "kept whole" in cb.summary and "pack_padded_sequence" in cb.summary
    fused, reference = load_fused(cb.export_dir), H.fp64_copy(module)
    for batch, length in ((1, 12), (3, 20), (2, 5)):  # batch 1 and lengths never seen
        tokens, lengths = torch.randint(1, 50, (batch, length)), torch.randint(1, length + 1, (batch,))
        got, want = fused(tokens, lengths), reference(tokens, lengths)
        assert got.shape == want.shape == (batch, 4) and got.dtype == torch.float32
        assert H.rel_err(got, want) < 1e-5
    torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))  # torch.fx's process-wide table is unharmed


class ImageListModel(H.CrossEntropySteps):
    """torchvision's detectors' call: a ``List[Tensor]`` of images in, one result per image out (a dict). With
    ``shared``, each image is scaled by the list's mean brightness: the items interact."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.shared = shared
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, images: list) -> list:
        batch = torch.stack(images)
        if self.shared:
            batch = batch / (1.0 + batch.mean().abs())
        features = self.body(batch).mean((2, 3))
        scores = self.head(features)
        return [{"scores": scores[i], "features": features[i]} for i in range(len(images))]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(torch.stack([r["scores"] for r in self(list(images))]), labels)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(list(batch[0]))


def _image_list_fit(tmp_path, shared: bool) -> Any:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 3, 16, 16), torch.randint(0, 4, (24,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    cb, module = FXFuseCallback(), ImageListModel(shared)
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    return cb, module


def test_a_list_whose_items_are_samples_takes_any_length(tmp_path) -> None:
    """The artifact is built for the list's length in the calls (4 images: four tensors in the graph); a list of 1,
    3 or 6 images was refused as a structure it was not built for. Each image's result shown to be its own (beside
    copies of itself it gets the result it got in the call), other lengths run as pieces of 4, the last padded."""
    cb, module = _image_list_fit(tmp_path, shared=False)
    manifest = read_manifest(cb.export_dir)
    assert manifest.signature is not None and manifest.signature.items is not None
    assert manifest.signature.items.length == 4
    fused, reference = load_fused(cb.export_dir), H.fp64_copy(module)
    for count in (1, 3, 4, 6):
        images = [torch.randn(3, 16, 16) for _ in range(count)]
        got, want = fused(images), reference([x.double() for x in images])
        assert type(got) is list and len(got) == count
        for g, w in zip(got, want):
            assert type(g) is dict and list(g) == ["scores", "features"]
            for key in g:
                assert g[key].shape == w[key].shape and g[key].dtype == torch.float32
                assert H.rel_err(g[key], w[key]) < 1e-5, (count, key)


def test_a_list_whose_items_interact_is_taken_at_its_length_only(tmp_path) -> None:
    """Images scaled by the list's mean: pieces would change every result, so no other length is taken."""
    cb, module = _image_list_fit(tmp_path, shared=True)
    signature = read_manifest(cb.export_dir).signature
    assert signature is not None and signature.items is None
    assert any("items of argument 0 are not independent" in note for note in signature.notes)
    fused = load_fused(cb.export_dir)
    images = [torch.randn(3, 16, 16) for _ in range(4)]
    got, want = fused(images), H.fp64_copy(module)([x.double() for x in images])
    assert all(H.rel_err(g["scores"], w["scores"]) < 1e-5 for g, w in zip(got, want))
    with pytest.raises(ExportError, match=r"given, which the artifact was not built for|cannot find its inputs"):
        fused(images[:3])


def test_a_kept_whole_library_function_survives_every_format_of_the_fused_graph(tmp_path) -> None:
    """The code format wrote the name it imports a kept-whole function by above the helper that imports it (load:
    NameError '_resolve'), so it was left out for every model with a function kept whole."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(1, 50, (32, 9)), torch.randint(3, 10, (32,)),
                                          torch.randint(0, 4, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, module = FXFuseCallback(export={"formats": ["graph_module", "code"]}), PackedGRU()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    assert set(read_manifest(cb.export_dir).formats) == {"graph_module", "code"}
    reference = H.fp64_copy(module)
    tokens, lengths = torch.randint(1, 50, (2, 14)), torch.tensor([14, 6])
    for name in ("graph_module", "code"):
        got = load_fused(cb.export_dir, format=name)(tokens, lengths)
        assert H.rel_err(got, reference(tokens, lengths)) < 1e-5, name


class OptionalMask(H.CrossEntropySteps):
    """Wav2Vec2's call: ``forward(x, attention_mask=None)``, every training and validation call passing the mask."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv1d(1, 8, 5, padding=2), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x.unsqueeze(1))))
        if attention_mask is None:
            return self.head(h.mean(-1))
        m = attention_mask[:, None, :].to(h.dtype)
        return self.head((h * m).sum(-1) / m.sum(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0], batch[1]), batch[2])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0], batch[1])


class OptionalMaskOtherwise(OptionalMask):
    """The same call, but without the mask the model pools otherwise (its maximum): no mask of ones stands in."""

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if attention_mask is not None:
            return super().forward(x, attention_mask)
        return self.head(torch.relu(self.bn(self.conv(x.unsqueeze(1)))).amax(-1))


def _fit_with_masks(tmp_path: Any, module: pl.LightningModule, padded: bool = True,
                    call_forms: bool = True) -> FXFuseCallback:
    torch.manual_seed(0)
    mask = torch.ones(16, 40, dtype=torch.long)
    if padded:
        mask[::2, 30:] = 0
    data = torch.utils.data.TensorDataset(torch.randn(16, 40), mask, torch.randint(0, 3, (16,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    cb = FXFuseCallback(export={"call_forms": call_forms})
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    return cb


def test_an_input_every_call_passed_left_out_gets_the_stand_in_proven_to_mean_leaving_it_out(tmp_path) -> None:
    """Wav2Vec2's served call leaves out the attention_mask every training call passed: it was refused ("takes 2
    input(s); got 1"). A mask of ones gives what the model gives without it on every observed call, so the artifact
    puts ones in its place: right at lengths and batch sizes never seen, by position and by name."""
    module = OptionalMask()
    cb = _fit_with_masks(tmp_path, module)
    manifest = read_manifest(cb.export_dir)
    assert [leaf.absent_fill for leaf in manifest.signature.inputs] == [None, 1.0]
    assert any(note.kind.name == "absent_filled" for note in cb.outcome.notes)
    reference = H.fp64_copy(module)
    for name in manifest.formats:
        fused = load_fused(cb.export_dir, format=name)
        for x in (torch.randn(1, 50), torch.randn(3, 23)):
            want = reference(x.double())
            assert H.rel_err(fused(x), want) < 1e-5, name
            assert H.rel_err(fused(x=x), want) < 1e-5, name
            assert H.rel_err(fused(x, attention_mask=None), want) < 1e-5, name


def test_a_mask_of_ones_in_every_training_call_is_kept_never_taken_for_labels(tmp_path) -> None:
    """GPT-2 trained on unpadded batches: the mask (an integer item of the batch, all ones) was taken for labels, since
    the model gave the same outputs without it, and left out of the artifact: served calls with a padded mask were
    refused. Labels are left out only where the model returns more with them (the loss)."""
    module = OptionalMask()
    cb = _fit_with_masks(tmp_path, module, padded=False)
    assert [leaf.path for leaf in cb.outcome.manifest.signature.inputs] == ["x", "attention_mask"]
    x, mask = torch.randn(2, 50), torch.ones(2, 50, dtype=torch.long)
    mask[1, 20:] = 0
    fused, reference = load_fused(cb.export_dir), H.fp64_copy(module)
    assert H.rel_err(fused(x, mask), reference(x.double(), mask)) < 1e-5
    assert H.rel_err(fused(x), reference(x.double())) < 1e-5


class WithLengths(OptionalMask):
    """torchaudio's speech models: ``forward(waveforms, lengths=None)``, None meaning every sample is whole; the steps
    pass the padded batch's lengths in every call."""

    def forward(self, x: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:  # type: ignore[override]
        mask = None if lengths is None else (torch.arange(x.shape[-1])[None, :] < lengths[:, None])
        return super().forward(x, mask)


def test_lengths_left_out_mean_whole_samples_where_proven(tmp_path) -> None:
    """torchaudio's wav2vec2 trained on padded batches with their lengths: model(waveform), its inference call, was
    refused. The length of the waveforms for every sample gives what the model gives without lengths on every
    observed call, so that stands in."""
    torch.manual_seed(0)
    lengths = torch.full((16,), 40)
    lengths[::2] = 30
    data = torch.utils.data.TensorDataset(torch.randn(16, 40), lengths, torch.randint(0, 3, (16,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    cb, module = FXFuseCallback(), WithLengths()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    inputs = cb.outcome.manifest.signature.inputs
    assert inputs[1].absent_size_of is not None and inputs[1].absent_size_of == inputs[0].groups[1]
    reference = H.fp64_copy(module)
    for x in (torch.randn(1, 50), torch.randn(3, 23)):
        assert H.rel_err(load_fused(cb.export_dir)(x), reference(x.double())) < 1e-5


class ReturnsLengths(WithLengths):
    """torchaudio's wav2vec2: ``forward(waveforms, lengths=None)`` returns ``(x, lengths)``, None in place of the
    lengths when none were given."""

    def forward(self, x: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> Any:  # type: ignore[override]
        return super().forward(x, lengths), (lengths - 1 if lengths is not None else None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0], batch[1])[0], batch[2])


def test_an_output_the_model_gives_as_none_without_an_input_is_none_when_it_is_left_out(tmp_path) -> None:
    """torchaudio's wav2vec2: no stand-in was taken for lengths, since without them the model returns (x, None)
    and with them (x, lengths): model(waveform), the tutorial's inference call, was refused."""
    torch.manual_seed(0)
    lengths = torch.full((16,), 40)
    lengths[::2] = 30
    data = torch.utils.data.TensorDataset(torch.randn(16, 40), lengths, torch.randint(0, 3, (16,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    cb, module = FXFuseCallback(), ReturnsLengths()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    reference = H.fp64_copy(module)
    for name in cb.outcome.manifest.formats:
        fused = load_fused(cb.export_dir, name)
        x = torch.randn(3, 23)
        got, want = fused(x), reference(x.double())
        assert type(got) is tuple and got[1] is None and want[1] is None, name
        assert H.rel_err(got[0], want[0]) < 1e-5, name
        given = torch.tensor([23, 10, 5])
        got, want = fused(x, given), reference(x.double(), given)
        assert torch.equal(got[1], want[1]) and H.rel_err(got[0], want[0]) < 1e-5, name


def test_an_input_left_out_that_no_stand_in_replaces_is_refused_saying_why_and_the_advice_works(tmp_path) -> None:
    """The refusal said "takes 2 input(s) (x, attention_mask); got 1": neither why nor what to do. Where neither
    ones nor zeros give what the model computes without the mask, the call leaving it out is refused without call
    forms; with them (the default) its own form, the model without the mask, answers it."""
    for call_forms in (False, True):
        module = OptionalMaskOtherwise()
        cb = _fit_with_masks(tmp_path / str(call_forms), module, call_forms=call_forms)
        assert all(leaf.absent_fill is None for leaf in read_manifest(cb.export_dir).signature.inputs)
        fused, x, reference = load_fused(cb.export_dir), torch.randn(1, 50), H.fp64_copy(module)
        ones = torch.ones(1, 50, dtype=torch.long)  # the advice taken: the mask passed, as the steps' calls did
        assert H.rel_err(fused(x, ones), reference(x.double(), ones)) < 1e-5
        if call_forms:
            assert [f.name for f in cb.outcome.manifest.signature.forms] == ["attention_mask=None"]
            assert H.rel_err(fused(x), reference(x.double())) < 1e-5
            continue
        with pytest.raises(ExportError, match="attention_mask left out, which every call the export was built from "
                                              ".* passed.* pass it as those calls did"):
            fused(x)


class Denoiser(pl.LightningModule):
    """diffusers' UNet2DModel as a DDPM's steps call it: one timestep per sample in training, one for all in the
    sampling loop (an int or a 0-d tensor, which the model repeats for every sample); ``repeats`` False: a model
    that takes one per sample only."""

    def __init__(self, repeats: bool = True) -> None:
        super().__init__()
        self.repeats = repeats
        self.temb, self.conv, self.bn = nn.Embedding(100, 8), nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.out = nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor, t: Any) -> torch.Tensor:
        if self.repeats:
            t = torch.as_tensor(t, device=x.device).reshape(-1).expand(x.shape[0])
        return self.out(torch.relu(self.bn(self.conv(x)) + self.temb(t)[:, :, None, None]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, t = batch[0], torch.randint(0, 100, (batch[0].shape[0],))
        noise = torch.randn_like(x)
        return F.mse_loss(self(x + noise, t), noise)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), 1e-3)


@pytest.mark.parametrize("repeats", [True, False])
def test_one_timestep_for_every_sample_is_taken_where_the_model_repeats_it(tmp_path, repeats: bool) -> None:
    """diffusers: trained with a timestep per sample, the sampling loop's call with one timestep (an int, a 0-d
    tensor) was refused ("1 input tensors given, the artifact takes 2"). It is taken where the model gave the same
    outputs with one value as with it repeated; a model that takes one per sample only refuses it as before."""
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 3, 8, 8)), batch_size=8)
    cb, model = FXFuseCallback(), Denoiser(repeats)
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader)
    assert [leaf.one_for_all for leaf in cb.outcome.manifest.signature.inputs] == [False, repeats]
    reference = H.fp64_copy(model)
    x = torch.randn(2, 3, 8, 8)
    for name in cb.outcome.manifest.formats:
        fused = load_fused(cb.export_dir, name)
        assert H.rel_err(fused(x, torch.tensor([5, 6])), reference(x.double(), torch.tensor([5, 6]))) < 1e-5, name
        for t in (5, torch.tensor(5)):
            if repeats:
                assert H.rel_err(fused(x, t), reference(x.double(), t)) < 1e-5, (name, t)
            else:
                with pytest.raises(ExportError):
                    fused(x, t)


def test_a_server_takes_the_calls_load_fused_takes_a_mask_left_out_and_one_timestep(tmp_path) -> None:
    """The server's contract required every input by name ("missing ['attention_mask']") and one array per sample
    ("expected a nested list" for a timestep): it takes what load_fused takes, the stand-ins made the same way."""
    import io
    import json

    import numpy as np

    from fx_lightning.serve.contract import Contract

    masked = OptionalMask()
    cb = _fit_with_masks(tmp_path / "mask", masked)
    contract = Contract.of(read_manifest(cb.export_dir))
    x = torch.randn(3, 23)
    decoded = contract.decode(json.dumps({"inputs": {"x": x.tolist()}}).encode(), "application/json")
    got = load_fused(cb.export_dir)(*[torch.from_numpy(a) for a in decoded.arrays])
    assert H.rel_err(got, H.fp64_copy(masked)(x.double())) < 1e-5
    buffer = io.BytesIO()
    np.savez(buffer, x=x.numpy())  # npz by name, the mask left out
    decoded = contract.decode(buffer.getvalue(), "application/x-npz")
    assert H.rel_err(load_fused(cb.export_dir)(*[torch.from_numpy(a) for a in decoded.arrays]),
                     H.fp64_copy(masked)(x.double())) < 1e-5

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 3, 8, 8)), batch_size=8)
    cb, denoiser = FXFuseCallback(), Denoiser()
    H.make_trainer(tmp_path / "t", [cb], max_epochs=1).fit(denoiser, loader)
    contract = Contract.of(read_manifest(cb.export_dir))
    x = torch.randn(2, 3, 8, 8)
    decoded = contract.decode(json.dumps({"inputs": {"x": x.tolist(), "t": 7}}).encode(), "application/json")
    got = load_fused(cb.export_dir)(*[torch.from_numpy(a) for a in decoded.arrays])
    assert H.rel_err(got, H.fp64_copy(denoiser)(x.double(), 7)) < 1e-5
    from fx_lightning.serve.contract import BadRequest

    for bad in ("7.5", str(2 ** 70)):  # one value for every sample is checked as any value is
        with pytest.raises(BadRequest, match="input 't'"):
            contract.decode(('{"inputs": {"x": %s, "t": %s}}' % (json.dumps(x.tolist()), bad)).encode(),
                            "application/json")


class AddsToFeatures(pl.LightningModule):
    """sentence-transformers' modules: forward adds its embedding to the features mapping it is given and returns
    that mapping; the steps pass a dict, ``encode`` a BatchEncoding."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, features: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        features.update({"sentence_embedding": self.f(features["x"])})
        return features

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self({"x": batch[0]})["sentence_embedding"].pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self({"x": batch[0]})

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), 1e-3)


def test_a_model_returning_the_mapping_it_was_given_returns_the_callers(tmp_path) -> None:
    """The artifact returned a plain dict where the model returns the caller's own mapping (a BatchEncoding)."""
    import collections

    class Encoding(collections.UserDict):
        pass

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=8)
    cb, module = FXFuseCallback(), AddsToFeatures()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    reference = H.fp64_copy(module)
    for given in (Encoding(x=torch.randn(3, 8)), {"x": torch.randn(1, 8)}):
        want = reference({"x": given["x"].double()})["sentence_embedding"]
        got = load_fused(cb.export_dir)(given)
        assert got is given and set(got) == {"x", "sentence_embedding"}
        assert H.rel_err(got["sentence_embedding"], want) < 1e-5


class SharedEncoderPair(pl.LightningModule):
    """RAFT runs both images through one encoder (``torch.cat`` on the batch, then ``chunk(2)``), and checks the
    width in Python (which stops symbolic tracing): torch.export guards the halves' size against 1, and batch 1,
    the usual optical-flow call, was refused as a branch of the model though the graph computes it exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, image1: torch.Tensor, image2: torch.Tensor) -> torch.Tensor:
        if image1.shape[-1] % 8 != 0:
            raise ValueError("the width must be a multiple of 8")
        f1, f2 = torch.chunk(self.enc(torch.cat([image1, image2], dim=0)), 2, dim=0)
        return (f1 * f2).sum(1, keepdim=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self(batch[0], batch[1]), batch[2])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0], batch[1]), batch[2]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_guard_against_one_row_that_the_graph_computes_exactly_takes_one_row(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(*(torch.randn(8, c, 16, 16, generator=g) for c in (3, 3, 1)))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    cb, model = FXFuseCallback(export={"formats": ["pt2", "graph_module"]}), SharedEncoderPair()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    assert any(c.endswith("or size0_0 == 1") for c in cb.outcome.manifest.signature.conditions)
    reference = H.fp64_copy(model)
    for fmt in ("pt2", "graph_module"):
        fused = load_fused(cb.export_dir, fmt)
        for n in (1, 3):
            a, b = torch.randn(n, 3, 16, 16), torch.randn(n, 3, 16, 16)
            got, want = fused(a, b), reference(a.double(), b.double())
            assert got.shape == want.shape == (n, 1, 16, 16) and H.rel_err(got, want) < 1e-5, (fmt, n)
    with pytest.raises(ExportError, match=r"takes only sizes where image1.shape\[3\] % 8 == 0"):
        fused(torch.randn(1, 3, 16, 20), torch.randn(1, 3, 16, 20))  # the width's own condition stands


def integrate(func: nn.Module, y0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """torchdiffeq's ``odeint``, reduced: it asserts its arguments' types, which symbolic tracing cannot follow, and
    its number of steps is read from the times' values (adaptive), which torch.export cannot capture."""
    assert isinstance(t, torch.Tensor), "t must be a torch.Tensor"
    assert isinstance(y0, torch.Tensor), "y0 must be either a torch.Tensor or a tuple"
    steps = int((t[-1] - t[0]).item() * 3)
    h, dt = y0, (t[-1] - t[0]) / steps
    for i in range(steps):
        h = h + dt * func(t[0] + i * dt, h)
    return h


class ODEFunc(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.conv = nn.GroupNorm(2, dim), nn.Conv2d(dim, dim, 3, padding=1)

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.norm(x))) * (1 + t)


class ODEBlock(nn.Module):
    """torchdiffeq's example: the integration times, a plain tensor attribute, reassigned in forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.odefunc = ODEFunc(dim)
        self.integration_time = torch.tensor([0.0, 1.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.integration_time = self.integration_time.type_as(x)
        return integrate(self.odefunc, x, self.integration_time)


class ODENet(H.CrossEntropySteps):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.block = ODEBlock(4)
        self.head = nn.Linear(4, H.NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def test_a_function_given_a_module_is_kept_whole_with_the_module_and_its_attributes_intact(tmp_path) -> None:
    """torchdiffeq's ODE-Net (held-out check 7): the preflight stopped training. Kept whole, ``odeint`` gets the ODE
    function as an argument: the cleanup deleted that module's own layers (only a called module's were kept), and
    tracing left a Proxy in ``integration_time`` (assigned in forward), on which the check run afterwards failed."""
    cb, model = FXFuseCallback(export={"formats": ["graph_module"]}), ODENet()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, *H.loaders())
    assert isinstance(model.block.integration_time, torch.Tensor)  # the user's module: never a Proxy
    assert any("integrate" in str(n) for n in cb.outcome.notes + cb.outcome.result.report.notes)
    assert cb.outcome.result.report.batchnorms_folded == 1
    x = torch.randn(3, 3, 10, 12)
    assert H.rel_err(load_fused(cb.export_dir)(x), H.fp64_copy(model)(x.double())) < 1e-5


class CachesWithoutLabels(pl.LightningModule):
    """BART's forward: with labels it computes the loss and turns its cache off; without them (every inference call)
    it returns its cache beside the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        h = self.body(x)
        logits = self.head(h)
        if labels is not None:
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}
        return {"logits": logits, "cache": h * 2}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0], labels=batch[1])["loss"]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self(batch[0], labels=batch[1])["loss"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_labels_are_left_out_where_the_model_without_them_returns_more_of_its_own(tmp_path) -> None:
    """transformers' BART (held-out check 7): without labels its outputs gain the cache, so labels were not proven
    labels, the artifact required them and every inference call raised KeyError: 'labels'."""
    data = torch.utils.data.TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb, model = FXFuseCallback(export={"formats": ["pt2", "graph_module"]}), CachesWithoutLabels()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    assert cb.outcome.manifest.signature.left_out == ["labels"]
    reference, x = H.fp64_copy(model), torch.randn(3, 6)
    for fmt in ("pt2", "graph_module"):
        got, want = load_fused(cb.export_dir, fmt)(x), reference(x.double())
        assert type(got) is dict and list(got) == ["logits", "cache"], fmt
        assert all(H.rel_err(got[k], want[k]) < 1e-5 for k in want), fmt


class ScanMixer(nn.Module):
    """transformers' MambaMixer slow path: unpacks the input's shape and scans over time in Python."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp, self.cell, self.out = nn.Linear(width, width), nn.Linear(2 * width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        h, state, outs = self.inp(x), torch.zeros(batch, width), []
        for i in range(length):
            state = torch.tanh(self.cell(torch.cat([state, h[:, i]], -1)))
            outs.append(state)
        return self.out(torch.stack(outs, 1))


class ScanLM(pl.LightningModule):
    """A Mamba causal LM as its users fine-tune it: ``forward(input_ids, labels=None)`` returns the loss with the
    labels, every batch of one length."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.norm = nn.Embedding(20, 16), ScanMixer(16), nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 20)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        logits = self.head(self.norm(self.mix(self.embed(input_ids)).transpose(1, 2)).transpose(1, 2))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch, labels=batch)["loss"]

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self(batch, labels=batch)["loss"])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_scan_over_time_is_kept_whole_so_every_length_is_served(tmp_path) -> None:
    """Held-out check 8 (transformers' Mamba): symbolic tracing traced the ``labels=None`` branch as if labels were
    given, so keeping the scan whole never gave a faithful graph, and torch.export's graph fixed the length (16, the
    only one trained) in every format: every other length was refused. A parameter the call leaves out is traced
    as its default: the scan kept whole, the rest fused, every length served."""
    loader = torch.utils.data.DataLoader(torch.randint(0, 20, (32, 16), generator=torch.Generator().manual_seed(0)),
                                         batch_size=8)
    cb, model = FXFuseCallback(), ScanLM()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    assert any(n.kind.name == "kept_whole" and "ScanMixer" in str(n) for n in cb.outcome.result.report.notes)
    assert cb.outcome.result.report.batchnorms_folded == 1  # the BatchNorm behind the transposes, outside the scan
    reference, fused = copy.deepcopy(model).double().eval(), load_fused(cb.export_dir)
    for batch, length in ((1, 5), (3, 27)):
        x = torch.randint(0, 20, (batch, length))
        got, want = fused(x), reference(x)
        assert set(got) == {"logits"} and got["logits"].shape == (batch, length, 20)
        assert H.rel_err(got["logits"], want["logits"]) < 1e-5, (batch, length)


class RootScan(ScanLM):
    """The scan in the LightningModule's own forward: nothing around it to keep it whole in."""

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        state, outs = torch.zeros(h.shape[0], 16), []
        for i in range(h.shape[1]):
            state = torch.tanh(self.mix.cell(torch.cat([state, h[:, i]], -1)))
            outs.append(state)
        logits = self.head(torch.stack(outs, 1))
        return {"logits": logits, **({"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}
                                     if labels is not None else {})}


def test_a_length_shown_to_vary_that_no_capture_keeps_dynamic_is_fixed_with_a_note(tmp_path) -> None:
    """The length was shown to vary by experiment, and no capture keeps it dynamic: every artifact takes the length
    seen, and says so (it was fixed again without a word), refusing others by name."""
    loader = torch.utils.data.DataLoader(torch.randint(0, 20, (32, 16), generator=torch.Generator().manual_seed(0)),
                                         batch_size=8)
    cb, model = FXFuseCallback(), RootScan()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    (note,) = [n for n in cb.outcome.notes if n.kind.name == "probed_fixed_in_capture"]
    assert "input_ids dim 1 (16)" in str(note) and "Constraints violated" in str(note), str(note)
    assert [n for n in cb.outcome.manifest.signature.notes if "shown to vary" in n] == [
        "sizes shown to vary by a call with them resized, fixed again (no capture kept them dynamic): input_ids dim 1"]
    fused, x = load_fused(cb.export_dir), torch.randint(0, 20, (3, 16))
    assert H.rel_err(fused(x)["logits"], copy.deepcopy(model).double().eval()(x)["logits"]) < 1e-5
    with pytest.raises(ExportError, match=r"input_ids\) dim 1 is 5; the artifact was built for 16 there"):
        fused(torch.randint(0, 20, (1, 5)))


class PointCloud:
    """A library's batch object (torch_geometric's ``Batch``): tensors in fields, methods of its own, and a count
    it caches in a private attribute when it is made."""

    def __init__(self, pos: torch.Tensor, batch: torch.Tensor) -> None:
        self.pos, self.batch = pos, batch
        self._num_graphs = int(batch.max()) + 1

    @property
    def num_graphs(self) -> int:
        return self._num_graphs if hasattr(self, "_num_graphs") else int(self.batch.max()) + 1

    def __contains__(self, key: str) -> bool:
        return getattr(self, key, None) is not None


class RadiusFilter(nn.Module):
    """e3nn's network: item assignment (no symbolic tracing) and a branch on values (no torch.export)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)

    def forward(self, data: PointCloud) -> torch.Tensor:
        radius = data.pos.norm(dim=1, keepdim=True)
        weight = torch.ones_like(radius)
        weight[radius > 1.5] = 0
        h = self.embed(data.pos) * weight
        if bool((radius > 3).any()):
            h = h * 0.5
        return h.new_zeros(data.num_graphs, 8).index_add(0, data.batch, h)


class PointClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net, self.head = RadiusFilter(), nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))

    def forward(self, data: PointCloud) -> torch.Tensor:
        return self.head(self.net(data))

    def training_step(self, data: PointCloud, batch_idx: int) -> torch.Tensor:
        return self(data).pow(2).mean()

    def validation_step(self, data: PointCloud, batch_idx: int) -> None:
        self.log("val_loss", self(data).pow(2).mean(), batch_size=1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _clouds(seed: int, graphs: int, nodes: int) -> PointCloud:
    g = torch.Generator().manual_seed(seed)
    return PointCloud(torch.randn(graphs * nodes, 3, generator=g), torch.arange(graphs).repeat_interleave(nodes))


def test_a_module_kept_whole_takes_the_librarys_batch_object(tmp_path) -> None:
    """Held-out check 8 (e3nn's network, given torch_geometric's Batch): no capture follows it, and keeping it
    whole failed too, torch.fx making no graph node of the batch object passed to it (``NotImplementedError:
    argument of type DataBatch``): the preflight stopped the training. The graph now passes the object's tensors and
    rebuilds it for the module kept whole, without the count the traced example cached (every call had 4 graphs:
    kept, it would answer 4 rows for 1); the head's BatchNorm folds, and the artifact takes the object."""
    loader = torch.utils.data.DataLoader([_clouds(s, 4, 6) for s in range(8)], batch_size=None)
    cb, model = FXFuseCallback(), PointClassifier()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    assert any(n.kind.name == "kept_whole" and "RadiusFilter" in str(n) for n in cb.outcome.result.report.notes)
    assert cb.outcome.result.report.batchnorms_folded == 1
    reference, fused = copy.deepcopy(model).double().eval(), load_fused(cb.export_dir)
    for seed, graphs, nodes in ((20, 1, 5), (21, 3, 9)):
        data = _clouds(seed, graphs, nodes)
        want = reference(PointCloud(data.pos.double(), data.batch))
        got = fused(data)
        assert got.shape == want.shape == (graphs, 3) and H.rel_err(got, want) < 1e-5, (graphs, nodes)


class CountedPool(nn.Module):
    """A torch_geometric model sized by the batch's own count: ``zeros(data.num_graphs, ...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)

    def forward(self, data: PointCloud) -> torch.Tensor:
        h = self.embed(data.pos)
        return h.new_zeros(data.num_graphs, 8).index_add(0, data.batch, h)


def test_an_objects_cached_count_is_never_built_in(tmp_path) -> None:
    """Review of the ninth session: the batch object was rebuilt from a copy of the recorded one, whose private
    ``_num_graphs`` (torch_geometric's ``Batch`` caches it) the model read through ``num_graphs``. Every call had 4
    graphs: the artifact answered 4 rows for 1 and for 3 graphs, in every format, a changed output structure."""
    loader = torch.utils.data.DataLoader([_clouds(s, 4, 6) for s in range(8)], batch_size=None)
    cb, model = FXFuseCallback(export={"formats": ["pt2", "graph_module"]}), PointClassifier()
    model.net = CountedPool()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(model, loader, loader)
    reference = copy.deepcopy(model).double().eval()
    for fmt in ("pt2", "graph_module"):
        for seed, graphs, nodes in ((20, 1, 5), (21, 3, 9)):
            data = _clouds(seed, graphs, nodes)
            got, want = load_fused(cb.export_dir, fmt)(data), reference(PointCloud(data.pos.double(), data.batch))
            assert got.shape == want.shape == (graphs, 3) and H.rel_err(got, want) < 1e-5, (fmt, graphs)
