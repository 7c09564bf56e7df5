"""Which artifact to serve: every format of an export timed side by side, each checked on the export's own
check batch, and the fastest that passed recorded in the manifest (``load_fused(dir)`` then loads it).

Timing is interleaved: every round runs every artifact once, in a shuffled order, so a slow minute on a
shared machine lands on all of them, with a short pause before each call so one runtime's spinning threads do
not slow the next; the table keeps medians and the 90th percentile. The check compares each
artifact's outputs on ``check.pt`` with the fp64 reference outputs saved there, with the export's own rule (a
few times the fused model's own error), so an artifact that disagrees is never selected.
"""

from __future__ import annotations

import dataclasses
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.batches import with_batch_size
from fx_lightning.errors import ExportError, first_line
from fx_lightning.export.loader import load_artifact
from fx_lightning.export.manifest import (
    ArtifactCheck,
    BenchTable,
    Manifest,
    Selected,
    Timing,
    TimingFailure,
    read_manifest,
    replace_manifest,
)
from fx_lightning.export.writer import CheckData, check_artifact, read_check_file

__all__ = ["Timing", "BenchTable", "bench_export", "select_fastest", "record_selection", "with_selection"]
# A pause before each timed call: torch's OpenMP threads spin for a while after a call and take the cores from
# whatever runs next. Measured (resnet18, batch 1, 2 cores): ONNX Runtime ran 55.2 ms right after torch calls,
# 49.1 ms alone and 49.2 ms after this pause; torch artifacts were unchanged. Each artifact is timed as if alone.
SETTLE_S = 0.02

Progress = Callable[[str, int, int], None]  # (what, done, total)


def _check(module: nn.Module, saved: CheckData) -> ArtifactCheck:
    """The artifact's outputs on the saved check inputs against the saved fp64 outputs, as at export."""
    try:
        comparison = check_artifact(module, tuple(saved.inputs), saved.expected, saved.fused_error)
    except Exception as exc:  # noqa: BLE001
        return ArtifactCheck(False, reason=f"raises {type(exc).__name__}: {first_line(exc)[:200]}")
    if comparison.mismatch is not None:
        return ArtifactCheck(False, reason=f"outputs of another structure or shape: {comparison.mismatch}")
    return ArtifactCheck(comparison.passed, comparison.relative_error, comparison.tolerance,
                         None if comparison.passed else comparison.describe())


def bench_export(
    root: Any,
    *,
    manifest: Optional[Manifest] = None,
    batch_sizes: Sequence[int] = (1, 8),
    formats: Optional[Sequence[str]] = None,
    baselines: Optional[Dict[str, nn.Module]] = None,
    rounds: int = 20,
    warmup: int = 3,
    threads: Optional[int] = None,
    progress: Optional[Progress] = None,
) -> BenchTable:
    """Time the export's artifacts (``formats``, default all) and ``baselines`` (name -> eager module, e.g.
    ``{"eager": unfused}``) at each batch size, interleaved; check every artifact on ``check.pt``. ``manifest``:
    the export's manifest when it is not on disk yet (an export being written), else it is read from ``root``."""
    root = Path(root)
    manifest = manifest if manifest is not None else read_manifest(root)
    if threads:
        torch.set_num_threads(threads)
    saved = read_check_file(root)
    table = BenchTable(torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), platform.machine(),
                       torch.__version__)
    models: Dict[str, nn.Module] = dict(baselines or {})
    for name in formats or list(manifest.formats):
        try:
            models[name] = load_artifact(root, manifest, name, device="cpu")
        except ExportError as exc:
            table.checks[name] = ArtifactCheck(False, reason=first_line(exc))
            continue
        check = _check(models[name], saved) if saved is not None else ArtifactCheck(True, reason="no check.pt")
        gate = manifest.formats[name].gate
        if gate is not None:  # a lossy variant: its accuracy gate decides, the fp64 error is for information
            check = dataclasses.replace(check, passed=gate.passed, reason="accuracy gate at export")
        table.checks[name] = check
    inputs = saved.inputs if saved is not None else _random_inputs(manifest)
    timings, failures = _time_interleaved(models, inputs, batch_sizes, rounds, warmup, progress)
    table.timings, table.failures = timings, failures
    return table


def _random_inputs(manifest: Manifest) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for spec in manifest.inputs:
        shape = [2 if d == "batch" else int(d) for d in spec.shape or []]
        dtype = getattr(torch, spec.dtype or "float32")
        out.append(torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype))
    return out


def _time_interleaved(models: Dict[str, nn.Module], inputs: Sequence[Any], batch_sizes: Sequence[int], rounds: int,
                      warmup: int, progress: Optional[Progress]) -> Tuple[List[Timing], List[TimingFailure]]:
    """Every model at every batch size, interleaved in shuffled rounds: the timings (median, p90) and what could
    not run (a model that raises at a batch size is not timed there again)."""
    cells = [(name, b) for b in batch_sizes for name in models]
    failures: List[TimingFailure] = []
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
                    except Exception as exc:  # noqa: BLE001 - e.g. a model exported for another batch size
                        runnable.discard(cell)
                        failures.append(TimingFailure(cell[0], cell[1], f"{type(exc).__name__}: {first_line(exc)[:200]}"))
                        continue
                    if r >= warmup:
                        times[cell].append(elapsed)
                if progress is not None:
                    progress("timing", done, total)
    timings = [Timing(name, b, 1e3 * statistics.median(ts), 1e3 * sorted(ts)[min(len(ts) - 1, int(0.9 * len(ts)))],
                      len(ts)) for (name, b), ts in times.items() if ts]
    return timings, failures


def select_fastest(table: BenchTable, batch_size: int) -> Optional[Selected]:
    """The fastest artifact at ``batch_size`` whose check passed (baselines are not artifacts), or None."""
    candidates = [(t.median_ms, t.artifact) for t in table.timings
                  if t.batch_size == batch_size and t.artifact in table.checks and table.checks[t.artifact].passed]
    if not candidates:
        return None
    median, name = min(candidates)
    return Selected(name, batch_size, median,
                    f"fastest at batch {batch_size} ({median:.2f} ms median, {table.threads} threads, {table.isa}) "
                    "of the artifacts that passed their check")


def with_selection(manifest: Manifest, table: BenchTable, selected: Optional[Selected]) -> Manifest:
    """``manifest`` with the table and the selection recorded."""
    return dataclasses.replace(manifest, bench=table, selected=selected)


def record_selection(root: Any, table: BenchTable, selected: Optional[Selected]) -> None:
    """Write the table and the selection into a finished export's manifest (atomically; the manifest is not in
    the file hashes)."""
    replace_manifest(Path(root), with_selection(read_manifest(root), table, selected))
