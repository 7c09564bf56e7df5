"""``FXFuseCallback``: Lightning glue that runs the fusion pipeline when ``fit`` ends.

It owns no fusion logic (that is :mod:`fx_lightning.pipeline`): it resolves and pre-checks the target
before training, then at ``on_fit_end`` picks the weights, gathers parity batches, calls the pipeline,
logs ``fx_fuse/`` metrics to every logger and prints a summary on rank zero. The LightningModule is
never changed, and no checkpoint is ever touched.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from fx_lightning.capture import capture, eval_copy
from fx_lightning.config import (
    ExportConfig,
    FuseConfig,
    ParityConfig,
    PassesConfig,
    TraceConfig,
    TraceMode,
    load_config,
)
from fx_lightning.engine import FuseResult
from fx_lightning.errors import ConfigError, FXLightningError, ParityError, TraceError
from fx_lightning.parity import ParityReport, _to_model, _device_dtype, as_args, extract_input
from fx_lightning.pipeline import Outcome, fuse_verify_export, resolve_target, target_example_inputs

__all__ = ["FXFuseCallback"]

METRIC_PREFIX = "fx_fuse/"


class FXFuseCallback(Callback):
    """Fuse (fold BatchNorms), verify and export the model when ``trainer.fit`` ends.

    Keyword arguments are the top-level keys of :class:`~fx_lightning.config.FuseConfig`; each nested
    one takes a dict, a DictConfig or the dataclass. Everything is validated here, so a typo fails
    before training starts.

    Example::

        trainer = L.Trainer(max_epochs=3, callbacks=[FXFuseCallback()])
        trainer.fit(model, datamodule)
        cb = trainer.callbacks[0]
        cb.parity_report.passed, cb.export_dir   # fused model in <log_dir>/fx_fused

        FXFuseCallback(weights="best", parity={"max_batches": 16, "rtol": 1e-5},
                       export={"formats": ["graph_module"]}, on_error="warn")

    After fit: ``result`` (:class:`~fx_lightning.engine.FuseResult`), ``parity_report``
    (:class:`~fx_lightning.parity.ParityReport`), ``export_dir`` (Path or None), ``summary`` (str).
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
    ) -> None:
        """
        Args:
            target: dotted attribute of the LightningModule to fuse; default ``backbone`` if present, else the module.
            weights: ``last`` (the module as training left it) or ``best`` (the ModelCheckpoint's best checkpoint).
            trace: capture options (``mode``: auto | fx | export, ``leaf_modules``, ``autowrap_functions``...).
            passes: one options node per built-in pass (``{fuse_conv_bn: {enabled: false}}``) and ``extra`` user passes.
            parity: ``enabled``, ``max_batches``, ``data``, ``input``, ``rtol``, ``min_cosine``, ``min_top1_agreement``,
                ``max_accuracy_drop``, ``on_failure`` (raise | warn).
            export: ``enabled``, ``dir`` (default ``<trainer.log_dir>/fx_fused``), ``formats``...
            on_error: ``raise`` (fit raises, checkpoints intact) or ``warn`` (log and let fit return).
        """
        super().__init__()
        self.config: FuseConfig = load_config(
            target=target, weights=weights, trace=trace, passes=passes, parity=parity, export=export,
            on_error=on_error,
        )
        self._reset()

    def _reset(self) -> None:
        self.result: Optional[FuseResult] = None
        self.parity_report: Optional[ParityReport] = None
        self.export_dir: Optional[Path] = None
        self.outcome: Optional[Outcome] = None
        self.summary: Optional[str] = None
        self.error: Optional[BaseException] = None
        self.skipped: Optional[str] = None
        self._preflight_pending = False
        self._raised: Optional[BaseException] = None

    @property
    def _raise_errors(self) -> bool:
        return str(self.config.on_error.value) == "raise"

    # ------------------------------------------------------------------------------ before training

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        # LightningModule.setup and configure_model run after this hook and may build the target (or the
        # default `backbone`): when the target is not there yet, check at on_fit_start instead, which is
        # still before the first training step.
        builds_later = is_overridden("configure_model", pl_module) or is_overridden("setup", pl_module)
        if builds_later:
            try:
                path, _ = resolve_target(pl_module, self.config.target)
            except ConfigError:
                path = None
            if path is None or (path == "" and self.config.target is None):
                self._preflight_pending = True
                return
        self._preflight(trainer, pl_module)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._preflight_pending:
            self._preflight_pending = False
            self._preflight(trainer, pl_module)

    def _preflight(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Resolve the target and capture a copy of it once, so that a config or tracing problem fails
        before the first training step rather than after hours of training."""
        try:
            path, target = resolve_target(pl_module, self.config.target)
            trace = self.config.trace
            fx_error: Optional[TraceError] = None
            if trace.mode is not TraceMode.export:
                try:
                    capture(target, dataclasses.replace(trace, mode=TraceMode.fx))
                    return
                except TraceError as exc:
                    if trace.mode is TraceMode.fx:
                        raise
                    fx_error = exc
            # torch.export (mode export, or auto after fx failed) needs real inputs: peek at one batch.
            inputs = self._peek_inputs(trainer, pl_module)
            if inputs is None:
                raise TraceError(
                    (f"{fx_error}\n  - " if fx_error else "")
                    + "no example input was found before training (no example_input_array and no batch could be "
                    "read from the dataloaders), so the torch.export capture could not be tried"
                )
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                work = eval_copy(pl_module)
                work_target = work.get_submodule(path) if path else work
                device, dtype = _device_dtype(work)
                args, _ = target_example_inputs(work, work_target, as_args(_to_model(inputs, device, dtype)))
                capture(work_target, trace, args, already_copied=True)
        except (ConfigError, TraceError) as exc:
            what = "is misconfigured" if isinstance(exc, ConfigError) else "cannot be captured"
            message = f"FXFuseCallback: the fusion target {what}, so it could not be fused after training; "
            if self._raise_errors:
                self._raised = type(exc)(f"{message}stopping before the first training step.\n{exc}")
                raise self._raised from exc
            self.skipped = f"pre-training check failed: {exc}"
            self.error = exc
            rank_zero_warn(f"{message}training goes on (on_error=warn) and nothing will be fused.\n{exc}")

    def _peek_inputs(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Any:
        """Whole-model inputs for a capture check: example_input_array, else one batch of val/train data."""
        example = getattr(pl_module, "example_input_array", None)
        if example is not None and not isinstance(example, dict):  # a dict means keyword arguments
            return example
        loops = (trainer.fit_loop.epoch_loop.val_loop, trainer.fit_loop)
        for loop in loops:
            source = getattr(loop, "_data_source", None)  # Lightning internals: guarded
            try:
                if source is None or not source.is_defined():
                    continue
                loader = _first_loader(source.dataloader())
                batch = next(iter(loader)) if loader is not None else None
            except Exception:  # noqa: BLE001 - a loader we cannot read here is read again after fit
                continue
            if batch is not None:
                return extract_input(batch, self.config.parity.input)
        return None

    # ------------------------------------------------------------------------------- after training

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        reason = self._skip_reason(trainer)
        # log_dir is a collective under DDP: every rank must ask, even those that then do nothing.
        log_dir = trainer.log_dir
        if reason is not None:
            self.skipped = self.skipped or reason
            rank_zero_info(f"FXFuseCallback: skipped ({reason}).")
            return
        if not trainer.is_global_zero:
            return
        try:
            self._fuse(trainer, pl_module, log_dir)
        except Exception as exc:  # noqa: BLE001 - every failure ends in _fail's message about checkpoints
            self._fail(trainer, exc)

    def _skip_reason(self, trainer: "pl.Trainer") -> Optional[str]:
        if self.skipped is not None:
            return self.skipped
        if trainer.fast_dev_run:
            return "fast_dev_run"
        if trainer.interrupted:
            return "training was interrupted"
        return None

    def _fuse(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", log_dir: Optional[str]) -> None:
        cfg = self.config
        model, weights_note = self._pick_weights(trainer, pl_module)
        batches, source, notes = self._parity_data(trainer, pl_module)
        export_dir = Path(cfg.export.dir) if cfg.export.dir else Path(log_dir or trainer.default_root_dir) / "fx_fused"
        try:
            outcome = fuse_verify_export(
                model,
                cfg,
                batches=batches,
                example_inputs=getattr(pl_module, "example_input_array", None),
                export_dir=export_dir,
                source=source,
                notes=[f"weights: {weights_note}", *notes],
                protected_paths=_checkpoint_files(trainer),
                extra={
                    "weights": weights_note,
                    "epoch": trainer.current_epoch,
                    "global_step": trainer.global_step,
                    "lightning_module": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
                },
            )
        except ParityError as exc:
            failed = getattr(exc, "outcome", None)
            if failed is not None:
                self._record(trainer, failed)
            raise
        self._record(trainer, outcome)

    def _record(self, trainer: "pl.Trainer", outcome: Outcome) -> None:
        self.outcome = outcome
        self.result = outcome.result
        self.parity_report = outcome.parity
        self.export_dir = outcome.export_dir
        self.summary = _summary(outcome)
        _log_metrics(trainer, _metrics(outcome))
        rank_zero_info(self.summary)

    def _pick_weights(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Tuple[Any, str]:
        if self.config.weights.value == "last":
            return pl_module, "last (the LightningModule as training left it)"
        ckpt_cb = trainer.checkpoint_callback
        if not isinstance(ckpt_cb, ModelCheckpoint):
            raise ConfigError(
                "weights: 'best' needs a ModelCheckpoint callback in the Trainer, and there is none "
                "(add ModelCheckpoint(monitor=...) or use weights: last)."
            )
        path = ckpt_cb.best_model_path
        if not path:
            raise ConfigError(
                "weights: 'best', but the ModelCheckpoint saved no checkpoint (best_model_path is empty); "
                "use weights: last or check the ModelCheckpoint's monitor/save settings."
            )
        from lightning.fabric.utilities.cloud_io import _load

        device, _ = _device_dtype(pl_module)
        # Our own trainer wrote this checkpoint during this fit, so full unpickling is trusted here.
        checkpoint = _load(path, map_location=device or "cpu", weights_only=False)
        # A copy takes the best weights: the LightningModule keeps its last-epoch weights.
        best = copy.deepcopy(pl_module)
        best.load_state_dict(checkpoint["state_dict"], strict=True)
        score = ckpt_cb.best_model_score
        score_text = f", {ckpt_cb.monitor}={float(score):.6g}" if score is not None and ckpt_cb.monitor else ""
        return best, f"best checkpoint {path}{score_text}"

    def _parity_data(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule"
    ) -> Tuple[List[Any], str, List[str]]:
        """Up to parity.max_batches batches: validation, else training data; example_input_array is the
        pipeline's own fallback."""
        cfg = self.config.parity
        wanted = cfg.data.value
        n = cfg.max_batches if cfg.enabled else 1
        notes: List[str] = []
        order = {"auto": ("val", "train"), "val": ("val",), "train": ("train",), "example": ()}[wanted]
        for name in order:
            loader = _first_loader(trainer.val_dataloaders if name == "val" else trainer.train_dataloader)
            if loader is None:
                loop = trainer.fit_loop.epoch_loop.val_loop if name == "val" else trainer.fit_loop
                loader = _loader_from_source(loop)
            batches = list(itertools.islice(iter(loader), n)) if loader is not None else []
            if batches:
                if name == "train" and wanted == "auto":
                    notes.append("no validation data: parity used training batches")
                return batches, name, notes
        if wanted != "example":
            notes.append(f"no {' or '.join(order)} data: parity used the LightningModule's example_input_array")
        return [], "example", notes

    # ----------------------------------------------------------------------------------------- errors

    def _fail(self, trainer: "pl.Trainer", exc: Exception) -> None:
        self.error = exc
        message = (
            f"FXFuseCallback failed after training ({type(exc).__name__}): {exc}\n"
            f"{_checkpoint_message(trainer)}"
        )
        if self._raise_errors:
            new: Exception = type(exc)(message) if isinstance(exc, FXLightningError) else FXLightningError(message)
            for attr in ("report", "outcome"):
                if hasattr(exc, attr):
                    setattr(new, attr, getattr(exc, attr))
            self._raised = new
            raise new from exc
        rank_zero_warn(message + "\n(on_error=warn: fit returns normally)")

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if exception is self._raised:
            return  # our own error, already explained
        self.skipped = f"fit did not finish ({type(exception).__name__})"
        rank_zero_info("FXFuseCallback: fit did not finish, so nothing was fused.")


# ------------------------------------------------------------------------------------------ helpers


def _first_loader(loaders: Any) -> Any:
    if loaders is None:
        return None
    if isinstance(loaders, dict):
        return next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


def _loader_from_source(loop: Any) -> Any:
    source = getattr(loop, "_data_source", None)
    try:
        if source is not None and source.is_defined():
            return _first_loader(source.dataloader())
    except Exception:  # noqa: BLE001 - Lightning internals; no loader means "try the next source"
        return None
    return None


def _checkpoint_callbacks(trainer: "pl.Trainer") -> List[ModelCheckpoint]:
    return [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]


def _checkpoint_files(trainer: "pl.Trainer") -> List[Path]:
    files: List[Path] = []
    for cb in _checkpoint_callbacks(trainer):
        for p in (cb.best_model_path, cb.last_model_path, *cb.best_k_models):
            if p:
                files.append(Path(p))
    return files


def _checkpoint_message(trainer: "pl.Trainer") -> str:
    callbacks = _checkpoint_callbacks(trainer)
    if not callbacks:
        return (
            "No ModelCheckpoint was configured, so no checkpoint was written; the trained weights are in the "
            "LightningModule, which FXFuseCallback never changes."
        )
    lines = ["Your trained checkpoints are intact (FXFuseCallback only reads them):"]
    for cb in callbacks:
        if cb.dirpath:
            lines.append(f"  directory: {cb.dirpath}")
        for label, p in (("best", cb.best_model_path), ("last", cb.last_model_path)):
            if p:
                lines.append(f"  {label}: {p}{'' if Path(p).exists() else ' (not on this filesystem)'}")
    return "\n".join(lines)


def _metrics(outcome: Outcome) -> Dict[str, float]:
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
    return {METRIC_PREFIX + k: v for k, v in out.items()}


def _log_metrics(trainer: "pl.Trainer", metrics: Dict[str, float]) -> None:
    # self.log() is refused in on_fit_end: write to the loggers directly.
    for lg in trainer.loggers:
        lg.log_metrics(metrics, step=trainer.global_step)
        lg.save()


def _summary(outcome: Outcome) -> str:
    report = outcome.result.report
    lines = [
        "=" * 30 + " FXFuseCallback " + "=" * 30,
        f"target: {outcome.target or '<the whole LightningModule>'}",
        str(report),
        f"BatchNorms folded: {report.batchnorms_folded}, left: {report.after.batchnorms}",
    ]
    if outcome.parity is not None:
        lines.append(str(outcome.parity))
    for note in outcome.notes:
        lines.append(f"note: {note}")
    if outcome.export_dir is not None:
        lines.append(f"fused model exported to: {outcome.export_dir}")
    else:
        lines.append("fused model not exported")
    lines.append("=" * 76)
    return "\n".join(lines)

