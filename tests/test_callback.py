"""FXFuseCallback end to end on CPU: tiny models, two epochs, a CSVLogger in tmp_path."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any, Dict, List

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_helpers as H
from fx_lightning import ConfigError, ExportError, FXFuseCallback, ParityError, TraceError
from fx_lightning.callback.ranks import WEIGHTS
from fx_lightning.pipeline.inputs import OBSERVED_CALLS
from fx_lightning.callback.trainer_data import BATCHES_READ, NO_VALIDATION_DATA
from fx_lightning.common.provenance import TrainerCounters


class Snapshot(pl.Callback):
    """Placed before FXFuseCallback: the module's fingerprint and output as fit ends, before fusion."""

    def __init__(self) -> None:
        self.fingerprint: Any = None
        self.output: Any = None
        self.x = torch.randn(4, 3, 8, 8)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fingerprint = H.state_fingerprint(pl_module)
        with torch.no_grad():
            was = pl_module.training
            pl_module.eval()
            self.output = pl_module(self.x).clone()
            pl_module.train(was)


def _metrics_rows(trainer: pl.Trainer) -> List[Dict[str, str]]:
    path = Path(trainer.logger.log_dir) / "metrics.csv"  # type: ignore[union-attr]
    with path.open() as f:
        return list(csv.DictReader(f))


def _logged(rows: List[Dict[str, str]], key: str) -> List[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def test_end_to_end_default_callback(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("fx_lightning.export")
    from fx_lightning import load_fused

    model = H.LitClassifier()
    snap, fuse_cb = Snapshot(), FXFuseCallback()
    trainer = H.make_trainer(tmp_path, [snap, fuse_cb])
    train, val = H.loaders()
    with caplog.at_level(logging.INFO):
        trainer.fit(model, train, val)

    assert model.training_steps == 8
    # The LightningModule is bitwise unchanged by the callback: weights, buffers, flags, forward.
    assert H.state_fingerprint(model) == snap.fingerprint
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(snap.x), snap.output)

    result = fuse_cb.result
    assert result is not None
    assert result.report.before.batchnorms == 2
    assert result.report.after.batchnorms == 0 and H.count_batchnorms(result.graph_module) == 0
    ref64 = H.fp64_copy(model.backbone)
    with torch.no_grad():
        assert H.rel_err(result.graph_module(snap.x), ref64(snap.x.double())) < 1e-5

    report = fuse_cb.parity_report
    assert report is not None and report.passed, report
    assert report.source == "val" and report.batches == 2
    assert report.metrics["relative_max_error"] < 1e-5

    rows = _metrics_rows(trainer)
    assert _logged(rows, "fx_fuse/parity_passed") == [1.0]
    assert _logged(rows, "fx_fuse/batchnorms_folded") == [2.0]
    assert _logged(rows, "fx_fuse/parity_relative_max_error")[0] == pytest.approx(
        report.metrics["relative_max_error"])
    assert _logged(rows, "fx_fuse/exported") == [1.0]

    assert fuse_cb.export_dir == Path(trainer.log_dir) / "fx_fused"
    loaded = load_fused(fuse_cb.export_dir)
    with torch.no_grad():
        assert H.rel_err(loaded(snap.x), ref64(snap.x.double())) < 1e-5

    summaries = [r.getMessage() for r in caplog.records if "FXFuseCallback ===" in r.getMessage()]
    assert len(summaries) == 1
    assert "parity PASSED" in summaries[0] and str(fuse_cb.export_dir) in summaries[0]
    # It leads with what the user decides on: folded/left, the parity verdict, where the export and its report are.
    assert summaries[0].splitlines()[1:3] == ["BatchNorms: 2 folded, 0 left", "parity: PASSED (worst relative error "
                                              f"{report.metrics['relative_max_error']:.3g})"]


def test_weights_best_fuses_the_best_checkpoint(tmp_path: Path) -> None:
    model = H.LitClassifier()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="score", mode="min", save_top_k=1)
    fuse_cb = FXFuseCallback(weights="best", export={"enabled": False})
    trainer = H.make_trainer(tmp_path, [ckpt, fuse_cb])
    trainer.fit(model, *H.loaders())

    assert "epoch=0" in Path(ckpt.best_model_path).name
    best = H.LitClassifier()
    best.load_state_dict(torch.load(ckpt.best_model_path, weights_only=False)["state_dict"])
    x = torch.randn(8, 3, 8, 8)
    fused = fuse_cb.result.graph_module  # type: ignore[union-attr]
    with torch.no_grad():
        out = fused(x)
        best_ref = H.fp64_copy(best.backbone)(x.double())
        last_ref = H.fp64_copy(model.backbone)(x.double())
    assert H.rel_err(best_ref, last_ref) > 1e-2  # the test means something: epoch 0 and 1 differ
    assert H.rel_err(out, best_ref) < 1e-5
    assert H.rel_err(out, last_ref) > 1e-2
    assert fuse_cb.parity_report.passed  # type: ignore[union-attr]
    assert any(n.kind == WEIGHTS and "best checkpoint" in n["description"] and "epoch=0" in n["description"]
               for n in fuse_cb.outcome.notes)  # type: ignore[union-attr]


