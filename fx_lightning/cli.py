"""The ``fx-lightning`` command line: fuse a checkpoint after the fact, inspect an export, benchmark it.

    fx-lightning fuse CKPT --model pkg.module:Class [--config file.yaml] [--datamodule pkg.mod:Class]
                     [--input-shape 1,3,32,32] [--output DIR] [dotted.key=value ...]
    fx-lightning inspect DIR [--json]
    fx-lightning bench DIR [--format pt2 ...] [--batch-size 8] [--iters 50]

``fuse`` runs the same pipeline as :class:`~fx_lightning.FXFuseCallback` (fuse -> parity -> export), with
the same config schema; overrides use OmegaConf's dotlist syntax (``parity.rtol=1e-3``,
``export.formats=[pt2,onnx]``). Exit status: 0 on success, 1 when fusion, parity or export fails, 2 on
usage errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["main", "build_parser", "load_cli_config"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fx-lightning",
        description="Fuse (fold BatchNorms), verify and export PyTorch Lightning models with torch.fx.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{fuse,inspect,bench}")

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

    bench = sub.add_parser(
        "bench", help="latency of an export against the unfused model, on random inputs",
        description="Times each exported format (and the unfused model, when its class and checkpoint are known) "
                    "on random inputs shaped as the manifest says.",
    )
    bench.add_argument("directory")
    bench.add_argument("--format", action="append", dest="formats", metavar="FORMAT",
                       help="format(s) to time (repeatable; default: every format in the export)")
    bench.add_argument("--batch-size", type=int, default=8)
    bench.add_argument("--iters", type=int, default=50, help="timed iterations per model")
    bench.add_argument("--warmup", type=int, default=5)
    bench.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run")
    bench.add_argument("--model", metavar="PKG.MODULE:CLASS",
                       help="unfused LightningModule class (default: the one recorded in the manifest)")
    bench.add_argument("--checkpoint", help="its checkpoint (default: the one recorded in the manifest)")
    bench.add_argument("--no-unfused", action="store_true", help="time the export formats only")
    bench.add_argument("--unsafe-load", action="store_true", help="load the checkpoint with weights_only=False")
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

    console = _console()
    try:
        if args.command == "fuse":
            return _cmd_fuse(args, console)
        if args.command == "inspect":
            return _cmd_inspect(args, console)
        return _cmd_bench(args, console)
    except FXLightningError as exc:
        _error(console, f"{type(exc).__name__}: {exc}")
        return 1
    except _UsageError as exc:
        _error(console, str(exc))
        return 2


class _UsageError(Exception):
    """A bad command-line argument: exit status 2, the message only."""


def _console() -> Any:
    from rich.console import Console

    # Off a terminal (pipes, CI logs, tests) rich assumes 80 columns and wraps table cells: give it room.
    width = None if sys.stdout.isatty() else 140
    return Console(width=width, highlight=False, soft_wrap=False)


def _error(console: Any, message: str) -> None:
    from rich.console import Console

    Console(file=sys.stderr, width=console.width, highlight=False).print(f"error: {message}", markup=False)


# =============================================================================================== fuse


def load_cli_config(path: Optional[str], overrides: Sequence[str]) -> Any:
    """The FuseConfig from a YAML file (a FuseConfig, or a Hydra node with ``_target_``) and dotlist overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from fx_lightning.config import load_config
    from fx_lightning.errors import ConfigError

    merged = OmegaConf.create({})
    if path:
        if not os.path.isfile(path):
            raise _UsageError(f"--config: no such file: {path}")
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
        raise _UsageError(f"overrides must look like dotted.key=value; got {', '.join(map(repr, bad))}")
    if overrides:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"overrides: {exc}") from None
    return load_config(merged)


