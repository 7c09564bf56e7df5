"""Serving latency on CPU of what the serving preset exports, on trained models judged on real held-out data.

Each torchvision model is trained on scikit-learn's handwritten digits upsampled to 224x224 (``digits.py``: no
download; cached after the first run) and run through fx-lightning's pipeline with
``configs/fx_fuse/serving.yaml``: fuse, parity on the held-out split, export in pt2, onnx, openvino and aoti
(packages for batch 1 and 8), and the lossy variants this CPU runs fast - torchao int8 (aoti, pt2), OpenVINO int8
(NNCF) and bf16, ONNX Runtime int8, Inductor bf16 - each calibrated on training images and kept only when it
passes the default gate on the held-out images (top-1 agreement with fp32 >= 0.99, accuracy drop <= 0.5
points, worst cosine >= 0.99). Every kept artifact (and ONNX Runtime with its threads spinning) is then timed in
one process, interleaved in shuffled rounds, after a 20 ms idle gap and back to back, against eager PyTorch and
``torch.compile`` of the unfused model. The gate figures of every variant, kept or not, come from the manifest.

The peers run with their own defaults, each in a process of its own, are in ``peer_defaults.py``.

    python benchmarks/serving.py                                  # the README tables (resnet18, mobilenet_v3_large)
    python benchmarks/serving.py --models resnet18 --rounds 5     # quick look
    python benchmarks/serving.py --render                         # the tables again from the JSON
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from rich.console import Console

from digits import CACHE, accuracy, digits_splits, trained_model  # benchmarks/digits.py
from fx_lightning.config import load_config
from fx_lightning.export import bench_export, read_manifest
from fx_lightning.export.manifest import Manifest
from fx_lightning.pipeline import Batches, fuse_verify_export
from machine import cpu_description  # benchmarks/machine.py

MODELS = ["resnet18", "mobilenet_v3_large"]
PRESET = Path(__file__).parents[1] / "configs" / "fx_fuse" / "serving.yaml"
FP32 = ["pt2", "onnx", "openvino", "aoti"]
LOSSY = ["aoti-int8", "pt2-int8", "openvino-int8", "onnx-int8", "openvino-bf16", "aoti-bf16", "pt2-bf16"]
TRAFFICS = ["idle", "back_to_back"]
EXPORTS = CACHE / "exports"  # kept between runs: peer_defaults.py times the selected artifacts


def serving_config(held_out_batches: int, formats: Optional[List[str]] = None) -> Any:
    """The serving preset, judged on the whole held-out split; ``formats`` instead of the preset's (the preset's
    when None)."""
    preset = OmegaConf.to_container(OmegaConf.load(PRESET))
    preset["parity"] = {"max_batches": held_out_batches}  # the whole held-out split
    if formats is not None:
        preset["export"]["formats"] = list(formats)
    return load_config(preset)


def export_model(name: str, size: int, console: Console, formats: Optional[List[str]] = None) -> Tuple[Any, float]:
    """The trained model exported with the serving preset into ``EXPORTS/<name>`` (kept for peer_defaults.py);
    returns the pipeline's outcome and the seconds it took."""
    train, held_out = digits_splits()
    model = trained_model(name, size, log=console.print)
    held = list(held_out.batches(32, size))
    calibration = [x for x, _ in train.batches(32, size, shuffle=True, seed=1)][:8]
    start = time.perf_counter()
    outcome = fuse_verify_export(model, serving_config(len(held), formats),
                                 Batches(held, "held-out digits", calibration=calibration), export_dir=EXPORTS / name)
    return outcome, time.perf_counter() - start


