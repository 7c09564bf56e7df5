"""Before the first training step: prove that the end-of-fit work can run, so that nothing that does not
depend on the trained weights fails after hours of training.

``preflight: full`` runs the whole pipeline once on a copy of the untrained model: the target, the export
directory and every format's dependencies, one batch of parity input (one sample), capture, every
configured pass, a parity smoke run (it must not raise; the gate is for after training) and every export
format written to a temporary directory and loaded back. ``capture`` resolves and captures the target only.
Under DDP every rank runs it and the ranks agree on the outcome (``reduce_boolean_decision``), so a failure
on one rank stops every rank before training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fx_lightning.batches import as_args, first_samples, model_device_dtype, to_model
from fx_lightning.callback.ranks import ErrorInfo, Failure, exchange, failure_of
from fx_lightning.callback.trainer_data import choose_batches, export_directory, peek_inputs, trainer_loaders
from fx_lightning.capture import capture, eval_copy
from fx_lightning.config import FormatFailure, FuseConfig, Preflight, WeightsSource
from fx_lightning.errors import ConfigError, ExportError, FXLightningError, ParityError, PassError, TraceError
from fx_lightning.pipeline import Batches, fuse_and_measure, judge, own_rng, resolve_device, resolve_target
from fx_lightning.pipeline import target_example_inputs

__all__ = ["PreflightReport", "target_pending", "check_before_fit", "run_preflight"]

# What to do about a failure at each stage (the error itself says what failed).
FIXES: Dict[str, str] = {
    "device": "set device: auto (where training runs) or cpu",
    "target": "point target at a submodule that the LightningModule's forward calls",
    "weights": "add a ModelCheckpoint that saves (monitor=..., save_top_k >= 1) or use weights: last",
    "export directory": "choose an export.dir that can be created and written (or set export.enabled: false)",
    "export dependencies": "install what is named above, or drop that format from export.formats",
    "parity input": "set parity.input to the key, index or 'pkg.module:function' that gives forward's input, "
                    "or give the LightningModule an example_input_array",
    "capture": "see the fixes listed above (trace.mode, trace.leaf_modules, trace.autowrap_functions)",
    "passes": "fix the pass named above, or disable it under passes",
    "parity": "check parity.input and the model's outputs (the gate itself is applied after training only)",
    "export": "drop the failing format from export.formats, or fix what the error names",
}


@dataclass
class PreflightReport:
    """What the preflight proved before training, and what it cost."""

    mode: str
    seconds: float = 0.0
    device: Optional[str] = None
    stages: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return (f"preflight ({self.mode}): {', '.join(self.stages) or 'nothing'} proven before training in "
                f"{self.seconds:.2f} s" + (f" on {self.device}" if self.device else ""))


def target_pending(pl_module: "pl.LightningModule", config: FuseConfig) -> bool:
    """True when the target (or the default ``backbone``) may not exist yet: ``LightningModule.setup`` and
    ``configure_model`` run after the callback's ``setup`` and may build it."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not (is_overridden("configure_model", pl_module) or is_overridden("setup", pl_module)):
        return False
    try:
        path, _ = resolve_target(pl_module, config.target)
    except ConfigError:
        return True
    return path == "" and config.target is None


def check_before_fit(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig
) -> Tuple[Optional[PreflightReport], Optional[Failure]]:
    """Run the preflight on this rank and agree with the other ranks: the report, or the failure that every
    rank raises (the lowest failing rank's, naming it). Every rank makes the same collective calls."""
    log_dir = trainer.log_dir  # a collective under DDP: first, on every rank
    report: Optional[PreflightReport] = None
    error: Optional[Exception] = None
    try:
        report = run_preflight(trainer, pl_module, config, log_dir)
    except Exception as exc:  # noqa: BLE001 - carried to every rank, raised there
        error = exc
    if trainer.strategy.reduce_boolean_decision(error is None, all=True):
        return report, None
    rank = int(trainer.global_rank)
    infos = exchange(trainer, ErrorInfo.of(rank, error) if error is not None else None)
    return None, failure_of(trainer, [i for i in infos if i is not None], error)


@contextlib.contextmanager
def _stage(report: PreflightReport, name: str) -> Iterator[None]:
    """Name the stage in any error raised inside the block (keeping our error types), and record success."""
    try:
        yield
    except Exception as exc:
        stage = _stage_of(exc, name)
        cls = type(exc) if isinstance(exc, FXLightningError) else FXLightningError
        text = str(exc) if isinstance(exc, FXLightningError) else f"{type(exc).__name__}: {exc}"
        raise cls(f"preflight failed at stage '{stage}' (before the first training step; nothing was trained): "
                  f"{text}\n  Fix: {FIXES[stage]}.") from exc
    report.stages.append(name)


def _stage_of(exc: Exception, name: str) -> str:
    """The fuse step covers capture, passes and parity: the error's type says which of them failed."""
    if name != "fuse":
        return name
    if isinstance(exc, TraceError):
        return "capture"
    if isinstance(exc, PassError):
        return "passes"
    if isinstance(exc, ConfigError):
        return "target"
    return "parity"


