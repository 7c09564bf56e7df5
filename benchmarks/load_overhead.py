"""What ``load_fused`` adds to a runtime's own call: ONNX Runtime run with its defaults on the export's
``model.onnx`` (numpy in and out, as a user of ONNX Runtime calls it) against ``load_fused(dir, format="onnx")``
(the settings the manifest records for it; torch in and out, the signature's checks), and against the same session on a static-shape file when one is given
(``--static``: e.g. ``torch.onnx.export`` of the unfused model, the file peer_defaults.py's ONNX Runtime peer runs).

Each in a process of its own (two sessions in one process take each other's cores), ``--rounds`` processes each,
taking turns; batch 1, back to back and after a 20 ms idle gap; the median over the processes of each one's median.

    python benchmarks/load_overhead.py benchmarks/results/cache/exports/mobilenet_v3_large \\
        --static benchmarks/results/cache/peer_int8/mobilenet_v3_large_224px/onnxruntime-int8/model_fp32.onnx
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

GAP_S = 0.02
TRAFFICS = ("back_to_back", "idle")


def _timed(call: Callable[[], Any], calls: int) -> Dict[str, float]:
    for _ in range(30):
        call()
    medians = {}
    for traffic in TRAFFICS:
        times = []
        for _ in range(calls):
            if traffic == "idle":
                time.sleep(GAP_S)
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
        medians[traffic] = statistics.median(times)
    return medians


def _one(kind: str, export: Path, static: Optional[Path], calls: int) -> Dict[str, float]:
    import numpy as np
    import torch

    torch.set_num_threads(2)
    if kind == "load_fused":
        from fx_lightning import load_fused

        model = load_fused(export, format="onnx")
        x = torch.zeros(1, *model.signature.inputs[0].shape[1:])
        return _timed(lambda: model(x), calls)
    import onnxruntime as ort

    session = ort.InferenceSession(str(static if kind == "static file" else export / "model.onnx"))
    first = session.get_inputs()[0]
    feed = {first.name: np.zeros([1, *first.shape[1:]], np.float32)}
    return _timed(lambda: session.run(None, feed), calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--static", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_one(args.worker, args.export, args.static, args.calls)))
        return
    kinds = ["session (defaults)", "load_fused", *(["static file"] if args.static else [])]
    results: Dict[str, Dict[str, List[float]]] = {k: {t: [] for t in TRAFFICS} for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            command = [sys.executable, __file__, str(args.export), "--calls", str(args.calls), "--worker", kind]
            command += ["--static", str(args.static)] if args.static else []
            medians = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
            for traffic, ms in medians.items():
                results[kind][traffic].append(ms)
    from machine import cpu_description  # benchmarks/machine.py

    print(f"{cpu_description()}; 2 threads; batch 1; ms: median over {args.rounds} processes (range)")
    base = {t: statistics.median(results[kinds[0]][t]) for t in TRAFFICS}
    for kind in kinds:
        cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}), {statistics.median(v) / base[t]:.3f}x"
                 for t, v in results[kind].items()]
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
