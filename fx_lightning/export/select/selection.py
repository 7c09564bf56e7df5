"""Which artifact to serve: every format of an export timed side by side, each checked on the export's own
check batch, and the fastest that passed recorded in the manifest for each batch size and traffic
(``load_fused(dir)`` loads the one for ``export.select_batch_size`` and ``export.select_traffic``;
``load_fused(dir, batch_size=, traffic=)`` picks another).

Each artifact is timed with the runtime settings it was written with and with each of its format's
``runtime_choices`` (ONNX Runtime's threads spinning between runs, say; ONNX Runtime's and OpenVINO's own defaults,
:data:`~fx_lightning.formats.base.RUNTIME_DEFAULTS`), after an idle gap and back to back, interleaved (timing.py);
the finalists are then timed again each in processes of its own (:data:`FINALIST_PROCESSES` fresh ones), as a
server runs them, each with every one of its runtime settings: the pick is never slower than the runtime's own
defaults on the same file, beyond the noise of those timings, which the table records (each process's median).
Candidates those processes cannot tell apart (a tie: their processes' medians overlap) are timed again, together,
in more and longer processes, and that timing decides (``tie_breaks``); the pick's ``why`` says so. The table keeps
medians and the 90th percentile. An artifact that fails its check on ``check.pt``
(:func:`~fx_lightning.export.check.check_artifact`, a lossy variant's gate included) is never selected.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from fx_lightning.config import Strategy, Traffic
from fx_lightning.errors import ExportError, first_line
from fx_lightning.formats import FORMATS
from fx_lightning.formats.base import RUNTIME_DEFAULTS
from fx_lightning.export.load.loader import load_artifact
from fx_lightning.export.manifest import (
    BenchTable,
    Manifest,
    Selected,
    Sweep,
    Timing,
    TimingFailure,
    read_manifest,
    write_manifest,
)
from fx_lightning.export.select.sweep import SweepSettings, sweep_module
from fx_lightning.export.progress import Progress
from fx_lightning.export.select.timing import (IDLE_GAP_S, Candidate, OwnSamples, Tick, sweep_in_own_processes,
                                              time_interleaved, time_in_own_processes)
from fx_lightning.export.check import Reference, check_artifact, read_check_file
from fx_lightning.common.machine import cpu_info
from fx_lightning.parity.report import ArtifactCheck

__all__ = ["Timing", "BenchTable", "bench_export", "check_entry", "select_fastest", "select_max_throughput",
           "select_by_strategy", "select_all", "tied_with", "record_selection", "with_selection", "sweep_candidates", "IDLE_GAP_S",
           "FINALIST_WITHIN", "FINALIST_ROUNDS", "FINALIST_PROCESSES", "TIE_PROCESSES", "TIE_ROUNDS",
           "SWEPT_PER_TRAFFIC"]

# Passing artifacts within this factor of the fastest (at most ``own_process_finalists`` per batch size and
# traffic) are the finalists, timed each in processes of its own for FINALIST_ROUNDS rounds each: a shared bench slows
# some runtimes and its medians wander, so near ties are decided alone (figures: docs/performance.md).
FINALIST_WITHIN = 1.6
FINALIST_ROUNDS = 20
# Each finalist is timed in this many fresh processes (one after another, the finalists taking turns in each): one
# process's median is one draw of its thread placement and memory layout, which moved a median by up to 1.6x between
# processes of one artifact (mobilenet_v3_large after idle gaps, Zen 4). Their spread is the noise the pick reports.
FINALIST_PROCESSES = 3
# Candidates tied with the fastest at a batch size and traffic (:func:`tied_with`) are timed again, together, in this
# many more fresh processes of TIE_ROUNDS rounds each, and the fastest of that timing is picked. The other traffic
# decided ties before and was as often wrong as right: on a Zen 3 the four fp32 finalists of mobilenet_v3_large ran
# within 3% after idle gaps; OpenVINO's defaults, faster back to back, were picked and then ran 7.11 ms a call against
# ONNX Runtime's defaults' 6.27 when the two were timed again for 60 rounds.
TIE_PROCESSES = 3
TIE_ROUNDS = 60
# At most this many artifacts per traffic get the throughput sweep (each costs seconds per batch size).
SWEPT_PER_TRAFFIC = 3


def check_entry(module: nn.Module, manifest: Manifest, name: str, saved: Optional[Reference]) -> ArtifactCheck:
    """Entry ``name`` of ``manifest``, loaded as ``module``, judged on ``check.pt`` with the export's own thresholds
    (:func:`~fx_lightning.export.check.check_artifact`): what the selection and a server require before serving it."""
    entry = manifest.formats[name]
    if saved is None:
        return ArtifactCheck(entry.gate is None or entry.gate.passed, "the export has no check.pt: loaded, not checked")
    return check_artifact(module, saved, min_agreement=manifest.min_discrete_agreement, gate=entry.gate)

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
    progress: Optional[Tick] = None,
    sweep: Optional[SweepSettings] = None,
    steps: Optional[Progress] = None,
) -> BenchTable:
    """Time the export's artifacts (``formats``, default all; each also with its format's runtime choices) and
    ``baselines`` (name -> eager module, e.g. ``{"eager": unfused}``) at each batch size, in both traffics,
    interleaved; check every artifact on ``check.pt``. ``own_process_finalists``: at most that many of the fastest
    passing artifacts at each batch size and traffic (within :data:`FINALIST_WITHIN` of the fastest) are then timed
    again, each in :data:`FINALIST_PROCESSES` processes of its own, for :data:`FINALIST_ROUNDS` rounds in each;
    those timings replace theirs (``process: "own"``, with each process's median). ``manifest``: the export's manifest when it is not on disk yet (an export being written),
    else it is read from ``root``. ``sweep``: then the throughput sweep (export/select/sweep.py) of the passing
    artifacts that could have the most throughput (:func:`sweep_candidates`), in both traffics, each in a process of
    its own when ``own_process_finalists`` is set. ``steps``: where the loading, the timing, the finalists and the
    sweep say they started and ended (their loops' progress too, unless ``progress``)."""
    steps = steps if steps is not None else Progress()
    progress = progress if progress is not None else steps.advance
    root = Path(root)
    manifest = manifest if manifest is not None else read_manifest(root)
    with steps.step("load and check every artifact") as end:
        table, models, saved = _load_and_check(root, manifest, formats, threads, baselines)
        end.result = f"{sum(c.passed for c in table.checks.values())} of {len(table.checks)} passed their check"
    inputs = saved.inputs if saved is not None else _random_inputs(manifest)
    signature = manifest.call_signature()
    if not signature.batched:  # no sample axis: the example is timed as it is, one "batch size"
        batch_sizes = [1]
    with steps.step("timing", f"{len(models)} candidate(s) at batch size(s) {', '.join(map(str, batch_sizes))}, "
                              f"{rounds} round(s)"):
        samples, failures = time_interleaved(models, inputs, batch_sizes, rounds, warmup, progress,
                                             axes=signature.input_axes() if signature.batched else None)
    table.timings = [Timing(name, b, **_figures(ts), traffic=traffic, runtime=runtime)
                     for ((name, runtime), b), by_traffic in samples.items() for traffic, ts in by_traffic.items() if ts]
    table.failures = [f for i, f in enumerate(failures) if f not in failures[:i]]  # a runtime choice fails as its artifact
    if own_process_finalists:
        with steps.step("the finalists timed each in a process of its own"):
            _time_finalists_alone(root, manifest, table, own_process_finalists, warmup, progress)
        with steps.step("ties timed again, together") as end:
            end.result = _break_ties(root, manifest, table, warmup, progress)
    if sweep is not None and signature.batched:
        with steps.step("throughput sweep (latency and samples/s against batch size)"):
            _sweep(root, manifest, table, models, inputs, signature.input_axes(), sweep,
                   own_process=bool(own_process_finalists), progress=progress)
    elif sweep is not None:
        table.not_swept["*"] = "no sample axis: the artifacts run at one batch size"
    return table


def _load_and_check(root: Path, manifest: Manifest, formats: Optional[Sequence[str]], threads: Optional[int],
                    baselines: Optional[Dict[str, nn.Module]]
                    ) -> Tuple[BenchTable, Dict[Tuple[str, str], nn.Module], Optional[Reference]]:
    """Every artifact loaded (with each runtime choice) and checked on ``check.pt``, beside the baselines."""
    if threads:
        torch.set_num_threads(threads)
    saved = read_check_file(root)
    table = BenchTable(torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), platform.machine(),
                       torch.__version__, cpu=cpu_info().short())
    models: Dict[Tuple[str, str], nn.Module] = {(name, ""): m for name, m in (baselines or {}).items()}
    for name in formats or list(manifest.formats):
        entry = manifest.formats[name]
        try:
            for runtime in ("", *FORMATS[entry.format_name or name].runtime_choices):
                models[(name, runtime)] = load_artifact(root, manifest, name, device="cpu", runtime=runtime)
        except ExportError as exc:
            table.checks[name] = ArtifactCheck(False, reason=first_line(exc))
            continue
        table.checks[name] = check_entry(models[(name, "")], manifest, name, saved)
    return table, models, saved


def sweep_candidates(table: BenchTable, traffic: str, limit: int = SWEPT_PER_TRAFFIC) -> List[Tuple[str, str]]:
    """The passing artifacts, each with its fastest runtime settings, whose throughput at the largest batch size
    timed is within :data:`FINALIST_WITHIN` of the best there (at most ``limit``, fastest first): the others
    are too far behind to have the most throughput at a larger one."""
    rows = _passing_timings(table, max((t.batch_size for t in table.timings), default=1), traffic)
    return [(t.artifact, t.runtime) for t in _fastest_artifacts(rows, limit)]


def _fastest_artifacts(rows: List[Timing], limit: int) -> List[Timing]:
    """Each artifact's fastest of ``rows`` (timings, fastest first) within :data:`FINALIST_WITHIN` of the fastest of
    all, at most ``limit`` of them."""
    best: Dict[str, Timing] = {}
    for t in rows:
        best.setdefault(t.artifact, t)
    return [t for t in best.values() if t.median_ms <= rows[0].median_ms * FINALIST_WITHIN][:limit]


def _sweep(root: Path, manifest: Manifest, table: BenchTable, models: Dict[Tuple[str, str], nn.Module],
           inputs: Sequence[Any], axes: Sequence[Optional[int]], settings: SweepSettings, own_process: bool,
           progress: Optional[Tick] = None) -> None:
    """Record the throughput sweep of each traffic's candidates in ``table`` (own process when asked, falling
    back to this one when that fails)."""
    largest = max((t.batch_size for t in table.timings), default=1)
    wanted: Dict[Tuple[str, str], List[str]] = {}
    for traffic in Traffic:
        chosen = sweep_candidates(table, traffic.value)
        for candidate in chosen:
            wanted.setdefault(candidate, []).append(traffic.value)
        for name, check in table.checks.items():
            if check.passed and name not in {c[0] for c in chosen}:
                table.not_swept[f"{name}, {traffic.value}"] = (f"more than {FINALIST_WITHIN}x the fastest at batch "
                                                               f"{largest}, or not among the {SWEPT_PER_TRAFFIC} "
                                                               "fastest")
    swept: Dict[Tuple[str, str], Tuple[Optional[List[Sweep]], str]] = {}
    if own_process:
        swept = sweep_in_own_processes(root, manifest.to_dict(), wanted, settings, table.threads, progress)
    for (artifact, runtime), traffics in wanted.items():
        sweeps, why = swept.get((artifact, runtime), (None, ""))
        if sweeps is not None:
            table.sweeps.extend(sweeps)
            continue
        if own_process:
            table.failures.append(TimingFailure(artifact, 1, f"not swept in a process of its own ({why}); swept in "
                                                             "the selection's process"))
        table.sweeps.extend(sweep_module(models[(artifact, runtime)], inputs, axes, artifact, runtime, traffic,
                                         settings) for traffic in traffics)


def _time_finalists_alone(root: Path, manifest: Manifest, table: BenchTable, finalists: int, warmup: int,
                          progress: Optional[Tick] = None) -> None:
    """Replace the finalists' timings in ``table``, each with every one of its runtime settings, with timings taken
    each in a process of its own, the processes taking turns (timing.py): the pick is then never slower than a
    runtime's own defaults on the same file, whatever the shared bench said."""
    chosen: Dict[Tuple[str, str], set] = {}
    for b in {t.batch_size for t in table.timings}:
        for traffic in Traffic:
            rows = _passing_timings(table, b, traffic.value)
            if len(rows) < 2:
                continue
            # The fastest ``finalists`` artifacts, not settings: three settings of one artifact would leave no room
            # for the next artifact (ONNX Runtime's three took every place from OpenVINO bf16 on mobilenet_v3_large).
            artifacts = [t.artifact for t in _fastest_artifacts(rows, finalists)]
            # And every artifact a runtime runs with its own defaults, whatever the shared bench said (runtimes in
            # one process slow each other unevenly: OpenVINO bf16 ran 7.4 ms there, 1.4-1.8 ms alone).
            artifacts += [t.artifact for t in rows if t.runtime == RUNTIME_DEFAULTS and t.artifact not in artifacts]
            for t in rows:
                if t.artifact in artifacts:
                    chosen.setdefault((t.artifact, t.runtime), set()).add(b)
    if len(chosen) < 2:
        return
    kept = _in_fresh_processes(root, manifest, table, chosen, FINALIST_ROUNDS, FINALIST_PROCESSES, warmup, progress,
                               "its shared-process timing stands")
    for i, t in enumerate(table.timings):
        per_process = _per_process(kept, t)
        if per_process:
            table.timings[i] = _timed_alone(t, per_process)


def _in_fresh_processes(root: Path, manifest: Manifest, table: BenchTable, chosen: Dict[Candidate, set], rounds: int,
                        processes: int, warmup: int, progress: Optional[Tick], otherwise: str
                        ) -> Dict[Candidate, List[OwnSamples]]:
    """Each chosen candidate at its batch sizes, in ``processes`` waves of fresh processes of its own taking turns
    (timing.py), ``rounds`` rounds each: each candidate's samples per process. One that fails in its first process
    is recorded in the table's failures (and ``otherwise`` says what stands instead); one that fails later keeps
    the processes it had."""
    kept: Dict[Candidate, List[OwnSamples]] = {c: [] for c in chosen}
    for _ in range(processes):
        timed = time_in_own_processes(root, manifest.to_dict(), {c: sorted(sizes) for c, sizes in chosen.items()},
                                      rounds, warmup, table.threads, progress=progress)
        for (artifact, runtime), (samples, why) in timed.items():
            if samples is not None:
                kept[(artifact, runtime)].append(samples)
            elif not kept[(artifact, runtime)]:
                table.failures.append(TimingFailure(artifact, min(chosen[(artifact, runtime)]),
                                                    f"not timed in a process of its own ({why}); {otherwise}"))
        chosen = {c: sizes for c, sizes in chosen.items() if kept[c]}
    return kept


def _per_process(kept: Dict[Candidate, List[OwnSamples]], timing: Timing) -> List[List[float]]:
    """``timing``'s candidate's seconds at its batch size and traffic in each process it was timed in."""
    return [ts for samples in kept.get((timing.artifact, timing.runtime), [])
            for ts in [samples.get((timing.batch_size, timing.traffic))] if ts]


def _break_ties(root: Path, manifest: Manifest, table: BenchTable, warmup: int, progress: Optional[Tick] = None
                ) -> str:
    """Time the candidates tied with the fastest (:func:`tied_with`) at each batch size and traffic again, those of
    one batch size and traffic together, in :data:`TIE_PROCESSES` more fresh processes of :data:`TIE_ROUNDS`
    rounds each; record those timings in ``table.tie_breaks`` (only the tied cells: the others' figures stand).
    Returns what was done, for the progress line."""
    ties = {(b, traffic.value): tied for b in sorted({t.batch_size for t in table.timings}) for traffic in Traffic
            for tied in [_tied(_passing_timings(table, b, traffic.value))] if len(tied) > 1}
    if not ties:
        return "no ties"
    chosen: Dict[Candidate, set] = {}
    for (b, _), tied in ties.items():
        for t in tied:
            chosen.setdefault((t.artifact, t.runtime), set()).add(b)
    kept = _in_fresh_processes(root, manifest, table, chosen, TIE_ROUNDS, TIE_PROCESSES, warmup, progress,
                               "its tie is decided by its finalist timing")
    table.tie_breaks = [_timed_alone(t, per_process) for tied in ties.values() for t in tied
                        for per_process in [_per_process(kept, t)] if per_process]
    return (f"{len(ties)} tie(s) among {len(chosen)} candidate(s), timed again in {TIE_PROCESSES} processes of "
            f"{TIE_ROUNDS} rounds each")


def _timed_alone(timing: Timing, per_process: Sequence[Sequence[float]]) -> Timing:
    """A finalist's timing from its calls' seconds in each of its processes: the median of the processes' medians
    (a slow process counts once, however many calls it made), the 90th percentile of all calls, and each median."""
    medians = [1e3 * statistics.median(ts) for ts in per_process]
    pooled = _figures([x for ts in per_process for x in ts])
    return dataclasses.replace(timing, **{**pooled, "median_ms": statistics.median(medians)},
                               process_medians_ms=medians, process="own")


def _figures(ts: Sequence[float]) -> Dict[str, Union[float, int]]:
    """A timing's figures from its calls' seconds: the median and the 90th percentile in ms, and how many."""
    p90 = sorted(ts)[min(len(ts) - 1, int(0.9 * len(ts)))]
    return {"median_ms": 1e3 * statistics.median(ts), "p90_ms": 1e3 * p90, "rounds": len(ts)}


def _passing(table: BenchTable, artifact: str) -> bool:
    """Whether ``artifact`` is one of the export's (not a baseline) and passed its check."""
    return artifact in table.checks and table.checks[artifact].passed


def _passing_timings(table: BenchTable, batch_size: int, traffic: str) -> List[Timing]:
    """The timings of the artifacts that passed their check at ``batch_size`` in ``traffic``, fastest first."""
    return sorted((t for t in table.timings if t.batch_size == batch_size and t.traffic == traffic
                   and _passing(table, t.artifact)), key=lambda t: t.median_ms)


def _random_inputs(manifest: Manifest) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for leaf in manifest.call_signature().inputs:
        shape = [2 if d == "batch" else int(d) for d in leaf.written_shape(manifest.dynamic_batch)]
        dtype = getattr(torch, leaf.dtype)
        out.append(torch.randn(shape, generator=g).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype))
    return out


