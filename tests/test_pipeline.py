"""fx_lightning.pipeline: target resolution and fuse -> parity -> export, without a Trainer."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_helpers as H
from fx_lightning import ConfigError, ExportError, ParityError
from fx_lightning.config import load_config
from fx_lightning.pipeline import Batches, fuse_verify_export, resolve_target, whole_model_with
from fx_lightning.pipeline.steps import PARITY_DISABLED


def _model() -> H.LitClassifier:
    torch.manual_seed(0)
    return H.randomize_batchnorms(H.LitClassifier())


def _val() -> list:
    return list(H.loaders()[1])


# --------------------------------------------------------------------------------------- resolve_target


def test_resolve_target_defaults_and_dotted_paths() -> None:
    lit = _model()
    assert resolve_target(lit, None) == ("backbone", lit.backbone)
    assert resolve_target(lit, "backbone.conv1") == ("backbone.conv1", lit.backbone.conv1)
    flat = H.FlatLit()
    assert resolve_target(flat, None) == ("", flat)


@pytest.mark.parametrize(
    "target, expected",
    [
        ("encoder", ["'encoder' is not a submodule of <root>", "backbone (TinyBackbone)", "head (Linear)"]),
        ("backbone.conv9", ["'conv9' is not a submodule of backbone", "conv1 (Conv2d)", "bn2 (BatchNorm2d)"]),
        ("lr", ["is a float, not a torch.nn.Module"]),
    ],
)
def test_missing_target_names_it_and_lists_children(target: str, expected: list) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_target(_model(), target)
    message = str(info.value)
    assert message.startswith(f"target: {target!r}")
    for part in expected:
        assert part in message


def test_whole_model_with_replaces_only_the_target() -> None:
    lit = _model()
    before = H.state_fingerprint(lit)
    replacement = nn.Identity()
    whole = whole_model_with(lit, "backbone", replacement)
    assert whole.backbone is replacement and lit.backbone is not replacement
    assert whole.head.weight is lit.head.weight  # shared, not copied
    assert H.state_fingerprint(lit) == before


# ------------------------------------------------------------------------------------ the whole pipeline


def test_pipeline_fuses_verifies_and_exports(tmp_path: Path) -> None:
    pytest.importorskip("fx_lightning.export")
    from fx_lightning import load_fused

    lit = _model()
    lit.train()
    before = H.state_fingerprint(lit)
    out = fuse_verify_export(lit, load_config({"export": {"formats": ["graph_module"]}}), Batches(_val(), "val"),
                             export_dir=tmp_path / "fused")
    assert H.state_fingerprint(lit) == before  # weights, buffers and training flags untouched
    gm = out.result.graph_module
    assert out.target == "backbone"
    assert out.result.report.before.batchnorms == 2 and H.count_batchnorms(gm) == 0
    assert out.parity is not None and out.parity.passed and out.parity.batches == 2
    x = _val()[0][0]
    ref64 = H.fp64_copy(lit.backbone)(x.double())
    assert H.rel_err(gm(x), ref64) < 1e-5
    assert H.rel_err(out.fused_model(x), H.fp64_copy(lit)(x.double())) < 1e-5
    assert out.export_dir == tmp_path / "fused"
    loaded = load_fused(out.export_dir)
    assert H.rel_err(loaded(x), ref64) < 1e-5
    manifest = json.loads((out.export_dir / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True
    assert manifest["extra"]["target"] == "backbone"


def test_parity_failure_raises_and_exports_nothing(tmp_path: Path) -> None:
    lit = _model()
    lit.backbone = H.NoisyBackbone()
    with pytest.raises(ParityError) as info:
        fuse_verify_export(lit, load_config(), Batches(_val()), export_dir=tmp_path / "fused")
    assert "changes from run to run" in str(info.value) and "Nothing was exported" in str(info.value)
    assert info.value.report.passed is False  # type: ignore[attr-defined]
    assert info.value.outcome.result.graph_module is not None  # type: ignore[attr-defined]
    assert not (tmp_path / "fused").exists()


def test_parity_failure_can_warn_and_still_exports_nothing(tmp_path: Path) -> None:
    lit = _model()
    lit.backbone = H.NoisyBackbone()
    with pytest.warns(UserWarning, match="parity FAILED"):
        out = fuse_verify_export(lit, load_config({"parity": {"on_failure": "warn"}}), Batches(_val()),
                                 export_dir=tmp_path / "fused")
    assert out.parity is not None and not out.parity.passed
    assert out.export_dir is None and not (tmp_path / "fused").exists()


def test_example_inputs_stand_in_for_missing_data() -> None:
    lit = _model()
    out = fuse_verify_export(lit, load_config({"export": {"enabled": False}}), Batches([]),
                             example_inputs=torch.randn(3, 3, 8, 8))
    assert out.parity is not None and out.parity.passed and out.parity.source == "example"
    assert out.parity.metrics["samples"] == 3


def test_export_never_replaces_a_protected_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpts" / "epoch=0.ckpt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"weights")
    for directory in (tmp_path / "ckpts", tmp_path):
        with pytest.raises(ExportError, match="export.dir"):
            fuse_verify_export(_model(), load_config(), Batches(_val()), export_dir=directory,
                               protected_paths=[ckpt])
    assert ckpt.read_bytes() == b"weights"


def test_whole_module_target_and_disabled_parity() -> None:
    flat = H.randomize_batchnorms(H.FlatLit())
    out = fuse_verify_export(flat, load_config({"parity": {"enabled": False}, "export": {"enabled": False}}),
                             Batches(_val()))
    assert out.target == "" and out.parity is None
    assert out.fused_model is out.result.graph_module
    assert PARITY_DISABLED in [n.kind for n in out.notes]
    x = _val()[0][0]
    assert H.rel_err(out.fused_model(x), H.fp64_copy(flat)(x.double())) < 1e-5


def test_low_precision_model_is_gated_against_its_own_rounding() -> None:
    lit = copy.deepcopy(_model()).to(torch.bfloat16)
    out = fuse_verify_export(lit, load_config({"export": {"enabled": False}}), Batches(_val()))
    assert out.parity is not None
    own = out.parity.metrics["reference_error_vs_fp64"]
    assert own > 1e-4  # bfloat16 rounding: a plain 1e-4 gate would be meaningless here
    assert out.parity.thresholds["relative_max_error"] == pytest.approx(max(1e-4, 4 * own))
    assert out.parity.passed, out.parity.failures
