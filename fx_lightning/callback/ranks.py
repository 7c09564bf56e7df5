"""The end of fit on every rank: the callback's distributed protocol, on the strategy's collectives.

Under DDP every rank runs ``on_fit_end``, and every rank makes the same collective calls in the same order
whatever happens to it locally, so that no rank can wait forever for one that took another path:

  1. ``trainer.log_dir``               (Lightning broadcasts it)
  2. rank zero's buffers               (broadcast; weights: last only: BatchNorm statistics can differ)
  -- local: pick the weights, fuse, measure parity on this rank's share of the data (errors are caught)
  3. exchange                          (all_gather: skip reason, error or parity state of every rank)
  -- any error: every rank raises (or warns) naming the rank and the cause; any skip: every rank skips
  -- rank zero merges the parity states and decides
  4. verdict                           (broadcast from rank zero: report and notes, or rank zero's error)
  -- parity failed: every rank raises or warns alike, nothing is written
  -- rank zero exports
  5. export result                     (broadcast from rank zero; the barrier: no rank returns before the
                                        export is complete or has failed)

Only rank zero can fail between 3 and 5, and its failures travel in the broadcasts; in one process these
steps cost nothing (a single-device strategy's ``broadcast`` returns its argument). The waits are bounded by
the strategy's process-group timeout (``DDPStrategy(timeout=)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import torch

from fx_lightning import errors
from fx_lightning.callback.trainer_data import (
    WeightsInfo,
    checkpoint_files,
    export_directory,
    parity_batches,
    pick_weights,
)
from fx_lightning.config import FuseConfig, WeightsSource
from fx_lightning.errors import FXLightningError
from fx_lightning.parity import ParityReport, ParityState, merge_parity_states
from fx_lightning.pipeline import (
    Measured,
    Outcome,
    export_outcome,
    fuse_and_measure,
    judge,
    parity_verdict,
    resolve_device,
)

__all__ = ["ErrorInfo", "Failure", "AfterFit", "fuse_after_fit", "exchange", "failure_of", "unsupported_strategy"]


@dataclass
class ErrorInfo:
    """An exception as it travels between ranks: its rank, type name and message (never the object: it may
    not pickle, and its class may not exist on the other side)."""

    rank: int
    type_name: str
    message: str

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> "ErrorInfo":
        return cls(rank, type(exc).__name__, str(exc))

    def rebuild(self) -> Exception:
        """The same fx_lightning error class when it is one of ours, else :class:`FXLightningError`."""
        cls = getattr(errors, self.type_name, None)
        if not (isinstance(cls, type) and issubclass(cls, FXLightningError)):
            cls = FXLightningError
        return cls(self.message)


@dataclass
class Failure:
    """What to raise (or warn) on this rank: ``error`` (local, or rebuilt from another rank's message when
    ``remote``; ``type_name`` is then the original type) and ``where`` it happened (" on rank 1 of 2")."""

    error: Exception
    where: str = ""
    type_name: Optional[str] = None
    remote: bool = False


@dataclass
class AfterFit:
    """The end of fit on this rank: the judged outcome (when there is one), why it was skipped, or what failed."""

    outcome: Optional[Outcome] = None
    skipped: Optional[str] = None
    failure: Optional[Failure] = None


@dataclass
class _RankReport:
    """What each rank sends in the exchange (step 3)."""

    rank: int
    skip: Optional[str] = None
    error: Optional[ErrorInfo] = None
    state: Optional[ParityState] = None
    buffers_differ: bool = False
    batches: int = 0


@dataclass
class _Verdict:
    """Rank zero's decision (step 4): the merged parity report and the outcome's notes, or its error."""

    parity: Optional[ParityReport]
    notes: List[str] = field(default_factory=list)
    error: Optional[ErrorInfo] = None


@dataclass
class _Exported:
    """Rank zero's export result (step 5)."""

    export_dir: Optional[str]
    notes: List[str] = field(default_factory=list)
    error: Optional[ErrorInfo] = None


@dataclass
class _Local:
    """This rank's share before the exchange."""

    measured: Optional[Measured] = None
    weights: Optional[WeightsInfo] = None
    batches: int = 0
    buffers_differ: bool = False
    error: Optional[Exception] = None


def fuse_after_fit(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig, skip: Optional[str],
    preflight: Optional[Dict[str, Any]] = None,
) -> AfterFit:
    """Run the protocol above on this rank and return what happened; raises nothing. ``preflight`` (what
    was proven before training) goes into the manifest."""
    rank = int(trainer.global_rank)
    log_dir = trainer.log_dir  # 1. a collective under DDP: every rank asks, even those that then skip
    buffers = _rank_zero_buffers(trainer, pl_module, config)  # 2.
    local = _measure(trainer, pl_module, config, buffers) if skip is None else _Local()
    mine = _RankReport(rank, skip, ErrorInfo.of(rank, local.error) if local.error is not None else None,
                       local.measured.parity_state if local.measured is not None else None,
                       local.buffers_differ, local.batches)
    everyone: List[_RankReport] = exchange(trainer, mine)  # 3.
    failed = [r.error for r in everyone if r.error is not None]
    if failed:
        return AfterFit(failure=failure_of(trainer, failed, local.error))
    skipped = next((r.skip for r in everyone if r.skip is not None), None)
    if skipped is not None:
        return AfterFit(skipped=skipped)
    measured = local.measured
    assert measured is not None  # no rank skipped or failed, so this one measured
    verdict, decide_error = _decide(trainer, measured, everyone) if rank == 0 else (None, None)
    verdict = trainer.strategy.broadcast(verdict, src=0)  # 4.
    if verdict.error is not None:
        return AfterFit(failure=failure_of(trainer, [verdict.error], decide_error))
    outcome = Outcome(measured.result, verdict.parity, None, measured.target, measured.fused_model,
                      list(verdict.notes))
    # The same report on every rank, so the same decision (and the same warning) on every rank.
    parity_error = parity_verdict(outcome, config)
    if parity_error is not None or (outcome.parity is not None and not outcome.parity.passed):
        return AfterFit(outcome, failure=Failure(parity_error) if parity_error is not None else None)
    metadata = {"weights": local.weights.to_dict() if local.weights is not None else None, "preflight": preflight}
    exported, export_error = (_export(trainer, pl_module, outcome, measured, metadata, log_dir)
                              if rank == 0 else (None, None))
    exported = trainer.strategy.broadcast(exported, src=0)  # 5. the barrier
    outcome.export_dir = Path(exported.export_dir) if exported.export_dir is not None else None
    outcome.notes = list(exported.notes)
    failure = failure_of(trainer, [exported.error], export_error) if exported.error is not None else None
    return AfterFit(outcome, failure=failure)