def select_fastest(table: BenchTable, batch_size: int, traffic: Any = "idle") -> Optional[Selected]:
    """The fastest artifact (with the runtime settings that made it so) at ``batch_size`` under ``traffic`` whose
    check passed (baselines are not artifacts), or None. Where others tie with the fastest within the noise of
    their processes (:func:`tied_with`), the fastest of the tied when they were timed again together
    (``table.tie_breaks``) is picked; when they were not, the fastest median stands, and the ``why`` says so."""
    traffic = Traffic(traffic).value
    tied = _tied(_passing_timings(table, batch_size, traffic))
    if not tied:
        return None
    again = _timed_again(table, tied)
    best = min(again or tied, key=_order)
    median = best.median_ms
    return Selected(best.artifact, batch_size, median,
                    f"fastest at batch {batch_size}, {traffic.replace('_', ' ')} traffic ({median:.2f} ms median, "
                    f"{table.threads} threads, {table.isa}{_how_timed(best.runtime, best.process)}) of the artifacts "
                    f"that passed their check{_tie_note(best, tied, again)}", traffic, best.runtime)


def _order(t: Timing) -> Tuple[float, str, str]:
    """Fastest first; the same median by name, for one answer."""
    return t.median_ms, t.artifact, t.runtime


def _tied(rows: List[Timing]) -> List[Timing]:
    """The fastest of ``rows`` and those tied with it (:func:`tied_with`), fastest first; [] for no rows."""
    if not rows:
        return []
    fastest = min(rows, key=_order)
    return sorted((t for t in rows if t is fastest or tied_with(t, fastest)), key=_order)


