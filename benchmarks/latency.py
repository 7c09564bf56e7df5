"""CPU inference latency: eager vs torch.fx's ``fuse`` vs fx-lightning vs the BN-to-Identity limit.

The limit is our own captured graph with every BatchNorm that fx-lightning folds replaced by its input
(Identity) and the convolutions left as they were: the fastest a BatchNorm fold can make the model.
All variants are timed interleaved, in one process, with ``torch.set_num_threads(threads)``; the table
shows medians and ratios, and the CPU they ran on. Also times ``fuse()`` itself against torch.fx's ``fuse``.
Besides torchvision's classifiers, two sequence models from tests/zoo_sequence_models.py at their usual sizes:
``patchtst`` (PatchTST/42: 336 steps of 7 series, patches of 16 with stride 8, d_model 128, 3 pre-norm layers,
its BatchNorms between transposes) and ``ecapa_tdnn`` (ECAPA-TDNN, C=512, on 2 s of 80 mel bands: reflect-padded
convs, ReLU, BatchNorm, Dropout1d(p=0)); torch.fx's ``fuse`` cannot trace ECAPA ("-").

    python benchmarks/latency.py                       # the README table (6 models, batch 1 and 8)
    python benchmarks/latency.py --models patchtst ecapa_tdnn --tag sequence
    python benchmarks/latency.py --models patchtst ecapa_tdnn --variants eager bn_identity_limit --repeats 50 \
        --tag sequence_h2h                             # fewer variants, more rounds: for a noisy machine
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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.fx as fx
import torchvision
from rich.console import Console
from rich.table import Table
from torch.fx.experimental.optimization import fuse as torch_fx_fuse

import fx_lightning
from fx_lightning.passes.bn_views import bn_input

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from machine import cpu_description  # noqa: E402  (benchmarks/machine.py)

MODELS = ["resnet18", "resnet50", "mobilenet_v3_large", "efficientnet_b0", "regnet_y_400mf", "densenet121"]
VARIANTS = ["eager", "torch_fx_fuse", "fx_lightning", "bn_identity_limit"]
FOLDS_OFF = {"passes": {name: {"enabled": False} for name in ("fuse_conv_bn", "fuse_linear_bn", "fuse_bn_into_next")}}


@dataclass(frozen=True)
class Workload:
    """A model to time and its input at a batch size; ``fuse_inputs``: fuse with an example input (the sequence
    models need shapes for their folds, ECAPA a torch.export capture); the torchvision rows keep their history."""

    build: Callable[[], torch.nn.Module]
    example: Callable[[int, int], torch.Tensor]  # (batch, image size) -> input
    fuse_inputs: bool = False
    inputs: str = ""  # what one sample is, for the results' header ("" for an image of --size)


def _sequence_models() -> Dict[str, Workload]:
    from fusion_helpers import randomize_batchnorms
    from zoo_sequence_models import ECAPATDNN, PatchTST

    return {
        "patchtst": Workload(lambda: randomize_batchnorms(PatchTST(
            pre_norm=True, n_vars=7, seq_len=336, patch_len=16, stride=8, d=128, heads=16, layers=3, pred_len=96)),
            lambda batch, size: torch.randn(batch, 336, 7), fuse_inputs=True, inputs="336 steps x 7 series"),
        "ecapa_tdnn": Workload(lambda: randomize_batchnorms(ECAPATDNN(n_mels=80, channels=512, scale=8, lin=192,
                                                                     attention=128)),
                               lambda batch, size: torch.randn(batch, 200, 80), fuse_inputs=True,
                               inputs="200 frames x 80 mel bands"),
    }


def workload(name: str) -> Workload:
    sequence = _sequence_models()
    if name in sequence:
        return sequence[name]
    return Workload(lambda: torchvision.models.get_model(name, weights=None),
                    lambda batch, size: torch.randn(batch, 3, size, size))


def identity_limit(model: torch.nn.Module, folded: set, example: Optional[torch.Tensor]) -> fx.GraphModule:
    """Our capture of ``model`` (the same capture and passes as fx-lightning's, the folds off) with the BatchNorm
    nodes we fold removed (replaced by their input)."""
    gm = fx_lightning.fuse(model, FOLDS_OFF, example_inputs=example).graph_module
    for node in list(gm.graph.nodes):
        if node.name in folded:
            node.replace_all_uses_with(bn_input(node))
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def _torch_fx_fuse(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """torch.fx's ``fuse``, or None where it cannot trace the model."""
    try:
        return torch_fx_fuse(model)
    except Exception:  # noqa: BLE001 - symbolic tracing fails on data-dependent Python (ECAPA's chunk loop)
        return None


def time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_model(name: str, batches: List[int], repeats: int, warmup: int, size: int,
                only: Optional[List[str]] = None) -> Dict:
    torch.manual_seed(0)
    work = workload(name)
    model = work.build().eval()
    example = work.example(1, size) if work.fuse_inputs else None
    fuse_times: Dict[str, List[float]] = {"torch_fx_fuse": [], "fx_lightning": []}
    for _ in range(3):  # fuse-time: median of 3 (each a full deep copy + trace + passes)
        fuse_times["torch_fx_fuse"].append(time_once(lambda: _torch_fx_fuse(model)))
        fuse_times["fx_lightning"].append(time_once(lambda: fx_lightning.fuse(model, example_inputs=example)))
    ours = fx_lightning.fuse(model, example_inputs=example)
    folded = {c.node for p in ours.report.passes if p.name.startswith("fuse_") for c in p.changed}
    reference = _torch_fx_fuse(model)
    variants = {
        "eager": model,
        "torch_fx_fuse": reference,
        "fx_lightning": ours.graph_module,
        "bn_identity_limit": identity_limit(model, folded, example),
    }
    # A head-to-head of fewer variants gives each more rounds in the same time (a shared machine's noise).
    timed = [v for v in VARIANTS if variants[v] is not None and (only is None or v in only)]
    out = {
        "model": name,
        "capture": ours.report.capture_mode,
        "batchnorms": ours.report.before.batchnorms,
        "folded": ours.report.batchnorms_folded,
        "fuse_seconds": {k: statistics.median(v) for k, v in fuse_times.items() if reference is not None
                         or k != "torch_fx_fuse"},
        "latency_ms": {},
    }
    for batch in batches:
        x = work.example(batch, size)
        samples: Dict[str, List[float]] = {v: [] for v in timed}
        with torch.inference_mode():
            for _ in range(warmup):
                for v in timed:
                    variants[v](x)
            order = list(timed)
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


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(ours: float, other: Optional[float]) -> str:
    return "-" if other is None else f"{ours / other:.3f}"


def render(results: List[Dict], console: Console) -> str:
    table = Table(title="CPU latency, median ms (ratio = fx-lightning / other; < 1 is faster)")
    for col in ("model", "batch", "eager", "torch.fx fuse", "fx-lightning", "BN->Identity", "vs eager",
                "vs torch.fx", "vs limit"):
        table.add_column(col, justify="right")
    md = ["| model | batch | eager ms | torch.fx fuse ms | fx-lightning ms | BN->Identity ms | vs eager | vs torch.fx "
          "| vs limit |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for batch, lat in r["latency_ms"].items():
            ours, other = lat["fx_lightning"], lat.get("torch_fx_fuse")
            eager, limit = lat.get("eager"), lat.get("bn_identity_limit")
            cells = [r["model"], batch, _ms(eager), _ms(other), _ms(ours), _ms(limit), _ratio(ours, eager),
                     _ratio(ours, other), _ratio(ours, limit)]
            table.add_row(*cells)
            md.append("| " + " | ".join(cells) + " |")
    console.print(table)
    ft = Table(title="time to fuse (s, median of 3)")
    for col in ("model", "BNs", "folded", "torch.fx fuse", "fx-lightning", "ratio"):
        ft.add_column(col, justify="right")
    md += ["", "| model | BatchNorms | folded by fx-lightning | torch.fx fuse s | fx-lightning fuse s | ratio |",
           "|---|---|---|---|---|---|"]
    for r in results:
        a, b = r["fuse_seconds"].get("torch_fx_fuse"), r["fuse_seconds"]["fx_lightning"]
        cells = [r["model"], str(r["batchnorms"]), str(r["folded"]), "-" if a is None else f"{a:.2f}", f"{b:.2f}",
                 "-" if a is None else f"{b / a:.2f}"]
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
    parser.add_argument("--tag", default="", help="written as latency_TAG.md/.json (default: latency.md/.json)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                        help="time only these (fx_lightning always): a head-to-head gets more rounds per minute")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(width=150)
    results = []
    for name in args.models:
        console.print(f"[bold]{name}[/bold] ...")
        only = None if args.variants is None else sorted(set(args.variants) | {"fx_lightning"})
        results.append(bench_model(name, args.batches, args.repeats, args.warmup, args.size, only))
    md = render(results, console)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "torchvision": torchvision.__version__, "threads": args.threads,
            "python": sys.version.split()[0], "machine": platform.machine(), "cpu": cpu_description(),
            "repeats": args.repeats, "size": args.size}
    stem = f"latency_{args.tag}" if args.tag else "latency"
    inputs = ", ".join(f"{name}: {workload(name).inputs or f'{args.size}x{args.size} image'}" for name in args.models)
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (args.out / f"{stem}.md").write_text(
        f"{meta['cpu']}, torch {meta['torch']}, {args.threads} threads, inputs ({inputs}), "
        f"median of {args.repeats} interleaved runs in shuffled order ({3 * args.repeats} at batch 1)\n\n{md}\n")
    console.print(f"{meta['cpu']}\nwrote {args.out / f'{stem}.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
