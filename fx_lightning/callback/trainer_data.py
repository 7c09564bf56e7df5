"""What the callback (and the CLI) read from a Trainer or a DataModule: parity batches, the weights to fuse,
the checkpoints to protect, and where to export.

Free functions over Lightning objects; none of them changes the LightningModule or touches a checkpoint.
"""

from __future__ import annotations

import copy
import itertools
import platform
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import lightning.pytorch as pl

from fx_lightning.common.batches import loader_sample_counts, model_device_dtype
from fx_lightning.callback.namespaces import lightning_classes
from fx_lightning.capture.working_copy import plain_state_dict, strip_compiled
from fx_lightning.config import FuseConfig, ParityConfig, ParityData, WeightsSource
from fx_lightning.errors import ConfigError
from fx_lightning.common.notes import NoteKind
from fx_lightning.pipeline import Batches, calibration_batch_count
from fx_lightning.common.provenance import WeightsInfo

__all__ = [
    "SOURCE_ORDER",
    "SOURCE_STAGES",
    "first_loader",
    "choose_batches",
    "parity_batches",
    "trainer_loaders",
    "validation_will_run",
    "export_directory",
    "pick_weights",
    "checkpoint_callbacks",
    "checkpoint_files",
    "checkpoint_message",
]

BATCHES_READ = NoteKind("batches_read", "parity read {count} batch(es) of {source} data (at most {limit}: {why})")
CALIBRATION_READ = NoteKind("calibration_read", "the lossy variants were calibrated on {count} batch(es) of "
                                                "training data and judged on the validation data")
NO_VALIDATION_DATA = NoteKind("no_validation_data", "no validation data: parity used training batches")
EXAMPLE_INPUT_ARRAY_USED = NoteKind("example_input_array_used", "no {sources} data: parity used the "
                                                                "LightningModule's example_input_array")

# parity.data -> the sources tried, in order (example_input_array is the pipeline's own fallback), and the stage
# each source's batches run in (what the callback observes).
SOURCE_ORDER: Dict[ParityData, Tuple[str, ...]] = {
    ParityData.auto: ("val", "train"),
    ParityData.val: ("val",),
    ParityData.train: ("train",),
    ParityData.example: (),
}
SOURCE_STAGES = {"val": "validation", "train": "training"}


def first_loader(loaders: Any) -> Any:
    """The first loader of a loader, a list/tuple or a dict of loaders (None for none)."""
    if loaders is None:
        return None
    if isinstance(loaders, dict):
        return next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


# A source's own batch limit (the trainer's limit_val_batches, say): (batches, "why") or None for no limit.
BatchLimit = Callable[[str, Any], Optional[Tuple[int, str]]]


def choose_batches(
    loaders: Mapping[str, Callable[[], Any]], parity: ParityConfig, limit: Optional[BatchLimit] = None
) -> Batches:
    """Up to ``parity.max_batches`` batches (one when parity is off: capture and export still need an input)
    from the first source in ``parity.data``'s order whose loader gives any; ``loaders`` maps a source name
    (``val``, ``train``) to a function returning its loader(s) or None. ``limit`` caps what is read from a
    source the way the training run capped it, and the note says so."""
    order = SOURCE_ORDER[parity.data]
    for name in order:
        getter = loaders.get(name)
        loader = first_loader(getter()) if getter is not None else None
        if loader is None:
            continue
        n, why = (parity.max_batches, "parity.max_batches") if parity.enabled else (1, "parity is disabled")
        capped = limit(name, loader) if limit is not None else None
        if capped is not None and capped[0] < n:
            n, why = capped
        batches = list(itertools.islice(iter(loader), n))
        if batches:
            notes = [NO_VALIDATION_DATA()] if name == "train" and len(order) > 1 else []
            notes.append(BATCHES_READ(count=len(batches), source=SOURCE_STAGES[name], limit=n, why=why))
            return Batches(batches, name, notes, samples=loader_sample_counts(loader, len(batches)))
    notes = [EXAMPLE_INPUT_ARRAY_USED(sources=" or ".join(order))] if parity.data is not ParityData.example else []
    return Batches([], "example", notes)


def export_directory(trainer: "pl.Trainer", config: FuseConfig, log_dir: Optional[str]) -> Path:
    """``export.dir``, else ``<trainer.log_dir>/fx_fused`` (``log_dir``: read by the caller on every rank)."""
    if config.export.dir:
        return Path(config.export.dir)
    return Path(log_dir or trainer.default_root_dir) / "fx_fused"