def tied_with(timing: Timing, fastest: Timing) -> bool:
    """Whether ``timing`` cannot be told apart from ``fastest``: each was timed in several processes and the lowest
    of its processes' medians is at most the highest of the fastest's."""
    mine, theirs = timing.spread(), fastest.spread()
    return mine is not None and theirs is not None and mine[0] <= theirs[1]


def _timed_again(table: BenchTable, tied: List[Timing]) -> List[Timing]:
    """The tie-break timings of every one of ``tied`` (two or more), or [] when any of them was not timed again:
    a tie is decided only among candidates timed together."""
    if len(tied) < 2:
        return []
    again = {(t.artifact, t.runtime): t for t in table.tie_breaks
             if (t.batch_size, t.traffic) == (tied[0].batch_size, tied[0].traffic)}
    found = [again.get((t.artifact, t.runtime)) for t in tied]
    return [t for t in found if t is not None] if all(found) else []


def _tie_note(decided: Timing, tied: List[Timing], again: List[Timing]) -> str:
    """What the ``why`` says of a pick made among ties: the noise, how it was decided, and whether the timing that
    decided it still overlaps."""
    if len(tied) < 2:
        return ""
    others = ", ".join(f"{_name(t)} {t.median_ms:.2f} ms" for t in tied if _name(t) != _name(decided))
    note = f"; tied with {others} (processes' medians overlapping)"
    if not again:
        return note + "; they were not all timed again, so the fastest median stands"
    figures = ", ".join(f"{_name(t)} {t.median_ms:.2f} ms" for t in sorted(again, key=_order))
    rounds = again[0].rounds // max(1, len(again[0].process_medians_ms))
    low, high = decided.spread() or (decided.median_ms, decided.median_ms)
    still = [t for t in again if t is not decided and tied_with(t, decided)]
    return (note + f"; timed again together in {len(decided.process_medians_ms)} fresh processes of {rounds} rounds "
            f"each: {figures} (its processes' medians {low:.2f}-{high:.2f} ms)"
            + ("; still within that noise of " + ", ".join(_name(t) for t in still) + _paired(decided, still)
               if still else ""))


