"""Before the first training step: prove that the end of fit can run, so that nothing that does not depend on
the trained weights fails after hours of training.

``preflight: full`` checks what needs no model (device, target, weights, the export directory and every format's
dependencies), then runs **the same driver the end of fit runs** (:func:`fx_lightning.pipeline.run_pipeline`) on a
copy of the untrained model, with the batches parity will read (one of each input shape) and a temporary export
directory: capture, passes, parity (measured; the gate is for after training), every format written and loaded
back, the variants (int8) made and gated, and the selection's bench run once. ``capture`` resolves the target and
captures it on those batches only. Under DDP every rank runs it through the strategy's collectives, so a failure
on one rank stops every rank before training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from fx_lightning.batches import as_args, extract_input, flat_tensors
from fx_lightning.callback.ranks import StrategyCollectives
from fx_lightning.callback.trainer_data import export_directory, parity_batches
from fx_lightning.config import FuseConfig, Preflight, WeightsSource
from fx_lightning.errors import ConfigError, ExportError, FXLightningError
from fx_lightning.pipeline import Batches, Destination, Failure, Mode, Source, resolve_device, resolve_target, run_pipeline
from fx_lightning.provenance import PreflightReport

__all__ = ["PreflightReport", "FIXES", "target_pending", "check_before_fit", "preflight_source"]

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
    "variants": "install what the variant needs (pip install 'fx-lightning[int8]' for quantize_int8), or disable it "
                "under passes",
    "selection": "drop the artifact that cannot run from export.formats, or set export.select: preference",
}


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
    """Run the preflight on this rank, with the other ranks: the report, or the failure every rank gets (the
    lowest failing rank's, naming it)."""
    if config.preflight is Preflight.off:
        return None, None
    log_dir = trainer.log_dir  # a collective under DDP: first, on every rank
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fx_fused_preflight_") as tmp:
        outcome = run_pipeline(
            rehearsal_config(config), lambda: preflight_source(trainer, pl_module, config, log_dir),
            Destination(Path(tmp) / "fx_fused"), collectives=StrategyCollectives(trainer), mode=Mode.rehearsal)
    if outcome.failure is not None:
        return None, outcome.failure
    steps = outcome.steps if config.preflight is Preflight.full else [s for s in outcome.steps if s != "passes"]
    return PreflightReport(config.preflight.value, time.perf_counter() - start, _device_name(trainer, config),
                           steps), None


def rehearsal_config(config: FuseConfig) -> FuseConfig:
    """The config the preflight runs: as given for ``full``; for ``capture``, capture alone (no pass, parity or
    export)."""
    if config.preflight is not Preflight.capture:
        return config
    passes = config.passes
    off = {f.name: dataclasses.replace(getattr(passes, f.name), enabled=False) for f in dataclasses.fields(passes)
           if f.name != "extra"}
    return dataclasses.replace(config, passes=dataclasses.replace(passes, extra=[], **off),
                               parity=dataclasses.replace(config.parity, enabled=False),
                               export=dataclasses.replace(config.export, enabled=False))


def _device_name(trainer: "pl.Trainer", config: FuseConfig) -> Optional[str]:
    device = resolve_device(config.device, trainer.strategy.root_device)
    return str(device) if device is not None else None


@contextlib.contextmanager
def _stage(name: str, checked: List[str]) -> Iterator[None]:
    """Name the stage in an error leaving the block (a foreign one is wrapped once); record success."""
    try:
        yield
    except FXLightningError as exc:
        exc.step = exc.step or name
        raise
    except Exception as exc:
        error = FXLightningError(f"{type(exc).__name__}: {exc}")
        error.step = name
        raise error from exc
    checked.append(name)


def preflight_source(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig,
                     log_dir: Optional[str]) -> Source:
    """The checks that need no model run, then the untrained model with the batches the end of fit will use."""
    checked: List[str] = []
    with _stage("device", checked):
        device = resolve_device(config.device, trainer.strategy.root_device)
    with _stage("target", checked):
        resolve_target(pl_module, config.target)
    if config.preflight is Preflight.full:
        with _stage("weights", checked):
            _check_weights(trainer, config)
        if config.export.enabled:
            with _stage("export directory", checked):
                _probe_writable(export_directory(trainer, config, log_dir), config.export.overwrite)
            with _stage("export dependencies", checked):
                from fx_lightning.export import FORMATS
                from fx_lightning.export.writer import require_formats

                require_formats([FORMATS[f.value] for f in config.export.formats])
    with _stage("parity input", checked):
        batches = preflight_batches(trainer, pl_module, config)
    return Source(pl_module, batches, getattr(pl_module, "example_input_array", None), device=device,
                  checked=checked)


def preflight_batches(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig) -> Batches:
    """The batches parity will read after training (validation, else training data, within the trainer's limits),
    one of each input shape, the first first: capture, parity and every format see the shapes the end of fit
    will. Checked for an input that can be taken out of them."""
    batches = parity_batches(trainer, config)
    if batches.items:
        seen: Dict[Tuple[Any, ...], Any] = {}
        for batch in batches.items:
            tensors = flat_tensors(as_args(extract_input(batch, config.parity.input)))  # raises, naming parity.input
            seen.setdefault(tuple((tuple(t.shape), t.dtype) for t in tensors), batch)
        return Batches(list(seen.values()), batches.source, batches.notes)
    example = getattr(pl_module, "example_input_array", None)
    if (example is None or isinstance(example, dict)) and (config.parity.enabled or config.export.enabled):
        raise ConfigError(
            "parity.data: no validation or training batch could be read before training and the LightningModule "
            "has no example_input_array: parity and export need inputs"
        )
    return batches


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
