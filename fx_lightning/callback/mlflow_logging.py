"""The export logged into the Trainer's ``MLFlowLogger`` run (``export.mlflow``): which run that is, what the
preflight proves about it before training, and the logging at the end of fit (rank zero logs once; every rank gets
the same result through the strategy's collectives). The logging itself is :func:`fx_lightning.tracking.log_export`.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, List, Optional, Tuple

import lightning.pytorch as pl

from fx_lightning.callback.namespaces import lightning_classes
from fx_lightning.callback.ranks import StrategyCollectives
from fx_lightning.config import FuseConfig
from fx_lightning.errors import ConfigError, ExportError, FXLightningError
from fx_lightning.common.notes import NoteKind
from fx_lightning.pipeline import Failure, Outcome, Step, exchange_failure
from fx_lightning.tracking import LoggedExport, MlflowRun, check_destination, log_export

__all__ = ["MLFLOW_LOGGED", "mlflow_loggers", "mlflow_run", "mlflow_wanted", "check_mlflow", "log_to_mlflow", "log_again_command"]

MLFLOW_LOGGED = NoteKind("mlflow_logged", "logged to MLflow as {run_uri} ({model_uri}, serving {served}){registered}")


def mlflow_loggers(trainer: "pl.Trainer") -> List[Any]:
    """The Trainer's MLFlowLoggers, of either Lightning namespace."""
    classes = lightning_classes("loggers.MLFlowLogger")
    return [lg for lg in trainer.loggers if classes and isinstance(lg, classes)]


def mlflow_wanted(trainer: "pl.Trainer", config: FuseConfig) -> bool:
    """Whether the end of fit logs into MLflow (or must refuse): an export, and ``enabled: true`` or an MLFlowLogger."""
    enabled = config.export.mlflow.enabled
    return config.export.enabled and (enabled is True or (enabled is None and bool(mlflow_loggers(trainer))))


def mlflow_run(trainer: "pl.Trainer", config: FuseConfig) -> Optional[MlflowRun]:
    """The :class:`~fx_lightning.tracking.MlflowRun` of the first MLFlowLogger (its tracking URI and run), or None when
    nothing is to be logged (:func:`mlflow_wanted`). Raises ConfigError for ``enabled: true`` without one. The run
    exists on rank zero alone: call it there (the ConfigError needs no logger and comes on any rank)."""
    if not mlflow_wanted(trainer, config):
        return None
    loggers = mlflow_loggers(trainer)
    if not loggers:
        raise ConfigError("export.mlflow.enabled: true, but the Trainer has no MLFlowLogger; add one "
                          "(Trainer(logger=MLFlowLogger(tracking_uri=...))), or set export.mlflow.enabled: null "
                          "(log when one is attached) or false.")
    logger = loggers[0]
    client = logger.experiment  # creates the logger's experiment and run when they do not exist yet
    return MlflowRun(tracking_uri=str(client.tracking_uri), run_id=logger.run_id,
                     registry_uri=config.export.mlflow.registry_uri)


def check_mlflow(trainer: "pl.Trainer", config: FuseConfig) -> None:
    """The preflight's check when :func:`mlflow_wanted`: an MLFlowLogger is there (every rank), and on rank zero MLflow
    imports, the tracking server answers for the logger's run and the registry answers when a model is to be
    registered."""
    if not mlflow_loggers(trainer):
        mlflow_run(trainer, config)  # enabled: true without one: the ConfigError, on every rank
        return
    run = mlflow_run(trainer, config) if trainer.is_global_zero else None
    if run is not None:
        check_destination(run, config.export.mlflow)


def log_to_mlflow(trainer: "pl.Trainer", config: FuseConfig, outcome: Outcome
                  ) -> Tuple[Optional[LoggedExport], Optional[Failure]]:
    """Log the export the outcome wrote into the MLFlowLogger's run (rank zero, once): the
    :class:`~fx_lightning.tracking.LoggedExport` on every rank (and a note in the outcome), or the failure every rank
    gets. A collective: every rank calls it. A failure leaves the export directory and the checkpoints as they are,
    and says so."""
    assert outcome.export_dir is not None
    export_dir, logged, error = outcome.export_dir, None, None
    run: Optional[MlflowRun] = None
    if trainer.is_global_zero:
        try:
            run = mlflow_run(trainer, config)
            if run is not None:
                logged = log_export(export_dir, run, config.export.mlflow)
        except Exception as exc:  # noqa: BLE001 - exchanged with the other ranks, raised (or warned) by the caller
            error = _explained(exc, export_dir, run, config)
    collectives = StrategyCollectives(trainer)
    failure = exchange_failure(collectives, error)
    logged = collectives.broadcast(logged, src=0)
    if logged is not None:
        registered = f"; registered as {logged.registered.uri}" if logged.registered is not None else ""
        outcome.notes.append(MLFLOW_LOGGED(run_uri=logged.run_uri, model_uri=logged.model_uri, served=logged.served,
                                           registered=registered))
    return logged, failure


def _explained(exc: Exception, export_dir: Path, run: Optional[MlflowRun], config: FuseConfig) -> FXLightningError:
    """``exc`` as our error, saying that the export stands and the command that logs it again."""
    error = exc if isinstance(exc, FXLightningError) else ExportError(f"{type(exc).__name__}: {exc}")
    if error is not exc:
        error.__cause__ = exc
    error.step = error.step or Step.mlflow.value
    return error.add_context(after=[f"The export in {export_dir} is complete and was not changed; log it again "
                                    f"with: {log_again_command(export_dir, run, config)}"])


def log_again_command(export_dir: Path, run: Optional[MlflowRun], config: FuseConfig) -> str:
    """The ``fx-lightning mlflow`` command that logs ``export_dir`` as the callback would have, shell-quoted."""
    options = config.export.mlflow
    words = ["fx-lightning", "mlflow", str(export_dir), "--tracking-uri",
             run.tracking_uri if run is not None else "URI"]
    flags = [("--run-id", run.run_id if run is not None else None), ("--artifact-path", options.artifact_path),
             ("--format", options.format), ("--register", options.register_as), ("--alias", options.alias),
             ("--registry-uri", options.registry_uri)]
    words += [w for flag, value in flags if value for w in (flag, value)]
    return " ".join(w if w in ("URI",) else shlex.quote(w) for w in words)
