"""What the commands share: usage errors, the console, importing the user's classes, loading a checkpoint."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Optional, Sequence

__all__ = ["UsageError", "make_console", "print_error", "import_path", "json_arg", "load_lightning_module", "fmt",
           "shape_text", "flags_of", "titled_table"]


class UsageError(Exception):
    """A bad command-line argument: exit status 2, the message only."""


def make_console() -> Any:
    from rich.console import Console

    # Off a terminal (pipes, CI logs, tests) rich assumes 80 columns and wraps table cells: give it room.
    width = None if sys.stdout.isatty() else 140
    return Console(width=width, highlight=False, soft_wrap=False)


def print_error(console: Any, message: str) -> None:
    from rich.console import Console

    Console(file=sys.stderr, width=console.width, highlight=False).print(f"error: {message}", markup=False)


def import_path(path: str, flag: str) -> Any:
    from fx_lightning.common.imports import import_object

    # The current directory first, as `python -m` would: users name their own modules here.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return import_object(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UsageError(f"{flag}: cannot import {path!r}: {exc}") from None


def flags_of(args: Any, record: type) -> Dict[str, object]:
    """The flags that set fields of the options dataclass ``record`` (named as its fields), as its keyword arguments."""
    import dataclasses

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(record) if hasattr(args, f.name)}


def json_arg(text: Optional[str], flag: str) -> Dict[str, object]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag}: expected a JSON object of keyword arguments")
    return value


def load_lightning_module(cls: Any, checkpoint: str, kwargs: Dict[str, object], unsafe: bool) -> Any:
    import pickle

    import torch

    from fx_lightning.errors import FXLightningError

    if not hasattr(cls, "load_from_checkpoint"):
        raise UsageError(f"--model: {cls!r} has no load_from_checkpoint; give a LightningModule subclass")
    if unsafe:
        kwargs = {**kwargs, "weights_only": False}
    try:
        try:
            model = cls.load_from_checkpoint(checkpoint, map_location="cpu", **kwargs)
        except RuntimeError as exc:
            if "_orig_mod." not in str(exc):
                raise
            # Saved from torch.compile'd submodules (Lightning #17415, #20233): load the keys without "_orig_mod.".
            model = cls.load_from_checkpoint(_without_compile_prefixes(checkpoint, unsafe), map_location="cpu", **kwargs)
    except pickle.UnpicklingError as exc:
        raise FXLightningError(
            f"{checkpoint}: the checkpoint holds objects that safe loading refuses ({str(exc).splitlines()[0]}); "
            "if you trust the file, add --unsafe-load"
        ) from None
    except (TypeError, KeyError, RuntimeError) as exc:
        raise FXLightningError(f"{checkpoint}: {cls.__name__}.load_from_checkpoint failed: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"--model: load_from_checkpoint returned a {type(model).__name__}, not a module")
    return model.eval()


def _without_compile_prefixes(checkpoint: str, unsafe: bool) -> Any:
    """The checkpoint, in memory, with the "_orig_mod." segments of torch.compile'd submodules dropped from its keys."""
    import io

    import torch

    from fx_lightning.capture.working_copy import plain_state_dict

    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=not unsafe)
    ckpt["state_dict"] = plain_state_dict(ckpt["state_dict"])
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    buffer.seek(0)
    return buffer


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def titled_table(title: str, *columns: str, right: Sequence[str] = (), **kwargs: Any) -> Any:
    """A rich table titled on the left, with ``columns`` (those in ``right`` right-justified: figures)."""
    from rich.table import Table

    out = Table(title=title, title_justify="left", **kwargs)
    for col in columns:
        out.add_column(col, justify="right" if col in right else "left")
    return out


def shape_text(shape: Any) -> str:
    if isinstance(shape, list):
        return "(" + ", ".join(str(s) for s in shape) + ")"
    return str(shape)

