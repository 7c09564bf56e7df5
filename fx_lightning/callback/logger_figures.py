"""The end of fit's figures in the Trainer's loggers, next to the training curves (rank zero, once): the fusion and
parity figures (and the served artifact's latency) as metrics for every logger; where a logger takes files, the
report too: TensorBoard gets the summary as text and the sweep's plots as figures, MLflow gets ``report.html`` and
the plots (SVG) as artifacts of the run. CSVLogger takes the metrics."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import lightning.pytorch as pl

from fx_lightning.callback.namespaces import lightning_classes
from fx_lightning.export.manifest import Manifest
from fx_lightning.export.write.report_html import REPORT_NAME, Series, sweep_series, sweep_svg
from fx_lightning.pipeline import Outcome, summary_text

__all__ = ["log_outcome", "outcome_metrics", "plots", "ARTIFACT_PATH"]

ARTIFACT_PATH = "fx_fuse"  # the folder of the run's artifacts, and the TensorBoard tags' prefix
METRIC_PREFIX = "fx_fuse/"


def outcome_metrics(outcome: Outcome) -> Dict[str, float]:
    """The ``fx_fuse/*`` figures of an outcome: the fuse report's, parity's and, when an artifact was selected,
    its median latency and the artifacts exported."""
    report = outcome.result.report
    out: Dict[str, float] = {
        "batchnorms_before": float(report.before.batchnorms),
        "batchnorms_after": float(report.after.batchnorms),
        "batchnorms_folded": float(report.batchnorms_folded),
        "nodes_before": float(report.before.nodes),
        "nodes_after": float(report.after.nodes),
        "parameters_before": float(report.before.parameters),
        "parameters_after": float(report.after.parameters),
        "fuse_seconds": float(report.seconds),
        "exported": 1.0 if outcome.export_dir is not None else 0.0,
    }
    if outcome.parity is not None:
        out["parity_passed"] = 1.0 if outcome.parity.passed else 0.0
        out["parity_batches"] = float(outcome.parity.batches)
        for key, value in outcome.parity.metrics.items():
            out[f"parity_{key}"] = float(value)
    manifest = outcome.manifest
    if manifest is not None:
        out["artifacts"] = float(len(manifest.formats))
        if manifest.selected is not None:
            out["selected_median_ms"] = float(manifest.selected.median_ms)
    return {METRIC_PREFIX + k: v for k, v in out.items()}


# What each of the sweep's charts plots against the batch size.
_Y_LABELS = {"latency": "ms per call", "throughput": "samples/s"}


def _charts(manifest: Manifest) -> Iterator[Tuple[str, str, List[Series]]]:
    """The sweep's charts as (kind, traffic, series): per traffic, latency then throughput."""
    sweeps = manifest.bench.sweeps if manifest.bench else []
    for traffic in dict.fromkeys(w.traffic for w in sweeps):
        for kind, series in sweep_series(sweeps, traffic).items():
            yield kind, traffic, series


def plots(manifest: Manifest) -> List[Tuple[str, str]]:
    """The sweep's plots as (file name, standalone SVG), per traffic: latency and throughput against batch size."""
    return [(f"sweep_{kind}_{traffic}.svg", sweep_svg(f"{kind} ({traffic})", "batch size", _Y_LABELS[kind], series,
                                                       f"{kind}.{traffic}"))
            for kind, traffic, series in _charts(manifest)]


def log_outcome(trainer: "pl.Trainer", outcome: Outcome) -> None:
    """Every logger: the metrics; TensorBoard and MLflow: the report and plots too. A logger that refuses a file
    costs a warning, never the fit (the export stands)."""
    metrics = outcome_metrics(outcome)
    for lg in trainer.loggers:  # not pl_module.log(): refused in on_fit_end
        lg.log_metrics(metrics, step=trainer.global_step)
        lg.save()
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
    out = []
    for kind, traffic, series in _charts(manifest):
        figure, axes = plt.subplots(figsize=(6, 3.5))
        for s in series:
            axes.plot([p[0] for p in s.points], [p[1] for p in s.points], "--" if s.dashed else "-", marker="o",
                      label=s.name)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("batch size")
        axes.set_ylabel(_Y_LABELS[kind])
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
