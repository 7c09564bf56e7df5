"""Time one artifact in a process of its own, as it is served: the selection's finalists are timed this way.

Runtimes in one process steal each other's cores: in the selection's shared bench, ONNX Runtime ran
mobilenet_v3_large at 6.7-7.4 ms after an idle gap, against 4.71 ms alone in a process (2 cores, Zen 4), and the
shared bench had picked OpenVINO bf16 (5.17 ms alone). A server runs one model per process, so the finalists are
timed each in a fresh Python process (``python -m fx_lightning.export.own_process``), with the same inputs
(``check.pt``), threads, traffics and idle gap as the shared bench.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["OwnProcessTiming", "time_in_own_process"]

# (batch size, traffic) -> seconds per call
OwnProcessTiming = Dict[Tuple[int, str], List[float]]
TIMEOUT_S = 600.0


def time_in_own_process(root: Path, manifest_json: Dict[str, object], artifact: str, runtime: str,
                        batch_sizes: Sequence[int], rounds: int, warmup: int, idle_gap_s: float,
                        threads: int) -> Tuple[Optional[OwnProcessTiming], str]:
    """``artifact`` with ``runtime`` timed in a fresh process: each round, at each batch size, one call after
    ``idle_gap_s`` (``idle``) and one right after it (``back_to_back``). Returns the samples, or None and why
    the process failed (the caller keeps what it had)."""
    with tempfile.TemporaryDirectory(prefix="fxl-own-process-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({
            "root": str(root), "manifest": manifest_json, "artifact": artifact, "runtime": runtime,
            "batch_sizes": list(batch_sizes), "rounds": rounds, "warmup": warmup, "idle_gap_s": idle_gap_s,
            "threads": threads, "out": str(Path(tmp) / "samples.json"),
        }), encoding="utf-8")
        # The parent's import path, so an artifact that imports the user's modules loads as it did here.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            done = subprocess.run([sys.executable, "-m", "fx_lightning.export.own_process", str(request)],
                                  capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {TIMEOUT_S:.0f} s"
        out = Path(tmp) / "samples.json"
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or ["no output"]
            return None, f"exit code {done.returncode}: {tail[0][:200]}"
        raw = json.loads(out.read_text(encoding="utf-8"))
    return {(int(b), str(traffic)): list(ts) for b, traffic, ts in raw}, ""


def _serve_request(path: Path) -> None:
    from fx_lightning.batches import with_batch_size
    from fx_lightning.export.loader import load_artifact
    from fx_lightning.export.manifest import Manifest
    from fx_lightning.export.writer import read_check_file

    request = json.loads(path.read_text(encoding="utf-8"))
    torch.set_num_threads(int(request["threads"]))
    root = Path(request["root"])
    manifest = Manifest.from_dict(request["manifest"])
    module = load_artifact(root, manifest, request["artifact"], device="cpu", runtime=request["runtime"])
    saved = read_check_file(root)
    if saved is None:
        raise SystemExit("no check.pt: nothing to time the artifact on")
    gap = float(request["idle_gap_s"])
    samples: Dict[Tuple[int, str], List[float]] = {}
    args = {b: with_batch_size(saved.inputs, b) for b in request["batch_sizes"]}
    with torch.no_grad():
        for r in range(int(request["warmup"]) + int(request["rounds"])):
            for b, batch in args.items():
                time.sleep(gap)
                start = time.perf_counter()
                module(*batch)
                middle = time.perf_counter()
                module(*batch)
                end = time.perf_counter()
                if r >= int(request["warmup"]):
                    samples.setdefault((b, "idle"), []).append(middle - start)
                    samples.setdefault((b, "back_to_back"), []).append(end - middle)
    Path(request["out"]).write_text(json.dumps([[b, t, ts] for (b, t), ts in samples.items()]), encoding="utf-8")


if __name__ == "__main__":
    _serve_request(Path(sys.argv[1]))
