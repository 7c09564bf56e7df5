"""What a user sees of the end of fit (issue 41): a line per step with its time as it goes, the libraries' own INFO
kept out, report.html in every export (opened in a real headless Chromium: no error, no request leaving the
file, the manifest's figures), and the figures and report in the Trainer's TensorBoard, MLflow and CSV loggers."""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger

from browser import Browser, chromium_path
from lightning_helpers import LitClassifier, loaders, make_trainer

from fx_lightning import FXFuseCallback
from fx_lightning.callback.progress_bar import RichProgress, TqdmProgress, progress_for
from fx_lightning.cli import main as cli_main
from fx_lightning.export import read_manifest
from fx_lightning.export.progress import LineProgress, Progress, quiet_libraries, times_text
from fx_lightning.export.write.report_html import REPORT_NAME, figures, render_report
from fx_lightning.export.select.sweep import SweepSettings, module_runner
from fx_lightning.formats.batching import BatchPieces
from fx_lightning.pipeline import export_step

DOCS = Path(__file__).resolve().parents[1] / "docs"
# A sweep short enough for a test (the real one stops when throughput stops growing, up to a minute per artifact).
QUICK_SWEEP = SweepSettings(stable_windows=1, max_windows=2, window_s=0.01, max_batch_size=4, time_limit_s=5.0)


# ------------------------------------------------------------------------------------------- progress


def test_each_step_says_when_it_starts_and_ends_with_its_time_and_the_summary_lists_them() -> None:
    lines: List[str] = []
    progress = LineProgress(lines.append, "end of fit")
    with progress.step("export") as end:
        with progress.step("format onnx: written and checked") as part:
            part.result = "1.2 MB, check passed"
        end.result = "1 artifact(s)"
    with pytest.raises(RuntimeError), progress.step("selection"):
        raise RuntimeError("boom")
    progress.close()
    assert lines[0] == "fx-lightning end of fit: export ..."
    assert lines[1] == "fx-lightning end of fit:   format onnx: written and checked ..."
    assert lines[2].startswith("fx-lightning end of fit:   format onnx: written and checked: done in ")
    assert lines[2].endswith(" s (1.2 MB, check passed)")
    assert lines[3].startswith("fx-lightning end of fit: export: done in ") and lines[3].endswith("(1 artifact(s))")
    assert lines[5].startswith("fx-lightning end of fit: selection: FAILED in ")
    summary = times_text(progress.times)
    assert summary[0] == "time per step:"  # in the order the steps started, parts indented under their step
    assert [line.split(":")[0].strip() for line in summary[1:]] == ["export", "format onnx", "selection"]
    assert summary[3].endswith("(failed)")


def test_a_quiet_step_says_it_is_still_running() -> None:
    """A step that prints nothing (a compile, a calibration) is not silent: a line says it still runs."""
    lines: List[str] = []
    heard = threading.Event()

    def write(line: str) -> None:
        lines.append(line)
        if "still running" in line:
            heard.set()

    progress = LineProgress(write, "preflight")
    progress.heartbeat_s = 0.2
    with progress.step("format aoti: written and checked"):
        assert heard.wait(60), lines  # the step stays open until the heartbeat spoke
    progress.close()
    assert any(line.startswith("fx-lightning preflight: format aoti: written and checked: still running (")
               for line in lines), lines


def test_a_long_loop_shows_how_far_it_is_and_what_is_left() -> None:
    lines: List[str] = []
    progress = LineProgress(lines.append)
    progress.every_s = 0.0
    for done in range(1, 5):
        progress.advance("timing", done, 4)
    assert lines[0].startswith("fx-lightning:   timing: 1/4 (25%), about ") and lines[0].endswith(" left")
    assert lines[-1] == "fx-lightning:   timing: 4/4 (100%)"


def test_the_libraries_info_is_kept_out_unless_our_logger_is_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    noisy = logging.getLogger("onnxscript.optimizer._constant_folding")
    with caplog.at_level(logging.INFO):
        with quiet_libraries():
            noisy.info("Skipping constant folding for node")
            noisy.warning("a real problem")
        assert [r.getMessage() for r in caplog.records] == ["a real problem"]
        caplog.clear()
        ours = logging.getLogger("fx_lightning")
        level = ours.level
        ours.setLevel(logging.DEBUG)
        try:
            with quiet_libraries():
                noisy.info("Skipping constant folding for node")
        finally:
            ours.setLevel(level)
        assert [r.getMessage() for r in caplog.records] == ["Skipping constant folding for node"]
    level = noisy.level
    with quiet_libraries():  # two pipelines at once (ranks as threads): the last to end restores the level
        with quiet_libraries():
            pass
        assert noisy.getEffectiveLevel() == logging.WARNING
    assert noisy.level == level


