"""Serving latency on CPU: every artifact an export writes against eager PyTorch and the peers a user would pick
instead (``torch.compile`` of the unfused model, ONNX Runtime on its own export is one of our formats).

For each torchvision model (random weights, BatchNorm statistics set by a few training-mode batches of
synthetic images, so they are not the identity) the script runs fx-lightning's pipeline - fuse, parity,
export in pt2, onnx, openvino (when installed) and aoti (one AOTInductor package per batch size), and the
int8 variant - then times, in one process, interleaved in shuffled rounds at a fixed thread count:

- ``eager``: the unfused model; ``torch.compile``: the unfused model through ``torch.compile`` (Inductor
  defaults), the peer a Python server would pick; ``fused``: the fused GraphModule run eagerly;
- ``pt2``, ``onnx``, ``openvino``, ``aoti``: the artifacts as ``load_fused`` gives them; ``pt2+compile``:
  ``load_fused(dir, "pt2", compile=True)`` (Inductor with freezing);
- ``aoti-int8``, ``pt2-int8+compile``: the int8 variant. Its gate is opened for the benchmark (every
  variant is kept so it can be timed); the table shows its top-1 agreement with the fp32 model on the
  parity batches and its error, which is what the gate reads.

Every row's relative error is measured the same way: max|out - ref| / max|ref| against an fp64 copy of the
unfused model in eval mode, on one batch of images at each batch size timed (the worst is shown).

The limit: the model's multiply-adds (``torch.utils.flop_counter``) at the rate this machine multiplies large
fp32 matrices (``torch.mm`` of 2048x2048, same threads, measured in the same run). An fp32 runtime that does
the same arithmetic cannot go much past it; ``sgemm limit`` is eager's median over that time, and each row's
``of limit`` is the share of that rate it reaches. Depthwise convolutions cannot run at matrix speed, so for
the MobileNet/EfficientNet rows it is a loose bound.

    python benchmarks/serving.py                                      # the README table (4 models)
    python benchmarks/serving.py --models resnet18 --rounds 5         # quick look
    python benchmarks/serving.py --render                             # the tables again from the JSON
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torchvision
from rich.console import Console
from rich.table import Table
from torch import nn

from fx_lightning import load_fused
from fx_lightning.batches import flat_tensors
from fx_lightning.config import load_config
from fx_lightning.errors import ExportError
from fx_lightning.export import FORMATS, bench_export, read_manifest, select_fastest
from fx_lightning.export.manifest import ArtifactCheck, BenchTable
from fx_lightning.export.writer import require_formats
from fx_lightning.passes.quantize import QuantizeInt8Options
from fx_lightning.pipeline import Batches, fuse_verify_export
from machine import cpu_description  # benchmarks/machine.py

MODELS = ["resnet18", "resnet50", "mobilenet_v3_large", "efficientnet_b0"]
ORDER = ["eager", "torch.compile", "fused", "pt2", "pt2+compile", "onnx", "openvino", "aoti", "pt2-int8+compile",
         "aoti-int8"]
FP32_FORMATS = ["pt2", "onnx", "openvino", "aoti"]


def trained_looking(name: str, size: int) -> nn.Module:
    """The model with random weights and BatchNorm statistics gathered from synthetic batches."""
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, size, size))
    return model.eval()


def relative_error(module: nn.Module, reference: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        got = flat_tensors(module(x))[0].double()
        want = flat_tensors(reference(x.double()))[0]
    return float((got - want).abs().max() / want.abs().max())


def installed(fmt: str) -> bool:
    """Whether the format can be written here (its extra installed, a compiler for aoti)."""
    try:
        require_formats([FORMATS[fmt]])
    except ExportError:
        return False
    return True


def model_flops(model: nn.Module, x: torch.Tensor) -> float:
    """Floating-point operations of one call (a multiply-add counts two), as torch's flop counter sees them."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    return float(counter.get_total_flops())


