"""The failure catalogue: every way FXFuseCallback's work can go wrong, in one place (single process).

In every case the same promises are checked (``assert_untouched``): the LightningModule is bitwise what
training left (weights, buffers, training flags, no replaced forward), and every checkpoint ModelCheckpoint
wrote still has its bytes and still loads into a fresh model.

    case                                   what fit does                     test
    a user pass raises                     raises PassError                  test_user_pass_that_raises
    a pass leaves a graph that won't lint  raises PassError                  test_pass_that_breaks_the_graph
    parity fails                           raises ParityError, no export     test_parity_failure
    the export write fails                 raises ExportError, no leftovers  test_export_write_failure
    Ctrl-C during training                 exits; on_exception says so       test_ctrl_c_during_training
    fast_dev_run                           returns; skipped, says so         test_fast_dev_run
    on_error=warn (any of the above)       returns; a warning names cause    test_on_error_warn_lets_fit_return

Under DDP the same failures reach every rank: tests/test_ddp.py. Detailed checks of single cases (messages,
logged metrics, best-checkpoint weights, pre-training checks) are in tests/test_callback.py.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_helpers as H
from fx_lightning import ExportError, FXFuseCallback, ParityError, PassError


class Snapshot(pl.Callback):
    """Placed before FXFuseCallback: the module's fingerprint and the checkpoints' hashes at the moment the
    callback would start (on_fit_end), or when fit is interrupted (on_exception)."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.ckpt_dir = ckpt_dir
        self.fingerprint: Any = None
        self.hashes: Optional[Dict[str, str]] = None

    def _take(self, pl_module: pl.LightningModule) -> None:
        self.fingerprint = H.state_fingerprint(pl_module)
        self.hashes = H.file_hashes(self.ckpt_dir) if self.ckpt_dir.exists() else {}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.fingerprint is None:  # an error raised by FXFuseCallback lands here too: keep the earlier state
            self._take(pl_module)


