"""Before the first optimizer step: prove that the end of fit can run, so that nothing that does not depend on
the trained weights fails after hours of training.

Two checks. :func:`check_settings`, when fit starts (before any step): what needs no model run (device, target,
weights, the export directory and every format's dependencies, the input normalisation). :func:`check_before_fit`,
once the target's calls have been observed (the sanity check's, else the first training step's forward) and before
the first optimizer step: **the same driver the end of fit runs** (:func:`fx_lightning.pipeline.run_pipeline`) on a
copy of the untrained model, with those calls and a temporary export directory: capture, passes, parity (measured;
the gate is for after training), every format written and loaded back (a format the end of fit would skip is a
note here too), the variants (int8) made and gated, and the selection's bench run once. ``preflight: capture``
captures only. Under DDP every rank runs both through the strategy's collectives, so a failure on one rank stops
every rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import lightning.pytorch as pl
import torch

from fx_lightning.common.batches import extract_input, flat_tensors
from fx_lightning.callback.mlflow_logging import check_mlflow, mlflow_wanted
from fx_lightning.callback.namespaces import lightning_classes
from fx_lightning.callback.observe import CallRecorder
from fx_lightning.callback.ranks import StrategyCollectives
from fx_lightning.callback.trainer_data import (checkpoint_callbacks, export_directory, parity_batches,
                                               validation_will_run)
from fx_lightning.callback.transforms import input_contract
from fx_lightning.capture.working_copy import plain_state_dict, strip_compiled
from fx_lightning.config import FuseConfig, Preflight, WeightsSource
from fx_lightning.errors import ConfigError, ExportError, FXLightningError, ModelError, first_line, require_inputs
from fx_lightning.formats import FORMATS
from fx_lightning.export.progress import Progress
from fx_lightning.export.write.input_contract import InputContract
from fx_lightning.export.write.writer import refuse_existing, require_formats
from fx_lightning.passes import Stage, builtin_passes
from fx_lightning.pipeline import (
    Batches,
    Destination,
    Failure,
    Mode,
    Observations,
    Source,
    exchange_failure,
    Step,
    in_step,
    FORMAT_NOT_EXPORTED,
    VARIANT_FAILED,
    own_rng,
    resolve_device,
    resolve_target,
    load_source,
    run_pipeline,
)
from fx_lightning.pipeline.targets import refuse_protected
from fx_lightning.common.provenance import PreflightReport
from fx_lightning.variants import VARIANTS

__all__ = ["PreflightReport", "FIXES", "check_settings", "check_before_fit", "rehearsal_due", "rehearse", "rehearsal_config", "settings_source",
           "preflight_source", "preflight_batches"]

# What to do about a failure at each stage (the error itself says what failed).
FIXES: Dict[Step, str] = {
    Step.device: "set device: auto (where training runs) or cpu",
    Step.target: "point target at a submodule that the LightningModule's forward calls",
    Step.weights: "add a ModelCheckpoint that saves (monitor=..., save_top_k >= 1) or use weights: last",
    Step.export_directory: "choose an export.dir that can be created and written, outside the checkpoint "
                           "directory (or set export.enabled: false)",
    Step.export_dependencies: "install what is named above, or drop that format from export.formats",
    Step.preprocess: "set export.preprocess.mean and std (one value per channel), give the validation dataset a "
                     "Normalize transform, or set export.preprocess.enabled: false",
    Step.parity_input: "set parity.input to the key, index or 'pkg.module:function' that gives forward's input, "
                       "or give the LightningModule an example_input_array",
    Step.capture: "see the fixes listed above (trace.mode, trace.leaf_modules, trace.autowrap_functions)",
    Step.passes: "fix the pass named above, or disable it under passes",
    Step.parity: "check parity.input and the model's outputs; outputs all drawn at random are refused at any "
                 "weights (parity.on_failure: warn trains and exports nothing); the gate's thresholds are applied "
                 "after training only",
    Step.export: "drop the failing format from export.formats, or fix what the error names",
    Step.variants: "install what the variant needs (" + ", ".join(
        f"pip install 'fx-lightning[{v.extra}]' for passes.{v.key}" for v in VARIANTS.values() if v.extra)
    + "), or disable it under passes",
    Step.selection: "drop the artifact that cannot run from export.formats, or set export.select: preference",
    Step.mlflow: "fix the MLFlowLogger's tracking_uri or export.mlflow as the error says, or set "
                 "export.mlflow.enabled: false",
}


def check_settings(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig) -> Optional[Failure]:
    """When fit starts, on every rank: the checks that need no model run (:func:`settings_source`'s). The failure
    every rank gets (the lowest failing rank's), or None."""
    if config.preflight is Preflight.off:
        return None
    log_dir = trainer.log_dir  # a collective under DDP: first, on every rank
    error: Optional[Exception] = None
    try:
        settings_source(trainer, pl_module, config, log_dir)
    except Exception as exc:  # noqa: BLE001 - exchanged with the other ranks, raised by the caller
        error = exc
    return exchange_failure(StrategyCollectives(trainer), error)


def check_before_fit(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig,
    observed: Optional[Observations], progress: Progress,
) -> Tuple[Optional[PreflightReport], Optional[Failure]]:
    """Run the preflight on this rank, with the other ranks, on the ``observed`` calls (None: the batches are read):
    the report, or the failure every rank gets (the lowest failing rank's, naming it). The caller's random number
    streams are left as they were: the preflight reads loaders and runs the model, and must not change the training
    run that follows; autocast is off (the hooks it runs from may sit inside a mixed-precision step)."""
    if config.preflight is Preflight.off:
        return None, None
    log_dir = trainer.log_dir  # a collective under DDP: first, on every rank
    start = time.perf_counter()
    staging, staging_error = _temporary_directory()
    try:
        with own_rng(pl_module, trainer.strategy.root_device), _no_autocast():
            source = load_source(lambda: preflight_source(trainer, pl_module, config, log_dir, staging_error,
                                                          observed), progress)
            outcome = run_pipeline(
                rehearsal_config(config), source, Destination(staging / "fx_fused" if staging is not None else None),
                collectives=StrategyCollectives(trainer), mode=Mode.rehearsal, progress=progress)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    if outcome.failure is not None and outcome.failure.type_name != ModelError.__name__:
        return None, outcome.failure  # first: the device may be what failed, and is not resolved again below
    seconds = time.perf_counter() - start
    if outcome.failure is not None:
        # The untrained model cannot run (training fills what it needs): what needs no model run is proven.
        return _unproven(trainer, config, f"the pipeline's steps: {first_line(outcome.failure.error)}", seconds), None
    steps = outcome.steps if config.preflight is Preflight.full else [s for s in outcome.steps if s != Step.passes]
    predicted = [str(n) for n in outcome.notes if n.kind in (FORMAT_NOT_EXPORTED, VARIANT_FAILED)]
    return PreflightReport(config.preflight.value, seconds, _device_name(trainer, config), steps,
                           predicted=predicted), None


def _unproven(trainer: "pl.Trainer", config: FuseConfig, why: str, seconds: float = 0.0) -> PreflightReport:
    """The report where the pipeline cannot be proven before training: what needs no model run was (at fit start)."""
    return PreflightReport(config.preflight.value, seconds, _device_name(trainer, config), _checks(config), why)


def _device_name(trainer: "pl.Trainer", config: FuseConfig) -> Optional[str]:
    resolved = resolve_device(config.device, trainer.strategy.root_device)
    return str(resolved) if resolved is not None else None


def rehearsal_due(trainer: "pl.Trainer", recorder: CallRecorder) -> bool:
    """Whether the preflight's rehearsal runs before the first training step: when every rank observed the
    target's calls in validation (the sanity check); else it runs at the first optimizer step, once the first
    training forward has been seen. A collective: every rank decides alike."""
    mine = recorder.observations_from("validation")
    return all(StrategyCollectives(trainer).all_gather(mine))


def rehearse(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig,
             recorder: CallRecorder, progress: Progress) -> Tuple[Optional[PreflightReport], Optional[Failure]]:
    """The preflight's rehearsal on what ``recorder`` observed (with its hooks off: the module is copied)."""
    with recorder.paused():
        observed, error = None, None
        try:
            observed = recorder.observations(validation_ahead=lambda: validation_will_run(trainer))
        except Exception as exc:  # noqa: BLE001 - exchanged with the other ranks, raised by the caller
            error = exc
            if isinstance(exc, FXLightningError):
                exc.step = exc.step or Step.target.value
        failure = exchange_failure(StrategyCollectives(trainer), error)
        if failure is not None and failure.type_name == ModelError.__name__:
            # decided by calls not seen yet (validation's): at the end of fit, on every rank alike
            return _unproven(trainer, config, first_line(failure.error)), None
        if failure is not None:
            return None, failure
        return check_before_fit(trainer, pl_module, config, observed, progress)


def _checks(config: FuseConfig) -> List[str]:
    """The checks :func:`preflight_source` makes for ``config``, in order."""
    checks = [Step.device, Step.target]
    if config.preflight is Preflight.full:
        checks.append(Step.weights)
        checks += [Step.export_directory, Step.export_dependencies] if config.export.enabled else []
    if config.export.enabled and config.export.mlflow.enabled:  # else it depends on the Trainer's loggers
        checks.append(Step.mlflow)
    if config.export.enabled and config.export.preprocess.enabled:
        checks.append(Step.preprocess)
    return [c.value for c in checks]


def _temporary_directory() -> Tuple[Optional[Path], Optional[OSError]]:
    """Where the rehearsal exports, or why it cannot be made: the error travels to every rank with the rest."""
    try:
        return Path(tempfile.mkdtemp(prefix="fx_fused_preflight_")), None
    except OSError as exc:
        return None, exc


def rehearsal_config(config: FuseConfig) -> FuseConfig:
    """The config the preflight runs: as given for ``full``; for ``capture``, what the end of fit runs up to the
    capture (the module passes, which change the module before it is captured), no graph pass, parity or export."""
    if config.preflight is not Preflight.capture:
        return config
    passes = config.passes
    module_stage = {spec.name for spec in builtin_passes() if spec.stage is Stage.module}
    off = {f.name: dataclasses.replace(getattr(passes, f.name), enabled=False) for f in dataclasses.fields(passes)
           if f.name != "extra" and f.name not in module_stage}
    return dataclasses.replace(config, passes=dataclasses.replace(passes, extra=[], **off),
                               parity=dataclasses.replace(config.parity, enabled=False),
                               export=dataclasses.replace(config.export, enabled=False))


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    with torch.autocast("cpu", enabled=False), (torch.autocast("cuda", enabled=False) if torch.cuda.is_available()
                                                else contextlib.nullcontext()):
        yield


def settings_source(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig,
                    log_dir: Optional[str], staging_error: Optional[OSError] = None
                    ) -> Tuple[Optional[torch.device], InputContract]:
    """The checks that need no model run: the device, the target, the weights, the export directory and the
    formats' dependencies, the input normalisation. Returns the device and the input contract."""
    with in_step(Step.device):
        device = resolve_device(config.device, trainer.strategy.root_device)
    with in_step(Step.target):
        resolve_target(pl_module, config.target)
    if config.preflight is Preflight.full:
        with in_step(Step.weights):
            _check_weights(trainer, pl_module, config)
        if config.export.enabled:
            with in_step(Step.export_directory):
                if staging_error is not None:
                    raise ExportError(f"the preflight cannot make a temporary directory to export into: "
                                      f"{staging_error.strerror or staging_error}")
                _probe_writable(export_directory(trainer, config, log_dir), config.export.overwrite,
                                [cb.dirpath for cb in checkpoint_callbacks(trainer) if cb.dirpath])
            with in_step(Step.export_dependencies):
                require_formats([FORMATS[f.value] for f in config.export.formats])
    if mlflow_wanted(trainer, config):
        with in_step(Step.mlflow):
            check_mlflow(trainer, config)
    with in_step(Step.preprocess):
        contract = input_contract(trainer, config)  # enabled with nothing to take mean/std from: fails here
    return device, contract


def preflight_source(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig,
                     log_dir: Optional[str], staging_error: Optional[OSError] = None,
                     observed: Optional[Observations] = None) -> Source:
    """The checks that need no model run, then the untrained model with the calls observed (else the batches the
    end of fit will read)."""
    device, contract = settings_source(trainer, pl_module, config, log_dir, staging_error)
    with in_step(Step.parity_input):
        batches = preflight_batches(trainer, pl_module, config, checked=observed is None)
    return Source(pl_module, batches, getattr(pl_module, "example_input_array", None), device=device,
                  checked=_checks(config) + [Step.parity_input.value], contract=contract, observed=observed)


def preflight_batches(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig,
                      checked: bool = True) -> Batches:
    """The batches parity will read after training (validation, else training data, within the trainer's limits),
    one of each input shape, the first first: capture, parity and every format see the shapes the end of fit
    will. ``checked`` (nothing was observed): checked for an input that can be taken out of them."""
    batches = parity_batches(trainer, config)
    if batches.items and checked:
        seen: Dict[Tuple[Any, ...], Tuple[Any, Optional[int]]] = {}
        for i, batch in enumerate(batches.items):
            tensors = flat_tensors(extract_input(batch, config.parity.input))  # raises, naming parity.input
            count = batches.samples[i] if i < len(batches.samples) else None
            seen.setdefault(tuple((tuple(t.shape), t.dtype) for t in tensors), (batch, count))
        return Batches([b for b, _ in seen.values()], batches.source, batches.notes, batches.calibration,
                       [n for _, n in seen.values()])
    if batches.items:
        return batches
    example = getattr(pl_module, "example_input_array", None)
    usable = example is not None and not isinstance(example, dict)
    require_inputs(usable or not (config.parity.enabled or config.export.enabled), "parity and export",
                   "validation or training batches that can be read before training, or an example_input_array on "
                   "the LightningModule", key="parity.data")
    return batches


def _check_weights(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig) -> None:
    """``weights: best`` needs a checkpoint that will be saved, and loads it into an unwrapped copy of the module
    (torch.compile wrappers removed, their key prefixes dropped) strictly: proven here on the current weights."""
    if config.weights is not WeightsSource.best:
        return
    ckpt = trainer.checkpoint_callback
    if not isinstance(ckpt, lightning_classes("callbacks.ModelCheckpoint")):
        raise ConfigError("weights: 'best' needs a ModelCheckpoint callback in the Trainer, and there is none.")
    if ckpt.save_top_k == 0:
        # Its own advice: the stage's ("add a ModelCheckpoint") would not do, the Trainer's first one being read.
        raise ConfigError("weights: 'best', but the ModelCheckpoint has save_top_k=0: it will save no best checkpoint.",
                          fix="give that ModelCheckpoint save_top_k >= 1 (or -1), or use weights: last")
    copy_ = strip_compiled(copy.deepcopy(pl_module))
    copy_.load_state_dict(plain_state_dict(pl_module.state_dict()), strict=True)


def _probe_writable(directory: Path, overwrite: bool, checkpoint_dirs: List[str]) -> None:
    """Create ``directory``'s parents and a file beside it, then remove what was created: the export's
    rename into place needs exactly that. An existing export the config may not replace, or a directory that is
    or holds the checkpoints' directory (the export replaces its directory), fails here too."""
    refuse_existing(directory, overwrite)
    refuse_protected(directory, checkpoint_dirs)
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