def trainer_loaders(trainer: "pl.Trainer") -> Dict[str, Callable[[], Any]]:
    """Source name -> a function returning the trainer's loader for it (set up or not yet)."""
    # A loader that the fit loop has not set up yet (before training) comes from its data source.
    def val() -> Any:
        loader = first_loader(trainer.val_dataloaders)
        return loader if loader is not None else _loader_from_source(trainer.fit_loop.epoch_loop.val_loop)

    def train() -> Any:
        loader = first_loader(trainer.train_dataloader)
        return loader if loader is not None else _loader_from_source(trainer.fit_loop)

    return {"val": val, "train": train}


def validation_will_run(trainer: "pl.Trainer") -> bool:
    """Whether fit will run validation steps: a validation loader, and a ``limit_val_batches`` that reads one."""
    return getattr(trainer, "limit_val_batches", None) != 0 and trainer_loaders(trainer)["val"]() is not None


def _loader_from_source(loop: Any) -> Any:
    """A loop's loader before the loop has set it up (Lightning internals: guarded)."""
    source = getattr(loop, "_data_source", None)
    try:
        if source is not None and source.is_defined():
            return first_loader(source.dataloader())
    except Exception:  # noqa: BLE001 - no loader means "try the next source"
        return None
    return None


def parity_batches(trainer: "pl.Trainer", config: FuseConfig) -> Batches:
    """Parity batches from the trainer's loaders (validation, else training data), never more than the
    trainer's ``limit_val_batches`` / ``limit_train_batches`` let training read; and, when a lossy variant is
    enabled and parity reads validation data, its calibration batches from the training data (a variant is then
    judged on data it was not calibrated on)."""
    loaders = trainer_loaders(trainer)
    batches = choose_batches(loaders, config.parity, lambda name, loader: _trainer_limit(trainer, name, loader))
    count = calibration_batch_count(config)
    train = first_loader(loaders["train"]()) if count and batches.source == "val" else None
    if train is not None:
        batches.calibration = list(itertools.islice(iter(train), count))
        if batches.calibration:
            batches.notes.append(CALIBRATION_READ(count=len(batches.calibration)))
    return batches


def _trainer_limit(trainer: "pl.Trainer", name: str, loader: Any) -> Optional[Tuple[int, str]]:
    """The number of batches the trainer reads from ``loader`` per epoch, as Lightning computes it."""
    key = f"limit_{name}_batches"
    value = getattr(trainer, key, None)
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value, f"the trainer's {key}={value}"
    try:
        length = len(loader)
    except TypeError:  # an iterable without a length: Lightning allows only 1.0 there
        return None
    if float(value) >= 1.0:
        return None
    return int(length * float(value)), f"the trainer's {key}={value} of {length} batches"


def pick_weights(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", config: FuseConfig
) -> Tuple[Any, WeightsInfo]:
    """The module to fuse and its weights' description: the LightningModule itself (``last``) or a copy
    holding the ModelCheckpoint's best checkpoint (``best``), with that checkpoint's epoch and step."""
    if config.weights is WeightsSource.last:
        return pl_module, WeightsInfo("last", "last (the LightningModule as training left it)",
                                      trainer.current_epoch, trainer.global_step)
    ckpt_cb = trainer.checkpoint_callback
    if not isinstance(ckpt_cb, lightning_classes("callbacks.ModelCheckpoint")):
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
    device, _ = model_device_dtype(pl_module)
    # Our own trainer wrote this checkpoint during this fit, so full unpickling is trusted here.
    checkpoint = _load(path, map_location=device or "cpu", weights_only=False)
    # A copy takes the best weights: the LightningModule keeps its last-epoch weights. torch.compile'd
    # submodules are unwrapped in the copy, and their "_orig_mod." key segments dropped from the checkpoint.
    best = strip_compiled(copy.deepcopy(pl_module))
    best.load_state_dict(plain_state_dict(checkpoint["state_dict"]), strict=True)
    score = ckpt_cb.best_model_score
    score_text = f", {ckpt_cb.monitor}={float(score):.6g}" if score is not None and ckpt_cb.monitor else ""
    epoch, step = checkpoint.get("epoch"), checkpoint.get("global_step")
    where = f" (epoch {epoch}, global step {step})" if epoch is not None else ""
    return best, WeightsInfo("best", f"best checkpoint {path}{score_text}{where}", epoch, step, str(path))


def checkpoint_callbacks(trainer: "pl.Trainer") -> List[Any]:
    """The trainer's ModelCheckpoints (of either Lightning namespace)."""
    return [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, lightning_classes("callbacks.ModelCheckpoint"))]


def checkpoint_files(trainer: "pl.Trainer") -> List[Path]:
    """Every checkpoint the trainer's ModelCheckpoints know of (an export must never replace one)."""
    return [Path(p) for cb in checkpoint_callbacks(trainer)
            for p in (cb.best_model_path, cb.last_model_path, *cb.best_k_models) if p]


def checkpoint_message(trainer: "pl.Trainer") -> str:
    """Where the user's trained weights are, for error messages."""
    callbacks = checkpoint_callbacks(trainer)
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