class CtrlC(pl.Callback):
    """Presses Ctrl-C (raises KeyboardInterrupt) after a given training batch."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            raise KeyboardInterrupt


def fit(
    tmp_path: Path,
    model: pl.LightningModule,
    fuse_cb: FXFuseCallback,
    snap: Snapshot,
    extra: Tuple[pl.Callback, ...] = (),
    **trainer_kwargs: Any,
) -> pl.Trainer:
    """Two epochs, a ModelCheckpoint keeping every epoch and last.ckpt in ``snap.ckpt_dir``, ``snap`` right
    before ``fuse_cb``; the caller expects the outcome (return or exception)."""
    ckpt = ModelCheckpoint(dirpath=snap.ckpt_dir, save_top_k=-1, save_last=True)
    trainer = H.make_trainer(tmp_path, [ckpt, *extra, snap, fuse_cb], **trainer_kwargs)
    trainer.fit(model, *H.loaders())
    return trainer


def assert_untouched(model: pl.LightningModule, snap: Snapshot, fresh: Callable[[], pl.LightningModule],
                     min_checkpoints: int = 1) -> None:
    """The promises of every case: the module as training left it; every checkpoint intact and loadable."""
    assert snap.fingerprint is not None and snap.hashes is not None, "the snapshot was never taken"
    assert H.state_fingerprint(model) == snap.fingerprint
    files = H.file_hashes(snap.ckpt_dir) if snap.ckpt_dir.exists() else {}
    assert files == snap.hashes
    assert len(files) >= min_checkpoints
    for name in files:
        # Our own training wrote these files, so full unpickling is fine here.
        checkpoint = torch.load(snap.ckpt_dir / name, weights_only=False)
        fresh().load_state_dict(checkpoint["state_dict"], strict=True)


def no_export_anywhere(root: Path) -> bool:
    return not list(root.rglob("fx_fused")) and not list(root.rglob(".fx_fused*"))


# ------------------------------------------------------------------------------------------- the catalogue


def test_user_pass_that_raises(tmp_path: Path) -> None:
    model = H.LitClassifier()
    snap = Snapshot(tmp_path / "ckpts")
    fuse_cb = FXFuseCallback(passes={"extra": ["sample_passes:raises"]})
    with pytest.raises(PassError) as info:
        fit(tmp_path, model, fuse_cb, snap)
    message = str(info.value)  # names the pass, its error and where the checkpoints are
    assert "sample_passes:raises" in message and "boom from a user pass" in message
    assert "checkpoints are intact" in message
    assert fuse_cb.result is None and fuse_cb.export_dir is None and no_export_anywhere(tmp_path)
    assert_untouched(model, snap, H.LitClassifier, min_checkpoints=3)


def test_pass_that_breaks_the_graph(tmp_path: Path) -> None:
    model = H.LitClassifier()
    snap = Snapshot(tmp_path / "ckpts")
    fuse_cb = FXFuseCallback(passes={"extra": ["sample_passes:breaks_graph"]})
    with pytest.raises(PassError, match="does not lint") as info:
        fit(tmp_path, model, fuse_cb, snap)
    assert "sample_passes:breaks_graph" in str(info.value)
    assert fuse_cb.result is None and no_export_anywhere(tmp_path)
    assert_untouched(model, snap, H.LitClassifier, min_checkpoints=3)


def test_parity_failure(tmp_path: Path) -> None:
    model = H.LitClassifier(backbone=H.NoisyBackbone())
    snap = Snapshot(tmp_path / "ckpts")
    fuse_cb = FXFuseCallback()
    with pytest.raises(ParityError, match="parity FAILED"):
        fit(tmp_path, model, fuse_cb, snap)
    assert fuse_cb.parity_report is not None and not fuse_cb.parity_report.passed
    assert fuse_cb.export_dir is None and no_export_anywhere(tmp_path)
    assert_untouched(model, snap, lambda: H.LitClassifier(backbone=H.NoisyBackbone()),
                     min_checkpoints=3)


def test_export_write_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from fx_lightning.export import FORMATS

    def disk_full(root: Path, ctx: Any) -> Dict[str, Any]:
        (root / "model.pt").write_bytes(b"half a model")  # a partial file in the staging directory
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setitem(FORMATS, "graph_module", dataclasses.replace(FORMATS["graph_module"], write=disk_full))
    model = H.LitClassifier()
    snap = Snapshot(tmp_path / "ckpts")
    fuse_cb = FXFuseCallback(export={"formats": ["graph_module"]})
    with pytest.raises(ExportError, match="No space left on device") as info:
        fit(tmp_path, model, fuse_cb, snap)
    assert "checkpoints are intact" in str(info.value)
    # Fused and verified, then the write failed: the report is kept, nothing partial is left on disk.
    assert fuse_cb.parity_report is not None and fuse_cb.parity_report.passed
    assert fuse_cb.export_dir is None and no_export_anywhere(tmp_path)
    assert_untouched(model, snap, H.LitClassifier, min_checkpoints=3)


def test_ctrl_c_during_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = H.LitClassifier()
    snap = Snapshot(tmp_path / "ckpts")
    fuse_cb = FXFuseCallback()
    handler = signal.getsignal(signal.SIGINT)
    try:
        # Lightning turns Ctrl-C into a graceful shutdown: on_exception hooks, teardown, then sys.exit(1).
        with caplog.at_level(logging.INFO), pytest.raises(SystemExit):
            fit(tmp_path, model, fuse_cb, snap, extra=(CtrlC(at_step=6),))
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on; give it back to pytest
    assert model.training_steps == 6  # interrupted in the second epoch, after epoch 0's checkpoint
    assert fuse_cb.result is None and fuse_cb.skipped == "fit did not finish (KeyboardInterrupt)"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("FXFuseCallback")]
    assert said == [
        "FXFuseCallback: fit did not finish (KeyboardInterrupt), so nothing was fused or exported; the "
        "LightningModule and the checkpoints are untouched."
    ]
    assert no_export_anywhere(tmp_path)
    assert_untouched(model, snap, H.LitClassifier, min_checkpoints=1)


def test_fast_dev_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = H.LitClassifier()
    snap = Snapshot(tmp_path / "ckpts")
    fuse_cb = FXFuseCallback()
    with caplog.at_level(logging.INFO):
        fit(tmp_path, model, fuse_cb, snap, fast_dev_run=True)
    assert fuse_cb.result is None and fuse_cb.skipped == "fast_dev_run"
    assert any(r.getMessage() == "FXFuseCallback: skipped (fast_dev_run)." for r in caplog.records)
    assert no_export_anywhere(tmp_path)
    # fast_dev_run turns ModelCheckpoint off: nothing was written, and nothing appeared.
    assert_untouched(model, snap, H.LitClassifier, min_checkpoints=0)


@pytest.mark.parametrize(
    "case, fuse_kwargs, error_type, cause",
    [
        ("user pass raises", {"passes": {"extra": ["sample_passes:raises"]}}, PassError, "boom from a user pass"),
        ("parity fails", {}, ParityError, "parity FAILED"),
    ],
)
def test_on_error_warn_lets_fit_return(
    tmp_path: Path, case: str, fuse_kwargs: Dict[str, Any], error_type: type, cause: str
) -> None:
    noisy = case == "parity fails"
    make: Callable[[], pl.LightningModule] = (
        (lambda: H.LitClassifier(backbone=H.NoisyBackbone())) if noisy else H.LitClassifier
    )
    model = make()
    snap = Snapshot(tmp_path / "ckpts")
    fuse_cb = FXFuseCallback(on_error="warn", **fuse_kwargs)
    with pytest.warns(UserWarning, match="FXFuseCallback failed after training") as caught:
        trainer = fit(tmp_path, model, fuse_cb, snap)  # returns: no exception
    messages: List[str] = [str(w.message) for w in caught if "FXFuseCallback failed" in str(w.message)]
    assert len(messages) == 1 and cause in messages[0] and "on_error=warn" in messages[0]
    assert isinstance(fuse_cb.error, error_type) and cause in str(fuse_cb.error)
    assert trainer.state.finished and model.training_steps == 8
    assert fuse_cb.export_dir is None and no_export_anywhere(tmp_path)
    assert_untouched(model, snap, make, min_checkpoints=3)