def sgemm_flops_per_second(n: int = 2048, rounds: int = 10) -> float:
    """How fast this machine multiplies large fp32 matrices at torch's thread count (median of ``rounds``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    times = []
    for r in range(rounds + 2):
        start = time.perf_counter()
        torch.mm(a, b)
        if r >= 2:
            times.append(time.perf_counter() - start)
    times.sort()
    return 2 * n ** 3 / times[len(times) // 2]


def bench_model(name: str, batches: List[int], rounds: int, size: int, int8: bool, console: Console,
                sgemm_flops_per_s: float) -> Dict:
    model = trained_looking(name, size)
    flops = {b: model_flops(model, torch.randn(b, 3, size, size)) for b in batches}
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 3, size, size, generator=g) for _ in range(4)]
    passes = {"quantize_int8": {"enabled": True, "calibration_batches": 4, "min_top1_agreement": 0.0,
                                "max_accuracy_drop": 1.0, "min_cosine": -1.0}} if int8 else {}
    wanted = [f for f in FP32_FORMATS if installed(f)]
    config = load_config({"export": {"formats": wanted, "aoti_batch_sizes": batches},
                          "parity": {"max_batches": 4}, "passes": passes})
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        outcome = fuse_verify_export(model, config, Batches(data, "given"), export_dir=Path(tmp) / name)
        export_s = time.perf_counter() - start
        root = outcome.export_dir
        manifest = read_manifest(root)
        baselines: Dict[str, nn.Module] = {"eager": model, "torch.compile": torch.compile(model),
                                           "fused": outcome.result.graph_module}
        baselines["pt2+compile"] = load_fused(root, "pt2", compile=True)
        if "pt2-int8" in manifest.formats:
            baselines["pt2-int8+compile"] = load_fused(root, "pt2-int8", compile=True)
        formats = [f for f in (*FP32_FORMATS, "aoti-int8") if f in manifest.formats]
        with torch.no_grad():  # compile outside the timing (warm-up would do it, but a compile is not a call)
            for module in baselines.values():
                for b in batches:
                    module(data[0][:b])
        table = bench_export(root, batch_sizes=batches, formats=formats, baselines=baselines, rounds=rounds,
                             warmup=2, threads=torch.get_num_threads())
        reference = trained_looking(name, size).double()
        modules = {**baselines, **{f: load_fused(root, f, device="cpu") for f in formats}}
        errors = {artifact: max(relative_error(module, reference, data[0][:b]) for b in batches)
                  for artifact, module in modules.items()}
        gates = {f: entry.gate.metrics for f, entry in manifest.formats.items() if entry.gate is not None}
    # The gate was opened so every variant is timed; the selection counts a variant only if it passes the
    # default gate (what a user gets without loosening it).
    default_pass = {entry: passes_default_gate(metrics) for entry, metrics in gates.items()}
    checks = {k: v for k, v in table.checks.items() if "int8" not in k}
    fp32 = BenchTable(table.threads, table.isa, table.machine, table.torch, table.timings, checks)
    gated = BenchTable(table.threads, table.isa, table.machine, table.torch, table.timings,
                       {**checks, **{k: ArtifactCheck(ok) for k, ok in default_pass.items()}})
    selected = {b: {kind: getattr(select_fastest(t, b), "format", None) for kind, t in (("fp32", fp32), ("any", gated))}
                for b in batches}
    rows = []
    for b in batches:
        eager, compiled = table.median("eager", b), table.median("torch.compile", b)
        limit_ms = 1e3 * flops[b] / sgemm_flops_per_s
        for artifact in ORDER:
            ms = table.median(artifact, b)
            if ms is None:
                continue
            rows.append({"model": name, "batch": b, "artifact": artifact, "median_ms": ms,
                         "vs_eager": eager / ms, "vs_torch_compile": compiled / ms,
                         "limit_ms": limit_ms, "of_limit": limit_ms / ms,
                         "relative_error": errors.get(artifact),
                         "top1_agreement": _metric(gates, artifact, "top1_agreement_strict"),
                         "cosine": _metric(gates, artifact, "cosine_similarity_min"),
                         "default_gate": default_pass.get(artifact.replace("+compile", "")),
                         "check": table.checks[artifact].passed if artifact in table.checks else None,
                         "selected": [k for k, v in selected[b].items() if v == artifact]})
    console.print(f"{name}: export {export_s:.0f} s, folded {outcome.result.report.batchnorms_folded} BatchNorms")
    return {"model": name, "export_s": export_s, "rows": rows, "skipped": [str(n) for n in outcome.notes],
            "threads": table.threads, "isa": table.isa, "gflops": {str(b): flops[b] / 1e9 for b in batches}}


def passes_default_gate(metrics: Dict[str, float]) -> bool:
    """Whether an int8 variant's gate figures pass quantize_int8's default thresholds (no labels here)."""
    default = QuantizeInt8Options()
    return (metrics.get("top1_agreement", 0.0) >= default.min_top1_agreement
            and metrics.get("cosine_similarity_min", -1.0) >= default.min_cosine)


def _metric(gates: Dict[str, Dict[str, float]], artifact: str, key: str) -> Optional[float]:
    metrics = gates.get(artifact.replace("+compile", ""))
    return None if metrics is None else metrics.get(key)


def to_markdown(results: List[Dict], meta: Dict) -> str:
    lines = [f"torch {meta['torch']}, {meta['threads']} threads, {meta['cpu']}, input "
             f"{meta['size']}x{meta['size']}, median of {meta['rounds']} interleaved rounds in shuffled order. "
             "Speed-up = eager (or torch.compile) median / this median; error: max|out - ref| / max|ref| against "
             "an fp64 copy of the unfused model. int8: strict top-1 agreement and the lowest per-sample cosine "
             "with the fp32 model on the parity batches (random weights: a weak test of int8, see the README), "
             "and whether that passes quantize_int8's default gate (agreement >= 0.98, cosine >= 0.99); the "
             "gate was opened to time every variant, and the selection counts a variant only if it passes. "
             "Selected: what `export.select: fastest` picks, among the fp32 artifacts and with int8 allowed. "
             f"Of limit: the model's FLOPs at this machine's sgemm rate ({_sgemm(meta)}) over this median.",
             "",
             "| model | batch | artifact | median ms | vs eager | vs torch.compile | of limit | rel. error "
             "| int8 agreement / cosine / default gate | selected |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for r in result["rows"]:
            int8 = "" if r["top1_agreement"] is None else (
                f"{r['top1_agreement']:.3f} / {r['cosine']:.4f} / {'passes' if r['default_gate'] else 'misses'}")
            lines.append(f"| {r['model']} | {r['batch']} | {r['artifact']} | {r['median_ms']:.1f} | "
                         f"{r['vs_eager']:.2f}x | {r['vs_torch_compile']:.2f}x | {_share(r.get('of_limit'))} | "
                         f"{r['relative_error']:.1e} | {int8} | "
                         f"{_selected(r['selected'])} |")
    lines += ["", "| model | GFLOPs at batch 1 | export (fuse, parity, every format, int8) s |", "|---|---|---|"]
    lines += [f"| {r['model']} | {_gflops(r)} | {r['export_s']:.0f} |" for r in results]
    return "\n".join(lines) + "\n"


SUMMARY = ["torch.compile", "fused", "pt2", "pt2+compile", "onnx", "openvino", "aoti", "aoti-int8"]


def to_summary(results: List[Dict], meta: Dict) -> str:
    """The README's table: speed-up over eager per artifact, and what the selection picks (fp32) with its error."""
    lines = [f"torch {meta['torch']}, {meta['threads']} threads, {meta['cpu']}, input "
             f"{meta['size']}x{meta['size']}, median of {meta['rounds']} interleaved rounds; speed-up over eager. "
             f"sgemm limit: eager over the model's FLOPs at this machine's sgemm rate ({_sgemm(meta)}).",
             "",
             "| model | batch | eager ms | " + " | ".join(SUMMARY) + " | sgemm limit | selected (fp32) | its rel. error |",
             "|---|---|---" + "|---" * len(SUMMARY) + "|---|---|---|"]
    for result in results:
        for b in sorted({r["batch"] for r in result["rows"]}):
            rows = {r["artifact"]: r for r in result["rows"] if r["batch"] == b}
            pick = next((r for r in rows.values() if "fp32" in r["selected"]), None)
            cells = [f"{rows[a]['vs_eager']:.2f}x" if a in rows else "-" for a in SUMMARY]
            if pick is not None:
                cells = [f"**{c}**" if a == pick["artifact"] else c for a, c in zip(SUMMARY, cells)]
            limit = rows["eager"].get("limit_ms")
            cells.append(f"{rows['eager']['median_ms'] / limit:.2f}x" if limit else "-")
            lines.append(f"| {result['model']} | {b} | {rows['eager']['median_ms']:.1f} | " + " | ".join(cells)
                         + (f" | {pick['artifact']} | {pick['relative_error']:.1e} |" if pick else " | - | - |"))
    return "\n".join(lines) + "\n"


