"""``pt2``: a ``torch.export`` ExportedProgram (``torch.export.save``): no pickled code, dynamic batch."""

from __future__ import annotations

import types
from pathlib import Path

import torch
from torch import nn

from fx_lightning.errors import ExportError, first_line
from fx_lightning.formats.base import Format, FormatEntry, WriteContext

__all__ = ["FORMAT", "export_program"]


def export_program(ctx: WriteContext) -> "torch.export.ExportedProgram":
    """The context's ``torch.export`` program of the plain fused model (made once for every writer)."""
    try:
        return ctx.export()
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"torch.export failed: {type(exc).__name__}: {first_line(exc)}") from exc


def _write(root: Path, ctx: WriteContext) -> FormatEntry:
    program = export_program(ctx)
    torch.export.save(program, root / FORMAT.path)
    return FormatEntry(FORMAT.path, "torch.export.load(path).module()",
                       options={"range_constraints": {str(k): str(v) for k, v in program.range_constraints.items()}})


def _load(root: Path, entry: FormatEntry, device: torch.device) -> nn.Module:
    program = torch.export.load(str(root / entry.path))
    if torch.device(entry.device or "cpu") != device:
        # ExportedProgram.module().to() would leave devices written into the graph (factory calls) behind.
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    module = program.module()
    _allow_eval(module)
    return module


def _allow_eval(module: nn.Module) -> None:
    """``ExportedProgram.module()`` raises on ``eval()``; it is already an inference graph, so make
    ``eval()`` a no-op (serving code calls it out of habit) and keep ``train()`` an error."""
    for m in module.modules():
        m.training = False  # the flags only; the graph was exported in eval mode

    def _eval(self: nn.Module) -> nn.Module:
        return self

    def _train(self: nn.Module, mode: bool = True) -> nn.Module:
        if mode:
            raise NotImplementedError("a loaded pt2 export is an inference graph; train() is not supported.")
        return self

    module.eval = types.MethodType(_eval, module)  # type: ignore[method-assign]
    module.train = types.MethodType(_train, module)  # type: ignore[method-assign]


FORMAT = Format(
    name="pt2",
    path="model.pt2",
    write=_write,
    load=_load,
    preference=10,
    readme=(
        "- `{path}` (pt2, recommended): `torch.export.load('{path}').module()`. No pickled code.\n"
        "  Already an inference graph: `.eval()` on it raises in plain torch; just call it."
    ),
    writes_variants=True,
    triton_backend="python",
    triton_refusal="python=False: a torch.export program (.pt2) is served by the Python-backend model only "
                   "(Triton's PyTorch backend does not load it)",
)
