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
import platform
import warnings
from dataclasses import dataclass
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
from fx_lightning import errors as _errors
from fx_lightning.engine import FuseResult
from fx_lightning.errors import ConfigError, FXLightningError, TraceError
from fx_lightning.parity import (
    ParityReport,
    ParityState,
    _device_dtype,
    _to_model,
    as_args,
    extract_input,
    merge_parity_states,
)
from fx_lightning.pipeline import (
    Measured,
    Outcome,
    export_outcome,
    fuse_and_measure,
    judge,
    parity_verdict,
    resolve_target,
    target_example_inputs,
)

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
        self._weights_note = ""
        self._local_batches = 0

    @property
    def _raise_errors(self) -> bool:
        return str(self.config.on_error.value) == "raise"

    # ------------------------------------------------------------------------------ before training

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        unsupported = _unsupported_strategy(trainer.strategy)
        if unsupported is not None:
            message = f"FXFuseCallback cannot run with this strategy: {unsupported}. "
            advice = ("Train with strategy='ddp' (or on one device), or remove FXFuseCallback and fuse the "
                      "consolidated checkpoint afterwards (fx-lightning fuse CKPT --model ...).")
            if self._raise_errors:
                self._raised = ConfigError(f"{message}Stopping before the first training step. {advice}")
                raise self._raised
            self.skipped = f"unsupported strategy: {unsupported}"
            self.error = ConfigError(message + advice)
            rank_zero_warn(f"{message}Training goes on (on_error=warn) and nothing will be fused. {advice}")
            return
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
    #
    # Under DDP every rank runs on_fit_end, and every rank makes the same collective calls in the same order
    # whatever happens to it locally, so that no rank can wait forever for one that took another path:
    #
    #   1. trainer.log_dir                   (Lightning broadcasts it)
    #   2. rank zero's buffers               (broadcast; weights: last only: BatchNorm statistics can differ)
    #   -- local: pick the weights, fuse, measure parity on this rank's share of the data (errors are caught)
    #   3. exchange                          (all_gather: skip reason, error or parity state of every rank)
    #   -- any error: every rank raises (or warns) naming the rank and the cause; any skip: every rank skips
    #   -- rank zero merges the parity states and decides
    #   4. verdict                           (broadcast from rank zero: report and notes, or rank zero's error)
    #   -- parity failed: every rank raises or warns alike, nothing is written
    #   -- rank zero exports
    #   5. export result                     (broadcast from rank zero; the barrier: no rank returns before the
    #                                         export is complete or has failed)
    #
    # Only rank zero can fail between 3 and 5, and its failures travel in the broadcasts; in one process these
    # steps cost nothing. The waits are bounded by the strategy's process-group timeout (DDPStrategy(timeout=)).

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        ranks = _Ranks(trainer)
        log_dir = trainer.log_dir  # 1. a collective under DDP: every rank asks, even those that then skip
        reason = self._skip_reason(trainer)
        reference_buffers = self._rank_zero_buffers(ranks, pl_module)  # 2.
        measured: Optional[Measured] = None
        local_error: Optional[Exception] = None
        buffers_differ = False
        if reason is None:
            try:
                measured, buffers_differ = self._measure(trainer, pl_module, reference_buffers)
            except Exception as exc:  # noqa: BLE001 - carried to every rank by the exchange, raised there
                local_error = exc
        mine = _RankReport(
            rank=ranks.rank,
            skip=reason,
            error=_ErrorInfo.of(ranks.rank, local_error) if local_error is not None else None,
            state=measured.parity_state if measured is not None else None,
            buffers_differ=buffers_differ,
            batches=self._local_batches,
        )
        everyone: List[_RankReport] = ranks.exchange(mine)  # 3.
        failed = [r.error for r in everyone if r.error is not None]
        if failed:
            self._fail_everywhere(trainer, ranks, failed, local_error)
            return
        skipped = next((r.skip for r in everyone if r.skip is not None), None)
        if skipped is not None:
            self.skipped = self.skipped or skipped
            rank_zero_info(f"FXFuseCallback: skipped ({skipped}).")
            return
        assert measured is not None  # no rank skipped or failed, so this one measured

        verdict: Optional[_Verdict] = None
        decide_error: Optional[Exception] = None
        if ranks.rank == 0:
            verdict, decide_error = self._decide(ranks, measured, everyone)
        verdict = ranks.broadcast(verdict)  # 4.
        assert verdict is not None
        if verdict.error is not None:
            self._fail_everywhere(trainer, ranks, [verdict.error], decide_error)
            return
        outcome = Outcome(measured.result, verdict.parity, None, measured.target, measured.fused_model,
                          list(verdict.notes))
        # The same report on every rank, so the same decision (and the same warning) on every rank.
        parity_error = parity_verdict(outcome, self.config)
        if parity_error is not None or (outcome.parity is not None and not outcome.parity.passed):
            self._record(trainer, outcome)
            if parity_error is not None:
                self._fail(trainer, parity_error)
            return

        exported: Optional[_Exported] = None
        export_error: Optional[Exception] = None
        if ranks.rank == 0:
            exported, export_error = self._export(trainer, pl_module, outcome, measured, log_dir)
        exported = ranks.broadcast(exported)  # 5. the barrier
        assert exported is not None
        outcome.export_dir = Path(exported.export_dir) if exported.export_dir is not None else None
        outcome.notes = list(exported.notes)
        self._record(trainer, outcome)
        if exported.error is not None:
            self._fail_everywhere(trainer, ranks, [exported.error], export_error)

    def _skip_reason(self, trainer: "pl.Trainer") -> Optional[str]:
        if self.skipped is not None:
            return self.skipped
        if trainer.fast_dev_run:
            return "fast_dev_run"
        if trainer.interrupted:
            return "training was interrupted"
        return None

    def _rank_zero_buffers(self, ranks: "_Ranks", pl_module: "pl.LightningModule") -> Optional[Dict[str, torch.Tensor]]:
        """Rank zero's buffers, on every rank (step 2). DDP keeps parameters equal on every rank, but BatchNorm
        running statistics are updated by each rank's own last training batches (without sync_batchnorm and
        with no validation after them): every rank must fuse the weights that rank zero exports."""
        if not ranks.distributed or self.config.weights.value != "last":
            return None  # weights: best is read from one checkpoint file by every rank
        payload: Optional[Dict[str, torch.Tensor]] = None
        if ranks.rank == 0:
            try:
                payload = {name: b.detach().cpu() for name, b in pl_module.named_buffers()}
            except Exception:  # noqa: BLE001 - rank zero must still take part; ranks then keep their own
                payload = None
        return ranks.broadcast(payload)

    def _measure(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        reference_buffers: Optional[Dict[str, torch.Tensor]],
    ) -> Tuple[Measured, bool]:
        """This rank's share: pick the weights, fuse a copy, measure parity on this rank's batches."""
        model, weights_note = self._pick_weights(trainer, pl_module)
        self._weights_note = weights_note
        batches, source, notes = self._parity_data(trainer, pl_module)
        self._local_batches = len(batches)
        differ = reference_buffers is not None and _buffers_differ(model, reference_buffers)
        measured = fuse_and_measure(
            model,
            self.config,
            batches=batches,
            example_inputs=getattr(pl_module, "example_input_array", None),
            source=source,
            notes=[f"weights: {weights_note}", *notes],
            buffers=reference_buffers if differ else None,
        )
        return measured, differ

    def _decide(
        self, ranks: "_Ranks", measured: Measured, everyone: List["_RankReport"]
    ) -> Tuple["_Verdict", Optional[Exception]]:
        """Rank zero: merge every rank's parity state and judge it once."""
        try:
            state = None
            if measured.parity_state is not None:
                states = [r.state for r in everyone]
                if any(s is None for s in states):
                    raise FXLightningError("a rank sent no parity measurements (ranks disagree on parity.enabled)")
                state = merge_parity_states([s for s in states if s is not None])
            outcome = judge(measured, state)
            notes = list(outcome.notes)
            if ranks.distributed:
                shares = ", ".join(f"rank {r.rank}: {r.batches}" for r in everyone)
                notes.append(f"parity merged over {ranks.world} ranks, each on its own share of the data "
                             f"(batches per rank: {shares})")
                differ = [str(r.rank) for r in everyone if r.buffers_differ]
                if differ:
                    notes.append(
                        f"buffers (BatchNorm running statistics) on rank(s) {', '.join(differ)} differed from rank "
                        "0's (no sync_batchnorm): every rank fused rank 0's, the weights that are exported"
                    )
            return _Verdict(outcome.parity, notes, None), None
        except Exception as exc:  # noqa: BLE001 - carried to every rank by the verdict broadcast
            return _Verdict(None, [], _ErrorInfo.of(0, exc)), exc

    def _export(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        outcome: Outcome,
        measured: Measured,
        log_dir: Optional[str],
    ) -> Tuple["_Exported", Optional[Exception]]:
        """Rank zero: write the export (atomically: complete or not at all)."""
        cfg = self.config
        try:
            export_dir = Path(cfg.export.dir) if cfg.export.dir else Path(log_dir or trainer.default_root_dir) / "fx_fused"
            export_outcome(
                outcome,
                measured,
                export_dir=export_dir,
                protected_paths=_checkpoint_files(trainer),
                extra={
                    "weights": self._weights_note,
                    "epoch": trainer.current_epoch,
                    "global_step": trainer.global_step,
                    "world_size": trainer.world_size,
                    "lightning_module": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
                },
            )
            path = str(outcome.export_dir) if outcome.export_dir is not None else None
            return _Exported(path, list(outcome.notes), None), None
        except Exception as exc:  # noqa: BLE001 - carried to every rank by the export broadcast
            return _Exported(None, list(outcome.notes), _ErrorInfo.of(0, exc)), exc

    def _record(self, trainer: "pl.Trainer", outcome: Outcome) -> None:
        self.outcome = outcome
        self.result = outcome.result
        self.parity_report = outcome.parity
        self.export_dir = outcome.export_dir
        self.summary = _summary(outcome)
        if trainer.is_global_zero:  # the ranks share one outcome: log it once
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
        from lightning.fabric.utilities.cloud_io import _load, get_filesystem

        if not get_filesystem(path).exists(path):
            # Under DDP every rank reads the checkpoint (each fuses and checks its own share of the data); on
            # several nodes without a shared filesystem only rank zero's node has it.
            raise ConfigError(
                f"weights: 'best': the checkpoint {path} cannot be read on rank {trainer.global_rank} "
                f"({platform.node()}); every rank fuses it, so it must be on a filesystem all nodes share "
                "(or use weights: last)."
            )
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

    def _fail(
        self,
        trainer: "pl.Trainer",
        exc: Exception,
        *,
        where: str = "",
        type_name: Optional[str] = None,
        remote: bool = False,
    ) -> None:
        """Raise (on_error=raise) or warn (on_error=warn) with the cause and where the checkpoints are.

        ``where`` names the failing rank under DDP; ``remote``: ``exc`` was rebuilt from another rank's
        message (``type_name`` is the original type), so there is no local traceback to chain.
        """
        self.error = exc
        message = (
            f"FXFuseCallback failed after training{where} ({type_name or type(exc).__name__}): {exc}\n"
            f"{_checkpoint_message(trainer)}"
        )
        if self._raise_errors:
            new: Exception = type(exc)(message) if isinstance(exc, FXLightningError) else FXLightningError(message)
            for attr in ("report", "outcome"):
                if hasattr(exc, attr):
                    setattr(new, attr, getattr(exc, attr))
            self._raised = new
            if remote:
                raise new from None
            raise new from exc
        # Every rank warns (not rank zero only): each rank's log must say why nothing was exported.
        warnings.warn(message + "\n(on_error=warn: fit returns normally)", UserWarning, stacklevel=2)

    def _fail_everywhere(
        self, trainer: "pl.Trainer", ranks: "_Ranks", failed: List["_ErrorInfo"], local: Optional[Exception]
    ) -> None:
        """Every rank raises (or warns) the same error: the lowest failing rank's, naming it."""
        first = failed[0]
        where = ""
        if ranks.distributed:
            where = f" on rank {first.rank} of {ranks.world}"
            if len(failed) > 1:
                where += " (also on " + ", ".join(f"rank {f.rank}: {f.type_name}" for f in failed[1:]) + ")"
        if local is not None and first.rank == ranks.rank:
            self._fail(trainer, local, where=where)
        else:
            self._fail(trainer, first.rebuild(), where=where, type_name=first.type_name, remote=True)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if exception is self._raised:
            return  # our own error, already explained
        # Ctrl-C, a crash in training or another callback: on_fit_end will not run, and nothing is touched.
        self.skipped = f"fit did not finish ({type(exception).__name__})"
        rank_zero_info(
            f"FXFuseCallback: fit did not finish ({type(exception).__name__}), so nothing was fused or exported; "
            "the LightningModule and the checkpoints are untouched."
        )


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



