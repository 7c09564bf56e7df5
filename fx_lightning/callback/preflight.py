"""Before the first training step: prove that the end-of-fit work can run, so that a misconfigured target or
an untraceable model fails at once rather than after hours of training."""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
import torch

from fx_lightning.batches import as_args, model_device_dtype, to_model
from fx_lightning.callback.trainer_data import peek_inputs
from fx_lightning.capture import capture, eval_copy
from fx_lightning.config import FuseConfig
from fx_lightning.pipeline import resolve_target, target_example_inputs

__all__ = ["target_pending", "check_capture"]


def target_pending(pl_module: "pl.LightningModule", config: FuseConfig) -> bool:
    """True when the target (or the default ``backbone``) may not exist yet: ``LightningModule.setup`` and
    ``configure_model`` run after the callback's ``setup`` and may build it."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from fx_lightning.errors import ConfigError

    if not (is_overridden("configure_model", pl_module) or is_overridden("setup", pl_module)):
        return False
    try:
        path, _ = resolve_target(pl_module, config.target)
    except ConfigError:
        return True
    return path == "" and config.target is None


def check_capture(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig) -> None:
    """Resolve the target and capture a copy of it once, on the inputs of one batch (or example_input_array)
    when there is one. Raises ConfigError or TraceError; changes nothing (the RNG streams included)."""
    path, target = resolve_target(pl_module, config.target)
    with torch.random.fork_rng(devices=_cuda_devices(pl_module)), torch.no_grad():
        inputs = peek_inputs(trainer, pl_module, config)
        if inputs is None:
            capture(target, config.trace)  # fx needs no inputs; auto/export explain what is missing
            return
        work = eval_copy(pl_module)
        work_target = work.get_submodule(path) if path else work
        device, dtype = model_device_dtype(work)
        args, _ = target_example_inputs(work, work_target, as_args(to_model(inputs, device, dtype)))
        capture(work_target, config.trace, args, already_copied=True)


def _cuda_devices(module: torch.nn.Module) -> Optional[list]:
    return sorted({t.device.index or 0 for t in module.parameters() if t.is_cuda})