def _paired(decided: Timing, others: List[Timing]) -> str:
    """How often ``decided`` was the faster in the processes timed side by side (the k-th process of each candidate
    ran in the same wave, taking turns: a slow wave slows all of them), against each of ``others``."""
    mine = decided.process_medians_ms
    counts = [f"{_name(t)} {sum(a < b for a, b in zip(mine, t.process_medians_ms))} of {len(mine)}"
              for t in others if len(t.process_medians_ms) == len(mine)]
    return f"; the faster in the same wave of processes against {', '.join(counts)}" if counts else ""


def _name(t: Timing) -> str:
    return t.artifact + (f" [{t.runtime}]" if t.runtime else "")


def _how_timed(runtime: str, process: str) -> str:
    """The runtime settings and the process a pick was timed with, as its ``why`` says them."""
    settings = f", runtime settings '{runtime}'" if runtime else ""
    return settings + (", timed in a process of its own" if process == "own" else "")


def select_max_throughput(table: BenchTable, traffic: Any = "back_to_back",
                          latency_budget_ms: Optional[float] = None) -> Optional[Selected]:
    """The passing artifact, runtime settings and batch size with the most samples per second over the recorded
    sweeps in ``traffic`` (the smaller batch size on a tie), its p99 within ``latency_budget_ms`` when given;
    None when no sweep has such a point."""
    traffic = Traffic(traffic).value
    points = [(point, w) for w in table.sweeps if w.traffic == traffic and _passing(table, w.artifact)
              for point in [w.best(latency_budget_ms)] if point is not None]
    if not points:
        return None
    point, w = max(points, key=lambda pw: (pw[0].throughput, -pw[0].batch_size))
    within = f" with p99 within {latency_budget_ms:g} ms" if latency_budget_ms is not None else ""
    return Selected(w.artifact, point.batch_size, point.p50_ms,
                    f"most samples/s{within} over the throughput sweep, {traffic.replace('_', ' ')} traffic: "
                    f"{point.throughput:.1f}/s at batch {point.batch_size} (p50 {point.p50_ms:.2f} ms, p99 "
                    f"{point.p99_ms:.2f} ms; {table.threads} threads, {table.isa}{_how_timed(w.runtime, w.process)}) "
                    "of the artifacts that passed their check", traffic, w.runtime,
                    strategy=Strategy.max_throughput.value, throughput=point.throughput, p99_ms=point.p99_ms,
                    latency_budget_ms=latency_budget_ms)


