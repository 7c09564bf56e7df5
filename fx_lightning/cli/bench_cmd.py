"""``fx-lightning bench DIR``: latency of an export's formats against the unfused model, on random inputs."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from fx_lightning.cli.common import UsageError, import_path, load_lightning_module

__all__ = ["run"]


def run(args: argparse.Namespace, console: Any) -> int:
    """``fx-lightning bench``: latency of an export's formats against the unfused model."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from fx_lightning.export import load_fused, read_manifest

    if args.batch_size < 1 or args.iters < 1 or args.warmup < 0:
        raise UsageError("--batch-size and --iters must be >= 1, --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.directory)
    manifest = read_manifest(root)
    formats = args.formats or list(manifest["formats"])
    unknown = [f for f in formats if f not in manifest["formats"]]
    if unknown:
        raise UsageError(f"--format: {', '.join(unknown)} not in this export (it has {', '.join(manifest['formats'])})")
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
            raise UsageError(f"input {spec.get('name')!r} is not a tensor ({spec.get('kind')}); bench needs tensors")
        shape = [batch_size if d == "batch" else int(d) for d in spec["shape"]]
        dtype = getattr(torch, spec.get("dtype", "float32"))
        x = torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
        inputs.append(x)
    if not inputs:
        raise UsageError("the manifest lists no inputs")
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
        cls = import_path(model_path, "--model")
    except UsageError as exc:
        if args.model:
            raise
        return None, f"unfused model not timed: {exc}"
    model = load_lightning_module(cls, checkpoint, {}, args.unsafe_load)
    target = extra.get("target")
    if target is None:
        target = (manifest.get("config") or {}).get("target")
        _, sub = resolve_target(model, target)
    else:
        sub = model.get_submodule(target) if target else model
    return sub.eval(), None
