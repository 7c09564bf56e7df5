"""``graph_module``: the fused ``torch.fx.GraphModule``, pickled with ``torch.save`` (code included)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import List

import torch
from torch import nn

from fx_lightning.errors import ExportError
from fx_lightning.formats.base import Format, FormatEntry, WriteContext, pickled_classes

__all__ = ["FORMAT"]


def _local_object(error: BaseException) -> bool:
    # pickle's messages for a class or function defined inside a function, which cannot be found by its name
    # (3.11: AttributeError or PicklingError; later versions: PicklingError).
    return any(words in str(error) for words in ("local object", "<locals>", "attribute lookup"))


def _save(model: nn.Module, path: Path) -> List[str]:
    """Pickle ``model``; returns the modules loading it needs beyond torch and the model's own.

    A class or function defined inside a function (a library caching the ``namedtuple`` output class it builds on
    its first call, a lambda) cannot be pickled by reference: cloudpickle pickles those by value and everything else
    as pickle does."""
    try:
        torch.save(model, path)
        return []
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        if not _local_object(error):
            raise
        try:
            import cloudpickle
        except ImportError:
            raise ExportError(
                f"{error}: a class defined inside a function is pickled by value only with cloudpickle, which is "
                "not installed: pip install cloudpickle (or fx-lightning[cloudpickle]).") from error
    torch.save(model, path, pickle_module=cloudpickle)
    return ["cloudpickle"]


def _write(root: Path, ctx: WriteContext) -> FormatEntry:
    needs = _save(ctx.model, root / FORMAT.path)  # imported before loading, with the install line when missing
    return FormatEntry(FORMAT.path, "torch.load(path, weights_only=False)", weights_only=False, pickled_code=True,
                       imports=needs,
                       options={"warning": "pickled Python objects: torch.load(..., weights_only=False) runs code; "
                                           "load only trusted files",
                                "requires_classes": pickled_classes(ctx.model)})


def _load(root: Path, entry: FormatEntry, device: torch.device) -> nn.Module:
    # weights_only=False is required: a GraphModule pickle carries its generated code (see the manifest).
    module = torch.load(str(root / entry.path), map_location=device, weights_only=False)
    if not isinstance(module, nn.Module):
        raise ExportError(f"{root / entry.path}: holds a {type(module).__name__}, not a module.")
    return module.eval()


FORMAT = Format(
    from_program=False,
    name="graph_module",
    path="model.pt",
    write=_write,
    load=_load,
    preference=20,
    pickled_code=True,
    readme=(
        "- `{path}` (graph_module): `torch.load('{path}', weights_only=False).eval()`.\n"
        "  **This is pickled code** (weights_only=False runs it): load only files you trust."
    ),
    triton_refusal="a pickled GraphModule is not TorchScript, which is what Triton's PyTorch backend loads, and it "
                   "holds pickled code",
)