def test_the_sweep_runs_an_artifact_as_pieces_without_telling_the_user_to_change_a_setting(
        caplog: pytest.LogCaptureFixture) -> None:
    pieces = BatchPieces({"1": lambda x: x * 2}, axes=[0], output_axes=[0], what="AOTInductor package",
                         hint="add it to export.aoti_batch_sizes")
    x = torch.ones(1, 3)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, "fx_lightning"):
        warnings.simplefilter("always")
        module_runner(pieces, [x], [0], "back_to_back")(4)
    assert not [w for w in caught if "pieces" in str(w.message)]
    assert any("running it as pieces" in r.getMessage() for r in caplog.records)
    with pytest.warns(UserWarning, match="add it to export.aoti_batch_sizes"):  # a user's own call still warns
        BatchPieces({"1": lambda x: x * 2}, axes=[0], output_axes=[0], hint="add it to export.aoti_batch_sizes")(
            torch.ones(3, 3))


def test_the_progress_is_drawn_as_the_trainer_draws_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = make_trainer(tmp_path, [], enable_progress_bar=False)
    assert type(progress_for(plain, "end of fit")) is LineProgress
    tqdm_trainer = make_trainer(tmp_path, [TQDMProgressBar()], enable_progress_bar=True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert type(progress_for(tqdm_trainer, "end of fit")) is LineProgress  # a log file: lines, not a bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert isinstance(progress_for(tqdm_trainer, "end of fit"), TqdmProgress)
    from rich.console import Console

    screen = io.StringIO()
    monkeypatch.setattr("rich.get_console", lambda: Console(file=screen, force_terminal=True, width=100))
    rich = progress_for(make_trainer(tmp_path, [RichProgressBar()], enable_progress_bar=True), "end of fit")
    assert isinstance(rich, RichProgress)
    with rich.step("timing"):
        rich.advance("timing", 1, 2)
    rich.close()
    assert "fx-lightning end of fit: timing: done in" in screen.getvalue()
    monkeypatch.setattr(pl.Trainer, "is_global_zero", property(lambda self: False))
    assert type(progress_for(plain, "end of fit")) is Progress  # other ranks draw nothing


# -------------------------------------------------------------------------------- a fit, as a user runs it


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("progress")
    loggers = [TensorBoardLogger(tmp / "tb", name="run"),
               MLFlowLogger(experiment_name="progress", tracking_uri=f"sqlite:///{tmp}/mlflow.db",
                            artifact_location=str(tmp / "artifacts")),
               CSVLogger(tmp / "csv", name="run")]
    callback = FXFuseCallback(export={"dir": str(tmp / "fx_fused"), "formats": ["graph_module", "pt2"],
                                      "select": "fastest", "mlflow": {"enabled": False}})
    handler = _Lines()
    progress_logger = logging.getLogger("fx_lightning.progress")
    progress_logger.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(export_step, "SweepSettings", lambda: QUICK_SWEEP)
            make_trainer(tmp, [callback], logger=loggers).fit(LitClassifier(), *loaders())
    finally:
        progress_logger.removeHandler(handler)
    yield {"tmp": tmp, "callback": callback, "lines": handler.lines, "loggers": loggers}


def test_the_preflight_and_the_end_of_fit_print_each_step_with_its_time(fitted: Dict[str, Any]) -> None:
    lines = fitted["lines"]
    for title in ("preflight", "end of fit"):
        for step in ("capture and passes", "parity", "export", "  format pt2: written and checked",
                     "  timing", "  throughput sweep (latency and samples/s against batch size)"):
            assert any(line.startswith(f"fx-lightning {title}: {step} ...") for line in lines), (title, step, lines)
            assert any(line.startswith(f"fx-lightning {title}: {step}: done in ") for line in lines), (title, step)
    summary = fitted["callback"].summary.splitlines()
    assert summary[1].startswith("BatchNorms: ") and summary[2].startswith("parity: PASSED")
    assert summary[3].startswith("served: ")
    times = summary[summary.index("time per step:") + 1:-1]  # last, before the closing banner: each step's time
    assert times and all(line.startswith("  ") for line in times) and "  export: " in [t[:10] for t in times]


def test_every_export_has_its_report_listed_in_the_manifest_and_inspect_writes_the_same(
        fitted: Dict[str, Any], tmp_path: Path) -> None:
    export_dir = fitted["callback"].export_dir
    manifest = read_manifest(export_dir)
    report = export_dir / REPORT_NAME
    assert manifest.files[REPORT_NAME].sha256 == hashlib.sha256(report.read_bytes()).hexdigest()
    assert report.read_text(encoding="utf-8") == render_report(manifest, f"fx-lightning export: {export_dir.name}")
    assert cli_main(["inspect", str(export_dir), "--html", str(tmp_path / "again.html")]) == 0
    assert (tmp_path / "again.html").read_bytes() == report.read_bytes()


def test_the_report_stands_alone() -> None:
    """No script, no font, no remote address anywhere in the page (beside the browser's own check below)."""
    from fx_lightning.export.manifest import Manifest

    page = render_report(Manifest(formats={}))
    assert "<script" not in page and "@font-face" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium is not installed: tests/engines.py install installs it (apt-get install chromium)")
        pytest.skip("Chromium is not installed here (python tests/engines.py install installs it); CI runs this")
    with Browser.start() as started:
        yield started


def test_the_report_renders_in_chromium_with_the_manifests_figures(fitted: Dict[str, Any], browser: Browser,
                                                                   tmp_path: Path) -> None:
    export_dir = fitted["callback"].export_dir
    manifest = read_manifest(export_dir)
    page = browser.open(export_dir / REPORT_NAME)
    assert page.errors == []
    assert page.requests == [(export_dir / REPORT_NAME).resolve().as_uri()]  # nothing else was asked for
    shown = page.evaluate("Object.fromEntries(Array.from(document.querySelectorAll('[data-key][data-value]'))"
                          ".filter(e => e.dataset.value !== '').map(e => [e.dataset.key, Number(e.dataset.value)]))")
    expected = figures(manifest)
    assert expected and {k: shown.get(k) for k in expected} == pytest.approx(expected, rel=0, abs=0)
    assert page.evaluate("document.querySelector('[data-key=\"selected.format\"]').textContent") == \
        manifest.selected.format
    # The sweep's plots: one point per batch size swept, at the manifest's samples/s.
    for sweep in manifest.bench.sweeps:
        drawn = page.evaluate(
            f"Array.from(document.querySelectorAll('svg[data-plot=\"throughput.{sweep.traffic}\"] circle'))"
            f".filter(c => c.dataset.series === {sweep.artifact!r}).map(c => [Number(c.dataset.x), "
            "Number(c.dataset.y)])")
        assert drawn == [[p.batch_size, p.throughput] for p in sweep.points]
    assert page.evaluate("document.querySelector('svg[data-plot^=\"latency\"]').getBoundingClientRect().width") > 100
    shot = page.screenshot(tmp_path / "report.png")
    assert shot.stat().st_size > 10_000
    if os.environ.get("FXL_DOCS_SCREENSHOT"):  # refreshes the README's picture
        (DOCS / "report.png").write_bytes(shot.read_bytes())


def test_tensorboard_holds_the_figures_the_summary_and_the_plots(fitted: Dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = fitted["loggers"][0]
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "tensors": 0, "scalars": 0}).Reload()
    tags = events.Tags()
    report = fitted["callback"].result.report
    assert events.Scalars("fx_fuse/batchnorms_folded")[-1].value == report.batchnorms_folded
    assert "fx_fuse/parity_relative_max_error" in tags["scalars"]
    assert "fx_fuse/summary/text_summary" in tags["tensors"]
    text = events.Tensors("fx_fuse/summary/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "BatchNorms: " in text and "time per step:" in text
    assert {"fx_fuse/sweep_latency_idle", "fx_fuse/sweep_throughput_back_to_back"} <= set(tags["images"])


def test_mlflow_holds_the_report_and_the_plots_as_artifacts_of_the_run(fitted: Dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    logger = fitted["loggers"][1]
    client = MlflowClient(logger._tracking_uri)
    names = {a.path for a in client.list_artifacts(logger.run_id, "fx_fuse")}
    assert {"fx_fuse/report.html", "fx_fuse/summary.txt", "fx_fuse/plots"} <= names
    plots = {a.path for a in client.list_artifacts(logger.run_id, "fx_fuse/plots")}
    assert "fx_fuse/plots/sweep_throughput_idle.svg" in plots
    local = client.download_artifacts(logger.run_id, "fx_fuse/report.html")
    assert Path(local).read_bytes() == (fitted["callback"].export_dir / REPORT_NAME).read_bytes()
    metrics = client.get_run(logger.run_id).data.metrics
    assert metrics["fx_fuse/batchnorms_folded"] == fitted["callback"].result.report.batchnorms_folded
    assert metrics["fx_fuse/selected_median_ms"] == pytest.approx(
        read_manifest(fitted["callback"].export_dir).selected.median_ms)


def test_the_csv_logger_holds_the_metrics(fitted: Dict[str, Any]) -> None:
    logger = fitted["loggers"][2]
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    folded = [r["fx_fuse/batchnorms_folded"] for r in rows if r.get("fx_fuse/batchnorms_folded")]
    assert folded and float(folded[-1]) == fitted["callback"].result.report.batchnorms_folded
    assert any(r.get("fx_fuse/selected_median_ms") for r in rows)


def test_the_int8_calibration_says_how_far_it_is() -> None:
    """Calibration runs a batch at a time through the model, a long and otherwise quiet step on a large model: the
    export's reporter is handed down to it and told after each batch."""
    pytest.importorskip("torchao")
    from fx_lightning.variants.base import VariantContext
    from fx_lightning.variants.int8 import QuantizeInt8Options, quantize_int8

    class Told(Progress):
        def __init__(self) -> None:
            super().__init__()
            self.told: List[tuple] = []

        def advance(self, what: str, done: int, total: Any) -> None:
            self.told.append((what, done, total))

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 2)).eval()
    batches = [(torch.randn(2, 3, 8, 8),) for _ in range(3)]
    progress = Told()
    options = QuantizeInt8Options(enabled=True, calibration_batches=3, max_float_layers=0)
    quantize_int8(torch.fx.symbolic_trace(model), options, VariantContext(batches[0], batches, None, None, progress))
    assert progress.told == [("calibration", 1, 3), ("calibration", 2, 3), ("calibration", 3, 3)]
