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
from typing import Optional, Sequence

from fx_lightning.cli.common import UsageError, make_console, print_error

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fx-lightning",
        description="Fuse (fold BatchNorms), verify and export PyTorch Lightning models with torch.fx.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{fuse,inspect,bench,serve,triton,mlflow}")

    fuse = sub.add_parser(
        "fuse", help="fuse a Lightning checkpoint, check parity and export it",
        description="Fuse a Lightning checkpoint after training: the callback's pipeline, from the command line.",
    )
    fuse.add_argument("checkpoint", help="a .ckpt written by Lightning")
    fuse.add_argument("--model", required=True, metavar="PKG.MODULE:CLASS",
                      help="the LightningModule class (its load_from_checkpoint rebuilds the model)")
    fuse.add_argument("--config", metavar="FILE.yaml", help="a FuseConfig YAML (the callback's options)")
    fuse.add_argument("--datamodule", metavar="PKG.MODULE:CLASS",
                      help="a LightningDataModule whose val (else train) batches are used for parity")
    fuse.add_argument("--datamodule-args", metavar="JSON", default=None,
                      help="keyword arguments for the datamodule, as JSON (default: its saved hyperparameters)")
    fuse.add_argument("--model-args", metavar="JSON", default=None,
                      help="extra keyword arguments for load_from_checkpoint, as JSON")
    fuse.add_argument("--input-shape", metavar="N,C,H,W",
                      help="random example input of this shape (when there is no datamodule/example_input_array)")
    fuse.add_argument("--input-dtype", default="float32", help="dtype of --input-shape's tensor (default float32)")
    fuse.add_argument("--output", "-o", metavar="DIR",
                      help="export directory (default: export.dir, else ./fx_fused)")
    fuse.add_argument("--dry-run", action="store_true", help="fuse and check parity, write nothing")
    fuse.add_argument("--unsafe-load", action="store_true",
                      help="load the checkpoint with weights_only=False (only for checkpoints you trust)")
    fuse.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                      help="config overrides in dotted form, e.g. parity.rtol=1e-3 export.formats=[pt2]")

    inspect_ = sub.add_parser("inspect", help="print an export's manifest as tables")
    inspect_.add_argument("directory")
    inspect_.add_argument("--json", action="store_true", help="print the manifest JSON instead")
    inspect_.add_argument("--verify", action="store_true", help="also check every file's sha256")
    inspect_.add_argument("--html", nargs="?", const="", default=None, metavar="FILE",
                          help="write the export's report.html (default: DIR/report.html; the same file the export "
                               "wrote, for an export written before it had one) and print its path")

    from fx_lightning.cli import bench_cmd, serve_cmd

    bench_cmd.add_parser(sub)

    serve_cmd.add_parser(sub)
    from fx_lightning.cli import triton_cmd

    triton_cmd.add_parser(sub)
    from fx_lightning.cli import mlflow_cmd

    mlflow_cmd.add_parser(sub)
    return parser


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
    from fx_lightning.cli import bench_cmd, fuse_cmd, inspect_cmd

    try:
        if args.command == "fuse":
            return fuse_cmd.run(args, console)
        if args.command == "inspect":
            return inspect_cmd.run(args, console)
        if args.command == "serve":
            from fx_lightning.cli import serve_cmd

            return serve_cmd.run(args, console)
        if args.command == "triton":
            from fx_lightning.cli import triton_cmd

            return triton_cmd.run(args, console)
        if args.command == "mlflow":
            from fx_lightning.cli import mlflow_cmd

            return mlflow_cmd.run(args, console)
        return bench_cmd.run(args, console)
    except FXLightningError as exc:
        print_error(console, f"{type(exc).__name__}: {exc}")
        return 1
    except UsageError as exc:
        print_error(console, str(exc))
        return 2
