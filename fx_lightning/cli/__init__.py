"""The ``fx-lightning`` command line: fuse a checkpoint after the fact, inspect an export, benchmark it.

    fx-lightning fuse CKPT --model pkg.module:Class [--config file.yaml] [--datamodule pkg.mod:Class]
                     [--input-shape 1,3,32,32] [--output DIR] [dotted.key=value ...]
    fx-lightning inspect DIR [--json] [--html [FILE]]
    fx-lightning bench DIR [--format pt2 ...] [--batch-size 8] [--iters 50] [--select [--strategy max_throughput]]
    fx-lightning triton DIR OUT [--name N] [--format onnx ...] [--max-batch-size 8] [--instances 1]
    fx-lightning mlflow DIR --tracking-uri URI [--run-id ID] [--register NAME [--alias A]]

``fuse`` runs the same pipeline as :class:`~fx_lightning.FXFuseCallback` (fuse -> parity -> export), with
the same config schema; overrides use OmegaConf's dotlist syntax (``parity.rtol=1e-3``,
``export.formats=[pt2,onnx]``). Exit status: 0 on success, 1 when fusion, parity or export fails, 2 on
usage errors.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any, Optional, Sequence

from fx_lightning.cli.common import UsageError, make_console, print_error

__all__ = ["main", "build_parser", "COMMANDS"]

COMMANDS = ("fuse", "inspect", "bench", "serve", "triton", "mlflow")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fx-lightning",
        description="Fuse (fold BatchNorms), verify and export PyTorch Lightning models with torch.fx.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for command in COMMANDS:
        _command(command).add_parser(sub)
    return parser


def _command(name: str) -> Any:
    """The module of the ``name`` command (``fx_lightning.cli.<name>_cmd``): its ``add_parser`` and ``run``."""
    return importlib.import_module(f"fx_lightning.cli.{name}_cmd")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``fx-lightning`` console script; returns the exit status."""
    parser = build_parser()
    # argparse gives every positional its values in the first run of them, so overrides written after
    # options (`fuse CKPT --model X a.b=1`) come back as unknown arguments: collect them here.
    args, rest = parser.parse_known_args(argv)
    if rest:
        if args.command != "fuse" or any(r.startswith("-") for r in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *rest]
    from fx_lightning.errors import FXLightningError

    console = make_console()
    try:
        return _command(args.command).run(args, console)
    except FXLightningError as exc:
        print_error(console, f"{type(exc).__name__}: {exc}")
        return 1
    except UsageError as exc:
        print_error(console, str(exc))
        return 2