def bench_model(name: str, batches: List[int], rounds: int, size: int, console: Console,
                formats: Optional[List[str]] = None) -> Dict[str, Any]:
    _, held_out = digits_splits()
    model = trained_model(name, size)
    outcome, export_s = export_model(name, size, console, formats)
    root = outcome.export_dir
    manifest = read_manifest(root)
    x = next(held_out.batches(max(batches), size))[0]
    baselines = {"eager": model, "torch.compile": torch.compile(model)}
    with torch.no_grad():  # compile outside the timing
        for b in batches:
            baselines["torch.compile"](x[:b])
    table = bench_export(root, batch_sizes=batches, baselines=baselines, rounds=rounds, warmup=3)
    rows = []
    for t in table.timings:
        eager = table.median("eager", t.batch_size, t.traffic)
        gate = _gate(manifest, t.artifact)
        rows.append({"model": name, "batch": t.batch_size, "traffic": t.traffic, "artifact": t.artifact,
                     "runtime": t.runtime, "median_ms": t.median_ms, "p90_ms": t.p90_ms,
                     "vs_eager": eager / t.median_ms if eager else None, **gate,
                     "selected": any((s.format, s.runtime, s.batch_size, s.traffic)
                                     == (t.artifact, t.runtime, t.batch_size, t.traffic) for s in manifest.selections)})
    console.print(f"{name}: export {export_s:.0f} s; kept {', '.join(manifest.formats)}")
    for note in outcome.notes:
        console.print(f"  {note}", markup=False)
    return {"model": name, "export_s": export_s, "rows": rows, "accuracy": accuracy(model, held_out, size),
            "variants": _variants(manifest), "threads": table.threads, "isa": table.isa,
            "default_selection": manifest.selected.format if manifest.selected else None}


def _gate(manifest: Manifest, artifact: str) -> Dict[str, Optional[float]]:
    entry = manifest.formats.get(artifact)
    metrics = entry.gate.metrics if entry is not None and entry.gate is not None else {}
    return {"top1_agreement": metrics.get("top1_agreement"), "accuracy_drop": metrics.get("accuracy_drop"),
            "cosine_min": metrics.get("cosine_similarity_min")}


def _variants(manifest: Manifest) -> List[Dict[str, Any]]:
    """Every variant's outcome: kept or not, its gate figures, why it was not made, how it was made."""
    out = []
    for outcomes in manifest.variants.values():
        for o in outcomes:
            metrics = o.gate.metrics if o.gate is not None else {}
            out.append({"entry": o.entry, "kept": o.kept, "skipped": o.skipped, "error": o.error,
                        "top1_agreement": metrics.get("top1_agreement"), "accuracy_drop": metrics.get("accuracy_drop"),
                        "accuracy": metrics.get("accuracy_fused"), "cosine_min": metrics.get("cosine_similarity_min"),
                        "failures": [str(f) for f in o.gate.failures] if o.gate is not None else [],
                        "made_with": [str(n) for n in o.notes]})
    return out