def select_by_strategy(table: BenchTable, strategy: Any, batch_size: int, traffic: Any,
                       latency_budget_ms: Optional[float] = None) -> Optional[Selected]:
    """The artifact ``strategy`` picks: ``min_latency``: the fastest at ``batch_size``; ``max_throughput``: the most
    samples per second over the sweep (within ``latency_budget_ms`` when given). Raises ExportError, with every
    swept artifact's lowest p99, when no artifact meets the budget."""
    if Strategy(strategy) is Strategy.min_latency:
        return select_fastest(table, batch_size, traffic)
    pick = select_max_throughput(table, traffic, latency_budget_ms)
    if pick is None and latency_budget_ms is not None:
        raise ExportError(_budget_refusal(table, Traffic(traffic).value, latency_budget_ms))
    return pick


def _budget_refusal(table: BenchTable, traffic: str, budget: float) -> str:
    lowest = sorted(((min(w.points, key=lambda p: p.p99_ms), w) for w in table.sweeps
                     if w.traffic == traffic and w.points and _passing(table, w.artifact)),
                    key=lambda pw: pw[0].p99_ms)
    figures = "; ".join(f"{w.artifact}{f' [{w.runtime}]' if w.runtime else ''} {p.p99_ms:.2f} ms at batch "
                        f"{p.batch_size}" for p, w in lowest)
    return (f"export.latency_budget_ms: {budget:g}: no artifact that passed its check has a p99 within it in "
            f"{traffic.replace('_', ' ')} traffic ({table.threads} threads, {table.isa}); the lowest p99 each reached: "
            f"{figures or 'none was swept'}. Allowed: a budget at least the lowest of these, or no budget.")


