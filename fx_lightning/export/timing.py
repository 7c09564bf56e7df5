"""Timing artifacts: interleaved rounds in one process (the selection's bench), and one artifact alone in a process
of its own (the selection's finalists).

Interleaved: every round runs every candidate once, in a shuffled order, so a slow minute on a shared machine
lands on all of them; each candidate runs once after an idle gap (:data:`IDLE_GAP_S`: the runtime's threads have
gone to sleep, as under sparse traffic) and once right after (back to back); the gap also keeps one runtime's
spinning threads from slowing the next.

Alone: runtimes in one process steal each other's cores (figures: docs/performance.md). A server runs one model
per process, so the finalists are timed each in a fresh Python process
(``python -m fx_lightning.export.timing``) with the same loop, inputs (``check.pt``), threads and idle gap.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.config import Traffic
from fx_lightning.errors import first_line
from fx_lightning.export.manifest import Sweep, TimingFailure
from fx_lightning.export.sweep import IDLE_GAP_S, SweepSettings, sweep_module
from fx_lightning.rows import with_rows

__all__ = ["IDLE_GAP_S", "Candidate", "Samples", "Progress", "time_interleaved", "time_in_own_process",
           "sweep_in_own_process"]

OWN_PROCESS_TIMEOUT_S = 600.0

Candidate = Tuple[str, str]  # (artifact or baseline, runtime choice)
Samples = Dict[Tuple[Candidate, int], Dict[str, List[float]]]  # (candidate, batch size) -> traffic -> seconds
Progress = Callable[[str, int, int], None]  # (what, done, total)


def time_interleaved(models: Dict[Candidate, nn.Module], inputs: Sequence[Any], batch_sizes: Sequence[int],
                     rounds: int, warmup: int, progress: Optional[Progress] = None,
                     axes: Optional[Sequence[Optional[int]]] = None) -> Tuple[Samples, List[TimingFailure]]:
    """Every candidate at every batch size, interleaved in shuffled rounds; in each round a candidate runs once
    after the idle gap (``idle``) and once right after that (``back_to_back``). ``axes``: the inputs' sample axes
    (the inputs cut or repeated to each batch size along them); None: no sample axis, the inputs are timed as they
    are (give one batch size). Returns the samples and what could not run (a model that raises at a batch size is
    not timed there again)."""
    cells = [(key, b) for b in batch_sizes for key in models]
    failures: List[TimingFailure] = []
    args = {b: (tuple(with_rows(inputs, axes, b)) if axes is not None else tuple(inputs)) for b in batch_sizes}
    times: Samples = {cell: {t.value: [] for t in Traffic} for cell in cells}
    runnable = set(cells)
    rng = random.Random(0)
    total = (warmup + rounds) * len(cells)
    done = 0
    with torch.no_grad():
        for r in range(warmup + rounds):
            order = list(cells)
            rng.shuffle(order)
            for cell in order:
                done += 1
                (name, _), b = cell
                if cell in runnable:
                    time.sleep(IDLE_GAP_S)
                    try:
                        idle = _timed(models[cell[0]], args[b])
                        back_to_back = _timed(models[cell[0]], args[b])
                    except Exception as exc:  # noqa: BLE001 - e.g. a model exported for another batch size
                        runnable.discard(cell)
                        failures.append(TimingFailure(name, b, f"{type(exc).__name__}: {first_line(exc)[:200]}"))
                        continue
                    if r >= warmup:
                        times[cell][Traffic.idle.value].append(idle)
                        times[cell][Traffic.back_to_back.value].append(back_to_back)
                if progress is not None:
                    progress("timing", done, total)
    return times, failures


def _timed(module: nn.Module, args: Sequence[Any]) -> float:
    start = time.perf_counter()
    module(*args)
    return time.perf_counter() - start


def time_in_own_process(root: Path, manifest_json: Dict[str, object], candidate: Candidate,
                        batch_sizes: Sequence[int], rounds: int, warmup: int,
                        threads: int) -> Tuple[Optional[Dict[Tuple[int, str], List[float]]], str]:
    """``candidate`` timed by :func:`time_interleaved` in a fresh process. Returns its samples as
    ``{(batch size, traffic): seconds}``, or None and why the process failed (the caller keeps what it had)."""
    raw, why = _in_own_process({"root": str(root), "manifest": manifest_json, "candidate": list(candidate),
                                "batch_sizes": list(batch_sizes), "rounds": rounds, "warmup": warmup,
                                "threads": threads})
    if raw is None:
        return None, why
    return {(int(b), str(traffic)): list(ts) for b, traffic, ts in raw}, ""


def sweep_in_own_process(root: Path, manifest_json: Dict[str, object], candidate: Candidate,
                         traffics: Sequence[str], settings: SweepSettings,
                         threads: int) -> Tuple[Optional[List[Sweep]], str]:
    """``candidate``'s throughput sweep (export/sweep.py) in each of ``traffics``, in a fresh process, as a server
    runs it. Returns the sweeps, or None and why the process failed."""
    raw, why = _in_own_process({"root": str(root), "manifest": manifest_json, "candidate": list(candidate),
                                "sweep": {"traffics": list(traffics), "settings": dataclasses.asdict(settings)},
                                "threads": threads})
    return ([Sweep.from_dict(w) for w in raw] if raw is not None else None), why


def _in_own_process(request: Dict[str, object]) -> Tuple[Any, str]:
    with tempfile.TemporaryDirectory(prefix="fxl-own-process-") as tmp:
        path, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        path.write_text(json.dumps({**request, "out": str(out)}), encoding="utf-8")
        # The parent's import path, so an artifact that imports the user's modules loads as it did here.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            done = subprocess.run([sys.executable, "-m", "fx_lightning.export.timing", str(path)],
                                  capture_output=True, text=True, timeout=OWN_PROCESS_TIMEOUT_S, env=env, check=False)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {OWN_PROCESS_TIMEOUT_S:.0f} s"
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or ["no output"]
            return None, f"exit code {done.returncode}: {tail[0][:200]}"
        return json.loads(out.read_text(encoding="utf-8")), ""


def _time_request(path: Path) -> None:
    """The worker of :func:`time_in_own_process`: load the one artifact, time it, write the samples."""
    from fx_lightning.export.loader import load_artifact
    from fx_lightning.export.manifest import Manifest
    from fx_lightning.export.check import read_check_file

    request = json.loads(path.read_text(encoding="utf-8"))
    torch.set_num_threads(int(request["threads"]))
    root = Path(request["root"])
    name, runtime = request["candidate"]
    module = load_artifact(root, Manifest.from_dict(request["manifest"]), name, device="cpu", runtime=runtime)
    saved = read_check_file(root)
    if saved is None:
        raise SystemExit("no check.pt: nothing to time the artifact on")
    manifest = Manifest.from_dict(request["manifest"])
    signature = manifest.call_signature()
    axes = signature.input_axes() if signature.batched else None
    if "sweep" in request:
        settings = SweepSettings(**request["sweep"]["settings"])
        result: Any = [sweep_module(module, saved.inputs, axes or [], name, runtime, traffic, settings,
                                    process="own").to_dict() for traffic in request["sweep"]["traffics"]]
    else:
        samples, failures = time_interleaved({(name, runtime): module}, saved.inputs, request["batch_sizes"],
                                             int(request["rounds"]), int(request["warmup"]), axes=axes)
        if failures:
            raise SystemExit(failures[0].reason)
        result = [[b, traffic, ts] for (_, b), by_traffic in samples.items() for traffic, ts in by_traffic.items()]
    Path(request["out"]).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    _time_request(Path(sys.argv[1]))
