"""CPU inference latency: eager vs torch.fx's ``fuse`` vs fx-lightning vs the BN-to-Identity limit.

The limit is our own captured graph with every BatchNorm that fx-lightning folds replaced by its input
(Identity) and the convolutions left as they were: the fastest a BatchNorm fold can make the model.
All variants are timed interleaved, in one process, with ``torch.set_num_threads(threads)``; the table
shows medians and ratios. Also times ``fuse()`` itself against torch.fx's ``fuse``.

    python benchmarks/latency.py                       # the README table (6 models, batch 1 and 8)
    python benchmarks/latency.py --models resnet18 --batches 1 --repeats 5   # quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.fx as fx
import torchvision
from rich.console import Console
from rich.table import Table
from torch.fx.experimental.optimization import fuse as torch_fx_fuse

import fx_lightning
from fx_lightning.capture import capture
from fx_lightning.config import TraceConfig

MODELS = ["resnet18", "resnet50", "mobilenet_v3_large", "efficientnet_b0", "regnet_y_400mf", "densenet121"]
VARIANTS = ["eager", "torch_fx_fuse", "fx_lightning", "bn_identity_limit"]


def identity_limit(model: torch.nn.Module, folded: set) -> fx.GraphModule:
    """Our capture of ``model`` with the BatchNorm nodes we fold removed (replaced by their input)."""
    gm = capture(model, TraceConfig(mode="fx")).graph_module
    for node in list(gm.graph.nodes):
        if node.name in folded:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_model(name: str, batches: List[int], repeats: int, warmup: int, size: int) -> Dict:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None).eval()
    fuse_times = {"torch_fx_fuse": [], "fx_lightning": []}
    for _ in range(3):  # fuse-time: median of 3 (each a full deep copy + trace + passes)
        fuse_times["torch_fx_fuse"].append(time_once(lambda: torch_fx_fuse(model)))
        fuse_times["fx_lightning"].append(time_once(lambda: fx_lightning.fuse(model)))
    ours = fx_lightning.fuse(model)
    folded = {c.node for p in ours.report.passes if p.name.startswith("fuse_") for c in p.changed}
    variants = {
        "eager": model,
        "torch_fx_fuse": torch_fx_fuse(model),
        "fx_lightning": ours.graph_module,
        "bn_identity_limit": identity_limit(model, folded),
    }
    out = {
        "model": name,
        "batchnorms": ours.report.before.batchnorms,
        "folded": ours.report.batchnorms_folded,
        "fuse_seconds": {k: statistics.median(v) for k, v in fuse_times.items()},
        "latency_ms": {},
    }
    for batch in batches:
        x = torch.randn(batch, 3, size, size)
        samples: Dict[str, List[float]] = {v: [] for v in VARIANTS}
        with torch.inference_mode():
            for _ in range(warmup):
                for v in VARIANTS:
                    variants[v](x)
            order = list(VARIANTS)
            rng = random.Random(0)
            # Batch 1 runs are short and noisier: three times the rounds, at little cost.
            for _ in range(repeats * 3 if batch == 1 else repeats):
                # Interleaved, in a fresh random order each round: drift on a shared machine, and whatever
                # the previous variant left in the caches, hit every variant alike.
                rng.shuffle(order)
                for v in order:
                    samples[v].append(time_once(lambda: variants[v](x)) * 1e3)
        out["latency_ms"][str(batch)] = {v: statistics.median(s) for v, s in samples.items()}
    return out


def render(results: List[Dict], console: Console) -> str:
    table = Table(title="CPU latency, median ms (ratio = fx-lightning / other; < 1 is faster)")
    for col in ("model", "batch", "eager", "torch.fx fuse", "fx-lightning", "BN->Identity", "vs eager",
                "vs torch.fx", "vs limit"):
        table.add_column(col, justify="right")
    md = ["| model | batch | eager ms | torch.fx fuse ms | fx-lightning ms | BN->Identity ms | vs eager | vs torch.fx | vs limit |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for batch, lat in r["latency_ms"].items():
            ours = lat["fx_lightning"]
            cells = [r["model"], batch, f"{lat['eager']:.1f}", f"{lat['torch_fx_fuse']:.1f}", f"{ours:.1f}",
                     f"{lat['bn_identity_limit']:.1f}", f"{ours / lat['eager']:.3f}",
                     f"{ours / lat['torch_fx_fuse']:.3f}", f"{ours / lat['bn_identity_limit']:.3f}"]
            table.add_row(*cells)
            md.append("| " + " | ".join(cells) + " |")
    console.print(table)
    ft = Table(title="time to fuse (s, median of 3)")
    for col in ("model", "BNs", "folded", "torch.fx fuse", "fx-lightning", "ratio"):
        ft.add_column(col, justify="right")
    md += ["", "| model | BatchNorms | folded by fx-lightning | torch.fx fuse s | fx-lightning fuse s | ratio |",
           "|---|---|---|---|---|---|"]
    for r in results:
        a, b = r["fuse_seconds"]["torch_fx_fuse"], r["fuse_seconds"]["fx_lightning"]
        cells = [r["model"], str(r["batchnorms"]), str(r["folded"]), f"{a:.2f}", f"{b:.2f}", f"{b / a:.2f}"]
        ft.add_row(*cells)
        md.append("| " + " | ".join(cells) + " |")
    console.print(ft)
    return "\n".join(md)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(width=150)
    results = []
    for name in args.models:
        console.print(f"[bold]{name}[/bold] ...")
        results.append(bench_model(name, args.batches, args.repeats, args.warmup, args.size))
    md = render(results, console)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "torchvision": torchvision.__version__, "threads": args.threads,
            "python": sys.version.split()[0], "machine": platform.machine(), "processor": platform.processor(),
            "repeats": args.repeats, "size": args.size}
    (args.out / "latency.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (args.out / "latency.md").write_text(
        f"torch {meta['torch']}, {args.threads} threads, input {args.size}x{args.size}, "
        f"median of {args.repeats} interleaved runs in shuffled order ({3 * args.repeats} at batch 1)\n\n{md}\n")
    console.print(f"wrote {args.out / 'latency.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