@pytest.mark.parametrize("preflight", ["full", "off"])
def test_weights_best_without_checkpoint_callback_fails_clearly(tmp_path: Path, preflight: str) -> None:
    fuse_cb = FXFuseCallback(weights="best", export={"enabled": False}, preflight=preflight)
    trainer = H.make_trainer(tmp_path, [fuse_cb], enable_checkpointing=False)
    model = H.LitClassifier()
    with pytest.raises(ConfigError, match="weights: 'best' needs a ModelCheckpoint") as info:
        trainer.fit(model, *H.loaders())
    if preflight == "full":  # found before training
        assert "stage 'weights'" in str(info.value) and model.training_steps == 0
    else:  # found after training: the message says where the trained weights are
        assert "No ModelCheckpoint was configured" in str(info.value) and model.training_steps == 8


def test_missing_target_fails_before_training(tmp_path: Path) -> None:
    model = H.LitClassifier()
    trainer = H.make_trainer(tmp_path, [FXFuseCallback(target="encoder")])
    with pytest.raises(ConfigError) as info:
        trainer.fit(model, *H.loaders())
    message = str(info.value)
    assert "'encoder'" in message and "backbone (TinyBackbone)" in message and "head (Linear)" in message
    assert model.training_steps == 0


def test_untraceable_backbone_fails_before_training_with_hints(tmp_path: Path) -> None:
    model = H.LitClassifier(backbone=H.DataDependentBackbone())
    # the sanity check's two validation batches take both ways of the branch: the preflight sees them
    trainer = H.make_trainer(tmp_path, [FXFuseCallback()], num_sanity_val_steps=2)
    with pytest.raises(TraceError) as info:
        trainer.fit(model, *H.loaders())
    message = str(info.value)
    H.assert_stopped_before_training(message, model, "capture")
    # a branch on values taking both ways, computing differently: no one graph answers both; the module is the whole
    # target, so no leaf_modules hint
    assert "on tensor values, no tracer can" in message and "trace.autowrap_functions" in message
    assert "if x[0, 0, 0, 0] > 0.3" in message and "no one graph answers both ways" in message


def test_untraceable_backbone_with_on_error_warn_trains_and_skips(tmp_path: Path) -> None:
    model = H.LitClassifier(backbone=H.DataDependentBackbone())
    fuse_cb = FXFuseCallback(on_error="warn", trace={"mode": "fx"})
    trainer = H.make_trainer(tmp_path, [fuse_cb])
    with pytest.warns(UserWarning, match="stage 'capture'"):
        trainer.fit(model, *H.loaders())
    assert model.training_steps == 8
    assert fuse_cb.result is None and fuse_cb.skipped and "preflight failed" in fuse_cb.skipped
    assert not (Path(trainer.log_dir) / "fx_fused").exists()


def test_shape_dependent_backbone_fuses_through_torch_export(tmp_path: Path) -> None:
    model = H.LitClassifier(backbone=H.ShapeDependentBackbone())
    fuse_cb = FXFuseCallback(export={"enabled": False})
    trainer = H.make_trainer(tmp_path, [fuse_cb])
    trainer.fit(model, *H.loaders())
    result = fuse_cb.result
    assert result is not None and result.report.capture_mode == "export"
    assert result.report.before.batchnorms == 2 and H.count_batchnorms(result.graph_module) == 0
    assert fuse_cb.parity_report.passed  # type: ignore[union-attr]
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        assert H.rel_err(result.graph_module(x), H.fp64_copy(model.backbone)(x.double())) < 1e-5


