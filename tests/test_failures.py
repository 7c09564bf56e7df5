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
    anything that does not depend on the   stops before the first training   test_preflight_stops_before_training
    trained weights (preflight: full)      step, the stage named             test_preflight_warn_trains_unfused

With the default ``preflight: full`` the first, second and fourth cases stop before training (the preflight
runs the pipeline once on the untrained model); the after-training cases run with ``preflight: off``, the
path a failure that depends on the trained weights still takes.

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
    fuse_cb = FXFuseCallback(passes={"extra": ["sample_passes:raises"]}, preflight="off")
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
    fuse_cb = FXFuseCallback(passes={"extra": ["sample_passes:breaks_graph"]}, preflight="off")
    with pytest.raises(PassError, match="does not lint") as info:
        fit(tmp_path, model, fuse_cb, snap)
    assert "sample_passes:breaks_graph" in str(info.value)
    assert fuse_cb.result is None and no_export_anywhere(tmp_path)
    assert_untouched(model, snap, H.LitClassifier, min_checkpoints=3)


def test_parity_failure(tmp_path: Path) -> None:
    """A parity failure after training (the preflight off: with it, outputs all drawn at random are refused before
    training, tests/test_callback.py) leaves the model and every checkpoint as they were."""
    model = H.LitClassifier(backbone=H.NoisyBackbone())
    snap = Snapshot(tmp_path / "ckpts")
    fuse_cb = FXFuseCallback(preflight="off")
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
    fuse_cb = FXFuseCallback(export={"formats": ["graph_module"]}, preflight="off")
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
    fuse_cb = FXFuseCallback(on_error="warn", preflight="off", **fuse_kwargs)
    with pytest.warns(UserWarning, match="FXFuseCallback failed after training") as caught:
        trainer = fit(tmp_path, model, fuse_cb, snap)  # returns: no exception
    messages: List[str] = [str(w.message) for w in caught if "FXFuseCallback failed" in str(w.message)]
    assert len(messages) == 1 and cause in messages[0] and "on_error=warn" in messages[0]
    assert isinstance(fuse_cb.error, error_type) and cause in str(fuse_cb.error)
    assert trainer.state.finished and model.training_steps == 8
    assert fuse_cb.export_dir is None and no_export_anywhere(tmp_path)
    assert_untouched(model, snap, make, min_checkpoints=3)


# ------------------------------------------------------------------------- caught before training (preflight)


class CountingDataset(torch.utils.data.Dataset):
    """The training data, counting every sample read: the preflight must not consume any."""

    def __init__(self, inner: torch.utils.data.Dataset) -> None:
        self.inner, self.reads = inner, 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        self.reads += 1
        return self.inner[i]


def _missing_onnxscript(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Dict[str, Any]:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else real(name, *a))
    return {"export": {"formats": ["pt2", "onnx"]}}


def _no_cxx_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Dict[str, Any]:
    import shutil

    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)  # no g++, c++, clang++ or $CXX on PATH
    return {"export": {"formats": ["pt2", "aoti"]}}


def _unwritable_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Dict[str, Any]:
    (tmp_path / "a_file").write_text("not a directory")
    return {"export": {"dir": str(tmp_path / "a_file" / "fused")}}


PREFLIGHT_CASES = {
    # case: (config or a function making it, the exception type, the stage, a fragment of the cause)
    "missing dependency": (_missing_onnxscript, "ExportError", "export dependencies", "onnxscript is not installed"),
    "no C++ compiler for aoti": (_no_cxx_compiler, "ExportError", "export dependencies", "a C++ compiler"),
    "unwritable export dir": (_unwritable_dir, "ExportError", "export directory", "cannot be created or written"),
    "user pass raises": ({"passes": {"extra": ["sample_passes:raises"]}}, "PassError", "passes",
                         "boom from a user pass"),
    "pass breaks lint": ({"passes": {"extra": ["sample_passes:breaks_graph"]}}, "PassError", "passes",
                         "does not lint"),
    "export cannot capture": ({"passes": {"extra": ["sample_passes:export_refuses"]}, "export": {"formats": ["pt2"]}},
                              "ExportError", "export", "torch.export failed"),
    "parity input": ({"parity": {"input": "image"}}, "ConfigError", "parity input", "'image' names a key"),
}


