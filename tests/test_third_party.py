"""Patterns from third-party libraries, reproduced with small models written here (issue: third-party
LightningModules and models as their users write them).

    pattern                                                            test
    fuse() that converts in place and returns None (RepVGGDW)           test_in_place_fuse_returning_none_is_kept_when_exact
    the same, but wrong: the module is put back from a deep copy        test_in_place_fuse_that_changes_outputs_is_undone
    a head whose fuse() drops an output branch (11 -> 6 tensors)        test_head_fuse_dropping_an_output_branch_is_undone
    a conversion that changes another module: undone as a whole         test_conversion_reaching_outside_its_module_is_undone
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, NamedTuple, Tuple

import pytest

import torch
import torch.nn.functional as F
from torch import nn

import lightning_helpers as H
from fx_lightning import fuse
from fx_lightning.parity.compare import compare_outputs

X = torch.randn(4, 8, 8, 8, generator=torch.Generator().manual_seed(0))


class RepDW(nn.Module):
    """A RepVGG-style depthwise block: 3x3 + 1x1 branches with BatchNorms; ``fuse()`` merges them into ``conv``
    in place, deletes the 1x1 branch and returns None (as some detector libraries write it)."""

    def __init__(self, channels: int = 8, exact: bool = True) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),
                                  nn.BatchNorm2d(channels))
        self.conv1 = nn.Sequential(nn.Conv2d(channels, channels, 1, groups=channels, bias=False),
                                   nn.BatchNorm2d(channels))
        self.exact = exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "conv1"):
            return F.relu(self.conv(x) + self.conv1(x))
        return F.relu(self.conv(x))

    @staticmethod
    def _folded(branch: nn.Sequential) -> Tuple[torch.Tensor, torch.Tensor]:
        conv, bn = branch[0], branch[1]
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        return conv.weight * scale.reshape(-1, 1, 1, 1), bn.bias - bn.running_mean * scale

    @torch.no_grad()
    def fuse(self) -> None:
        w3, b3 = self._folded(self.conv)
        w1, b1 = self._folded(self.conv1)
        merged = nn.Conv2d(w3.shape[0], w3.shape[0], 3, padding=1, groups=w3.shape[0])
        merged.weight.copy_(w3 + (F.pad(w1, [1, 1, 1, 1]) if self.exact else 0))
        merged.bias.copy_(b3 + b1)
        self.conv = merged  # the module changes in place...
        del self.conv1
        return None  # ...and nothing is returned


def _net(exact: bool = True) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), RepDW(exact=exact), RepDW(exact=exact))
    return H.randomize_batchnorms(net).eval()


def test_in_place_fuse_returning_none_is_kept_when_exact() -> None:
    model = _net(exact=True)
    before = H.state_fingerprint(model)
    result = fuse(model, example_inputs=(X,))
    assert H.state_fingerprint(model) == before  # the user's module keeps both branches
    changed = result.report.pass_report("reparameterize").changed
    assert [c.node for c in changed] == ["2", "3"] and all(c.details["method"] == "fuse" for c in changed)
    assert not any("conv1" in str(n.target) for n in result.graph_module.graph.nodes)
    assert H.rel_err(result.graph_module(X), H.fp64_copy(model)(X.double())) < 1e-5


def test_in_place_fuse_that_changes_outputs_is_undone() -> None:
    """Before: the pass 'put back' the object fuse() had already changed (conv1 deleted): capture crashed with
    AttributeError, or the model silently lost a branch. Now the module comes back from a deep copy."""
    model = _net(exact=False)
    result = fuse(model, example_inputs=(X,))
    skipped = result.report.pass_report("reparameterize").skipped
    assert [s.node for s in skipped] == ["2", "3"]
    assert all("RepDW.fuse() changed the module's outputs" in s.reason for s in skipped)
    assert H.rel_err(result.graph_module(X), H.fp64_copy(model)(X.double())) < 1e-5


class Head(nn.Module):
    """A detection head with a one-to-many branch for training (5 extra outputs); its ``fuse()`` drops that
    branch, so the fused head returns 6 tensors where the model returns 11."""

    def __init__(self) -> None:
        super().__init__()
        self.one2one = nn.ModuleList(nn.Conv2d(8, 4, 1) for _ in range(6))
        self.one2many = nn.ModuleList(nn.Conv2d(8, 4, 1) for _ in range(5))

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        outs = [m(x) for m in self.one2one]
        if self.one2many is not None:
            outs += [m(x) for m in self.one2many]
        return outs

    def fuse(self) -> "Head":
        self.one2many = None  # in place, then returns itself
        return self


def test_head_fuse_dropping_an_output_branch_is_undone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), Head()).eval()
    result = fuse(model, example_inputs=(X,))
    (skip,) = result.report.pass_report("reparameterize").skipped
    assert skip.node == "2" and "Head.fuse() changed the module's outputs (the output has 6 tensor(s), the reference 11" in skip.reason
    want = H.fp64_copy(model)(X.double())
    got = result.graph_module(X)
    assert len(got) == 11
    comparison = compare_outputs([g.double() for g in got], want, rtol=1e-5)
    assert comparison.passed, comparison.describe()


class Scaled(nn.Module):
    def __init__(self, gain: nn.Parameter) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Leaky(nn.Module):
    """Its own deploy conversion is exact for itself, but it rescales a parameter it shares with another module:
    each module checks out alone, the whole model does not."""

    def __init__(self, gain: nn.Parameter) -> None:
        super().__init__()
        self.gain = gain
        self.conv = nn.Conv2d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)

    @torch.no_grad()
    def switch_to_deploy(self) -> None:
        self.gain.mul_(2.0)  # reaches outside: Scaled reads it


def test_conversion_reaching_outside_its_module_is_undone() -> None:
    torch.manual_seed(0)
    gain = nn.Parameter(torch.ones(1))
    model = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), Leaky(gain), Scaled(gain)).eval()
    result = fuse(model, example_inputs=(X,))
    report = result.report.pass_report("reparameterize")
    assert report.changed == [] and len(report.skipped) == 1
    assert report.skipped[0].reason.startswith("undone: with the module-stage conversions the model's outputs differed")
    assert model[2].gain.item() == 1.0  # the user's model never changed
    assert H.rel_err(result.graph_module(X), H.fp64_copy(model)(X.double())) < 1e-5


def test_the_whole_module_can_be_chosen_while_a_backbone_exists(tmp_path) -> None:
    """target: "" is the whole LightningModule (what whole-module manifests record), backbone or not."""
    from fx_lightning import FXFuseCallback
    from fx_lightning.export import read_manifest

    model = H.LitClassifier()
    cb = FXFuseCallback(target="", export={"formats": ["pt2"]})
    H.make_trainer(tmp_path, [cb]).fit(model, *H.loaders())
    assert cb.outcome is not None and cb.outcome.target == ""
    manifest = read_manifest(cb.export_dir)
    assert manifest.provenance.target == "" and manifest.config["target"] == ""  # type: ignore[index]
    x = torch.randn(3, 3, 8, 8)
    assert cb.result.graph_module(x).shape == (3, H.NUM_CLASSES)  # head included  # type: ignore[union-attr]
    assert H.rel_err(cb.result.graph_module(x), H.fp64_copy(model)(x.double())) < 1e-5  # type: ignore[union-attr]


def test_fuse_and_export_is_the_pipeline_without_lightning(tmp_path) -> None:
    import fx_lightning
    from fx_lightning import ConfigError, ParityError

    torch.manual_seed(0)
    model = H.randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))).eval()
    loader = H.loaders()[1]  # (x, y) batches: the input and the labels are found without configuration
    outcome = fx_lightning.fuse_and_export(model, tmp_path / "fused", batches=loader,
                                           config={"export": {"formats": ["pt2"]}})
    assert outcome.export_dir == tmp_path / "fused" and outcome.parity.passed and outcome.parity.batches == 2
    assert "accuracy_drop" in outcome.parity.metrics  # labels were read from the batches
    x = torch.randn(5, 3, 8, 8)
    assert H.rel_err(fx_lightning.load_fused(tmp_path / "fused")(x), H.fp64_copy(model)(x.double())) < 1e-5
    with pytest.raises(ConfigError, match="give batches"):
        fx_lightning.fuse_and_export(model, tmp_path / "none")
    with pytest.raises(ParityError) as info:  # a model no fusion can match: nothing is written
        fx_lightning.fuse_and_export(H.NoisyBackbone(), tmp_path / "noisy", batches=loader)
    assert info.value.report is not None and not info.value.report.passed and not (tmp_path / "noisy").exists()


def test_an_embedding_model_gets_no_accuracy_and_a_classifier_keeps_it() -> None:
    """argmax of a 128-d embedding against 4 classes is not an accuracy: the report says why it left it out."""
    from fx_lightning.config import load_config
    from fx_lightning.parity.gate import NOT_SCORES_FOR_LABELS
    from fx_lightning.pipeline import Batches, fuse_verify_export

    torch.manual_seed(0)
    embed = H.randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1),
                                                 nn.Flatten(), nn.Linear(8, 128))).eval()
    batches = Batches(list(H.loaders()[1]), "val")  # labels 0..3
    config = load_config({"export": {"enabled": False}})
    parity = fuse_verify_export(embed, config, batches).parity
    assert parity is not None and parity.passed
    assert not {"top1_agreement", "accuracy_reference", "accuracy_fused"} & set(parity.metrics)
    (note,) = [n for n in parity.notes if n.kind == NOT_SCORES_FOR_LABELS]
    assert (note["width"], note["low"], note["high"]) == (128, 0, 3)
    classifier = nn.Sequential(embed, nn.ReLU(), nn.Linear(128, 4)).eval()
    parity = fuse_verify_export(classifier, config, batches).parity
    assert parity is not None and {"top1_agreement", "accuracy_reference", "accuracy_drop"} <= set(parity.metrics)


def test_a_classifier_on_validation_data_sorted_by_class_keeps_its_accuracy() -> None:
    """Validation loaders are rarely shuffled and many datasets are stored by class: a first batch holding only
    class 0 must not make a 10-class classifier's scores look like an embedding (its accuracy was dropped)."""
    from fx_lightning.config import load_config
    from fx_lightning.parity.gate import NOT_SCORES_FOR_LABELS
    from fx_lightning.pipeline import Batches, fuse_verify_export

    torch.manual_seed(0)
    classifier = H.randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1),
                                                      nn.Flatten(), nn.Linear(8, 10))).eval()
    # Four batches of 8 images, one class per batch at first, then the rest: labels sorted as stored.
    labels = torch.arange(10).repeat_interleave(4)[:32]
    batches = Batches([(torch.randn(8, 3, 16, 16), labels[i:i + 8]) for i in range(0, 32, 8)], "val")
    assert batches.items[0][1].unique().numel() == 2 and int(labels.max()) == 7
    parity = fuse_verify_export(classifier, load_config({"export": {"enabled": False}}), batches).parity
    assert parity is not None and parity.passed
    assert not [n for n in parity.notes if n.kind == NOT_SCORES_FOR_LABELS]
    assert {"top1_agreement", "accuracy_reference", "accuracy_fused", "accuracy_drop"} <= set(parity.metrics)
    reference = H.fp64_copy(classifier)
    expected = sum(int((reference(x.double()).argmax(-1) == y).sum()) for x, y in batches.items) / 32
    assert abs(parity.metrics["accuracy_reference"] - expected) < 1e-9