def test_nondeterministic_backbone_is_refused_before_training_and_warn_trains_keeping_checkpoints(tmp_path: Path) -> None:
    """Every output drawn at random in eval mode leaves nothing to compare at any weights: the preflight raises the
    ParityError the end of fit would (pyro's AutoNormal guide was refused only after training). Its advice,
    parity.on_failure: warn, trains, warns, exports nothing and keeps the checkpoints."""
    model = H.LitClassifier(backbone=H.NoisyBackbone())
    fuse_cb = FXFuseCallback()
    with pytest.raises(ParityError) as info:
        H.make_trainer(tmp_path / "refused", [fuse_cb]).fit(model, *H.loaders())
    message = str(info.value)
    # Its output changes from run to run in eval mode: nothing a fused model could be compared on.
    assert "every output of the target (1) changes from run to run" in message
    assert "before the first optimizer step" in message and "(set parity.on_failure: warn to only warn)" in message
    assert "parity.on_failure: warn trains and exports nothing" in message
    model = H.LitClassifier(backbone=H.NoisyBackbone())
    hashes = H.HashCheckpoints()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    fuse_cb = FXFuseCallback(parity={"on_failure": "warn"})
    trainer = H.make_trainer(tmp_path / "warned", [ckpt, hashes, fuse_cb])
    with pytest.warns(UserWarning, match="changes from run to run"):
        trainer.fit(model, *H.loaders())
    assert fuse_cb.parity_report is not None and not fuse_cb.parity_report.passed
    assert fuse_cb.export_dir is None and not (Path(trainer.log_dir) / "fx_fused").exists()
    assert len(hashes.hashes) >= 2  # an epoch checkpoint and last.ckpt
    assert H.file_hashes(tmp_path / "ckpts") == hashes.hashes
    state = torch.load(ckpt.last_model_path, weights_only=False)["state_dict"]
    assert set(state) == set(model.state_dict())
    assert _logged(_metrics_rows(trainer), "fx_fuse/parity_passed") == [0.0]


def test_parity_failure_with_on_error_warn_lets_fit_return(tmp_path: Path) -> None:
    """on_error: warn: the preflight's ParityError (every output drawn at random) is a warning, training goes on and
    nothing is fused."""
    model = H.LitClassifier(backbone=H.NoisyBackbone())
    fuse_cb = FXFuseCallback(on_error="warn")
    trainer = H.make_trainer(tmp_path, [fuse_cb])
    with pytest.warns(UserWarning, match=r"(?s)stopped before the first optimizer step \(ParityError\).*Training "
                                         r"goes on \(on_error=warn\)"):
        trainer.fit(model, *H.loaders())
    assert isinstance(fuse_cb.error, ParityError) and model.training_steps == 8
    assert fuse_cb.export_dir is None and not (Path(trainer.log_dir) / "fx_fused").exists()


def test_export_into_the_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpts"
    fuse_cb = FXFuseCallback(export={"dir": str(ckpt_dir)})
    model = H.LitClassifier()
    trainer = H.make_trainer(tmp_path, [ModelCheckpoint(dirpath=ckpt_dir), fuse_cb])
    with pytest.raises(ExportError, match=r"(?s)stage 'export directory'.*could replace a checkpoint"):
        trainer.fit(model, *H.loaders())
    # Refused by the preflight: before any training step, so before any checkpoint was written.
    assert model.training_steps == 0 and not (ckpt_dir.exists() and any(ckpt_dir.iterdir()))
    # And after training (preflight off), refused again with every checkpoint intact.
    hashes = H.HashCheckpoints()
    fuse_cb = FXFuseCallback(export={"dir": str(ckpt_dir)}, preflight="off")
    trainer = H.make_trainer(tmp_path, [ModelCheckpoint(dirpath=ckpt_dir), hashes, fuse_cb])
    with pytest.raises(ExportError, match="could replace a checkpoint"):
        trainer.fit(H.LitClassifier(), *H.loaders())
    assert hashes.hashes and H.file_hashes(ckpt_dir) == hashes.hashes


