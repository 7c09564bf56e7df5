"""``fx-lightning bench DIR``: latency of an export's formats against the unfused model, on random inputs."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from torch import nn

from fx_lightning.cli.common import UsageError, import_path, load_lightning_module, titled_table
from fx_lightning.config import ExportConfig, Selection, Strategy

__all__ = ["add_parser", "run"]

FINALISTS = 3  # with --select: the fastest artifacts timed again (and swept) each in a process of its own


def add_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench", help="time every artifact of an export side by side, check each, and pick the fastest",
        description="Times each exported format (and the unfused model, when its class and checkpoint are known) "
                    "interleaved, in one process, with fixed threads; checks every artifact's outputs on the "
                    "export's check batch; --select also sweeps the likely winners' throughput over batch sizes on "
                    "this machine and records the table, the sweep and the picks in the manifest, which "
                    "load_fused(dir), fx-lightning serve and fx-lightning triton then use.",
    )
    bench.add_argument("directory")
    bench.add_argument("--format", action="append", dest="formats", metavar="FORMAT",
                       help="format(s) to time (repeatable; default: every format in the export)")
    bench.add_argument("--batch-size", type=int, action="append", dest="batch_sizes", metavar="N",
                       help="batch size(s) to time (repeatable; default: 1 and 8)")
    bench.add_argument("--iters", type=int, default=30, help="timed rounds (each runs every model once)")
    bench.add_argument("--warmup", type=int, default=5)
    bench.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run")
    bench.add_argument("--select", action="store_true",
                       help="record the table and the fastest artifact that passed its check in the manifest")
    bench.add_argument("--select-batch-size", type=int, default=None,
                       help="the batch size the fastest is chosen at (default: the first --batch-size)")
    bench.add_argument("--select-traffic", choices=["idle", "back_to_back"], default="idle",
                       help="the traffic the default artifact is chosen for: requests after an idle gap, or back "
                            "to back (the manifest records the fastest for both)")
    bench.add_argument("--strategy", choices=["min_latency", "max_throughput"], default="min_latency",
                       help="with --select: the default artifact is the fastest at --select-batch-size "
                            "(min_latency) or the most samples/s over the throughput sweep (max_throughput); the "
                            "manifest records both")
    bench.add_argument("--latency-budget-ms", type=float, default=None, metavar="MS",
                       help="with --strategy max_throughput: the p99 a batch may take at most (refused, with each "
                            "artifact's figures, when none meets it)")
    bench.add_argument("--no-sweep", action="store_false", dest="sweep",
                       help="with --select: leave out the throughput sweep (batch sizes 1, 2, 4... until "
                            "throughput stops growing, in a process of its own per artifact), which serve and "
                            "triton take their batching from")
    bench.add_argument("--model", metavar="PKG.MODULE:CLASS",
                       help="unfused LightningModule class (default: the one recorded in the manifest)")
    bench.add_argument("--checkpoint", help="its checkpoint (default: the one recorded in the manifest)")
    bench.add_argument("--no-unfused", action="store_true", help="time the export formats only")
    bench.add_argument("--unsafe-load", action="store_true", help="load the checkpoint with weights_only=False")


def run(args: argparse.Namespace, console: Any) -> int:
    """``fx-lightning bench``: every artifact timed side by side and checked; optionally, select the fastest."""
    from fx_lightning.export import bench_export, read_manifest, record_selection
    from fx_lightning.export.select.selection import select_by_strategy
    from fx_lightning.export.select.sweep import SweepSettings

    sizes = args.batch_sizes or [1, 8]
    if any(b < 1 for b in sizes) or args.iters < 1 or args.warmup < 0:
        raise UsageError("--batch-size and --iters must be >= 1, --warmup >= 0")
    budget = args.latency_budget_ms
    select_at = args.select_batch_size if args.select_batch_size is not None else sizes[0]
    try:  # the flags set these keys of the export config: its one check, in its words
        ExportConfig(select=Selection.fastest if args.select else Selection.preference,
                     select_strategy=Strategy[args.strategy], latency_budget_ms=budget,
                     select_batch_size=select_at).check()
    except ValueError as exc:
        raise UsageError(f"export.{exc} (--select sets export.select: fastest, --strategy export.select_strategy, "
                         "--latency-budget-ms export.latency_budget_ms)") from None
    if args.strategy == "max_throughput" and not args.sweep:
        raise UsageError("--strategy max_throughput picks from the throughput sweep: drop --no-sweep")
    root = Path(args.directory)
    manifest = read_manifest(root)
    formats = args.formats or list(manifest.formats)
    unknown = [f for f in formats if f not in manifest.formats]
    if unknown:
        raise UsageError(f"--format: {', '.join(unknown)} not in this export (it has {', '.join(manifest.formats)})")
    baselines: Dict[str, nn.Module] = {}
    unfused_note = None
    if not args.no_unfused:
        unfused, unfused_note = _unfused_model(args, manifest)
        if unfused is not None:
            baselines["unfused"] = unfused
    with _progress(console) as update:
        table = bench_export(root, manifest=manifest, batch_sizes=sizes, formats=formats, baselines=baselines,
                             rounds=args.iters, warmup=args.warmup, threads=args.threads, progress=update,
                             own_process_finalists=FINALISTS if args.select else 0,
                             sweep=SweepSettings() if args.select and args.sweep else None)
    for size in sizes:
        for traffic in ("idle", "back_to_back"):
            console.print(_table(table, size, traffic, args.iters, "unfused" if baselines else None))
    for traffic in ("idle", "back_to_back"):
        if any(w.traffic == traffic for w in table.sweeps):
            console.print(_sweep_table(table, traffic))
    if unfused_note:
        console.print(f"note: {unfused_note}", markup=False)
    for name, check in table.checks.items():
        if not check.passed:
            console.print(f"{name}: check FAILED ({check.reason}): never selected", markup=False)
    if args.select:
        selected = select_by_strategy(table, args.strategy, select_at, args.select_traffic,
                                      budget)  # a budget nobody meets raises: the manifest is left as it was
        record_selection(root, table, selected)
        console.print(f"selected: {selected.format} ({selected.why})" if selected else
                      "selected: nothing (no artifact passed its check)", markup=False)
    return 0


@contextlib.contextmanager
def _progress(console: Any) -> Iterator[Callable[[str, int, int], None]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("timing", total=None)

        def update(what: str, done: int, total: int) -> None:
            progress.update(task, description=what, completed=done, total=total)

        yield update


def _table(table: Any, size: int, traffic: str, iters: int, baseline: Optional[str]) -> Any:
    columns = (("model", "check", "median ms", "p90 ms", "processes' medians ms", "samples/s")
               + ((f"speed-up vs {baseline}",) if baseline else ()))
    out = titled_table(f"latency, batch {size}, {traffic.replace('_', ' ')} traffic, {iters} iterations "
                       f"({table.threads} threads, {table.isa})", *columns, right=columns[2:])
    base = table.median(baseline, size, traffic) if baseline else None
    for t in sorted((t for t in table.timings if t.batch_size == size and t.traffic == traffic),
                    key=lambda t: t.median_ms):
        check = table.checks.get(t.artifact)
        verdict = "-" if check is None else (f"ok {check.relative_error or 0:.1e}" if check.passed else "FAILED")
        spread = t.spread()
        noise = f"{spread[0]:.3f}-{spread[1]:.3f} ({len(t.process_medians_ms)})" if spread else "-"
        row = [t.artifact + (f" [{t.runtime}]" if t.runtime else ""), verdict, f"{t.median_ms:.3f}", f"{t.p90_ms:.3f}",
               noise, f"{1e3 * size / t.median_ms:,.0f}"]
        if baseline:
            row.append(f"{base / t.median_ms:.2f}x" if base else "-")
        out.add_row(*row)
    return out


def _sweep_table(table: Any, traffic: str) -> Any:
    columns = ("model", "batch", "p50 ms", "p99 ms", "samples/s", "stable")
    out = titled_table(f"throughput sweep, {traffic.replace('_', ' ')} traffic ({table.threads} threads, {table.isa})",
                       *columns, right=columns[1:])
    for w in (w for w in table.sweeps if w.traffic == traffic):
        best = w.best()
        for p in w.points:
            name = w.artifact + (f" [{w.runtime}]" if w.runtime else "") if p is w.points[0] else ""
            mark = " *" if p is best else ""
            out.add_row(name, str(p.batch_size), f"{p.p50_ms:.3f}", f"{p.p99_ms:.3f}", f"{p.throughput:,.1f}{mark}",
                        "yes" if p.stable else "no")
        out.add_row("", "", "", "", f"stop: {w.stop}", "")
    return out


def _unfused_model(args: argparse.Namespace, manifest: Any) -> Tuple[Any, Optional[str]]:
    """The original (unfused) target, from --model/--checkpoint or what the manifest recorded."""
    from fx_lightning.export.load.interface import FromLeaves
    from fx_lightning.export.write.prologue import behind_prologue
    from fx_lightning.pipeline import resolve_target

    origin = manifest.provenance
    model_path = args.model or origin.model or origin.lightning_module
    checkpoint = args.checkpoint or origin.checkpoint
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
    target = origin.target
    if target is None:
        _, sub = resolve_target(model, (manifest.config or {}).get("target"))
    else:
        sub = model.get_submodule(target) if target else model
    if manifest.signature is not None and manifest.signature.flat:  # one tensor per input leaf, as the artifacts
        sub = FromLeaves(sub, manifest.signature)
    return behind_prologue(sub.eval(), manifest.preprocess), None