def _preflight_case(case: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Tuple[Dict[str, Any], str, str, str]:
    config, error_type, stage, cause = PREFLIGHT_CASES[case]
    return (config(monkeypatch, tmp_path) if callable(config) else config), error_type, stage, cause


def _fit_counting(tmp_path: Path, model: pl.LightningModule, fuse_cb: FXFuseCallback) -> Tuple[pl.Trainer, CountingDataset]:
    train_set = CountingDataset(H.tiny_dataset(64, 0))
    _, val = H.loaders()
    trainer = H.make_trainer(tmp_path, [fuse_cb])
    trainer.fit(model, torch.utils.data.DataLoader(train_set, batch_size=16, shuffle=True), val)
    return trainer, train_set


@pytest.mark.parametrize("case", sorted(PREFLIGHT_CASES))
def test_preflight_stops_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    config, error_type, stage, cause = _preflight_case(case, monkeypatch, tmp_path)
    model = H.LitClassifier()
    before = H.snapshot(model)
    fuse_cb = FXFuseCallback(**config)
    with pytest.raises(Exception) as info:
        _fit_counting(tmp_path, model, fuse_cb)
    assert type(info.value).__name__ == error_type, info.value
    message = str(info.value)
    # Every format failed: no advice (dropping one cannot help, no other is known to work); else the stage's.
    assert cause in message and ("Fix:" not in message if "no format could be written" in message else "Fix:" in message)
    assert "drop the failing format" not in message
    H.assert_stopped_before_training(message, model, stage, before)
    assert no_export_anywhere(tmp_path)
    assert fuse_cb.preflight is None and fuse_cb.result is None


@pytest.mark.parametrize("case", sorted(PREFLIGHT_CASES))
def test_preflight_warn_trains_unfused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    config, error_type, stage, cause = _preflight_case(case, monkeypatch, tmp_path)
    model = H.LitClassifier()
    fuse_cb = FXFuseCallback(on_error="warn", **config)
    with pytest.warns(UserWarning, match=f"stage '{stage}'") as caught:
        trainer, train_set = _fit_counting(tmp_path, model, fuse_cb)
    warned = [str(w.message) for w in caught if f"stage '{stage}'" in str(w.message)]
    assert len(warned) == 1 and cause in warned[0] and "nothing will be fused" in warned[0]
    assert trainer.state.finished and model.training_steps == 8 and train_set.reads == 8 * 16
    assert fuse_cb.result is None and fuse_cb.export_dir is None and no_export_anywhere(tmp_path)
    assert fuse_cb.skipped is not None and "preflight failed" in fuse_cb.skipped


def test_preflight_passes_reads_no_training_data_and_reports_its_cost(tmp_path: Path) -> None:
    from fx_lightning.export import read_manifest

    model = H.LitClassifier()
    fuse_cb = FXFuseCallback(export={"formats": ["graph_module", "pt2"]})
    trainer, train_set = _fit_counting(tmp_path, model, fuse_cb)
    assert train_set.reads == 8 * 16  # the preflight read validation data only, and training read its own
    report = fuse_cb.preflight
    assert report is not None and report.mode == "full" and report.seconds > 0
    # The checks that need no model, then every step of the end of fit's own driver.
    assert report.stages == ["device", "target", "weights", "export directory", "export dependencies",
                             "parity input", "capture", "passes", "parity", "export"]
    assert "preflight (full)" in (fuse_cb.summary or "") and f"{report.seconds:.2f} s" in (fuse_cb.summary or "")
    assert read_manifest(fuse_cb.export_dir).provenance.preflight == report
    assert not list(Path(trainer.log_dir).glob(".fx_fused*"))  # the probe left nothing

