"""Which artifact to serve: every format of an export timed side by side, each checked on the export's own
check batch, and the fastest that passed recorded in the manifest (``load_fused(dir)`` then loads it).

Timing is interleaved: every round runs every artifact once, in a shuffled order, so a slow minute on a
shared machine lands on all of them, with a short pause before each call so one runtime's spinning threads do
not slow the next; the table keeps medians and the 90th percentile. The check compares each
artifact's outputs on ``check.pt`` with the fp64 reference outputs saved there, with the export's own rule (a
few times the fused model's own error), so an artifact that disagrees is never selected.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from fx_lightning.batches import flat_tensors, with_batch_size
from fx_lightning.errors import ExportError
from fx_lightning.export.manifest import read_manifest, replace_manifest

__all__ = ["Timing", "BenchTable", "bench_export", "select_fastest", "record_selection"]

# An artifact may be this many times further from the fp64 reference than the fused model (as at export).
CHECK_FACTOR = 8.0
# A pause before each timed call: torch's OpenMP threads spin for a while after a call and take the cores from
# whatever runs next. Measured (resnet18, batch 1, 2 cores): ONNX Runtime ran 55.2 ms right after torch calls,
# 49.1 ms alone and 49.2 ms after this pause; torch artifacts were unchanged. Each artifact is timed as if alone.
SETTLE_S = 0.02
_FLOOR = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}

Progress = Callable[[str, int, int], None]  # (what, done, total)


@dataclass
class Timing:
    artifact: str
    batch_size: int
    median_ms: float
    p90_ms: float
    rounds: int


@dataclass
class BenchTable:
    """Timings of every artifact (and of the eager baselines given), and each artifact's check."""

    threads: int
    isa: str
    machine: str
    torch: str
    timings: List[Timing] = field(default_factory=list)
    checks: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def median(self, artifact: str, batch_size: int) -> Optional[float]:
        return next((t.median_ms for t in self.timings if t.artifact == artifact and t.batch_size == batch_size), None)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _check(module: nn.Module, saved: Dict[str, Any]) -> Dict[str, Any]:
    """The artifact's outputs on the saved check inputs against the saved fp64 outputs."""
    try:
        with torch.no_grad():
            got = flat_tensors(module(*saved["inputs"]))
    except Exception as exc:  # noqa: BLE001
        return {"passed": False, "reason": f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    expected = saved["expected"]
    if len(got) != len(expected) or any(g.shape != e.shape for g, e in zip(got, expected)):
        return {"passed": False, "reason": "outputs of another structure or shape"}
    worst, tolerance = 0.0, 0.0
    for g, e in zip(got, expected):
        if not e.is_floating_point():
            continue
        g64, e64 = g.detach().cpu().double(), e.double()
        err = float((g64 - e64).abs().max() / e64.abs().max().clamp_min(1e-30)) if e64.numel() else 0.0
        tol = max(_FLOOR.get(g.dtype, 1e-5), CHECK_FACTOR * float(saved.get("fused_error", 0.0)))
        worst, tolerance = max(worst, err), max(tolerance, tol)
    passed = worst <= tolerance
    return {"passed": passed, "relative_error": worst, "tolerance": tolerance,
            **({} if passed else {"reason": f"relative error {worst:.2e} > {tolerance:.1e}"})}


def bench_export(
    root: Any,
    *,
    batch_sizes: Sequence[int] = (1, 8),
    formats: Optional[Sequence[str]] = None,
    baselines: Optional[Dict[str, nn.Module]] = None,
    rounds: int = 20,
    warmup: int = 3,
    threads: Optional[int] = None,
    progress: Optional[Progress] = None,
) -> BenchTable:
    """Time the export's artifacts (``formats``, default all) and ``baselines`` (name -> eager module, e.g.
    ``{"eager": unfused}``) at each batch size, interleaved; check every artifact on ``check.pt``."""
    from fx_lightning.export.loader import load_fused  # the selection module is loaded by the loader too
    from fx_lightning.export.writer import CHECK_FILE

    root = Path(root)
    manifest = read_manifest(root)
    if threads:
        torch.set_num_threads(threads)
    saved = torch.load(root / CHECK_FILE, weights_only=True) if (root / CHECK_FILE).is_file() else None
    table = BenchTable(torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), platform.machine(),
                       torch.__version__)
    models: Dict[str, nn.Module] = dict(baselines or {})
    for name in formats or list(manifest["formats"]):
        try:
            models[name] = load_fused(root, name, device="cpu")
        except ExportError as exc:
            table.checks[name] = {"passed": False, "reason": str(exc).splitlines()[0]}
            continue
        check = _check(models[name], saved) if saved is not None else {"passed": True, "reason": "no check.pt"}
        gate = manifest["formats"][name].get("gate")
        if gate is not None:  # a lossy variant: its accuracy gate decides, the fp64 error is for information
            check = {**check, "passed": bool(gate.get("passed")), "reason": "accuracy gate at export"}
        table.checks[name] = check
    inputs = saved["inputs"] if saved is not None else _random_inputs(manifest)
    _time_interleaved(table, models, inputs, batch_sizes, rounds, warmup, progress)
    return table


def _random_inputs(manifest: Dict[str, Any]) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for spec in manifest.get("inputs") or []:
        shape = [2 if d == "batch" else int(d) for d in spec["shape"]]
        dtype = getattr(torch, spec.get("dtype", "float32"))
        out.append(torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype))
    return out


def _time_interleaved(table: BenchTable, models: Dict[str, nn.Module], inputs: Sequence[Any],
                      batch_sizes: Sequence[int], rounds: int, warmup: int, progress: Optional[Progress]) -> None:
    cells = [(name, b) for b in batch_sizes for name in models]
    args = {b: with_batch_size(inputs, b) for b in batch_sizes}
    times: Dict[Any, List[float]] = {cell: [] for cell in cells}
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
                if cell in runnable:
                    time.sleep(SETTLE_S)
                    try:
                        start = time.perf_counter()
                        models[cell[0]](*args[cell[1]])
                        elapsed = time.perf_counter() - start
                    except Exception:  # noqa: BLE001 - e.g. an AOTI package compiled for other batch sizes
                        runnable.discard(cell)
                        continue
                    if r >= warmup:
                        times[cell].append(elapsed)
                if progress is not None:
                    progress("timing", done, total)
    for (name, b), ts in times.items():
        if ts:
            ts.sort()
            table.timings.append(Timing(name, b, 1e3 * statistics.median(ts),
                                        1e3 * ts[min(len(ts) - 1, int(0.9 * len(ts)))], len(ts)))


def select_fastest(table: BenchTable, batch_size: int) -> Optional[Dict[str, Any]]:
    """The fastest artifact at ``batch_size`` whose check passed (baselines are not artifacts), or None."""
    candidates = [(t.median_ms, t.artifact) for t in table.timings
                  if t.batch_size == batch_size and table.checks.get(t.artifact, {}).get("passed")]
    if not candidates:
        return None
    median, name = min(candidates)
    return {"format": name, "batch_size": batch_size, "median_ms": median,
            "why": f"fastest at batch {batch_size} ({median:.2f} ms median, {table.threads} threads, {table.isa}) "
                   "of the artifacts that passed their check"}


def record_selection(root: Any, table: BenchTable, selected: Optional[Dict[str, Any]]) -> None:
    """Write the table and the selection into the manifest (atomically; the manifest is not in the file hashes)."""
    manifest = read_manifest(root)
    manifest["bench"] = table.to_dict()
    manifest["selected"] = selected
    replace_manifest(Path(root), manifest)