def _cmd_fuse(args: argparse.Namespace, console: Any) -> int:
    import dataclasses

    import torch

    from fx_lightning.pipeline import Batches, fuse_verify_export, summary_text

    cfg = load_cli_config(args.config, args.overrides)
    if not os.path.isfile(args.checkpoint):
        raise _UsageError(f"checkpoint: no such file: {args.checkpoint}")
    model_cls = _import(args.model, "--model")
    model = _load_lightning_module(model_cls, args.checkpoint, _json_arg(args.model_args, "--model-args"),
                                   args.unsafe_load)

    batches = _datamodule_batches(args, cfg) if args.datamodule else Batches([], "example")
    example = getattr(model, "example_input_array", None)
    if args.input_shape:
        example = _random_input(args.input_shape, args.input_dtype)
    if not batches.items and example is None:
        raise _UsageError(
            "no inputs for parity and export: give --datamodule pkg.mod:Class or --input-shape N,C,H,W "
            f"({args.model} has no example_input_array)"
        )

    export_dir = args.output or cfg.export.dir or "fx_fused"
    cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, dir=str(export_dir)))
    meta = _checkpoint_meta(args.checkpoint)
    checkpoint = os.path.abspath(args.checkpoint)
    extra = {
        "weights": {"source": "checkpoint", "description": f"checkpoint {checkpoint}", "epoch": meta.get("epoch"),
                    "global_step": meta.get("global_step"), "checkpoint": checkpoint},
        "lightning_module": f"{model_cls.__module__}.{model_cls.__qualname__}",
        "checkpoint": os.path.abspath(args.checkpoint),
        "model": args.model,
        "written_by": "fx-lightning fuse",
    }
    console.print(f"fusing {args.checkpoint} ({args.model})", markup=False)
    with torch.no_grad():
        outcome = fuse_verify_export(
            model, cfg, batches, example_inputs=example, export_dir=Path(export_dir), write=not args.dry_run,
            protected_paths=[args.checkpoint], extra=extra,
        )
    console.print(summary_text(outcome), markup=False)
    if outcome.parity is not None and not outcome.parity.passed:
        _error(console, "parity failed: nothing was exported")
        return 1
    if outcome.export_dir is None and args.dry_run:
        console.print("dry run: nothing written", markup=False)
    return 0


def _import(path: str, flag: str) -> Any:
    from fx_lightning._imports import import_object

    # The current directory first, as `python -m` would: users name their own modules here.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return import_object(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise _UsageError(f"{flag}: cannot import {path!r}: {exc}") from None


def _json_arg(text: Optional[str], flag: str) -> Dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _UsageError(f"{flag}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _UsageError(f"{flag}: expected a JSON object of keyword arguments")
    return value


def _load_lightning_module(cls: Any, checkpoint: str, kwargs: Dict[str, Any], unsafe: bool) -> Any:
    import pickle

    import torch

    from fx_lightning.errors import FXLightningError

    if not hasattr(cls, "load_from_checkpoint"):
        raise _UsageError(f"--model: {cls!r} has no load_from_checkpoint; give a LightningModule subclass")
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
        raise _UsageError(f"--model: load_from_checkpoint returned a {type(model).__name__}, not a module")
    return model.eval()


def _without_compile_prefixes(checkpoint: str, unsafe: bool) -> Any:
    """The checkpoint, in memory, with the "_orig_mod." segments of torch.compile'd submodules dropped from its keys."""
    import io

    import torch

    from fx_lightning.capture import plain_state_dict

    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=not unsafe)
    ckpt["state_dict"] = plain_state_dict(ckpt["state_dict"])
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    buffer.seek(0)
    return buffer


def _checkpoint_meta(checkpoint: str) -> Dict[str, Any]:
    """Epoch and step from the checkpoint, read with the safe loader (fields we cannot read stay absent)."""
    import torch

    try:
        ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - metadata only; the model loaded already
        return {}
    return {k: ckpt.get(k) for k in ("epoch", "global_step") if isinstance(ckpt.get(k), int)}


