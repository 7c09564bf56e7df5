"""The end of fit on every rank: the strategy's collectives plugged into the one driver.

Under DDP every rank runs ``on_fit_end`` and makes the same collective calls in the same order whatever happens
to it locally: ``trainer.log_dir`` (Lightning broadcasts it), rank zero's buffers (a broadcast; weights: last
only, since BatchNorm statistics can differ between ranks), then the driver's own protocol
(:func:`fx_lightning.pipeline.run_pipeline`: exchange, verdict, export). In one process these cost nothing (a
single-device strategy's ``broadcast`` returns its argument). The waits are bounded by the strategy's
process-group timeout (``DDPStrategy(timeout=)``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, TypeVar

import lightning.pytorch as pl
import torch

from fx_lightning.callback.namespaces import lightning_classes
from fx_lightning.callback.trainer_data import (
    checkpoint_files,
    export_directory,
    parity_batches,
    pick_weights,
)
from fx_lightning.callback.transforms import input_contract
from fx_lightning.config import FuseConfig, WeightsSource
from fx_lightning.export.progress import Progress
from fx_lightning.common.notes import NoteKind
from fx_lightning.pipeline import (
    Batches,
    Destination,
    Observations,
    Outcome,
    Source,
    calibration_batch_count,
    resolve_device,
    load_source,
    run_pipeline,
)
from fx_lightning.common.provenance import PreflightReport, Provenance, TrainerCounters

__all__ = ["StrategyCollectives", "WEIGHTS", "fuse_after_fit", "end_of_fit_source", "unsupported_strategy"]

T = TypeVar("T")

WEIGHTS = NoteKind("weights", "weights: {description}")


class StrategyCollectives:
    """The driver's collectives on a Lightning strategy: its ``broadcast``, and ``all_gather_object`` of the
    process group (one broadcast per rank for a DDP-family strategy without one, such as XLA)."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer
        self.rank = int(trainer.global_rank)
        self.world_size = int(trainer.world_size)

    def broadcast(self, obj: T, src: int = 0) -> T:
        return self.trainer.strategy.broadcast(obj, src=src)

    def all_gather(self, obj: T) -> List[T]:
        if self.world_size <= 1:
            return [obj]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            gathered: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, obj)
            return gathered
        return [self.broadcast(obj if r == self.rank else None, src=r) for r in range(self.world_size)]


def fuse_after_fit(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig, skip: Optional[str],
    preflight: Optional[PreflightReport], observed: Optional[Observations], progress: Progress,
) -> Outcome:
    """Run the pipeline on this rank at the end of fit and return what happened; raises nothing. ``preflight``
    (what was proven before training) goes into the manifest; ``observed``: the target's calls during fit;
    ``progress``: where its steps are shown (the callback's, drawn like the Trainer's progress bar)."""
    log_dir = trainer.log_dir  # a collective under DDP: every rank asks, even those that then skip
    buffers = _rank_zero_buffers(trainer, pl_module, config)
    provenance = Provenance(
        lightning_module=f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
        # The counters at the end of fit; the weights' own are under "weights" (they differ for best).
        trainer=TrainerCounters(trainer.current_epoch, trainer.global_step),
        world_size=trainer.world_size, preflight=preflight,
    )
    destination = Destination(export_directory(trainer, config, log_dir), checkpoint_files(trainer), provenance)
    source = (load_source(lambda: end_of_fit_source(trainer, pl_module, config, buffers, observed), progress)
              if skip is None else None)
    return run_pipeline(config, source, destination, collectives=StrategyCollectives(trainer), skip=skip,
                        progress=progress)


def end_of_fit_source(trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig,
                      reference_buffers: Optional[Dict[str, torch.Tensor]], observed: Optional[Observations]) -> Source:
    """This rank's source: the weights to fuse, its parity batches, the device, and rank zero's buffers when
    this rank's differ."""
    device = resolve_device(config.device, trainer.strategy.root_device)
    model, weights = pick_weights(trainer, pl_module, config)
    differ = reference_buffers is not None and _buffers_differ(model, reference_buffers)
    observed_steps = observed is not None and bool(observed.steps) and config.parity.input is None
    batches = Batches([], "val") if observed_steps and not calibration_batch_count(config) else \
        parity_batches(trainer, config)  # the calls observed are compared on; batches for calibration only
    return Source(model, batches, getattr(pl_module, "example_input_array", None),
                  device=device, buffers=reference_buffers if differ else None, buffers_differ=differ,
                  weights=weights, notes=[WEIGHTS(description=weights.description)],
                  contract=input_contract(trainer, config), observed=observed)


def _rank_zero_buffers(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig
) -> Optional[Dict[str, torch.Tensor]]:
    """Rank zero's buffers, on every rank. DDP keeps parameters equal on every rank, but BatchNorm running
    statistics are updated by each rank's own last training batches (without sync_batchnorm and with no
    validation after them): every rank must fuse the weights that rank zero exports."""
    if trainer.world_size <= 1 or config.weights is not WeightsSource.last:
        return None  # weights: best is read from one checkpoint file by every rank
    payload: Optional[Dict[str, torch.Tensor]] = None
    if trainer.global_rank == 0:
        try:
            payload = {name: b.detach().cpu() for name, b in pl_module.named_buffers()}
        except Exception:  # noqa: BLE001 - rank zero must still take part; ranks then keep their own
            payload = None
    return trainer.strategy.broadcast(payload, src=0)


def _buffers_differ(model: torch.nn.Module, reference: Dict[str, torch.Tensor]) -> bool:
    for name, buffer in model.named_buffers():
        other = reference.get(name)
        if other is not None and (other.shape != buffer.shape or not torch.equal(buffer.detach().cpu(), other)):
            return True
    return False


def unsupported_strategy(strategy: Any) -> Optional[str]:
    """Why the callback cannot run under ``strategy`` (None: it can). Sharded strategies hold no rank with
    the whole model after fit, which fusion and parity need."""
    name = type(strategy).__name__
    sharded = sum((lightning_classes(f"strategies.{n}") for n in ("FSDPStrategy", "DeepSpeedStrategy",
                                                                   "ModelParallelStrategy")), ())
    if isinstance(strategy, sharded):  # before the DDP check: DeepSpeedStrategy subclasses DDPStrategy
        return (
            f"{name} shards the weights across ranks, and fusion and parity need the whole model on every rank; "
            "sharded strategies (FSDP, DeepSpeed, model parallel) are not supported yet"
        )
    if isinstance(strategy, lightning_classes("strategies.ParallelStrategy")) and not isinstance(
            strategy, lightning_classes("strategies.DDPStrategy")):
        return (
            f"{name} is not a DDP-family strategy; FXFuseCallback supports one device and DDP-family strategies "
            "(ddp, ddp_spawn, ddp_fork, ddp_notebook)"
        )
    return None
