"""The ``fx-lightning`` CLI: ``fuse`` on a checkpoint from a real ``Trainer.fit`` gives the callback's manifest;
``inspect`` and ``bench`` read exports; errors give exit status 1 (pipeline) or 2 (usage) with the cause."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fx_lightning import FXFuseCallback
from fx_lightning.cli import main
from fx_lightning.export import load_fused, read_manifest

from export_cli_models import CliClassifier, CliData
from export_helpers import clean_env, reference_fp64, rel_err

MODEL = "export_cli_models:CliClassifier"
DATA = "export_cli_models:CliData"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Dict[str, Any]:
    """Two short epochs of a real fit with the callback exporting, and a checkpoint of the final weights."""
    base = tmp_path_factory.mktemp("fit")
    pl.seed_everything(0, workers=True)
    model = CliClassifier()
    callback = FXFuseCallback(export={"dir": str(base / "callback_export"), "formats": ["graph_module", "pt2"]})
    ckpt = ModelCheckpoint(dirpath=str(base / "ckpt"), save_last=True, save_top_k=0)
    trainer = pl.Trainer(
        max_epochs=2, limit_train_batches=3, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, ckpt],
        default_root_dir=str(base),
    )
    trainer.fit(model, datamodule=CliData())
    assert callback.export_dir is not None, callback.summary
    # Fit moved the BatchNorm statistics away from the identity: the fusion below is not trivial.
    assert not torch.allclose(model.backbone.bn1.running_var, torch.ones_like(model.backbone.bn1.running_var))
    return {"base": base, "callback_dir": Path(callback.export_dir), "ckpt": Path(ckpt.last_model_path),
            "model": model}


def _fuse(trained, out: Path, *extra: str) -> int:
    return main(["fuse", str(trained["ckpt"]), "--model", MODEL, "--output", str(out), *extra])


@pytest.fixture(scope="module")
def cli_export(trained) -> Path:
    out = trained["base"] / "cli_export"
    assert _fuse(trained, out, "--datamodule", DATA, "export.formats=[graph_module,pt2]") == 0
    return out


def test_cli_fuse_gives_the_callbacks_manifest(trained, cli_export):
    cb, cli = read_manifest(trained["callback_dir"]), read_manifest(cli_export)
    for m in (cb, cli):
        assert m.config is not None and m.report is not None
        m.config["export"].pop("dir")
    assert cli.config == cb.config
    for key in ("capture_mode", "before", "after", "remaining_batchnorms", "batchnorms_folded"):
        assert cli.report[key] == cb.report[key], key
    strip = lambda passes: [(p["name"], p["changed"], p["skipped"]) for p in passes]  # noqa: E731
    assert strip(cli.report["passes"]) == strip(cb.report["passes"])
    assert cb.report["batchnorms_folded"] == 3
    assert cli.parity is not None and cb.parity is not None
    assert cli.parity.passed is True and cb.parity.passed is True
    for key in ("batches", "source", "failures", "thresholds"):
        assert getattr(cli.parity, key) == getattr(cb.parity, key), key
    assert cli.parity.source == "val"
    assert cli.parity.metrics.keys() == cb.parity.metrics.keys()
    for key, value in cb.parity.metrics.items():
        assert cli.parity.metrics[key] == pytest.approx(value, rel=1e-3, abs=1e-9), key
    assert cli.inputs == cb.inputs and cli.outputs == cb.outputs
    assert list(cli.formats) == list(cb.formats)
    for key in ("target", "lightning_module"):
        assert getattr(cli.provenance, key) == getattr(cb.provenance, key), key
    # The same weights: the callback's last weights are the checkpoint the CLI fused, saved at the same counters.
    cli_weights, cb_weights = cli.provenance.weights, cb.provenance.weights
    assert cli_weights is not None and cb_weights is not None
    for key in ("epoch", "global_step"):
        assert getattr(cli_weights, key) == getattr(cb_weights, key) is not None, key
    assert cb_weights.source == "last" and cli_weights.source == "checkpoint"
    assert cli.provenance.checkpoint == str(trained["ckpt"].resolve())

    # Same weights, same answers: both exports against the original backbone in fp64.
    backbone = CliClassifier.load_from_checkpoint(trained["ckpt"], map_location="cpu").backbone.eval()
    x = torch.randn(7, 3, 8, 8)
    ref = reference_fp64(backbone, x)
    assert rel_err(reference_fp64(trained["model"].backbone, x), ref) == 0.0
    for directory in (trained["callback_dir"], cli_export):
        assert rel_err(load_fused(directory)(x), ref) <= 1e-5


def test_cli_fuse_config_file_overrides_and_example_input_array(trained, tmp_path, capsys):
    (tmp_path / "fuse.yaml").write_text(
        "_target_: fx_lightning.FXFuseCallback\nparity:\n  rtol: 0.01\n  max_batches: 2\nexport:\n  formats: [graph_module]\n"
    )
    out = tmp_path / "exp"
    code = main(["fuse", str(trained["ckpt"]), "--model", "export_cli_models:CliClassifierWithExample",
                 "--config", str(tmp_path / "fuse.yaml"), "-o", str(out),
                 "parity.rtol=1e-3", "export.formats=[pt2,code]", "passes.remove_dropout.enabled=false"])
    assert code == 0, capsys.readouterr().err
    manifest = read_manifest(out)
    assert manifest.config is not None and manifest.report is not None and manifest.parity is not None
    assert manifest.config["parity"]["rtol"] == 1e-3  # the command line beats the file
    assert manifest.config["parity"]["max_batches"] == 2  # the file beats the default
    assert manifest.config["passes"]["remove_dropout"]["enabled"] is False
    assert list(manifest.formats) == ["pt2", "code"]
    assert manifest.parity.source == "example" and manifest.parity.passed is True
    assert "remove_dropout" not in [p["name"] for p in manifest.report["passes"]]
    assert f"exported to {out}" in capsys.readouterr().out


def test_cli_fuse_input_shape_dry_run(trained, tmp_path, capsys):
    out = tmp_path / "never"
    assert _fuse(trained, out, "--input-shape", "2,3,8,8", "--dry-run") == 0
    captured = capsys.readouterr().out
    assert "parity PASSED" in captured and "dry run: nothing written" in captured
    assert not out.exists()


def test_cli_fuse_parity_failure_exports_nothing(trained, tmp_path, capsys):
    out = tmp_path / "exp"
    # rtol 0: folding changes float rounding, so the gate must fail.
    assert _fuse(trained, out, "--datamodule", DATA, "parity.rtol=0") == 1
    err = capsys.readouterr().err
    assert "ParityError" in err and "relative" in err and "Nothing was exported" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "args, status, message",
    [
        (["parity.rtoll=1e-3"], 1, "parity.rtoll: unknown key. Did you mean 'parity.rtol'?"),
        (["export.formats=[tflite]"], 1, "export.formats[0]: invalid value 'tflite'"),
        (["rtol"], 2, "overrides must look like dotted.key=value"),
        (["--input-shape", "2,x"], 2, "--input-shape: expected integers"),
    ],
)
def test_cli_fuse_bad_arguments(trained, tmp_path, capsys, args, status, message):
    assert _fuse(trained, tmp_path / "exp", "--datamodule", DATA, *args) == status
    assert message in capsys.readouterr().err
    assert not (tmp_path / "exp").exists()


def test_cli_fuse_missing_things(trained, tmp_path, capsys):
    assert main(["fuse", str(tmp_path / "nope.ckpt"), "--model", MODEL]) == 2
    assert "checkpoint: no such file" in capsys.readouterr().err
    assert main(["fuse", str(trained["ckpt"]), "--model", "export_cli_models:Nope"]) == 2
    assert "--model: cannot import 'export_cli_models:Nope'" in capsys.readouterr().err
    assert main(["fuse", str(trained["ckpt"]), "--model", MODEL, "-o", str(tmp_path / "exp")]) == 2
    assert "no inputs for parity and export" in capsys.readouterr().err
    # The export may not replace the checkpoint's directory.
    assert _fuse(trained, trained["ckpt"].parent, "--datamodule", DATA) == 1
    assert "could replace a checkpoint" in capsys.readouterr().err
    assert trained["ckpt"].is_file()


def test_inspect_prints_the_manifest(cli_export, capsys):
    assert main(["inspect", str(cli_export), "--verify"]) == 0
    out = capsys.readouterr().out
    manifest = read_manifest(cli_export)
    for needle in ("format_version", "PASSED", "fuse_conv_bn", "fuse_linear_bn", "model.pt2", "model.pt",
                   "weights_only=False", "all files match their sha256", "(batch, 3, n0, n0)",
                   manifest.files["model.pt2"].sha256[:16]):
        assert needle in out, needle
    # The round-trip check in words: which format, on which input shapes, what error against what.
    assert manifest.inputs[0]["example_shape"] is not None
    example = "x".join(map(str, manifest.inputs[0]["example_shape"]))
    assert f"pt2: loaded back and run on input {example} and 1x3x8x8: relative error" in out
    assert "against an fp64 copy of the fused model" in out and "the fused model itself" in out and "rel err" not in out
    weights = manifest.provenance.weights
    assert weights is not None
    words = " ".join(out.replace("│", " ").split())
    assert f"weights saved at epoch {weights.epoch}, global step {weights.global_step}" in words
    assert main(["inspect", str(cli_export), "--json"]) == 0
    # --json prints the manifest as written: the file's JSON
    assert json.loads(capsys.readouterr().out) == json.loads((cli_export / "manifest.json").read_text())


def test_inspect_reports_corruption_and_non_exports(cli_export, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(cli_export, copy)
    with open(copy / "model.pt", "ab") as fh:
        fh.write(b"x")
    assert main(["inspect", str(copy), "--verify"]) == 1
    assert "model.pt: corrupt file" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 1
    assert "manifest.json: missing" in capsys.readouterr().err


def test_bench_times_export_and_unfused(cli_export, capsys):
    code = main(["bench", str(cli_export), "--iters", "3", "--warmup", "1", "--batch-size", "2", "--threads", "1"])
    assert code == 0
    out = capsys.readouterr().out
    for needle in ("latency, batch 2, idle traffic, 3 iterations", "latency, batch 2, back to back traffic", "unfused", "pt2", "graph_module", "speed-up vs unfused"):
        assert needle in out, needle
    assert "x" in out.split("unfused")[-1]  # a speed-up figure was computed
    assert main(["bench", str(cli_export), "--format", "onnx"]) == 2
    assert "--format: onnx not in this export" in capsys.readouterr().err


def test_bench_times_the_unfused_model_of_a_raw_pixel_export_on_raw_pixels(trained, tmp_path, capsys):
    """With export.preprocess the artifacts take raw uint8 pixels: the unfused model is timed behind the same
    normalisation (it failed with "Input type (unsigned char) and bias type (float)" and was left out)."""
    out = tmp_path / "raw"
    assert _fuse(trained, out, "--datamodule", DATA, "export.formats=[pt2]", "export.preprocess.enabled=true",
                 "export.preprocess.mean=[0.5,0.5,0.5]", "export.preprocess.std=[0.25,0.25,0.25]") == 0
    capsys.readouterr()
    assert main(["bench", str(out), "--iters", "2", "--warmup", "0", "--batch-size", "2", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    unfused = [row for row in cells if row[0] == "unfused"]
    pt2 = [row for row in cells if row[0] == "pt2"]
    assert unfused and pt2, text  # earlier: no unfused row at all
    assert all(row[-1].endswith("x") and float(row[-1][:-1]) > 0 for row in pt2), text  # earlier: "-"


def test_console_script_is_installed(cli_export, tmp_path):
    script = Path(sys.executable).parent / "fx-lightning"
    assert script.exists(), "pip install -e . should have created the console script"
    proc = subprocess.run([str(script), "inspect", str(cli_export)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "formats" in proc.stdout and "PASSED" in proc.stdout