def _datamodule_batches(args: argparse.Namespace, cfg: Any) -> Any:
    """Parity batches from --datamodule, following parity.data (auto: val, else train)."""
    from fx_lightning.callback.trainer_data import choose_batches

    dm_cls = _import(args.datamodule, "--datamodule")
    kwargs = _json_arg(args.datamodule_args, "--datamodule-args")
    if not kwargs and hasattr(dm_cls, "load_from_checkpoint") and _has_datamodule_hparams(args.checkpoint):
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


def _has_datamodule_hparams(checkpoint: str) -> bool:
    import torch

    try:
        ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001
        return False
    return bool(ckpt.get("datamodule_hyper_parameters"))


_DTYPES = {"float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
           "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "int64": "int64", "long": "int64",
           "int32": "int32", "int": "int32"}


def _random_input(shape_text: str, dtype_text: str) -> Any:
    import torch

    try:
        shape = [int(s) for s in shape_text.strip().replace("x", ",").split(",")]  # 8,3,32,32 or 8x3x32x32
    except ValueError:
        raise _UsageError(f"--input-shape: expected integers like 8,3,32,32, got {shape_text!r}") from None
    if not shape or any(s < 1 for s in shape):
        raise _UsageError(f"--input-shape: expected positive integers like 8,3,32,32, got {shape_text!r}")
    if dtype_text not in _DTYPES:
        raise _UsageError(f"--input-dtype: {dtype_text!r}; allowed: {', '.join(sorted(set(_DTYPES.values())))}")
    dtype = getattr(torch, _DTYPES[dtype_text])
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 10, shape, generator=g, dtype=dtype)


# ============================================================================================ inspect


def _cmd_inspect(args: argparse.Namespace, console: Any) -> int:
    from fx_lightning.export import read_manifest, verify_files

    root = Path(args.directory)
    manifest = read_manifest(root)
    if args.verify:
        verify_files(root, manifest)
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    for table in (_summary_table(root, manifest), _io_table(manifest), *_report_tables(manifest),
                  _formats_table(manifest)):
        console.print(table)
    console.print("round-trip checks (each format loaded back from the export and compared before it was kept):",
                  markup=False)
    inputs = [spec for spec in manifest.get("inputs") or [] if spec.get("kind", "tensor") == "tensor"]
    for name, entry in manifest["formats"].items():
        console.print(f"  {roundtrip_text(name, entry.get('check') or {}, inputs)}", markup=False, soft_wrap=True)
    console.print(_files_table(manifest))
    if args.verify:
        console.print("all files match their sha256", markup=False)
    return 0


def _table(title: str, *columns: str, **kwargs: Any) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", **kwargs)
    for col in columns:
        table.add_column(col)
    return table


def _summary_table(root: Path, manifest: Dict[str, Any]) -> Any:
    summary = _table(f"fx-lightning export: {root}", "key", "value", show_header=False)
    versions = manifest.get("versions", {})
    extra = manifest.get("extra") or {}
    summary.add_row("format_version", str(manifest.get("format_version")))
    summary.add_row("created", str(manifest.get("created_utc")))
    summary.add_row("versions", ", ".join(f"{k} {v}" for k, v in versions.items() if v and k != "format_version"))
    config = manifest.get("config") or {}
    summary.add_row("target", str(config.get("target") or extra.get("target") or "<default>"))
    for label, text in _weights_rows(extra):
        summary.add_row(label, text)
    parity = manifest.get("parity")
    if parity is None:
        summary.add_row("parity", "not checked")
    else:
        verdict = "PASSED" if parity.get("passed") else "FAILED"
        summary.add_row("parity", f"{verdict} ({parity.get('batches', '?')} batch(es) of {parity.get('source', '?')} data)")
        for key, value in (parity.get("metrics") or {}).items():
            summary.add_row(f"  {key}", _fmt(value))
        for failure in parity.get("failures") or []:
            summary.add_row("  FAIL", str(failure))
    summary.add_row("dynamic batch", str(manifest.get("dynamic_batch")))
    return summary


