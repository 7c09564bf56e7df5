"""One pipeline for every caller: the preflight proves what the end of fit runs, on the same driver and the
same batch shapes; the manifest is a typed record written once, inside the atomic write; versions are checked.

    what                                                           test
    forward(*args, **kwargs), no backbone: fuses at the end of fit  test_args_kwargs_forward_without_backbone_fuses
    a model that captures at batch 1 only: stops in the preflight   test_capture_that_needs_the_real_batch_stops_before_training
    the int8 variant cannot be made (torchao missing): warns, goes on  test_an_int8_variant_that_cannot_be_made_never_stops_training
    the selection cannot run at its batch size: stops before        test_preflight_stops_when_the_selection_cannot_run
    a manifest from a future version: refused, naming the version   test_manifest_from_a_future_version_is_refused
    an export written by version 1: still loads                     test_an_export_of_format_version_1_still_loads
    variants and selection: inside the one atomic rename            test_variants_and_selection_are_written_before_the_rename
    a selection that fails: nothing is left on disk                 test_a_failing_selection_leaves_nothing
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_helpers as H
from fx_lightning import ExportError, FXFuseCallback, FuseConfig, TraceError, load_fused
from fx_lightning.config import load_config
from fx_lightning.export import read_manifest
from fx_lightning.export.manifest import FORMAT_VERSION, Manifest
from fx_lightning.pipeline import Batches, fuse_verify_export

DATA = Path(__file__).parent / "data"


class ArgsKwargsLit(pl.LightningModule):
    """A trainer-library shape: ``forward(self, *args, **kwargs)``, no ``backbone``, and a branch on the batch
    size that symbolic tracing cannot follow (so the capture is torch.export's, with a dynamic batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, H.NUM_CLASSES))
        self.training_steps = 0

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = args[0]
        if x.shape[0] > 1:  # a shape branch: torch.fx raises, torch.export follows it
            x = x * 1.0
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.training_steps += 1
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class OnlyAtBatchOne(nn.Module):
    """Captures at batch 1 and at no other batch size: at batch > 1 it branches on the input's values, the two ways
    computing differently and both taken by the batches, which no one graph answers. A preflight on one sample would
    pass; the end of fit would fail."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn(self.conv(x))).mean((2, 3))
        if x.shape[0] > 1 and bool(x[0, 0, 0, 0] > x[1, 0, 0, 0]):
            return out * 2
        return out


def test_callback_takes_exactly_the_config_keys() -> None:
    """The callback's flat arguments are FuseConfig's top-level keys (LightningCLI and Hydra read the signature)."""
    import dataclasses

    params = list(inspect.signature(FXFuseCallback.__init__).parameters)[1:]
    assert params == [f.name for f in dataclasses.fields(FuseConfig)]


def test_args_kwargs_forward_without_backbone_fuses(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ArgsKwargsLit()
    cb = FXFuseCallback(export={"formats": ["pt2"]})
    train, val = H.loaders(batch_size=8)
    trainer = H.make_trainer(tmp_path, [cb])
    trainer.fit(model, train, val)
    assert model.training_steps == 8 and cb.preflight is not None
    assert cb.outcome is not None and cb.outcome.target == ""
    assert cb.result is not None and cb.result.report.capture_mode == "export"
    assert cb.result.report.batchnorms_folded == 1
    assert cb.parity_report is not None and cb.parity_report.passed and cb.parity_report.batches == 2
    loaded = load_fused(cb.export_dir)
    reference = H.fp64_copy(model)
    for n in (1, 3, 8):  # the export takes any batch size, not only the one it was captured with
        x = torch.randn(n, 3, 8, 8)
        assert H.rel_err(loaded(x), reference(x.double())) < 1e-5


def test_capture_that_needs_the_real_batch_stops_before_training(tmp_path: Path) -> None:
    model = H.LitClassifier(backbone=OnlyAtBatchOne(), width=8)
    before = H.snapshot(model)
    cb = FXFuseCallback()
    with pytest.raises(TraceError) as info:
        # the sanity check's two validation batches take both ways: the preflight sees them
        H.make_trainer(tmp_path, [cb], num_sanity_val_steps=2).fit(model, *H.loaders(batch_size=8))
    message = str(info.value)
    H.assert_stopped_before_training(message, model, "capture", before)
    assert cb.result is None and cb.export_dir is None


def _hide_module(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make ``import name`` (and its submodules) fail as if it were not installed."""
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, key)
    monkeypatch.setitem(sys.modules, name, None)