class EnsembleBackbone(nn.Module):
    """An ensemble run as one batch: the batch is repeated for every member and split back with the batch size
    the model was built for, so it runs at that batch size only."""

    def __init__(self, members: int = 3, batch_size: int = 8) -> None:
        super().__init__()
        self.members, self.batch_size = members, batch_size
        self.net = H.TinyBackbone(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.net(x.repeat(self.members, 1, 1, 1))
        return feats.reshape(self.members, self.batch_size, -1).mean(0)


def _padded_reference(model: nn.Module, x: torch.Tensor, built: int) -> torch.Tensor:
    """What the model (which runs at ``built`` samples only) gives for ``x``: pieces of ``built``, padded."""
    reference = H.fp64_copy(model)
    outs = []
    for start in range(0, x.shape[0], built):
        piece = x[start:start + built].double()
        padded = torch.cat([piece] * (-(-built // piece.shape[0])))[:built]
        outs.append(reference(padded)[:piece.shape[0]])
    return torch.cat(outs)


def test_a_model_that_runs_at_its_batch_size_only_is_exported_for_it_without_configuration(tmp_path) -> None:
    """Before: the preflight stopped at stage 'export' (pt2: "Constraints violated (batch)"), and the way out took
    three keys. Now: exported statically for the data's batch size, said in the notes and the manifest."""
    import warnings

    from fx_lightning import FXFuseCallback, load_fused
    from fx_lightning.export import read_manifest
    from fx_lightning.export.write.writer import STATIC_EXPORT

    model = H.LitClassifier(backbone=EnsembleBackbone())
    cb = FXFuseCallback()  # zero configuration
    H.make_trainer(tmp_path, [cb]).fit(model, *H.loaders(batch_size=8))
    assert cb.parity_report is not None and cb.parity_report.passed
    note = next(n for n in cb.outcome.notes if n.kind == STATIC_EXPORT)  # type: ignore[union-attr]
    assert note["batch_size"] == 8
    manifest = read_manifest(cb.export_dir)
    assert not manifest.dynamic_batch and STATIC_EXPORT in [n.kind for n in manifest.notes]
    assert {name: entry.batch_sizes for name, entry in manifest.formats.items()} == {"graph_module": [8], "pt2": [8]}
    assert manifest.inputs[0]["shape"] == [8, 3, "n0", "n0"]  # height and width shown to vary (trace.probe_sizes)
    backbone = model.backbone
    for fmt in ("pt2", "graph_module"):
        loaded = load_fused(cb.export_dir, fmt)
        x8 = torch.randn(8, 3, 8, 8)
        assert H.rel_err(loaded(x8), H.fp64_copy(backbone)(x8.double())) < 1e-5
        for n in (3, 13):  # other batch sizes: pieces of 8, the last one padded, with a warning
            x = torch.randn(n, 3, 8, 8)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = loaded(x)
            assert got.shape == (n, 8) and any("running it as pieces" in str(w.message) for w in caught)
            assert H.rel_err(got, _padded_reference(backbone, x, 8)) < 1e-5


def test_a_trainer_and_module_from_pytorch_lightning_need_no_configuration(tmp_path) -> None:
    """The standalone ``pytorch_lightning`` package (the same code as lightning.pytorch, other classes): before,
    the callback stopped before training ("Expected a parent", then "needs a ModelCheckpoint")."""
    import pytorch_lightning as pl_standalone
    from pytorch_lightning.callbacks import ModelCheckpoint

    from fx_lightning import FXFuseCallback, load_fused

    class Classifier(pl_standalone.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.head = H.TinyBackbone(8), nn.Linear(8, H.NUM_CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Classifier()
    cb = FXFuseCallback(weights="best", export={"formats": ["pt2"]})
    trainer = pl_standalone.Trainer(max_epochs=2, limit_train_batches=4, limit_val_batches=2, accelerator="cpu",
                                    callbacks=[ModelCheckpoint(monitor="val_loss"), cb], logger=False,
                                    enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(model, *H.loaders())
    assert cb.preflight is not None and "weights" in cb.preflight.stages
    assert cb.parity_report is not None and cb.parity_report.passed and cb.export_dir is not None
    assert cb.outcome.manifest.provenance.weights.source == "best"  # type: ignore[union-attr]
    x = torch.randn(3, 3, 8, 8)
    assert load_fused(cb.export_dir)(x).shape == (3, 8)


def test_the_callback_never_imports_pytorch_lightning_itself() -> None:
    import subprocess
    import sys

    code = ("import sys, fx_lightning; from fx_lightning.callback.namespaces import lightning_classes; "
            "fx_lightning.FXFuseCallback(); print(len(lightning_classes('callbacks.ModelCheckpoint')), "
            "'pytorch_lightning' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "False"]


class Pair(NamedTuple):
    logits: torch.Tensor
    features: torch.Tensor


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    features: torch.Tensor


class RecordHead(nn.Module):
    """Returns its outputs as a named tuple or as a plain dataclass (what many libraries do)."""

    def __init__(self, record: type) -> None:
        super().__init__()
        self.record = record
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> Any:
        features = self.bn(self.conv(x)).mean((2, 3))
        return self.record(self.fc(features), features)


@pytest.mark.parametrize("record", [Pair, Prediction])
@pytest.mark.parametrize("mode", ["fx", "export"])
def test_named_tuple_and_dataclass_outputs_are_exported_and_reloaded(tmp_path, record: type, mode: str) -> None:
    """Before: pt2 failed with "Can't serialize TreeSpec of namedtuple class"; a dataclass cannot be saved
    either. torch.export's artifacts now return the fields in order (a tuple, or a dict of the dataclass's
    fields), the manifest names each output, and the pickled formats keep the class."""
    import fx_lightning

    torch.manual_seed(0)
    model = H.randomize_batchnorms(RecordHead(record)).eval()
    formats = ["pt2", "onnx", "graph_module"]
    outcome = fx_lightning.fuse_and_export(model, tmp_path / "e", example_inputs=(torch.randn(4, 3, 8, 8),),
                                           config={"trace": {"mode": mode}, "export": {"formats": formats}})
    manifest = outcome.manifest
    assert list(manifest.formats) == formats and manifest.failed_formats == {} and manifest.dynamic_batch
    assert [(s["name"], s["shape"]) for s in manifest.outputs] == [("logits", ["batch", 2]), ("features", ["batch", 4])]
    x = torch.randn(3, 3, 8, 8)
    want = H.fp64_copy(model)(x.double())
    for fmt in formats:
        got = fx_lightning.load_fused(tmp_path / "e", fmt)(x)
        got_logits, got_features = (got.logits, got.features) if isinstance(got, record) else (
            (got["logits"], got["features"]) if isinstance(got, dict) else got)
        assert H.rel_err(got_logits, want.logits) < 1e-5 and H.rel_err(got_features, want.features) < 1e-5, fmt


# ------------------------------------------------------------- batches as libraries build them


class TwoViews(torch.utils.data.Dataset):
    """A self-supervised data set: ``([view0, view1], target)``."""

    def __init__(self, n: int = 32) -> None:
        self.inner = H.tiny_dataset(n, 1)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        x, y = self.inner[i]
        return [x, torch.flip(x, dims=[-1])], y


class SelfSupervised(H.LitClassifier):
    """A backbone and a projection head; its steps take two views (as self-supervised libraries write them)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))

    def _loss(self, batch: Any) -> torch.Tensor:
        (v0, v1), _ = batch
        return -F.cosine_similarity(self(v0), self(v1).detach()).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.training_steps += 1
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))


def test_a_two_view_self_supervised_module_needs_no_configuration(tmp_path) -> None:
    """Before: the automatic input was the list of views (conv2d() received a list), before training with the
    preflight, after it without; the only way out was a module-level function for parity.input. The callback now
    observes what the backbone receives in the module's own steps: each view."""
    from fx_lightning import FXFuseCallback, load_fused
    from fx_lightning.pipeline.inputs import OBSERVED_CALLS

    loader = lambda: torch.utils.data.DataLoader(TwoViews(), batch_size=16)  # noqa: E731
    model = SelfSupervised()
    cb = FXFuseCallback(export={"formats": ["pt2"]})
    H.make_trainer(tmp_path, [cb]).fit(model, loader(), loader())
    assert cb.parity_report is not None and cb.parity_report.passed
    assert cb.parity_report.batches == 4  # 2 validation batches x 2 views: what the backbone received
    note = next(n for n in cb.outcome.notes if n.kind == OBSERVED_CALLS)  # type: ignore[union-attr]
    assert note["stage"] == "validation" and note["calls"] == 4
    x = torch.randn(5, 3, 8, 8)
    assert H.rel_err(load_fused(cb.export_dir)(x), H.fp64_copy(model.backbone)(x.double())) < 1e-5


@dataclasses.dataclass
class ImageBatch:
    """A library's own batch type."""

    image: torch.Tensor
    label: torch.Tensor


def _image_batches(n: int = 2) -> List[ImageBatch]:
    data = H.tiny_dataset(16 * n, 2)
    return [ImageBatch(data.tensors[0][i:i + 16], data.tensors[1][i:i + 16]) for i in range(0, 16 * n, 16)]


def test_a_dataclass_batch_reaches_the_model_with_its_labels() -> None:
    from fx_lightning.config import load_config
    from fx_lightning.pipeline import Batches, fuse_verify_export

    model = H.randomize_batchnorms(H.LitClassifier()).eval()
    out = fuse_verify_export(model, load_config({"export": {"enabled": False}}), Batches(_image_batches(), "val"))
    assert out.parity is not None and out.parity.passed and out.parity.batches == 2
    assert "accuracy_drop" in out.parity.metrics  # the label field was found too


def test_when_no_input_can_be_found_the_error_says_what_was_tried() -> None:
    from fx_lightning import ConfigError
    from fx_lightning.config import load_config
    from fx_lightning.pipeline import Batches, fuse_verify_export

    model = SelfSupervised()
    model.validation_step = lambda batch, i: None  # type: ignore[method-assign]  # steps that run no model
    model.training_step = lambda batch, i: None  # type: ignore[method-assign]
    batches = Batches([([torch.randn(4, 3, 8, 8)] * 2, torch.zeros(4, dtype=torch.long))], "val")
    with pytest.raises(ConfigError) as info:
        fuse_verify_export(model, load_config({"export": {"enabled": False}}), batches)
    message = str(info.value)
    assert "tuple(list(Tensor[4, 3, 8, 8] float32, Tensor[4, 3, 8, 8] float32), Tensor[4] int64)" in message
    assert "validation_step never called the target; its training_step never called the target" in message
    assert "parity.input can be a key of a dict batch" in message and "'*' (the whole batch" in message


class Tabular(nn.Module):
    """A tabular model as such libraries write it: forward takes a dict of named inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cont, self.bn = nn.Embedding(10, 4), nn.Linear(3, 4), nn.BatchNorm1d(4)
        self.out = nn.Linear(8, 2)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        continuous = self.bn(self.cont(batch["continuous"]))
        return self.out(torch.cat([continuous, self.embed(batch["categorical"]).mean(1)], 1))


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_a_dict_input_model_is_exported_with_a_dynamic_batch(tmp_path, mode: str) -> None:
    """Before: dict inputs got dynamic_shapes of the wrong structure, and the export refused "nested or keyword
    inputs". The dict is captured through a flat interface (one tensor per key, by name), so ONNX takes it too, and
    every artifact is called with the dict as the model is."""
    import fx_lightning

    model = H.randomize_batchnorms(Tabular()).eval()
    g = torch.Generator().manual_seed(0)
    x = {"continuous": torch.randn(8, 3, generator=g), "categorical": torch.randint(0, 10, (8, 5), generator=g)}
    formats = ["pt2", "graph_module", "onnx"]
    outcome = fx_lightning.fuse_and_export(model, tmp_path / "e", example_inputs=(x,),
                                           config={"trace": {"mode": mode}, "export": {"formats": formats}})
    assert outcome.result.report.batchnorms_folded == 1 and outcome.manifest.dynamic_batch
    assert [(s["name"], s["shape"]) for s in outcome.manifest.inputs] == [
        ("batch_continuous", ["batch", 3]), ("batch_categorical", ["batch", "n0"])]  # a mean over the columns
    assert [leaf.path for leaf in outcome.manifest.signature.inputs] == ["batch['continuous']", "batch['categorical']"]
    y = {"continuous": torch.randn(3, 3), "categorical": torch.randint(0, 10, (3, 5))}
    want = H.fp64_copy(model)({"continuous": y["continuous"].double(), "categorical": y["categorical"]})
    for fmt in formats:
        loaded = fx_lightning.load_fused(tmp_path / "e", fmt)
        assert H.rel_err(loaded(y), want) < 1e-5, fmt  # the dict, as the model takes it
        assert H.rel_err(loaded(batch_continuous=y["continuous"], batch_categorical=y["categorical"]), want) < 1e-5
    wide = {"continuous": y["continuous"], "categorical": torch.randint(0, 10, (3, 7))}  # the model takes 7 columns
    want = H.fp64_copy(model)({"continuous": wide["continuous"].double(), "categorical": wide["categorical"]})
    for fmt in formats:
        assert H.rel_err(fx_lightning.load_fused(tmp_path / "e", fmt)(wide), want) < 1e-5, fmt


class MemoryBank(nn.Module):
    """Scores a sample by its distance to features stored during training (an anomaly detector's memory bank):
    it cannot run before training."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = H.TinyBackbone(8)
        self.register_buffer("bank", torch.empty(0, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bank.numel() == 0:
            raise RuntimeError("the memory bank is empty: fit the model first")
        return torch.cdist(self.backbone(x), self.bank).min(1).values


class Detector(H.LitClassifier):
    def __init__(self) -> None:
        super().__init__(backbone=MemoryBank())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.training_steps += 1
        features = self.backbone.backbone(batch[0])
        self.backbone.bank = torch.cat([self.backbone.bank, features.detach()])[-64:]
        return features.pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("score", self(batch[0]).mean())


def test_a_model_that_runs_only_once_trained_is_not_stopped_by_the_preflight(tmp_path) -> None:
    """Before: the preflight stopped training (the untrained model raised). With no sanity check the preflight runs
    after the first training step's forward (which fills the memory bank), before its optimizer step: it proves the
    whole pipeline; the end of fit fuses, verifies and exports the trained model."""
    from fx_lightning import FXFuseCallback, load_fused

    model = Detector()
    cb = FXFuseCallback(export={"formats": ["pt2"]})
    H.make_trainer(tmp_path, [cb]).fit(model, *H.loaders())
    assert model.training_steps == 8 and cb.preflight is not None and cb.preflight.unproven is None
    assert {"capture", "parity", "export"} <= set(cb.preflight.stages)
    assert cb.parity_report is not None and cb.parity_report.passed
    x = torch.randn(5, 3, 8, 8)
    assert H.rel_err(load_fused(cb.export_dir)(x), H.fp64_copy(model.backbone)(x.double())) < 1e-5


class Segmenter(nn.Module):
    """Returns scores and a thresholded mask (0.0/1.0) and its class per pixel: discrete outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 2, 3, padding=1), nn.BatchNorm2d(2)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.bn(self.conv(x))
        return scores, (scores[:, :1] > 0).float(), scores.argmax(1)


def test_discrete_outputs_are_judged_by_agreement(tmp_path) -> None:
    """Before: a mask value on the threshold flipped by fusion gave relative_max_error = 1 (the scores differed by
    4e-7). A candidate whose scores differ by 1e-7 and whose mask has one pixel flipped (1 of 1024) passes; the
    export of the real fused model (integer labels included) round-trips; a real disagreement fails by name."""
    import fx_lightning
    from fx_lightning import ParityError
    from fx_lightning.parity.gate import check_parity
    from fx_lightning.parity.gate import GATE_MISSED

    torch.manual_seed(0)
    model = H.randomize_batchnorms(Segmenter()).eval()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(3))

    def near(inputs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores, mask, labels = model(inputs)
        flipped = mask.clone()
        flipped[0, 0, 5, 5] = 1.0 - flipped[0, 0, 5, 5]
        return scores * (1 + 1e-7), flipped, labels

    report = check_parity(model, near, [x])
    assert report.passed, report.failures
    assert report.metrics["discrete_agreement"] == pytest.approx(1 - 1 / 2048)  # mask and labels, 1024 each
    assert report.metrics["relative_max_error"] < 1e-6  # over the scores alone
    outcome = fx_lightning.fuse_and_export(model, tmp_path / "e", example_inputs=(x,),
                                           config={"export": {"formats": ["pt2", "graph_module"]}})
    assert outcome.parity.passed and list(outcome.manifest.formats) == ["pt2", "graph_module"]
    assert fx_lightning.load_fused(tmp_path / "e")(x)[2].dtype == torch.int64
    # A real disagreement still fails, naming the key.
    with pytest.raises(ParityError) as info:
        fx_lightning.fuse_and_export(model, tmp_path / "strict", example_inputs=(x,),
                                     config={"parity": {"min_discrete_agreement": 1.0 + 0.0}, "passes": {
                                         "extra": ["sample_passes:flip_a_mask_value"]}})
    (failure,) = info.value.report.failures  # type: ignore[union-attr]
    assert failure.kind == GATE_MISSED and failure["key"] == "parity.min_discrete_agreement"