def _weights_rows(extra: Dict[str, Any]) -> List[Tuple[str, str]]:
    """Which weights were fused and the counters they were saved at; the trainer's own final counters apart."""
    rows = []
    weights = extra.get("weights")
    if isinstance(weights, dict):
        rows.append(("weights", str(weights.get("description") or weights.get("source"))))
        if weights.get("epoch") is not None or weights.get("global_step") is not None:
            rows.append(("weights saved at", f"epoch {weights.get('epoch')}, global step {weights.get('global_step')}"))
    trainer = extra.get("trainer")
    if isinstance(trainer, dict):
        rows.append(("trainer at end of fit", f"epoch {trainer.get('epoch')}, global step {trainer.get('global_step')}"))
    for key in ("checkpoint", "lightning_module"):
        if extra.get(key) is not None:
            rows.append((key, str(extra[key])))
    return rows


def _io_table(manifest: Dict[str, Any]) -> Any:
    table = _table("inputs and outputs", "", "name", "shape", "dtype")
    for kind in ("inputs", "outputs"):
        for spec in manifest.get(kind) or []:
            table.add_row(kind[:-1], str(spec.get("name")), _shape(spec.get("shape", spec.get("value"))),
                          str(spec.get("dtype", spec.get("kind", ""))))
    return table


def _report_tables(manifest: Dict[str, Any]) -> List[Any]:
    report = manifest.get("report")
    if not report:
        return []
    passes = _table(f"fuse report (capture: {report.get('capture_mode')}, "
                    f"BatchNorms folded: {report.get('batchnorms_folded')})", "pass", "changed", "skipped")
    for p in report.get("passes", []):
        passes.add_row(str(p.get("name")), str(len(p.get("changed", []))), str(len(p.get("skipped", []))))
    stats = _table("graph", "", "nodes", "BatchNorms", "dropouts", "parameters")
    for label in ("before", "after"):
        s = report.get(label) or {}
        stats.add_row(label, str(s.get("nodes")), str(s.get("batchnorms")), str(s.get("dropouts")),
                      f"{s.get('parameters', 0):,}")
    return [passes, stats]


def _formats_table(manifest: Dict[str, Any]) -> Any:
    table = _table("formats", "format", "path", "loader", "pickled code")
    for name, entry in manifest["formats"].items():
        table.add_row(name, str(entry.get("path")), str(entry.get("loader")),
                      "yes (weights_only=False)" if entry.get("pickled_code") else "no")
    return table


def roundtrip_text(name: str, check: Dict[str, Any], inputs: List[Dict[str, Any]]) -> str:
    """The round-trip check of one format, in words: what was compared with what, on which batches."""
    if not check.get("checked"):
        return f"{name}: not checked: {check.get('reason', 'no check recorded')}"
    shapes = []
    for size in check.get("batch_sizes") or []:
        dims = [size if d == "batch" else d for d in (inputs[0].get("shape") or [])] if inputs else []
        shapes.append("x".join(str(d) for d in dims) if dims else f"batch {size}")
    return (f"{name}: loaded back and run on input {' and '.join(shapes)}: relative error "
            f"{_fmt(check.get('max_rel_err'))} against the fused model (max|loaded - fused| / max|fused|)")


def _files_table(manifest: Dict[str, Any]) -> Any:
    table = _table("files", "file", "bytes", "sha256")
    for name, info in manifest["files"].items():
        table.add_row(name, f"{info.get('size', 0):,}", str(info.get("sha256", ""))[:16] + "...")
    return table


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _shape(shape: Any) -> str:
    if isinstance(shape, list):
        return "(" + ", ".join(str(s) for s in shape) + ")"
    return str(shape)


# ============================================================================================== bench


