"""``fx-lightning fuse CKPT``: the callback's pipeline (fuse -> parity -> export) on a checkpoint, after the fact."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from fx_lightning.cli.common import UsageError, import_path, json_arg, load_lightning_module, print_error

__all__ = ["add_parser", "run", "load_cli_config"]


def add_parser(sub: Any) -> None:
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


def load_cli_config(path: Optional[str], overrides: Sequence[str]) -> Any:
    """The FuseConfig from a YAML file (a FuseConfig, or a Hydra node with ``_target_``) and dotlist overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from fx_lightning.config import load_config
    from fx_lightning.errors import ConfigError

    merged = OmegaConf.create({})
    if path:
        if not os.path.isfile(path):
            raise UsageError(f"--config: no such file: {path}")
        try:
            loaded = OmegaConf.load(path)
        except (OSError, OmegaConfBaseException, ValueError) as exc:
            raise ConfigError(f"--config {path}: cannot read it: {exc}") from None
        if not isinstance(loaded, type(merged)):
            raise ConfigError(f"--config {path}: expected a mapping of FuseConfig keys, got a list.")
        loaded.pop("_target_", None)  # a Hydra callback node: the rest are FuseConfig's keys
        merged = loaded
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise UsageError(f"overrides must look like dotted.key=value; got {', '.join(map(repr, bad))}")
    if overrides:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"overrides: {exc}") from None
    return load_config(merged)


def run(args: argparse.Namespace, console: Any) -> int:
    """``fx-lightning fuse``: the callback's pipeline on a checkpoint."""
    import dataclasses

    import torch

    from fx_lightning.errors import NoInputsError, require_inputs
    from fx_lightning.export.progress import LineProgress
    from fx_lightning.pipeline import Batches, fuse_verify_export, summary_text
    from fx_lightning.common.provenance import Provenance, WeightsInfo

    cfg = load_cli_config(args.config, args.overrides)
    if not os.path.isfile(args.checkpoint):
        raise UsageError(f"checkpoint: no such file: {args.checkpoint}")
    model_cls = import_path(args.model, "--model")
    model = load_lightning_module(model_cls, args.checkpoint, json_arg(args.model_args, "--model-args"),
                                   args.unsafe_load)

    batches = _datamodule_batches(args, cfg) if args.datamodule else Batches([], "example")
    example = getattr(model, "example_input_array", None)
    if args.input_shape:
        example = _random_input(args.input_shape, args.input_dtype)
    try:  # here a usage error (exit 2): the flags that give inputs are missing
        require_inputs(bool(batches.items) or example is not None, "parity and export",
                       f"--datamodule pkg.mod:Class or --input-shape N,C,H,W ({args.model} has no "
                       "example_input_array)")
    except NoInputsError as exc:
        raise UsageError(str(exc)) from None

    export_dir = args.output or cfg.export.dir or "fx_fused"
    cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, dir=str(export_dir)))
    entries = _checkpoint_entries(args.checkpoint)
    epoch, step = (entries.get(k) if isinstance(entries.get(k), int) else None for k in ("epoch", "global_step"))
    checkpoint = os.path.abspath(args.checkpoint)
    extra = Provenance(
        weights=WeightsInfo("checkpoint", f"checkpoint {checkpoint}", epoch, step, checkpoint),
        lightning_module=f"{model_cls.__module__}.{model_cls.__qualname__}",
        checkpoint=checkpoint,
        model=args.model,
        written_by="fx-lightning fuse",
    )
    console.print(f"fusing {args.checkpoint} ({args.model})", markup=False)
    with torch.no_grad():
        outcome = fuse_verify_export(
            model, cfg, batches, example_inputs=example, export_dir=Path(export_dir), write=not args.dry_run,
            protected_paths=[args.checkpoint], extra=extra,
            progress=LineProgress(lambda line: console.print(line, markup=False, highlight=False)),
        )
    console.print(summary_text(outcome), markup=False)
    if outcome.parity is not None and not outcome.parity.passed:
        print_error(console, "parity failed: nothing was exported")
        return 1
    if outcome.export_dir is None and args.dry_run:
        console.print("dry run: nothing written", markup=False)
    return 0


def _checkpoint_entries(checkpoint: str) -> Dict[str, object]:
    """The checkpoint's top-level entries, read with the safe loader ({} when it cannot: they are metadata only, the
    model loaded already)."""
    import torch

    try:
        entries = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001
        return {}
    return entries if isinstance(entries, dict) else {}


def _datamodule_batches(args: argparse.Namespace, cfg: Any) -> Any:
    """Parity batches from --datamodule, following parity.data (auto: val, else train)."""
    from fx_lightning.callback.trainer_data import choose_batches

    dm_cls = import_path(args.datamodule, "--datamodule")
    kwargs = json_arg(args.datamodule_args, "--datamodule-args")
    if not kwargs and hasattr(dm_cls, "load_from_checkpoint") and \
            _checkpoint_entries(args.checkpoint).get("datamodule_hyper_parameters"):
        datamodule = dm_cls.load_from_checkpoint(args.checkpoint, map_location="cpu")
    else:
        datamodule = dm_cls(**kwargs)
    if hasattr(datamodule, "prepare_data"):
        datamodule.prepare_data()
    if hasattr(datamodule, "setup"):
        datamodule.setup("fit")

    def loader(name: str) -> Any:
        method = getattr(datamodule, f"{name}_dataloader", None)
        try:
            return method() if method is not None else None
        except NotImplementedError:  # Lightning's hook default when the datamodule defines no such loader
            return None

    return choose_batches({"val": lambda: loader("val"), "train": lambda: loader("train")}, cfg.parity)


def _random_input(shape_text: str, dtype_text: str) -> Any:
    import torch

    try:
        shape = [int(s) for s in shape_text.strip().replace("x", ",").split(",")]  # 8,3,32,32 or 8x3x32x32
    except ValueError:
        raise UsageError(f"--input-shape: expected integers like 8,3,32,32, got {shape_text!r}") from None
    if not shape or any(s < 1 for s in shape):
        raise UsageError(f"--input-shape: expected positive integers like 8,3,32,32, got {shape_text!r}")
    from fx_lightning.common.dtypes import BY_NAME, DTYPES

    found = BY_NAME.get(dtype_text)
    if found is None:
        raise UsageError(f"--input-dtype: {dtype_text!r}; allowed: {', '.join(d.torch for d in DTYPES)} (or "
                         f"{', '.join(a for d in DTYPES for a in d.aliases)})")
    dtype = getattr(torch, found.torch)
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 10, shape, generator=g, dtype=dtype)