def test_fast_dev_run_is_skipped(tmp_path: Path) -> None:
    fuse_cb = FXFuseCallback()
    trainer = H.make_trainer(tmp_path, [fuse_cb], fast_dev_run=True)
    trainer.fit(H.LitClassifier(), *H.loaders())
    assert fuse_cb.result is None and fuse_cb.skipped == "fast_dev_run"
    assert not list(tmp_path.rglob("fx_fused"))


class Crash(H.LitClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def test_failed_fit_fuses_nothing(tmp_path: Path) -> None:
    fuse_cb = FXFuseCallback()
    trainer = H.make_trainer(tmp_path, [fuse_cb])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Crash(), *H.loaders())
    assert fuse_cb.result is None and "RuntimeError" in (fuse_cb.skipped or "")
    assert not list(tmp_path.rglob("fx_fused"))


def test_module_without_backbone_and_train_data_fallback(tmp_path: Path) -> None:
    model = H.randomize_batchnorms(H.FlatLit())
    fuse_cb = FXFuseCallback(export={"enabled": False})
    trainer = H.make_trainer(tmp_path, [fuse_cb], limit_val_batches=0)
    trainer.fit(model, train_dataloaders=H.loaders()[0])
    assert fuse_cb.outcome is not None and fuse_cb.outcome.target == ""
    report = fuse_cb.parity_report
    assert report is not None and report.passed and report.source == "train"
    assert any(n.kind == NO_VALIDATION_DATA for n in fuse_cb.outcome.notes)
    assert H.count_batchnorms(fuse_cb.result.graph_module) == 0  # type: ignore[union-attr]


def test_example_input_array_as_parity_data(tmp_path: Path) -> None:
    model = H.LitClassifier()
    model.example_input_array = torch.randn(6, 3, 8, 8)
    fuse_cb = FXFuseCallback(parity={"data": "example"}, export={"enabled": False})
    trainer = H.make_trainer(tmp_path, [fuse_cb])
    trainer.fit(model, *H.loaders())
    report = fuse_cb.parity_report
    assert report is not None and report.passed and report.source == "example"
    assert report.metrics["samples"] == 6


