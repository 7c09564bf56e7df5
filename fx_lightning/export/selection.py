"""Which artifact to serve: every format of an export timed side by side, each checked on the export's own
check batch, and the fastest that passed recorded in the manifest for each batch size and traffic
(``load_fused(dir)`` loads the one for ``export.select_batch_size`` and ``export.select_traffic``;
``load_fused(dir, batch_size=, traffic=)`` picks another).

Each artifact is timed with the runtime settings it was written with and with each of its format's
``runtime_choices`` (ONNX Runtime's threads spinning between runs, say), and in two kinds of traffic: a call after
an idle gap (:data:`IDLE_GAP_S`: the runtime's threads have gone to sleep, as under sparse traffic) and a call right
after another (back to back), interleaved (timing.py); the finalists are then timed again each in a process of
its own, as a server runs them. The table keeps medians and the 90th percentile. The check
compares each artifact's outputs on ``check.pt`` with the fp64 reference outputs saved there, with the export's
own rule (a few times the fused model's own error), so an artifact that disagrees is never selected; a lossy
variant's accuracy gate at export stands in for it.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.config import Traffic
from fx_lightning.errors import ExportError, first_line
from fx_lightning.formats import FORMATS
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
from fx_lightning.export.timing import IDLE_GAP_S, Progress, time_interleaved, time_in_own_process
from fx_lightning.export.check import CheckData, check_artifact, read_check_file
from fx_lightning.tolerance import LOSSY_MAX_ERROR

__all__ = ["Timing", "BenchTable", "bench_export", "check_saved", "select_fastest", "select_all", "record_selection",
           "with_selection", "IDLE_GAP_S", "FINALIST_WITHIN", "FINALIST_ROUNDS"]

# Passing artifacts within this factor of the fastest (at most ``own_process_finalists`` per batch size and
# traffic) are the finalists, timed each in a process of its own for FINALIST_ROUNDS rounds: a shared bench slows
# some runtimes and its medians wander, so near ties are decided alone (figures: docs/performance.md).
FINALIST_WITHIN = 1.6
FINALIST_ROUNDS = 30


def check_saved(module: nn.Module, saved: CheckData, *, lossy: bool = False) -> ArtifactCheck:
    """The artifact's outputs on the saved check inputs against the saved fp64 outputs, as at export. A lossy
    variant (``lossy``) is judged by its accuracy gate at export; here it passes when it runs and its outputs
    have the reference's structure and shapes, and its error is recorded for information."""
    try:
        comparison = check_artifact(module, tuple(saved.inputs), saved.expected, saved.fused_error, saved.stochastic)
    except Exception as exc:  # noqa: BLE001
        return ArtifactCheck(False, reason=f"raises {type(exc).__name__}: {first_line(exc)[:200]}")
    if comparison.mismatch is not None:
        return ArtifactCheck(False, reason=f"outputs of another structure or shape: {comparison.mismatch}")
    if lossy:  # its gate at export judged its accuracy; here it must run, with the structure and finite outputs
        error = comparison.relative_error
        sane = error is not None and math.isfinite(error) and error < LOSSY_MAX_ERROR
        return ArtifactCheck(sane, error, comparison.tolerance,
                             "lossy variant: judged by its accuracy gate at export; here it ran with the reference's "
                             "output structure" if sane else f"lossy variant: relative error {error} (NaN, infinite "
                             "or as large as the outputs): it does not compute the model")
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
    own_process_finalists: int = 0,
    threads: Optional[int] = None,
    progress: Optional[Progress] = None,
    runtime_choices: bool = True,
) -> BenchTable:
    """Time the export's artifacts (``formats``, default all; each also with its format's runtime choices unless
    ``runtime_choices`` is false) and ``baselines`` (name -> eager module, e.g. ``{"eager": unfused}``) at each
    batch size, in both traffics, interleaved; check every artifact on ``check.pt``. ``own_process_finalists``: at
    most that many of the fastest passing artifacts at each batch size and traffic (within :data:`FINALIST_WITHIN`
    of the fastest) are then timed again, each in a process of its own, for :data:`FINALIST_ROUNDS` rounds; those
    timings replace theirs (``process: "own"``). ``manifest``: the export's manifest when it is not on disk yet
    (an export being written), else it is read from ``root``."""
    root = Path(root)
    manifest = manifest if manifest is not None else read_manifest(root)
    if threads:
        torch.set_num_threads(threads)
    saved = read_check_file(root)
    table = BenchTable(torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), platform.machine(),
                       torch.__version__)
    models: Dict[Tuple[str, str], nn.Module] = {(name, ""): m for name, m in (baselines or {}).items()}
    for name in formats or list(manifest.formats):
        entry = manifest.formats[name]
        choices = FORMATS[entry.format_name or name].runtime_choices if runtime_choices else {}
        try:
            for runtime in ("", *choices):
                models[(name, runtime)] = load_artifact(root, manifest, name, device="cpu", runtime=runtime)
        except ExportError as exc:
            table.checks[name] = ArtifactCheck(False, reason=first_line(exc))
            continue
        check = check_saved(models[(name, "")], saved) if saved is not None else ArtifactCheck(True, reason="no check.pt")
        if entry.gate is not None:  # a lossy variant: its accuracy gate decides, the fp64 error is for information
            check = dataclasses.replace(check, passed=entry.gate.passed, reason="accuracy gate at export")
        table.checks[name] = check
    inputs = saved.inputs if saved is not None else _random_inputs(manifest)
    signature = manifest.call_signature()
    if not signature.batched:  # no sample axis: the example is timed as it is, one "batch size"
        batch_sizes = [1]
    samples, failures = time_interleaved(models, inputs, batch_sizes, rounds, warmup, progress,
                                         axes=signature.input_axes() if signature.batched else None)
    table.timings = [Timing(name, b, 1e3 * statistics.median(ts), 1e3 * _p90(ts), len(ts), traffic, runtime)
                     for ((name, runtime), b), by_traffic in samples.items() for traffic, ts in by_traffic.items() if ts]
    table.failures = [f for i, f in enumerate(failures) if f not in failures[:i]]  # a runtime choice fails as its artifact
    if own_process_finalists:
        _time_finalists_alone(root, manifest, table, own_process_finalists, warmup)
    return table


