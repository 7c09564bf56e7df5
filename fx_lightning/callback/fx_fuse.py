"""``FXFuseCallback``: Lightning glue that runs the fusion pipeline when ``fit`` ends.

Hooks of a few lines over free functions: :mod:`.preflight` (the pipeline rehearsed before the first training
step), :mod:`.ranks` (the end of fit on every rank, through the strategy's collectives) and :mod:`.trainer_data`
(loaders, weights, checkpoints, loggers). It owns no fusion logic: both run the one driver,
:func:`fx_lightning.pipeline.run_pipeline`. The LightningModule is never changed, and no checkpoint is touched.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from fx_lightning.callback.mlflow_logging import log_to_mlflow
from fx_lightning.callback.observe import CallRecorder, step_loader
from fx_lightning.callback.logger_figures import log_outcome
from fx_lightning.callback.preflight import FIXES, check_settings, rehearsal_due, rehearse
from fx_lightning.callback.progress_bar import progress_for
from fx_lightning.callback.ranks import fuse_after_fit, unsupported_strategy
from fx_lightning.callback.trainer_data import checkpoint_message
from fx_lightning.config import ExportConfig, FuseConfig, OnError, ParityConfig, PassesConfig, TraceConfig, load_config
from fx_lightning.pipeline.engine import FuseResult
from fx_lightning.errors import ConfigError, FXLightningError
from fx_lightning.parity.report import ParityReport
from fx_lightning.pipeline import Failure, Outcome, summary_text
from fx_lightning.common.provenance import PreflightReport
from fx_lightning.tracking import LoggedExport

__all__ = ["FXFuseCallback"]


class FXFuseCallback(Callback):
    """Fuse (fold BatchNorms), verify and export the model when ``trainer.fit`` ends.

    The keyword arguments are the top-level keys of :class:`~fx_lightning.config.FuseConfig`, where each is
    documented (the signature lists them for LightningCLI and Hydra; a test keeps the two equal); each nested one
    takes a dict, a DictConfig or the dataclass. Everything is validated here, so a typo fails before training.

    Example::

        trainer = L.Trainer(max_epochs=3, callbacks=[FXFuseCallback()])
        trainer.fit(model, datamodule)
        cb = trainer.callbacks[0]
        cb.parity_report.passed, cb.export_dir   # fused model in <log_dir>/fx_fused

        FXFuseCallback(weights="best", parity={"max_batches": 16, "rtol": 1e-5},
                       export={"formats": ["graph_module"]}, on_error="warn")

    After fit: ``result`` (:class:`~fx_lightning.pipeline.engine.FuseResult`), ``parity_report``
    (:class:`~fx_lightning.parity.ParityReport`), ``export_dir`` (Path or None), ``mlflow``
    (:class:`~fx_lightning.tracking.LoggedExport` when it was logged into the Trainer's MLFlowLogger run),
    ``outcome`` (everything the pipeline did), ``summary`` (str); before it, ``preflight`` (what was proven).
    """

    def __init__(
        self,
        target: Optional[str] = None,
        weights: str = "last",
        trace: Optional[Union[Dict[str, Any], TraceConfig]] = None,
        passes: Optional[Union[Dict[str, Any], PassesConfig]] = None,
        parity: Optional[Union[Dict[str, Any], ParityConfig]] = None,
        export: Optional[Union[Dict[str, Any], ExportConfig]] = None,
        on_error: str = "raise",
        preflight: str = "full",
        device: str = "auto",
    ) -> None:
        super().__init__()
        self.config: FuseConfig = load_config(
            target=target, weights=weights, trace=trace, passes=passes, parity=parity, export=export,
            on_error=on_error, preflight=preflight, device=device,
        )
        self._reset()

    def _reset(self) -> None:
        self.result: Optional[FuseResult] = None
        self.parity_report: Optional[ParityReport] = None
        self.export_dir: Optional[Path] = None
        self.mlflow: Optional[LoggedExport] = None
        self.outcome: Optional[Outcome] = None
        self.summary: Optional[str] = None
        self.error: Optional[BaseException] = None
        self.skipped: Optional[str] = None
        self.preflight: Optional[PreflightReport] = None
        self._raised: Optional[BaseException] = None
        self._recorder: Optional[CallRecorder] = None
        self._rehearsed = False
        self._origin: Optional["FXFuseCallback"] = getattr(self, "_origin", None)

    # ------------------------------------------------------------------------------ before training

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        unsupported = unsupported_strategy(trainer.strategy)
        if unsupported is not None:
            error = ConfigError(
                f"FXFuseCallback cannot run with this strategy: {unsupported}. Stopping before the first training "
                "step. Train with strategy='ddp' (or on one device), or remove FXFuseCallback and fuse the "
                "consolidated checkpoint afterwards (fx-lightning fuse CKPT --model ...).")
            self._refuse_before_fit(Failure.of(error), f"unsupported strategy: {unsupported}")

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # After Lightning's setup (configure_model run, the module on its device and in the precision it trains
        # in), before the sanity check and the first step: what needs no model run is checked now; the rest once
        # the target's calls are observed, before the first optimizer step.
        if self.skipped is not None:
            return
        failure = check_settings(trainer, pl_module, self.config)
        if failure is not None:
            self._refuse_preflight(failure, "before the first training step")
            return
        self._recorder = CallRecorder(pl_module, self.config)

    def on_validation_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._recorder is not None and dataloader_idx == 0:
            self._recorder.begin("validation", batch, batch_idx, step_loader(trainer, "validation"))

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self._recorder is None:
            return
        if not self._rehearsed and rehearsal_due(trainer, self._recorder):
            self._rehearse(trainer, pl_module)
        self._recorder.begin("training", batch, batch_idx, step_loader(trainer, "training"))

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any,
                           **kwargs: Any) -> None:
        if self._recorder is not None:
            self._recorder.end()

    on_validation_batch_end = on_train_batch_end

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        if self._recorder is not None and not self._rehearsed:
            self._rehearse(trainer, pl_module)

    def _rehearse(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        assert self._recorder is not None
        self._rehearsed = True
        self.preflight, failure = rehearse(trainer, pl_module, self.config, self._recorder,
                                           progress_for(trainer, "preflight"))
        if self.preflight is not None and (self.preflight.unproven or self.preflight.predicted):
            rank_zero_warn(f"FXFuseCallback: {self.preflight}. Training goes on; the end of fit runs them on the "
                           "trained model.")
        if failure is not None:
            self._refuse_preflight(failure, "before the first optimizer step")

    def _refuse_preflight(self, failure: Failure, when: str) -> None:
        stage = failure.error.step or "preflight"
        # The error's own advice when it carries one ("": none would work), else its stage's.
        fix = failure.error.fix if failure.error.fix is not None else FIXES.get(stage, "see the error above")
        failure.error.add_context(
            headline=f"FXFuseCallback: the end-of-fit work would fail{failure.where}, so it is stopped {when} "
                     f"({failure.type_name or type(failure.error).__name__}).\npreflight failed at stage '{stage}' "
                     f"({when}; nothing was trained):",
            after=[f"  Fix: {fix}."] if fix else [])
        self._refuse_before_fit(failure, f"preflight failed: {failure.error}")

    def _refuse_before_fit(self, failure: Failure, skipped: str) -> None:
        """Raise the failure's error before training (on_error=raise), or warn and let training go on unfused."""
        self._stop_recording()
        error = failure.error
        self._raise_if_asked(failure)
        self.skipped = skipped
        self.error = error
        rank_zero_warn(f"{error} Training goes on (on_error=warn) and nothing will be fused.")

    # ------------------------------------------------------------------------------- after training

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        skip = self.skipped or ("fast_dev_run" if trainer.fast_dev_run else None) or (
            "training was interrupted" if trainer.interrupted else None)
        observed, recorder = None, self._stop_recording()
        if recorder is not None and skip is None:
            try:
                observed = recorder.observations()
            except FXLightningError as exc:  # a target it cannot pick (the preflight said so before training)
                self._fail(trainer, Failure.of(exc))
                return
        outcome = fuse_after_fit(trainer, pl_module, self.config, skip, self.preflight, observed,
                                 progress_for(trainer, "end of fit"))
        if outcome.export_dir is not None and outcome.failure is None:
            self.mlflow, outcome.failure = log_to_mlflow(trainer, self.config, outcome)
        if outcome.result is not None:
            self._record(trainer, outcome)
        if outcome.skipped is not None:
            self.skipped = self.skipped or outcome.skipped
            rank_zero_info(f"FXFuseCallback: skipped ({outcome.skipped}).")
        try:
            if outcome.failure is not None:
                self._fail(trainer, outcome.failure)
        finally:  # this copy's results on the object it was copied from (see ``__deepcopy__``)
            if self._origin is not None:
                for key in _RESULTS:
                    setattr(self._origin, key, getattr(self, key))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FXFuseCallback":
        """A copy (a library that deep-copies the trainer's callbacks runs the copy) whose results reach this
        object too, so the callback the user holds is never left empty."""
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        for key, value in self.__dict__.items():
            setattr(twin, key, value if key == "_origin" else copy.deepcopy(value, memo))
        twin._origin = self._origin if self._origin is not None else self
        return twin

    def _record(self, trainer: "pl.Trainer", outcome: Outcome) -> None:
        """Keep what the pipeline did, log its figures once and print its summary."""
        self.outcome, self.result, self.parity_report, self.export_dir = (
            outcome, outcome.result, outcome.parity, outcome.export_dir)
        banner = "=" * 30 + " FXFuseCallback " + "=" * 30
        preflight = [str(self.preflight)] if self.preflight is not None else []
        self.summary = f"{banner}\n{summary_text(outcome, preflight)}\n{'=' * len(banner)}"
        if trainer.is_global_zero:  # the ranks share one outcome: log it once
            log_outcome(trainer, outcome)
        rank_zero_info(self.summary)

    def _fail(self, trainer: "pl.Trainer", failure: Failure) -> None:
        """Raise (on_error=raise) or warn (on_error=warn) with the cause and where the checkpoints are."""
        fix = failure.error.fix  # the error's own advice (a stage's is worded for the preflight)
        error = failure.error.add_context(
            headline=f"FXFuseCallback failed after training{failure.where} "
                     f"({failure.type_name or type(failure.error).__name__}):",
            after=([f"  Fix: {fix}."] if fix else []) + [checkpoint_message(trainer)])
        self.error = error
        self._raise_if_asked(failure)
        # Every rank warns (not rank zero only): each rank's log must say why nothing was exported.
        warnings.warn(f"{error}\n(on_error=warn: fit returns normally)", UserWarning, stacklevel=2)

    def _raise_if_asked(self, failure: Failure) -> None:
        """on_error=raise: raise the failure's error keeping its cause (one rebuilt from another rank's message has
        none here)."""
        if self.config.on_error is OnError["raise"]:
            self._raised = failure.error
            if failure.remote:
                raise failure.error from None
            raise failure.error

    def _stop_recording(self) -> Optional[CallRecorder]:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.end()
        return recorder

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._stop_recording()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._stop_recording()
        if exception is self._raised:
            return  # our own error, already explained
        if trainer.state.fn != TrainerFn.FITTING or self.outcome is not None:
            # trainer.test/validate/predict after a completed fit (or a later callback's on_fit_end): what was
            # fused and exported at the end of fit stands.
            if self.export_dir is not None:
                rank_zero_info(f"FXFuseCallback: {type(exception).__name__} raised after fit; the fused model "
                               f"exported at the end of fit stands: {self.export_dir}")
            return
        # Ctrl-C, a crash in training or another callback: on_fit_end will not run, and nothing is touched.
        self.skipped = f"fit did not finish ({type(exception).__name__})"
        rank_zero_info(
            f"FXFuseCallback: fit did not finish ({type(exception).__name__}), so nothing was fused or exported; "
            "the LightningModule and the checkpoints are untouched."
        )


# What a run leaves on the callback for the user (copied to the callback a copy was made from).
_RESULTS = ("result", "parity_report", "export_dir", "mlflow", "outcome", "summary", "error", "skipped", "preflight")