def to_markdown(results: List[Dict], meta: Dict) -> str:
    """Every timing, and every variant's gate."""
    lines = [_header(meta), "",
             "| model | batch | traffic | artifact | runtime settings | median ms | p90 ms | vs eager | top-1 agreement "
             "| accuracy drop | selected |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for r in sorted(result["rows"], key=lambda r: (r["batch"], r["traffic"], r["median_ms"])):
            lines.append(f"| {r['model']} | {r['batch']} | {r['traffic']} | {r['artifact']} | {r['runtime'] or '-'} | "
                         f"{r['median_ms']:.2f} | {r['p90_ms']:.2f} | {_x(r['vs_eager'])} | {_f(r['top1_agreement'])} | "
                         f"{_points(r['accuracy_drop'])} | {'**yes**' if r['selected'] else ''} |")
    lines += ["", "Every variant (kept only when it passed the gate on the held-out split):", "",
              "| model | variant | kept | top-1 agreement | accuracy drop | worst cosine | why not kept / how made |",
              "|---|---|---|---|---|---|---|"]
    for result in results:
        for v in result["variants"]:
            why = v["skipped"] or v["error"] or "; ".join(v["failures"]) or "; ".join(v["made_with"])
            lines.append(f"| {result['model']} | {v['entry']} | {'yes' if v['kept'] else 'no'} | {_f(v['top1_agreement'])} "
                         f"| {_points(v['accuracy_drop'])} | {_f(v['cosine_min'])} | {why} |")
    lines += ["", "| model | held-out accuracy (fp32) | export s (fuse, parity, every format and variant, selection) |",
              "|---|---|---|"]
    lines += [f"| {r['model']} | {100 * r['accuracy']:.2f}% | {r['export_s']:.0f} |" for r in results]
    return "\n".join(lines) + "\n"


def to_summary(results: List[Dict], meta: Dict) -> str:
    """The README's table: per model, batch and traffic, eager, the best fp32 artifact, each lossy variant and
    what the selection recorded, as speed-ups over eager; the selected artifact's gate figures."""
    lines = [_header(meta), "",
             "| model | batch | traffic | eager ms | torch.compile | best fp32 | " + " | ".join(LOSSY)
             + " | selected | its agreement / accuracy drop |",
             "|---|---|---|---|---|---|" + "---|" * len(LOSSY) + "---|---|"]
    for result in results:
        for b in sorted({r["batch"] for r in result["rows"]}):
            for traffic in TRAFFICS:
                rows = [r for r in result["rows"] if r["batch"] == b and r["traffic"] == traffic]
                if not rows:
                    continue
                best = {}
                for r in rows:  # the fastest runtime settings of each artifact
                    if r["artifact"] not in best or r["median_ms"] < best[r["artifact"]]["median_ms"]:
                        best[r["artifact"]] = r
                fp32 = min((best[a] for a in FP32 if a in best), key=lambda r: r["median_ms"], default=None)
                pick = next((r for r in rows if r["selected"]), None)
                cells = [f"{best['eager']['median_ms']:.1f}", _x(best.get("torch.compile", {}).get("vs_eager")),
                         f"{fp32['artifact']} {_x(fp32['vs_eager'])}" if fp32 else "-"]
                cells += [_x(best[a]["vs_eager"]) if a in best else "-" for a in LOSSY]
                cells += [f"**{pick['artifact']}{' (' + pick['runtime'] + ')' if pick['runtime'] else ''} "
                          f"{_x(pick['vs_eager'])}**" if pick else "not timed at export",
                          f"{_f(pick['top1_agreement'])} / {_points(pick['accuracy_drop'])}"
                          if pick and pick["top1_agreement"] is not None else "fp32 (exact)" if pick else "-"]
                lines.append(f"| {result['model']} | {b} | {traffic.replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines += ["", "`-`: not kept (see the variants table in benchmarks/results/serving.md: skipped on this CPU, "
              "or missed its gate). The export times and records a selection at batch 1 and "
              "`export.select_batch_size` (1 in the serving preset); at other batch sizes the table shows what "
              "`fx-lightning bench` would pick."]
    return "\n".join(lines) + "\n"


def _header(meta: Dict) -> str:
    return (f"torch {meta['torch']}, {meta['threads']} threads, {meta['cpu']}, input {meta['size']}x{meta['size']}, "
            f"models trained on scikit-learn's digits (upsampled), gates on the {meta['held_out']} held-out images; "
            f"median of {meta['rounds']} interleaved rounds, idle: each call after a 20 ms idle gap, back to back: "
            "right after the previous call. Speed-up over eager in the same traffic."
            + (f" export.formats: {', '.join(meta['formats'])} (instead of the preset's)."
               if isinstance(meta.get("formats"), list) else ""))


def _x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _f(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"


def _points(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:+.2f} pt"


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "serving"))
    parser.add_argument("--render", action="store_true", help="only write the tables again from OUT.json")
    parser.add_argument("--formats", nargs="+", help="export.formats instead of the preset's (aoti's packages take "
                        "minutes each to compile on a small machine)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.render:
        saved = json.loads(out.with_suffix(".json").read_text())
        write_tables(out, saved["results"], saved["meta"])
        return 0
    torch.set_num_threads(args.threads)
    console = Console()
    results = [bench_model(m, args.batches, args.rounds, args.size, console, args.formats) for m in args.models]
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "isa": results[0]["isa"],
            "cpu": cpu_description(), "machine": platform.machine(), "size": args.size, "rounds": args.rounds,
            "held_out": len(digits_splits()[1].labels), "formats": args.formats or "the preset's"}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    write_tables(out, results, meta)
    console.print(to_summary(results, meta), markup=False)
    return 0


def write_tables(out: Path, results: List[Dict], meta: Dict) -> None:
    """OUT.md (every row and variant) and OUT_summary.md (the README's table)."""
    out.with_suffix(".md").write_text(to_markdown(results, meta))
    out.with_name(out.name + "_summary.md").write_text(to_summary(results, meta))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