def test_parity_input_rule_for_dict_batches(tmp_path: Path) -> None:
    class DictLit(H.LitClassifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step((batch["pixels"], batch["y"]), batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            super().validation_step((batch["pixels"], batch["y"]), batch_idx)

    def as_dicts(n: int, seed: int) -> DataLoader:
        data = H.tiny_dataset(n, seed)
        return DataLoader([{"pixels": x, "y": y} for x, y in data], batch_size=16)  # collates to dicts

    fuse_cb = FXFuseCallback(parity={"input": "pixels"}, export={"enabled": False})
    trainer = H.make_trainer(tmp_path, [fuse_cb])
    trainer.fit(DictLit(), as_dicts(64, 0), as_dicts(32, 1))
    report = fuse_cb.parity_report
    assert report is not None and report.passed and report.batches == 2
    assert "accuracy_fused" in report.metrics  # labels found under "y"


class LateBackbone(H.LitClassifier):
    """Builds its backbone in configure_model, which Lightning calls after the callbacks' setup."""

    def __init__(self) -> None:
        super().__init__()
        del self.backbone

    def configure_model(self) -> None:
        if not hasattr(self, "backbone"):
            self.backbone = H.randomize_batchnorms(H.TinyBackbone())


def test_target_built_in_configure_model_is_checked_and_fused(tmp_path: Path) -> None:
    model = LateBackbone()
    fuse_cb = FXFuseCallback(export={"enabled": False})
    trainer = H.make_trainer(tmp_path, [fuse_cb])
    trainer.fit(model, *H.loaders())
    assert fuse_cb.outcome is not None and fuse_cb.outcome.target == "backbone"
    assert fuse_cb.parity_report is not None and fuse_cb.parity_report.passed


def test_missing_target_is_still_caught_when_the_module_builds_later(tmp_path: Path) -> None:
    model = LateBackbone()
    trainer = H.make_trainer(tmp_path, [FXFuseCallback(target="encoder")])
    with pytest.raises(ConfigError, match="'encoder'"):
        trainer.fit(model, *H.loaders())
    assert model.training_steps == 0


# ------------------------------------------------------------------- after fit (lightning-hydra-template)


class FailingTest(H.LitClassifier):
    """A template-style module whose test step raises (as the template's does under torch >= 2.6)."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        raise RuntimeError("test step broke")


@pytest.mark.parametrize("on_error", ["raise", "warn"])
def test_exception_in_test_after_fit_leaves_the_export_standing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, on_error: str
) -> None:
    model = FailingTest()
    fuse_cb = FXFuseCallback(on_error=on_error)
    trainer = H.make_trainer(tmp_path, [fuse_cb])
    train, val = H.loaders()
    trainer.fit(model, train, val)
    export_dir, result = fuse_cb.export_dir, fuse_cb.result
    assert export_dir is not None and (export_dir / "manifest.json").is_file() and result is not None
    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="test step broke"):
        trainer.test(model, val)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "nothing was fused" not in messages and "did not finish" not in messages
    assert f"the fused model exported at the end of fit stands: {export_dir}" in messages
    assert fuse_cb.skipped is None and fuse_cb.export_dir == export_dir and fuse_cb.result is result
    assert fuse_cb.error is None and (export_dir / "manifest.json").is_file()


def test_weights_best_records_the_checkpoints_epoch_and_step(tmp_path: Path) -> None:
    from fx_lightning.export import read_manifest

    model = H.LitClassifier()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="score", mode="min", save_top_k=1)
    fuse_cb = FXFuseCallback(weights="best", export={"formats": ["graph_module"]})
    trainer = H.make_trainer(tmp_path, [ckpt, fuse_cb], max_epochs=3)
    trainer.fit(model, *H.loaders())
    saved = torch.load(ckpt.best_model_path, weights_only=False)
    assert saved["epoch"] == 0 and saved["global_step"] == 4  # the best is epoch 0 of 3 (4 steps per epoch)
    extra = read_manifest(fuse_cb.export_dir).provenance
    assert extra.weights is not None
    assert extra.weights.source == "best" and extra.weights.checkpoint == ckpt.best_model_path
    assert (extra.weights.epoch, extra.weights.global_step) == (0, 4)
    assert extra.trainer == TrainerCounters(epoch=3, global_step=12)  # the trainer's final counters, apart


@pytest.mark.parametrize("limit, expected", [(2, 2), (0.25, 2), (1.0, 5)])
def test_parity_reads_no_more_than_the_trainer_validates(tmp_path: Path, limit: Any, expected: int) -> None:
    train, _ = H.loaders()
    val = DataLoader(H.tiny_dataset(64, 1), batch_size=8)  # 8 validation batches
    fuse_cb = FXFuseCallback(parity={"max_batches": 5}, export={"enabled": False})
    trainer = H.make_trainer(tmp_path, [fuse_cb], limit_val_batches=limit)
    trainer.fit(H.LitClassifier(), train, val)
    report = fuse_cb.parity_report
    assert report is not None and report.passed and report.batches == expected
    # Parity compares the calls the last validation made: as many as the trainer validated, at most max_batches.
    assert any(n.kind == OBSERVED_CALLS and (n["calls"], n["stage"]) == (expected, "validation")
               for n in fuse_cb.outcome.notes), fuse_cb.outcome.notes  # type: ignore[union-attr]


def test_parity_reads_no_more_batches_than_the_trainer_validates_when_nothing_is_observed(tmp_path: Path) -> None:
    train, _ = H.loaders()
    val = DataLoader(H.tiny_dataset(64, 1), batch_size=8)  # 8 validation batches
    fuse_cb = FXFuseCallback(parity={"max_batches": 5, "input": 0}, export={"enabled": False})  # the batch, read
    trainer = H.make_trainer(tmp_path, [fuse_cb], limit_val_batches=0.25)
    trainer.fit(H.LitClassifier(), train, val)
    assert fuse_cb.parity_report is not None and fuse_cb.parity_report.batches == 2
    assert any(n.kind == BATCHES_READ and (n["count"], n["source"], n["limit"]) == (2, "validation", 2)
               and n["why"].startswith("the trainer's limit_val_batches=0.25")  # type: ignore[union-attr]
               for n in fuse_cb.outcome.notes), fuse_cb.outcome.notes  # type: ignore[union-attr]
