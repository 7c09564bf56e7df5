"""Training set-ups people use: torch.compile'd modules, "_orig_mod." checkpoints, mixed and bf16 precision,
and where fusion, parity and export run (``device``). All on CPU; CI never needs a GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_helpers as H
from export_cli_models import CompiledInSetupClassifier, CliData
from fx_lightning import ConfigError, ExportError, FXFuseCallback, load_fused
from fx_lightning.cli import main
from fx_lightning.export import read_manifest

X = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(3))


def _fit(tmp_path: Path, model: Any, fuse_cb: FXFuseCallback, *extra: Any, **trainer_kwargs: Any) -> Any:
    trainer = H.make_trainer(tmp_path, [*extra, fuse_cb], **trainer_kwargs)
    trainer.fit(model, *H.loaders())
    return trainer


def _assert_fused_and_exported(fuse_cb: FXFuseCallback, backbone: torch.nn.Module, tol: float = 1e-5) -> None:
    assert fuse_cb.parity_report is not None and fuse_cb.parity_report.passed, fuse_cb.parity_report
    assert fuse_cb.result is not None and fuse_cb.result.report.batchnorms_folded == 2
    ref = H.fp64_copy(backbone)(X.double())
    with torch.no_grad():
        assert H.rel_err(fuse_cb.result.graph_module(X), ref) <= tol
        assert H.rel_err(load_fused(fuse_cb.export_dir)(X), ref) <= tol


# ------------------------------------------------------------------------------------ torch.compile


def test_compiled_lightning_module(tmp_path: Path) -> None:
    """trainer.fit(torch.compile(model)): Lightning puts compiled methods on the module; the copy drops them."""
    model = H.LitClassifier()
    fuse_cb = FXFuseCallback()
    _fit(tmp_path, torch.compile(model, backend="eager"), fuse_cb)
    assert model._compiler_ctx is not None and "forward" in model.__dict__  # still compiled: untouched
    _assert_fused_and_exported(fuse_cb, model.backbone)


def test_compiled_backbone_and_best_weights(tmp_path: Path) -> None:
    """A backbone compiled in setup (lightning-hydra-template's compile: true): checkpoints carry
    "backbone._orig_mod." keys, weights: best loads them into an uncompiled copy."""
    model = CompiledInSetupClassifier()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="val_loss", save_top_k=1)
    fuse_cb = FXFuseCallback(weights="best")
    trainer = H.make_trainer(tmp_path, [ckpt, fuse_cb])
    trainer.fit(model, datamodule=CliData())
    assert type(model.backbone).__name__ == "OptimizedModule"  # the user's module keeps its compiled backbone
    state = torch.load(ckpt.best_model_path, weights_only=False)["state_dict"]
    assert any(k.startswith("backbone._orig_mod.") for k in state)
    best = CompiledInSetupClassifier()
    best.load_state_dict({k.replace("_orig_mod.", ""): v for k, v in state.items()})
    ref = H.fp64_copy(best.backbone)(X.double())
    assert fuse_cb.parity_report is not None and fuse_cb.parity_report.passed
    with torch.no_grad():
        assert H.rel_err(fuse_cb.result.graph_module(X), ref) <= 1e-5  # type: ignore[union-attr]


def test_cli_fuses_a_checkpoint_with_orig_mod_keys(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = CompiledInSetupClassifier()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, save_top_k=0)
    trainer = H.make_trainer(tmp_path, [ckpt], logger=False)
    trainer.fit(model, datamodule=CliData())
    with pytest.raises(RuntimeError, match="_orig_mod"):  # what Lightning's own loader says (#17415)
        CompiledInSetupClassifier.load_from_checkpoint(ckpt.last_model_path, map_location="cpu")
    out = tmp_path / "fused"
    code = main(["fuse", ckpt.last_model_path, "--model", "export_cli_models:CompiledInSetupClassifier",
                 "--datamodule", "export_cli_models:CliData", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    ref = H.fp64_copy(model.backbone._orig_mod)(X.double())
    with torch.no_grad():
        assert H.rel_err(load_fused(out)(X), ref) <= 1e-5


# -------------------------------------------------------------------------------------------- precision


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_fuses_fp32_weights_in_fp32(tmp_path: Path, precision: str) -> None:
    model = H.LitClassifier()
    fuse_cb = FXFuseCallback()
    _fit(tmp_path, model, fuse_cb, precision=precision)
    assert next(model.parameters()).dtype == torch.float32
    _assert_fused_and_exported(fuse_cb, model.backbone)
    assert "reference_error_vs_fp64" not in fuse_cb.parity_report.metrics  # type: ignore[union-attr]  # fp32 gate


def test_bf16_true_is_gated_against_its_own_rounding(tmp_path: Path) -> None:
    model = H.LitClassifier()
    fuse_cb = FXFuseCallback()
    _fit(tmp_path, model, fuse_cb, precision="bf16-true")
    assert next(model.parameters()).dtype == torch.bfloat16
    report = fuse_cb.parity_report
    assert report is not None and report.passed, report
    own = report.metrics["reference_error_vs_fp64"]
    assert own > 1e-4 and report.thresholds["relative_max_error"] == pytest.approx(max(1e-4, 4 * own))
    fused = fuse_cb.result.graph_module  # type: ignore[union-attr]
    assert next(fused.parameters()).dtype == torch.bfloat16  # folded in fp32/fp64, cast back
    ref = H.fp64_copy(model.backbone)(X.double())
    unfused_err = H.rel_err(model.backbone.eval()(X.bfloat16()), ref)
    with torch.no_grad():
        assert H.rel_err(fused(X.bfloat16()), ref) <= 1.5 * unfused_err + 1e-3
        assert H.rel_err(load_fused(fuse_cb.export_dir)(X.bfloat16()), ref) <= 1.5 * unfused_err + 1e-3


# ---------------------------------------------------------------------------------------------- devices


def test_device_auto_is_where_training_ran_and_recorded(tmp_path: Path) -> None:
    fuse_cb = FXFuseCallback(export={"formats": ["graph_module", "pt2"]})
    trainer = _fit(tmp_path, H.LitClassifier(), fuse_cb)
    assert fuse_cb.preflight is not None and fuse_cb.preflight.device == str(trainer.strategy.root_device) == "cpu"
    manifest = read_manifest(fuse_cb.export_dir)
    assert {entry.device for entry in manifest.formats.values()} == {"cpu"}
    assert manifest.inputs[0]["device"] == "cpu"


def test_unavailable_device_fails_before_training(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    model = H.LitClassifier()
    with pytest.raises(ConfigError, match=r"(?s)stage 'device'.*device: 'cuda' is not available") as info:
        _fit(tmp_path, model, FXFuseCallback(device="cuda"))
    assert model.training_steps == 0 and "Fix:" in str(info.value)
    with pytest.raises(ConfigError, match="device: 'gpu' is not a torch device"):
        FXFuseCallback(device="gpu")


def test_load_fused_where_asked_and_where_built(tmp_path: Path) -> None:
    fuse_cb = FXFuseCallback(export={"formats": ["pt2", "graph_module", "code", "onnx"]})
    _fit(tmp_path, H.LitClassifier(), fuse_cb)
    out = fuse_cb.export_dir
    ref = H.fp64_copy(fuse_cb.result.graph_module)(X.double())  # type: ignore[union-attr]
    for fmt in ("pt2", "graph_module", "code", "onnx"):
        with torch.no_grad():
            model = load_fused(out, fmt, device="cpu")
            assert H.rel_err(model(X), ref) <= 1e-5, fmt
    # An artifact recorded as built for a GPU that this process lacks loads on the CPU (and is moved there).
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["formats"].values():
        entry["device"] = "cuda:0"
    (out / "manifest.json").write_text(json.dumps(manifest))
    if not torch.cuda.is_available():
        for fmt in ("pt2", "graph_module", "code"):
            model = load_fused(out, fmt)
            assert all(t.device.type == "cpu" for t in model.state_dict().values()), fmt
            with torch.no_grad():
                assert H.rel_err(model(X), ref) <= 1e-5, fmt
        with pytest.raises(ExportError, match="format 'onnx' cannot run on cuda"):
            load_fused(out, "onnx", device="cuda")