def _cmd_bench(args: argparse.Namespace, console: Any) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from fx_lightning.export import load_fused, read_manifest

    if args.batch_size < 1 or args.iters < 1 or args.warmup < 0:
        raise _UsageError("--batch-size and --iters must be >= 1, --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.directory)
    manifest = read_manifest(root)
    formats = args.formats or list(manifest["formats"])
    unknown = [f for f in formats if f not in manifest["formats"]]
    if unknown:
        raise _UsageError(f"--format: {', '.join(unknown)} not in this export (it has {', '.join(manifest['formats'])})")
    inputs = _bench_inputs(manifest, args.batch_size)

    candidates: List[Tuple[str, Callable[[], Any]]] = []
    unfused_note = None
    if not args.no_unfused:
        unfused, unfused_note = _unfused_model(args, manifest)
        if unfused is not None:
            candidates.append(("unfused", lambda m=unfused: m))
    for fmt in formats:
        candidates.append((fmt, lambda f=fmt: load_fused(root, f)))

    rows: List[Tuple[str, List[float]]] = []
    columns = (TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        tasks = {name: progress.add_task(name, total=args.warmup + args.iters) for name, _ in candidates}
        for name, make in candidates:
            model = make()
            times: List[float] = []
            with torch.no_grad():
                for i in range(args.warmup + args.iters):
                    start = time.perf_counter()
                    model(*inputs)
                    elapsed = time.perf_counter() - start
                    if i >= args.warmup:
                        times.append(elapsed)
                    progress.advance(tasks[name])
            rows.append((name, times))

    table = Table(title=f"latency, batch {args.batch_size}, {args.iters} iterations "
                        f"({torch.get_num_threads()} threads)", title_justify="left")
    for col in ("model", "mean ms", "median ms", "p90 ms", "samples/s", "speed-up vs unfused"):
        table.add_column(col, justify="right" if col != "model" else "left")
    base = next((statistics.median(t) for n, t in rows if n == "unfused"), None)
    for name, times in rows:
        med = statistics.median(times)
        p90 = sorted(times)[min(len(times) - 1, math.ceil(0.9 * len(times)) - 1)]
        speedup = f"{base / med:.2f}x" if base is not None and med > 0 else "-"
        table.add_row(name, f"{1e3 * statistics.fmean(times):.3f}", f"{1e3 * med:.3f}", f"{1e3 * p90:.3f}",
                      f"{args.batch_size / med:,.0f}" if med > 0 else "-", speedup)
    console.print(table)
    if unfused_note:
        console.print(f"note: {unfused_note}", markup=False)
    return 0


def _bench_inputs(manifest: Dict[str, Any], batch_size: int) -> List[Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    inputs = []
    for spec in manifest.get("inputs") or []:
        if spec.get("kind", "tensor") != "tensor":
            raise _UsageError(f"input {spec.get('name')!r} is not a tensor ({spec.get('kind')}); bench needs tensors")
        shape = [batch_size if d == "batch" else int(d) for d in spec["shape"]]
        dtype = getattr(torch, spec.get("dtype", "float32"))
        x = torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
        inputs.append(x)
    if not inputs:
        raise _UsageError("the manifest lists no inputs")
    return inputs


def _unfused_model(args: argparse.Namespace, manifest: Dict[str, Any]) -> Tuple[Any, Optional[str]]:
    """The original (unfused) target, from --model/--checkpoint or what the manifest recorded."""
    from fx_lightning.pipeline import resolve_target

    extra = manifest.get("extra") or {}
    model_path = args.model or extra.get("model") or extra.get("lightning_module")
    checkpoint = args.checkpoint or extra.get("checkpoint")
    if not model_path or not checkpoint:
        return None, ("unfused model not timed: give --model pkg.mod:Class and --checkpoint CKPT "
                      "(the manifest does not record both)")
    if not os.path.isfile(checkpoint):
        return None, f"unfused model not timed: checkpoint {checkpoint} not found"
    try:
        cls = _import(model_path, "--model")
    except _UsageError as exc:
        if args.model:
            raise
        return None, f"unfused model not timed: {exc}"
    model = _load_lightning_module(cls, checkpoint, {}, args.unsafe_load)
    target = extra.get("target")
    if target is None:
        target = (manifest.get("config") or {}).get("target")
        _, sub = resolve_target(model, target)
    else:
        sub = model.get_submodule(target) if target else model
    return sub.eval(), None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