def run_preflight(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig, log_dir: Optional[str]
) -> Optional[PreflightReport]:
    """The checks of ``config.preflight`` on this rank; raises the first failure with its stage named."""
    if config.preflight is Preflight.off:
        return None
    start = time.perf_counter()
    report = PreflightReport(config.preflight.value)
    with _stage(report, "device"):
        device = resolve_device(config.device, trainer.strategy.root_device)
        report.device = str(device) if device is not None else None
    with _stage(report, "target"):
        path, _ = resolve_target(pl_module, config.target)
    with own_rng(pl_module, device), torch.no_grad():
        if config.preflight is Preflight.capture:
            with _stage(report, "capture"):
                _check_capture(trainer, pl_module, config, path, device)
        else:
            _check_full(trainer, pl_module, config, report, device, log_dir)
    report.seconds = time.perf_counter() - start
    return report


def _check_capture(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig, path: str,
    device: Optional[torch.device],
) -> None:
    """Capture a copy of the target on the inputs of one batch (or example_input_array) when there is one."""
    inputs = peek_inputs(trainer, pl_module, config)
    work = eval_copy(pl_module, device)
    work_target = work.get_submodule(path) if path else work
    if inputs is None:
        capture(work_target, config.trace, already_copied=True)  # fx needs no inputs; auto/export explain
        return
    device_, dtype = model_device_dtype(work)
    args, _ = target_example_inputs(work, work_target, as_args(to_model(inputs, device_, dtype)))
    capture(work_target, config.trace, args, already_copied=True)


def _check_full(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig, report: PreflightReport,
    device: Optional[torch.device], log_dir: Optional[str],
) -> None:
    with _stage(report, "weights"):
        _check_weights(trainer, config)
    if config.export.enabled:
        with _stage(report, "export directory"):
            _probe_writable(export_directory(trainer, config, log_dir), config.export.overwrite)
        with _stage(report, "export dependencies"):
            from fx_lightning.export import FORMATS
            from fx_lightning.export.writer import require_formats

            require_formats([FORMATS[f.value] for f in config.export.formats])
    with _stage(report, "parity input"):
        batches = _one_sample(trainer, pl_module, config)
    example = getattr(pl_module, "example_input_array", None)
    with _stage(report, "fuse"):
        measured = fuse_and_measure(pl_module, config, batches, example_inputs=example, device=device)
        if measured.parity_state is not None:
            judge(measured)  # computes every metric; the verdict is for after training
    if config.export.enabled:
        with _stage(report, "export"):
            _export_to_temporary(measured, config)


def _check_weights(trainer: "pl.Trainer", config: FuseConfig) -> None:
    if config.weights is not WeightsSource.best:
        return
    ckpt = trainer.checkpoint_callback
    if not isinstance(ckpt, ModelCheckpoint):
        raise ConfigError("weights: 'best' needs a ModelCheckpoint callback in the Trainer, and there is none.")
    if ckpt.save_top_k == 0:
        raise ConfigError("weights: 'best', but the ModelCheckpoint has save_top_k=0: it will save no best checkpoint.")


def _probe_writable(directory: Path, overwrite: bool) -> None:
    """Create ``directory``'s parents and a file beside it, then remove what was created: the export's
    rename into place needs exactly that. An existing export the config may not replace fails here too."""
    from fx_lightning.export.writer import refuse_existing

    refuse_existing(directory, overwrite)
    created: List[Path] = []
    parent = directory.parent
    try:
        for p in reversed([parent, *parent.parents]):
            if not p.exists():
                os.mkdir(p)
                created.append(p)
        fd, probe = tempfile.mkstemp(prefix=f".{directory.name}.probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ExportError(f"export.dir {directory}: cannot be created or written: {exc.strerror or exc}") from exc
    finally:
        for p in reversed(created):
            with contextlib.suppress(OSError):
                p.rmdir()


def _one_sample(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig) -> Batches:
    """One sample of the first parity batch (the smoke run needs no more), checked for an extractable input."""
    from fx_lightning.batches import extract_input

    one = dataclasses.replace(config.parity, max_batches=1)
    batches = choose_batches(trainer_loaders(trainer), one)
    if batches.items:
        batch = first_samples(batches.items[0], 1)
        extract_input(batch, config.parity.input)  # raises ConfigError naming parity.input
        return Batches([batch], batches.source)
    example = getattr(pl_module, "example_input_array", None)
    if (example is None or isinstance(example, dict)) and (config.parity.enabled or config.export.enabled):
        raise ParityError(
            "no validation or training batch could be read before training and the LightningModule has no "
            "example_input_array: parity and export need inputs"
        )
    return batches


def _export_to_temporary(measured: Any, config: FuseConfig) -> None:
    """Write every configured format to a temporary directory (loaded back and compared there), then remove it."""
    from fx_lightning.export import export_fused

    if measured.target_inputs is None:
        raise ExportError("no example inputs to trace the export with")
    # Strict here: a format that fails now would be missing after training.
    strict = dataclasses.replace(config, export=dataclasses.replace(config.export, on_format_failure=FormatFailure["raise"]))
    root = Path(tempfile.mkdtemp(prefix="fx_fused_preflight_"))
    try:
        export_fused(measured.result.graph_module, root / "fx_fused", example_inputs=measured.target_inputs,
                     config=strict)
    finally:
        shutil.rmtree(root, ignore_errors=True)