def test_an_int8_variant_that_cannot_be_made_never_stops_training(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A lossy variant is dropped with its reason, never worth a stopped training (issue 36 item 10): the preflight
    says at fit start what the end of fit will drop and how to get it, and the fp32 artifacts stand."""
    _hide_module(monkeypatch, "torchao")
    model = H.LitClassifier()
    cb = FXFuseCallback(passes={"quantize_int8": {"enabled": True}}, export={"formats": ["pt2"]})
    with pytest.warns(UserWarning, match=r"the end of fit will: quantize_int8 could not be made: PassError: "
                                         r"quantize_int8 needs torchao: pip install 'fx-lightning\[int8\]'"):
        H.make_trainer(tmp_path, [cb]).fit(model, *H.loaders())
    assert model.training_steps > 0 and cb.export_dir is not None
    outcome = read_manifest(cb.export_dir).variants["int8"][0]
    assert not outcome.kept and "pip install 'fx-lightning[int8]'" in (outcome.error or "")
    assert list(read_manifest(cb.export_dir).formats) == ["pt2"]


def test_preflight_stops_when_the_selection_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX is written and checked only where ONNX Runtime is installed; without it the only artifact cannot be
    loaded to be timed, so nothing could ever be selected: the preflight says so, naming why."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    model = H.LitClassifier()
    cb = FXFuseCallback(export={"formats": ["onnx"], "select": "fastest"})
    with pytest.raises(ExportError) as info:
        H.make_trainer(tmp_path, [cb]).fit(model, *H.loaders())
    message = str(info.value)
    assert "export.select_batch_size 1" in message
    assert "onnx: check failed" in message and "needs onnxruntime" in message
    H.assert_stopped_before_training(message, model, "selection")


def _export(tmp_path: Path, config: Dict[str, Any]) -> Path:
    lit = H.randomize_batchnorms(H.LitClassifier())
    out = fuse_verify_export(lit, load_config(config), Batches(list(H.loaders()[1]), "val"),
                             export_dir=tmp_path / "fused")
    assert out.export_dir is not None
    return out.export_dir


def test_manifest_from_a_future_version_is_refused(tmp_path: Path) -> None:
    root = _export(tmp_path, {"export": {"formats": ["pt2"]}})
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    assert data["format_version"] == FORMAT_VERSION
    data["format_version"] = FORMAT_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(ExportError) as info:
        load_fused(root)
    message = str(info.value)
    assert f"format_version {FORMAT_VERSION + 1}" in message and "upgrade fx-lightning" in message
    data["format_version"] = "two"
    path.write_text(json.dumps(data))
    with pytest.raises(ExportError, match="format_version 'two' is unknown"):
        read_manifest(root)


def test_manifest_round_trips_through_its_record(tmp_path: Path) -> None:
    root = _export(tmp_path, {"export": {"formats": ["pt2", "graph_module"], "select": "fastest"}})
    on_disk = json.loads((root / "manifest.json").read_text())
    manifest = read_manifest(root)
    assert isinstance(manifest, Manifest) and manifest.to_dict() == on_disk
    assert manifest.selected is not None and manifest.selected.format in ("pt2", "graph_module")
    assert manifest.provenance.target == "backbone"
    assert manifest.formats["pt2"].check is not None and manifest.formats["pt2"].check.passed
    assert manifest.parity is not None and manifest.parity.passed


def test_an_export_of_format_version_1_still_loads() -> None:
    """tests/data/export_v1 was written by fx-lightning before this change (see make_export_v1.py)."""
    root = DATA / "export_v1"
    assert json.loads((root / "manifest.json").read_text())["format_version"] == 1
    manifest = read_manifest(root)
    assert manifest.format_version == 1 and manifest.selected is not None
    assert manifest.parity is not None and manifest.parity.passed and manifest.provenance.target == ""
    saved = torch.load(DATA / "export_v1_inputs.pt", weights_only=True)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 3))
    model.load_state_dict(saved["model"])
    reference = H.fp64_copy(model)
    x = saved["batches"][0][0]
    assert type(load_fused(root)).__name__ == "GraphModule"  # the selected artifact (graph_module)
    for fmt in ("pt2", "graph_module", "code"):
        assert H.rel_err(load_fused(root, fmt)(x), reference(x.double())) < 1e-5


def test_variants_and_selection_are_written_before_the_rename(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torchao")
    from fx_lightning.export.write import atomic

    seen: List[Dict[str, Any]] = []
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if Path(dst).name == "fused" and Path(src).name.startswith(".fused.tmp-"):
            manifest = json.loads((Path(src) / "manifest.json").read_text())
            files = sorted(p.relative_to(src).as_posix() for p in Path(src).rglob("*") if p.is_file())
            seen.append({"manifest": manifest, "files": files})
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    root = _export(tmp_path, {"export": {"formats": ["pt2"], "select": "fastest"},
                              # A gate every int8 model passes: this test is about where it is written.
                              "passes": {"quantize_int8": {"enabled": True, "min_top1_agreement": 0.0,
                                                           "max_accuracy_drop": 1.0, "min_cosine": -1.0}}})
    assert len(seen) == 1, "the export was not renamed into place exactly once"
    at_rename = seen[0]
    assert "pt2-int8" in at_rename["manifest"]["formats"] and "int8" in at_rename["manifest"]["variants"]
    assert at_rename["manifest"]["selected"] is not None and at_rename["manifest"]["bench"]["timings"]
    assert any(f.startswith("int8/") for f in at_rename["files"])
    final = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert final == at_rename["files"]  # nothing was added after the rename
    assert json.loads((root / "manifest.json").read_text()) == at_rename["manifest"]


def test_a_failing_selection_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fx_lightning.pipeline import export_step

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the bench broke (simulated)")

    monkeypatch.setattr(export_step, "bench_export", broken)
    with pytest.raises(ExportError, match="the bench broke") as info:
        _export(tmp_path, {"export": {"formats": ["pt2"], "select": "fastest"}})
    assert info.value.step == "selection"
    assert not (tmp_path / "fused").exists() and not list(tmp_path.glob(".fused*"))


# ------------------------------------------------------------------ the preflight leaves the run as it was


def _trained_weights(tmp_path: Path, callbacks: List[Any]) -> Dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    model = H.LitClassifier()
    train, val = H.loaders()  # shuffled training data: the RNG decides the batches
    H.make_trainer(tmp_path, callbacks).fit(model, train, val)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_preflight_does_not_change_the_training_run(tmp_path: Path) -> None:
    """The preflight reads loaders and runs the model (every DataLoader iterator draws a seed): with the caller's
    RNG streams restored, the same seed trains the same weights with and without the callback."""
    alone = _trained_weights(tmp_path / "alone", [])
    fused = _trained_weights(tmp_path / "fused", [FXFuseCallback(export={"formats": ["pt2"]})])
    assert alone.keys() == fused.keys()
    assert all(torch.equal(alone[k], fused[k]) for k in alone), [k for k in alone if not torch.equal(alone[k], fused[k])]


def test_the_preflight_sees_the_precision_training_converts_to(tmp_path: Path) -> None:
    """bf16-true converts the module after the callbacks' setup: the preflight runs after it, as the end of fit."""
    import sample_passes

    sample_passes.SEEN_DTYPES.clear()
    cb = FXFuseCallback(passes={"extra": ["sample_passes:record_dtypes"]}, export={"formats": ["pt2"]})
    H.make_trainer(tmp_path, [cb], precision="bf16-true").fit(H.LitClassifier(), *H.loaders())
    assert sample_passes.SEEN_DTYPES == [torch.bfloat16, torch.bfloat16]  # the preflight's run, the end of fit's


def test_an_export_directory_that_holds_the_checkpoints_stops_before_training(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = H.LitClassifier()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "run" / "checkpoints")
    cb = FXFuseCallback(export={"dir": str(tmp_path / "run")})  # replacing it would take the checkpoints along
    with pytest.raises(ExportError) as info:
        H.make_trainer(tmp_path, [ckpt, cb]).fit(model, *H.loaders())
    assert "stage 'export directory'" in str(info.value) and "checkpoint" in str(info.value)
    assert model.training_steps == 0


def test_an_int8_pass_that_fails_after_training_leaves_the_fp32_export(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from fx_lightning.pipeline.export_step import VARIANT_FAILED

    _hide_module(monkeypatch, "torchao")
    cb = FXFuseCallback(passes={"quantize_int8": {"enabled": True}}, export={"formats": ["pt2"]}, preflight="off")
    H.make_trainer(tmp_path, [cb]).fit(H.LitClassifier(), *H.loaders())
    assert cb.export_dir is not None and list(read_manifest(cb.export_dir).formats) == ["pt2"]
    note = next(n for n in cb.outcome.notes if n.kind == VARIANT_FAILED)  # type: ignore[union-attr]
    assert note["artifact"] == "quantize_int8" and "torchao" in str(note["error"])


def test_export_dir_is_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = fuse_verify_export(H.LitClassifier(), load_config({"export": {"formats": ["pt2"]}}),
                             Batches(list(H.loaders()[1]), "val"), export_dir="relative/fused")
    assert out.export_dir == tmp_path / "relative" / "fused" and out.export_dir.is_absolute()


def test_mappings_of_any_kind_carry_their_tensors_to_the_model() -> None:
    """Hugging Face's BatchEncoding is a UserDict: its tensors must still be moved and cast."""
    from collections import UserDict

    from fx_lightning.common.batches import to_model

    moved = to_model(UserDict({"pixel_values": torch.ones(2, 3)}), None, torch.float64)
    assert moved["pixel_values"].dtype == torch.float64


def test_a_richer_version_1_export_still_loads_with_its_notes_and_variants() -> None:
    """tests/data/export_v1_rich (make_export_v1_rich.py): notes, parity notes, a failed int8 gate, provenance."""
    from fx_lightning.common.notes import TEXT

    root = DATA / "export_v1_rich"
    manifest = read_manifest(root)
    assert manifest.format_version == 1 and set(manifest.formats) == {"graph_module", "pt2", "onnx"}
    assert [str(n) for n in manifest.report["notes"]] == ["captured with torch.export (ATen-level graph)"]  # type: ignore[index]
    assert manifest.parity is not None and [n.kind for n in manifest.parity.notes] == [TEXT]
    assert str(manifest.parity.notes[0]) == "no integer labels in the batches: accuracy not measured"
    (missed,) = manifest.variants["int8"]
    assert missed.entry == "pt2-int8" and not missed.kept and missed.gate is not None
    assert str(missed.gate.failures[0]).startswith("cosine_similarity_min = 0.999902 < passes.quantize_int8.min_cosine")
    origin = manifest.provenance
    assert origin.weights is not None and origin.weights.global_step == 8
    assert origin.preflight is not None and origin.preflight.seconds == 1.25
    assert origin.lightning_module == "my_pkg.models.Classifier" and origin.other == {"my_own_key": [1, 2]}
    again = Manifest.from_dict(manifest.to_dict())  # written back as version 2, read again: the same records
    assert again.to_dict() == manifest.to_dict() and manifest.to_dict()["format_version"] == FORMAT_VERSION
    saved = torch.load(DATA / "export_v1_rich_inputs.pt", weights_only=True)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 3))
    model.load_state_dict(saved["model"])
    x = saved["batches"][0]
    for fmt in ("graph_module", "pt2", "onnx"):
        assert H.rel_err(load_fused(root, fmt)(x), H.fp64_copy(model)(x.double())) < 1e-5


def test_the_selection_is_written_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the variants test above, with the selection alone (no torchao needed)."""
    from fx_lightning.export.write import atomic

    at_rename: List[Dict[str, Any]] = []
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if Path(dst).name == "fused":
            at_rename.append(json.loads((Path(src) / "manifest.json").read_text()))
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    root = _export(tmp_path, {"export": {"formats": ["pt2", "graph_module"], "select": "fastest"}})
    assert len(at_rename) == 1 and at_rename[0]["selected"] is not None and at_rename[0]["bench"]["timings"]
    assert json.loads((root / "manifest.json").read_text()) == at_rename[0]