def select_all(table: BenchTable) -> List[Selected]:
    """The fastest passing artifact for every batch size timed and every traffic, and the one with the most
    throughput in every traffic swept."""
    picks = [select_fastest(table, b, t) for b in sorted({t.batch_size for t in table.timings}) for t in Traffic]
    picks += [select_max_throughput(table, t) for t in Traffic]
    return [p for p in picks if p is not None]


def with_selection(manifest: Manifest, table: BenchTable, selected: Optional[Selected]) -> Manifest:
    """``manifest`` with the table, the default selection and the picks of :func:`select_all` recorded (and the
    default, when it is a pick within a latency budget)."""
    def settings(pick: Optional[Selected]) -> Optional[Selected]:
        if pick is None or not pick.runtime or pick.format not in manifest.formats:
            return pick
        entry = manifest.formats[pick.format]
        return dataclasses.replace(pick, runtime_options=dict(FORMATS[entry.format_name or pick.format]
                                                              .runtime_choices[pick.runtime]))

    picks = select_all(table)
    if selected is not None and selected.latency_budget_ms is not None:
        picks.append(selected)
    return dataclasses.replace(manifest, bench=table, selected=settings(selected),
                               selections=[settings(s) for s in picks])  # type: ignore[misc]


def record_selection(root: Any, table: BenchTable, selected: Optional[Selected]) -> None:
    """Write the table and the selections into a finished export's manifest (atomically; the manifest is not in
    the file hashes)."""
    write_manifest(Path(root), with_selection(read_manifest(root), table, selected))
