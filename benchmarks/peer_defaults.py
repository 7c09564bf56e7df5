"""The artifact selected with ``configs/fx_fuse/serving.yaml`` against the peers a user would try by hand, each
run with its own defaults in a process of its own (runtimes in one process steal each other's cores):

- ``onnxruntime``: ``torch.onnx.export(model, x, path)`` of the trained, unfused model, then
  ``onnxruntime.InferenceSession(path)`` with no options (all graph optimisations, intra-op threads spinning);
- ``openvino``: ``openvino.convert_model(model, example_input=x)``, then ``Core().compile_model(m, "CPU")`` with
  no config (on a CPU with AVX512-BF16 or AMX that runs bf16);
- ``fx-lightning``: ``load_fused(dir, batch_size=1, traffic=...)``: what the export recorded as the fastest for
  batch 1 in that traffic, with the runtime settings that made it so.

Each process loads its model, warms up, then times batch 1 back to back (each call right after the previous one)
and with a 20 ms idle gap before each call; medians. The models and exports are those of ``serving.py`` (run it
first; it keeps the exports under ``benchmarks/results/cache/exports``).

    python benchmarks/peer_defaults.py                       # resnet18 and mobilenet_v3_large
    python benchmarks/peer_defaults.py --models resnet18 --calls 100
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

from digits import digits_splits, trained_model  # benchmarks/digits.py
from machine import cpu_description  # benchmarks/machine.py

KINDS = ["onnxruntime", "openvino", "fx-lightning"]
GAP_S = 0.02
HERE = Path(__file__).parent


def _input(size: int) -> torch.Tensor:
    return next(digits_splits()[1].batches(1, size))[0]


def _runner(kind: str, model_name: str, size: int, traffic: str) -> Callable[[torch.Tensor], Any]:
    x = _input(size)
    if kind == "fx-lightning":
        from fx_lightning import load_fused
        from serving import EXPORTS  # benchmarks/serving.py

        module = load_fused(EXPORTS / model_name, batch_size=1, traffic=traffic)
        return lambda t: module(t)
    model = trained_model(model_name, size)
    if kind == "onnxruntime":
        import onnxruntime as ort

        path = Path(tempfile.mkdtemp()) / "model.onnx"
        torch.onnx.export(model, (x,), str(path))
        session = ort.InferenceSession(str(path))
        name = session.get_inputs()[0].name
        return lambda t: session.run(None, {name: t.numpy()})
    if kind == "openvino":
        import openvino as ov

        compiled = ov.Core().compile_model(ov.convert_model(model, example_input=x), "CPU")
        return lambda t: compiled(t.numpy())
    raise ValueError(kind)


def worker(kind: str, model_name: str, size: int, calls: int, threads: int) -> Dict[str, Any]:
    """Times one peer in this process: batch 1, back to back and after an idle gap."""
    torch.set_num_threads(threads)
    x = _input(size)
    out: Dict[str, Any] = {"kind": kind, "model": model_name}
    with torch.no_grad():
        for traffic in ("back_to_back", "idle"):
            run = _runner(kind, model_name, size, traffic)
            for _ in range(20):
                run(x)
            times = []
            for _ in range(calls):
                if traffic == "idle":
                    time.sleep(GAP_S)
                start = time.perf_counter()
                run(x)
                times.append(time.perf_counter() - start)
            out[traffic] = 1e3 * statistics.median(times)
            if kind == "fx-lightning":
                from fx_lightning.export import read_manifest
                from fx_lightning.export.loader import selection_for
                from serving import EXPORTS

                pick = selection_for(read_manifest(EXPORTS / model_name), 1, traffic)
                out[f"{traffic}_artifact"] = f"{pick.format}{' (' + pick.runtime + ')' if pick.runtime else ''}" \
                    if pick else "default"
    return out


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v3_large"])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5,
                        help="processes per peer, interleaved with the others' (this machine's speed drifts over "
                             "minutes: one process per peer in a row differed by 30%% between identical runtimes)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(HERE / "results" / "peer_defaults"))
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.models[0], args.size, args.calls, args.threads)))
        return 0
    runs = []
    order = random.Random(0)
    for model in args.models:
        for _ in range(args.repeats):
            kinds = list(KINDS)
            order.shuffle(kinds)
            for kind in kinds:
                cmd = [sys.executable, str(Path(__file__)), "--worker", kind, "--models", model, "--size",
                       str(args.size), "--calls", str(args.calls), "--threads", str(args.threads)]
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
                if done.returncode != 0:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return done.returncode
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(runs[-1], flush=True)
    results = aggregate(runs)
    meta = {"cpu": cpu_description(), "threads": args.threads, "calls": args.calls, "size": args.size,
            "torch": torch.__version__, "repeats": args.repeats}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results, "runs": runs}, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(results, meta))
    print(to_markdown(results, meta))
    return 0


def aggregate(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One result per model and peer: the median over its processes of each process's median, and their range."""
    results = []
    for model in dict.fromkeys(r["model"] for r in runs):
        for kind in KINDS:
            mine = [r for r in runs if (r["model"], r["kind"]) == (model, kind)]
            if not mine:
                continue
            result = {**mine[0]}
            for traffic in ("back_to_back", "idle"):
                values = [r[traffic] for r in mine]
                result[traffic] = statistics.median(values)
                result[f"{traffic}_range"] = [min(values), max(values)]
            results.append(result)
    return results


def to_markdown(results: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    lines = [f"torch {meta['torch']}, {meta['threads']} threads, {meta['cpu']}, input {meta['size']}x{meta['size']}, "
             f"batch 1, each peer in a process of its own with its own defaults, {meta.get('repeats', 1)} processes "
             f"per peer interleaved with the others'; ms: the median over those processes of each one's median of "
             f"{meta['calls']} calls (range in brackets); idle: a 20 ms gap before each call.", "",
             "| model | traffic | onnxruntime (defaults) ms | openvino (defaults) ms | fx-lightning selected | ms | "
             "vs onnxruntime | vs openvino |", "|---|---|---|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in results):
        by_kind = {r["kind"]: r for r in results if r["model"] == model}
        for traffic in ("back_to_back", "idle"):
            ort_ms, ov_ms = by_kind["onnxruntime"][traffic], by_kind["openvino"][traffic]
            ours = by_kind["fx-lightning"]
            cells = [f"{r[traffic]:.2f} ({_range(r, traffic)})" for r in
                     (by_kind["onnxruntime"], by_kind["openvino"])]
            lines.append(f"| {model} | {traffic.replace('_', ' ')} | {cells[0]} | {cells[1]} | "
                         f"{ours[traffic + '_artifact']} | {ours[traffic]:.2f} ({_range(ours, traffic)}) | "
                         f"{ort_ms / ours[traffic]:.2f}x | {ov_ms / ours[traffic]:.2f}x |")
    return "\n".join(lines) + "\n"


def _range(result: Dict[str, Any], traffic: str) -> str:
    low, high = result.get(f"{traffic}_range", [result[traffic]] * 2)
    return f"{low:.2f}-{high:.2f}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
