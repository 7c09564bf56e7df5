"""The end of fit's figures in the Trainer's loggers, next to the training curves (rank zero, once): the fusion and
parity figures (and the served artifact's latency) as metrics for every logger; where a logger takes files, the
report too: TensorBoard gets the summary as text and the sweep's plots as figures, MLflow gets ``report.html`` and
the plots (SVG) as artifacts of the run. CSVLogger takes the metrics."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import lightning.pytorch as pl

from fx_lightning.callback.namespaces import lightning_classes
from fx_lightning.callback.trainer_data import METRIC_PREFIX, fuse_metrics, log_metrics
from fx_lightning.export.manifest import Manifest
from fx_lightning.export.write.report_html import REPORT_NAME, sweep_series, sweep_svg
from fx_lightning.pipeline import Outcome, summary_text

__all__ = ["log_outcome", "outcome_metrics", "plots", "ARTIFACT_PATH"]

ARTIFACT_PATH = "fx_fuse"  # the folder of the run's artifacts, and the TensorBoard tags' prefix


def outcome_metrics(outcome: Outcome) -> Dict[str, float]:
    """:func:`fuse_metrics` and, when an artifact was selected, its median latency and the artifacts exported."""
    out = fuse_metrics(outcome)
    manifest = outcome.manifest
    if manifest is not None:
        out[METRIC_PREFIX + "artifacts"] = float(len(manifest.formats))
        if manifest.selected is not None:
            out[METRIC_PREFIX + "selected_median_ms"] = float(manifest.selected.median_ms)
    return out


def plots(manifest: Manifest) -> List[Tuple[str, str]]:
    """The sweep's plots as (file name, standalone SVG), per traffic: latency and throughput against batch size."""
    bench = manifest.bench
    out: List[Tuple[str, str]] = []
    for traffic in dict.fromkeys(w.traffic for w in (bench.sweeps if bench else [])):
        series = sweep_series(bench.sweeps, traffic) if bench else {}
        out.append((f"sweep_latency_{traffic}.svg", sweep_svg(f"latency ({traffic})", "batch size", "ms per call",
                                                              series["latency"], f"latency.{traffic}")))
        out.append((f"sweep_throughput_{traffic}.svg", sweep_svg(f"throughput ({traffic})", "batch size",
                                                                 "samples/s", series["throughput"],
                                                                 f"throughput.{traffic}")))
    return out


def log_outcome(trainer: "pl.Trainer", outcome: Outcome) -> None:
    """Every logger: the metrics; TensorBoard and MLflow: the report and plots too. A logger that refuses a file
    costs a warning, never the fit (the export stands)."""
    log_metrics(trainer, outcome_metrics(outcome))
    tensorboard, mlflow = lightning_classes("loggers.TensorBoardLogger"), lightning_classes("loggers.MLFlowLogger")
    for lg in trainer.loggers:
        try:
            if tensorboard and isinstance(lg, tensorboard):
                _tensorboard(lg, outcome, trainer.global_step)
            elif mlflow and isinstance(lg, mlflow):
                _mlflow(lg, outcome)
        except Exception as exc:  # noqa: BLE001 - a logger's failure is not the export's
            warnings.warn(f"FXFuseCallback: the report could not be logged to {type(lg).__name__}: "
                          f"{type(exc).__name__}: {exc}", UserWarning, stacklevel=2)


def _tensorboard(logger: Any, outcome: Outcome, step: int) -> None:
    writer = logger.experiment
    # Markdown keeps the summary's layout: each line as code.
    writer.add_text(f"{ARTIFACT_PATH}/summary", "    " + summary_text(outcome).replace("\n", "\n    "), step)
    manifest = outcome.manifest
    if manifest is not None and manifest.bench is not None:
        for name, figure in _figures(manifest):
            writer.add_figure(f"{ARTIFACT_PATH}/{name}", figure, step, close=True)
    writer.flush()


def _figures(manifest: Manifest) -> List[Tuple[str, Any]]:
    """The sweep's plots as matplotlib figures (what TensorBoard draws); none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    bench = manifest.bench
    out = []
    for traffic in dict.fromkeys(w.traffic for w in (bench.sweeps if bench else [])):
        for kind, series in sweep_series(bench.sweeps, traffic).items() if bench else ():
            figure, axes = plt.subplots(figsize=(6, 3.5))
            for s in series:
                axes.plot([p[0] for p in s.points], [p[1] for p in s.points], "--" if s.dashed else "-", marker="o",
                          label=s.name)
            axes.set_xscale("log", base=2)
            axes.set_xlabel("batch size")
            axes.set_ylabel("ms per call" if kind == "latency" else "samples/s")
            axes.set_title(f"{kind} ({traffic})")
            axes.legend(fontsize=7)
            figure.tight_layout()
            out.append((f"sweep_{kind}_{traffic}", figure))
    return out


def _mlflow(logger: Any, outcome: Outcome) -> None:
    client, run_id = logger.experiment, logger.run_id
    if outcome.export_dir is not None and (outcome.export_dir / REPORT_NAME).is_file():
        client.log_artifact(run_id, str(outcome.export_dir / REPORT_NAME), ARTIFACT_PATH)
    client.log_text(run_id, summary_text(outcome), f"{ARTIFACT_PATH}/summary.txt")
    if outcome.manifest is not None:
        with tempfile.TemporaryDirectory(prefix="fxl-plots-") as tmp:
            for name, svg in plots(outcome.manifest):
                (Path(tmp) / name).write_text(svg, encoding="utf-8")
            if any(Path(tmp).iterdir()):
                client.log_artifacts(run_id, tmp, f"{ARTIFACT_PATH}/plots")