def _time_finalists_alone(root: Path, manifest: Manifest, table: BenchTable, finalists: int, warmup: int) -> None:
    """Replace the finalists' timings in ``table`` with timings taken each in a process of its own."""
    chosen: Dict[Tuple[str, str], set] = {}
    for b in {t.batch_size for t in table.timings}:
        for traffic in Traffic:
            rows = sorted((t for t in table.timings if t.batch_size == b and t.traffic == traffic.value
                           and t.artifact in table.checks and table.checks[t.artifact].passed),
                          key=lambda t: t.median_ms)
            if len(rows) < 2:
                continue
            for t in rows[:finalists]:
                if t.median_ms <= rows[0].median_ms * FINALIST_WITHIN:
                    chosen.setdefault((t.artifact, t.runtime), set()).add(b)
    if len(chosen) < 2:
        return
    manifest_json = manifest.to_dict()
    for (artifact, runtime), sizes in chosen.items():
        samples, why = time_in_own_process(root, manifest_json, (artifact, runtime), sorted(sizes), FINALIST_ROUNDS,
                                           warmup, table.threads)
        if samples is None:
            table.failures.append(TimingFailure(artifact, min(sizes), f"not timed in a process of its own ({why}); "
                                                                     "its shared-process timing stands"))
            continue
        for i, t in enumerate(table.timings):
            ts = samples.get((t.batch_size, t.traffic))
            if (t.artifact, t.runtime) == (artifact, runtime) and ts:
                table.timings[i] = dataclasses.replace(t, median_ms=1e3 * statistics.median(ts),
                                                       p90_ms=1e3 * _p90(ts), rounds=len(ts), process="own")


def _p90(ts: Sequence[float]) -> float:
    return sorted(ts)[min(len(ts) - 1, int(0.9 * len(ts)))]


def _random_inputs(manifest: Manifest) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for spec in manifest.inputs:
        shape = [2 if d == "batch" else int(d) for d in spec.shape or []]
        dtype = getattr(torch, spec.dtype or "float32")
        out.append(torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype))
    return out


def select_fastest(table: BenchTable, batch_size: int, traffic: Any = "idle") -> Optional[Selected]:
    """The fastest artifact (with the runtime settings that made it so) at ``batch_size`` under ``traffic`` whose
    check passed (baselines are not artifacts), or None."""
    traffic = Traffic(traffic).value
    candidates = [(t.median_ms, t.artifact, t.runtime) for t in table.timings
                  if t.batch_size == batch_size and t.traffic == traffic and t.artifact in table.checks
                  and table.checks[t.artifact].passed]
    if not candidates:
        return None
    median, name, runtime = min(candidates)
    settings = f", runtime settings '{runtime}'" if runtime else ""
    alone = any(t.process == "own" for t in table.timings
                if (t.artifact, t.runtime, t.batch_size, t.traffic) == (name, runtime, batch_size, traffic))
    settings += ", timed in a process of its own" if alone else ""
    return Selected(name, batch_size, median,
                    f"fastest at batch {batch_size}, {traffic.replace('_', ' ')} traffic ({median:.2f} ms median, "
                    f"{table.threads} threads, {table.isa}{settings}) of the artifacts that passed their check",
                    traffic, runtime)


def select_all(table: BenchTable) -> List[Selected]:
    """The fastest passing artifact for every batch size timed and every traffic."""
    picks = (select_fastest(table, b, t) for b in sorted({t.batch_size for t in table.timings}) for t in Traffic)
    return [p for p in picks if p is not None]


def with_selection(manifest: Manifest, table: BenchTable, selected: Optional[Selected]) -> Manifest:
    """``manifest`` with the table, the default selection and the fastest per batch size and traffic recorded."""
    def settings(pick: Optional[Selected]) -> Optional[Selected]:
        if pick is None or not pick.runtime or pick.format not in manifest.formats:
            return pick
        entry = manifest.formats[pick.format]
        return dataclasses.replace(pick, runtime_options=dict(FORMATS[entry.format_name or pick.format]
                                                              .runtime_choices[pick.runtime]))

    return dataclasses.replace(manifest, bench=table, selected=settings(selected),
                               selections=[settings(s) for s in select_all(table)])  # type: ignore[misc]


def record_selection(root: Any, table: BenchTable, selected: Optional[Selected]) -> None:
    """Write the table and the selections into a finished export's manifest (atomically; the manifest is not in
    the file hashes)."""
    replace_manifest(Path(root), with_selection(read_manifest(root), table, selected))