# ------------------------------------------------------------------------------------------ ranks


@dataclass
class _ErrorInfo:
    """An exception as it travels between ranks: its rank, type name and message (never the object: it may
    not pickle, and its class may not exist on the other side)."""

    rank: int
    type_name: str
    message: str

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> "_ErrorInfo":
        return cls(rank, type(exc).__name__, str(exc))

    def rebuild(self) -> Exception:
        """The same fx_lightning error class when it is one of ours, else :class:`FXLightningError`."""
        cls = getattr(_errors, self.type_name, None)
        if not (isinstance(cls, type) and issubclass(cls, FXLightningError)):
            cls = FXLightningError
        return cls(self.message)


@dataclass
class _RankReport:
    """What each rank sends in the exchange (step 3)."""

    rank: int
    skip: Optional[str] = None
    error: Optional[_ErrorInfo] = None
    state: Optional[ParityState] = None
    buffers_differ: bool = False
    batches: int = 0


@dataclass
class _Verdict:
    """Rank zero's decision (step 4): the merged parity report and the outcome's notes, or its error."""

    parity: Optional[ParityReport]
    notes: List[str]
    error: Optional[_ErrorInfo]


@dataclass
class _Exported:
    """Rank zero's export result (step 5)."""

    export_dir: Optional[str]
    notes: List[str]
    error: Optional[_ErrorInfo]