def exchange(trainer: "pl.Trainer", obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    world = int(trainer.world_size)
    if world <= 1:
        return [obj]
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered
    # A DDP-family strategy without a torch.distributed process group (XLA): one broadcast per rank.
    rank = int(trainer.global_rank)
    return [trainer.strategy.broadcast(obj if r == rank else None, src=r) for r in range(world)]


def failure_of(trainer: "pl.Trainer", failed: List[ErrorInfo], local: Optional[Exception]) -> Failure:
    """Every rank raises (or warns) the same error: the lowest failing rank's, naming it."""
    first = failed[0]
    where = ""
    if trainer.world_size > 1:
        where = f" on rank {first.rank} of {trainer.world_size}"
        if len(failed) > 1:
            where += " (also on " + ", ".join(f"rank {f.rank}: {f.type_name}" for f in failed[1:]) + ")"
    if local is not None and first.rank == trainer.global_rank:
        return Failure(local, where)
    return Failure(first.rebuild(), where, first.type_name, remote=True)


def _rank_zero_buffers(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig
) -> Optional[Dict[str, torch.Tensor]]:
    """Rank zero's buffers, on every rank (step 2). DDP keeps parameters equal on every rank, but BatchNorm
    running statistics are updated by each rank's own last training batches (without sync_batchnorm and
    with no validation after them): every rank must fuse the weights that rank zero exports."""
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


def _measure(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig,
    reference_buffers: Optional[Dict[str, torch.Tensor]],
) -> _Local:
    """This rank's share: pick the weights, fuse a copy, measure parity on this rank's batches."""
    local = _Local()
    try:
        device = resolve_device(config.device, trainer.strategy.root_device)
        model, local.weights = pick_weights(trainer, pl_module, config)
        batches = parity_batches(trainer, config)
        local.batches = len(batches.items)
        local.buffers_differ = reference_buffers is not None and _buffers_differ(model, reference_buffers)
        local.measured = fuse_and_measure(
            model, config, batches,
            example_inputs=getattr(pl_module, "example_input_array", None),
            notes=[f"weights: {local.weights.description}"],
            buffers=reference_buffers if local.buffers_differ else None,
            device=device,
        )
    except Exception as exc:  # noqa: BLE001 - carried to every rank by the exchange, raised there
        local.error = exc
    return local


def _decide(
    trainer: "pl.Trainer", measured: Measured, everyone: List[_RankReport]
) -> Tuple[_Verdict, Optional[Exception]]:
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
        if trainer.world_size > 1:
            shares = ", ".join(f"rank {r.rank}: {r.batches}" for r in everyone)
            notes.append(f"parity merged over {trainer.world_size} ranks, each on its own share of the data "
                         f"(batches per rank: {shares})")
            differ = [str(r.rank) for r in everyone if r.buffers_differ]
            if differ:
                notes.append(
                    f"buffers (BatchNorm running statistics) on rank(s) {', '.join(differ)} differed from rank "
                    "0's (no sync_batchnorm): every rank fused rank 0's, the weights that are exported"
                )
        return _Verdict(outcome.parity, notes), None
    except Exception as exc:  # noqa: BLE001 - carried to every rank by the verdict broadcast
        return _Verdict(None, [], ErrorInfo.of(0, exc)), exc


def _export(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", outcome: Outcome, measured: Measured,
    metadata: Dict[str, Any], log_dir: Optional[str],
) -> Tuple[_Exported, Optional[Exception]]:
    """Rank zero: write the export (atomically: complete or not at all)."""
    try:
        export_outcome(
            outcome, measured, export_dir=export_directory(trainer, measured.config, log_dir),
            protected_paths=checkpoint_files(trainer),
            extra={
                **metadata,
                # The counters at the end of fit; the weights' own are under "weights" (they differ for best).
                "trainer": {"epoch": trainer.current_epoch, "global_step": trainer.global_step},
                "world_size": trainer.world_size,
                "lightning_module": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
            },
        )
        path = str(outcome.export_dir) if outcome.export_dir is not None else None
        return _Exported(path, list(outcome.notes)), None
    except Exception as exc:  # noqa: BLE001 - carried to every rank by the export broadcast
        return _Exported(None, list(outcome.notes), ErrorInfo.of(0, exc)), exc


def unsupported_strategy(strategy: Any) -> Optional[str]:
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
