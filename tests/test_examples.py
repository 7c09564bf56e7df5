"""The examples run end to end (shrunk: fewer samples and epochs than their defaults)."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from hydra import compose, initialize_config_dir

import lightning_helpers as H
from examples.data import CLASSES, make_stripes
from fx_lightning import FXFuseCallback
from fx_lightning.callback.ranks import WEIGHTS


def test_stripes_are_deterministic_and_cover_every_class() -> None:
    a, b = make_stripes(64, seed=3), make_stripes(64, seed=3)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    assert not torch.equal(a.tensors[0], make_stripes(64, seed=4).tensors[0])
    assert set(a.tensors[1].tolist()) == set(range(len(CLASSES)))
    assert a.tensors[0].shape == (64, 3, 24, 24)


def test_train_example_learns_fuses_and_reloads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("fx_lightning.export")
    from examples.train import main

    cb = main(["--epochs", "2", "--num-train", "512", "--num-val", "128", "--root", str(tmp_path)])
    report = cb.parity_report
    assert report is not None and report.passed, report
    assert report.metrics["accuracy_reference"] > 0.5  # chance is 0.25: the dataset is learnable
    assert cb.result is not None and cb.result.report.before.batchnorms == 4
    assert cb.result.report.after.batchnorms == 0
    assert cb.export_dir is not None and (cb.export_dir / "manifest.json").is_file()
    assert f"Fused model: {cb.export_dir}" in capsys.readouterr().out


def test_hydra_app_trains_with_a_preset(tmp_path: Path) -> None:
    from examples.hydra_app import CONFIG_DIR, train

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[
            "fx_fuse=no_export", "trainer.max_epochs=1", "data.num_train=128", "data.num_val=64",
            f"trainer.default_root_dir={tmp_path}", "callbacks.fx_fuse.parity.max_batches=1",
        ])
    cb = train(cfg)
    assert isinstance(cb, FXFuseCallback)
    assert cb.config.export.enabled is False and cb.export_dir is None
    assert cb.parity_report is not None and cb.parity_report.passed and cb.parity_report.batches == 1


def test_lightning_cli_example_fits_and_fuses_the_best_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("fx_lightning.export")
    from examples.cli import main

    args = ["fit", "--config", str(H.REPO / "configs" / "cli" / "train.yaml"), "--trainer.max_epochs=1",
            "--data.num_train=128", "--data.num_val=64", f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}"]
    with mock.patch.object(sys, "argv", ["cli.py"]):
        cli = main(args)
    cb = next(c for c in cli.trainer.callbacks if isinstance(c, FXFuseCallback))
    assert cb.parity_report is not None and cb.parity_report.passed
    assert cb.outcome is not None
    assert any(n.kind == WEIGHTS and "best checkpoint" in n["description"] for n in cb.outcome.notes)  # type: ignore[operator]
    assert cb.export_dir is not None and cb.export_dir.is_dir()