class _Ranks:
    """The collectives of ``on_fit_end`` on the trainer's strategy; in one process each returns at once."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.strategy = trainer.strategy
        self.world = int(trainer.world_size)
        self.rank = int(trainer.global_rank)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def broadcast(self, obj: Any) -> Any:
        """Rank zero's ``obj`` on every rank."""
        return self.strategy.broadcast(obj, src=0) if self.distributed else obj

    def exchange(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            gathered: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, obj)
            return gathered
        # A DDP-family strategy without a torch.distributed process group (XLA): one broadcast per rank.
        return [self.strategy.broadcast(obj if r == self.rank else None, src=r) for r in range(self.world)]


def _buffers_differ(model: torch.nn.Module, reference: Dict[str, torch.Tensor]) -> bool:
    for name, buffer in model.named_buffers():
        other = reference.get(name)
        if other is not None and (other.shape != buffer.shape or not torch.equal(buffer.detach().cpu(), other)):
            return True
    return False


def _unsupported_strategy(strategy: Any) -> Optional[str]:
    """Why the callback cannot run under ``strategy`` (None: it can). Sharded strategies hold no rank with
    the whole model after fit, which fusion and parity need."""
    from lightning.pytorch import strategies

    name = type(strategy).__name__
    sharded = tuple(
        cls for cls in (getattr(strategies, n, None) for n in ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"))
        if isinstance(cls, type)
    )
    if isinstance(strategy, sharded):  # before the DDP check: DeepSpeedStrategy subclasses DDPStrategy
        return (
            f"{name} shards the weights across ranks, and fusion and parity need the whole model on every rank; "
            "sharded strategies (FSDP, DeepSpeed, model parallel) are not supported yet"
        )
    if isinstance(strategy, strategies.ParallelStrategy) and not isinstance(strategy, strategies.DDPStrategy):
        return (
            f"{name} is not a DDP-family strategy; FXFuseCallback supports one device and DDP-family strategies "
            "(ddp, ddp_spawn, ddp_fork, ddp_notebook)"
        )
    return None
