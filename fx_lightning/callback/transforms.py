"""What the training code shows about the model's input, for ``export.preprocess`` and ``export.labels``: the
validation data's normalisation (a torchvision ``Normalize`` in the validation dataloader's
``dataset.transform``) and the class names (the datamodule's or the validation dataset's ``classes``).

torchvision is never imported here: a dataset holding torchvision transforms has imported it already, and the
transforms are recognised by their class (name and module), so ``fx_lightning`` works without it.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import lightning.pytorch as pl
import torch

from fx_lightning.callback.trainer_data import first_loader, trainer_loaders
from fx_lightning.config import FuseConfig
from fx_lightning.export.write.input_contract import Found, FoundLabels, InputContract, resolve_input_contract
from fx_lightning.export.manifest import Preprocess

__all__ = ["find_in_training_code", "input_contract", "normalisation_of"]

_PIXELS = 1.0 / 255.0  # what the scaling conversions (ToTensor, ToDtype(scale=True)) multiply uint8 pixels by


def input_contract(trainer: "pl.Trainer", config: FuseConfig) -> InputContract:
    """``export.preprocess`` and ``export.labels`` with what the trainer's data shows (a ConfigError when the
    prologue is enabled without mean/std and no Normalize is found)."""
    found, searched = find_in_training_code(trainer)
    return resolve_input_contract(config.export, found, searched)


def find_in_training_code(trainer: "pl.Trainer") -> Tuple[Found, str]:
    """The normalisation and class names the trainer's validation data shows, and where they were looked for.
    Never raises: the user's own loaders may, and then nothing is found."""
    datamodule = getattr(trainer, "datamodule", None)
    prefix = "datamodule.val_dataloader()" if datamodule is not None else "the validation dataloader"
    try:
        loader = first_loader(trainer_loaders(trainer)["val"]())
        datasets = list(_datasets(getattr(loader, "dataset", None), f"{prefix}.dataset"))
    except Exception:  # noqa: BLE001 - nothing found; the config decides
        return Found(), f"{prefix}.dataset.transform"
    preprocess = next((p for dataset, path in datasets if (p := _dataset_normalisation(dataset, path))), None)
    labels = _class_names(datamodule, "datamodule.classes") or next(
        (names for dataset, path in datasets if (names := _class_names(dataset, f"{path}.classes"))), None)
    return Found(preprocess, labels), f"{prefix}.dataset.transform"


def _datasets(dataset: Any, path: str) -> Iterator[Tuple[Any, str]]:
    """``dataset`` and those it wraps (``Subset``-like ``.dataset``), each with its path."""
    seen = 0
    while dataset is not None and seen < 8:
        yield dataset, path
        dataset, path, seen = getattr(dataset, "dataset", None), f"{path}.dataset", seen + 1


def _dataset_normalisation(dataset: Any, path: str) -> Optional[Preprocess]:
    for attribute in ("transform", "transforms"):
        found = normalisation_of(getattr(dataset, attribute, None), f"{path}.{attribute}")
        if found is not None:
            return found
    return None


def normalisation_of(transform: Any, source: str) -> Optional[Preprocess]:
    """The ``Normalize(mean, std)`` of a torchvision transform (nested ``Compose`` included), with the scale of
    the conversion before it (``ToTensor``, ``ConvertImageDtype`` or ``ToDtype(float32, scale=True)``: 1/255; else 1),
    or None."""
    scale = 1.0
    for step in _steps(transform):
        name = _torchvision_class(step)
        if name in ("ToTensor", "ConvertImageDtype"):
            scale = _PIXELS
        elif name == "ToDtype" and getattr(step, "scale", False):
            scale = _PIXELS  # a ToDtype without scale=True leaves the values (and the scale so far) as they are
        elif name == "Normalize":
            mean, std = _floats(getattr(step, "mean", None)), _floats(getattr(step, "std", None))
            if mean and std and len(mean) == len(std) and all(s > 0 for s in std):
                return Preprocess(mean=mean, std=std, scale=scale, source=source)
            return None
    return None


def _steps(transform: Any, depth: int = 0) -> List[Any]:
    """A transform flattened: Compose (v1, v2) and torchvision's StandardTransform opened up, in order."""
    if transform is None or depth > 8:
        return []
    inner = getattr(transform, "transforms", None)
    if isinstance(inner, (list, tuple)):
        return [s for t in inner for s in _steps(t, depth + 1)]
    if _torchvision_class(transform) == "StandardTransform":
        return _steps(getattr(transform, "transform", None), depth + 1)
    return [transform]


def _torchvision_class(obj: Any) -> Optional[str]:
    cls = type(obj)
    return cls.__name__ if cls.__module__.startswith("torchvision.") else None


def _floats(value: Any) -> List[float]:
    try:
        return [float(v) for v in torch.as_tensor(value, dtype=torch.float64).flatten().tolist()]
    except (TypeError, ValueError, RuntimeError):
        return []


def _class_names(owner: Any, source: str) -> Optional[FoundLabels]:
    names = getattr(owner, "classes", None) if owner is not None else None
    if isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names):
        return FoundLabels(tuple(names), source)
    return None