def _sgemm(meta: Dict) -> str:
    return f"{meta['sgemm_gflops']:.0f} GFLOP/s" if "sgemm_gflops" in meta else "not measured"


def _share(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _gflops(result: Dict) -> str:
    return f"{result['gflops']['1']:.2f}" if "1" in result.get("gflops", {}) else "-"


def _selected(kinds: List[str]) -> str:
    if kinds == ["fp32", "any"]:
        return "**fastest**"
    return {("fp32",): "fastest fp32", ("any",): "fastest (int8 allowed)"}.get(tuple(kinds), "")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--no-int8", action="store_true", help="skip the int8 variant (no torchao)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "serving"))
    parser.add_argument("--render", action="store_true", help="only write the tables again from OUT.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.render:
        saved = json.loads(out.with_suffix(".json").read_text())
        write_tables(out, saved["results"], saved["meta"])
        return 0
    torch.set_num_threads(args.threads)
    console = Console()
    sgemm = sgemm_flops_per_second()
    results = [bench_model(m, args.batches, args.rounds, args.size, not args.no_int8, console, sgemm)
               for m in args.models]
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "isa": results[0]["isa"],
            "cpu": cpu_description(), "machine": platform.machine(), "size": args.size, "rounds": args.rounds,
            "sgemm_gflops": sgemm / 1e9}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    write_tables(out, results, meta)
    table = Table(title="serving latency")
    for col in ("model", "batch", "artifact", "ms", "vs eager", "vs compile", "error"):
        table.add_column(col)
    for result in results:
        for r in result["rows"]:
            table.add_row(r["model"], str(r["batch"]), r["artifact"], f"{r['median_ms']:.1f}",
                          f"{r['vs_eager']:.2f}x", f"{r['vs_torch_compile']:.2f}x", f"{r['relative_error']:.1e}")
    console.print(table)
    return 0


def write_tables(out: Path, results: List[Dict], meta: Dict) -> None:
    """OUT.md (every row) and OUT_summary.md (the README's table)."""
    out.with_suffix(".md").write_text(to_markdown(results, meta))
    out.with_name(out.name + "_summary.md").write_text(to_summary(results, meta))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
