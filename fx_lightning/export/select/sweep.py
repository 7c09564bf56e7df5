"""The throughput sweep: an artifact timed at batch sizes 1, 2, 4, ... until its throughput stops growing, and
the batching a server should use that the sweep implies.

Each batch size is timed in windows of calls (about :attr:`SweepSettings.window_s` of wall time each); windows
are repeated until the last :attr:`SweepSettings.stable_windows` agree on throughput within
:attr:`SweepSettings.agreement` (a shared machine's slow minute shows as a window that disagrees), and the point
keeps those windows' calls: p50, p99 (nearest rank) and samples per second of run time. The sweep stops at the
first batch size whose throughput grew by less than :attr:`SweepSettings.growth` over the one before (larger
batches only add latency), at ``max_batch_size``, at the time limit, or where the artifact raises. In ``idle``
traffic every call comes after the idle gap (the gap is not run time); in ``back_to_back`` right after the one
before.

The runner is a function ``run(batch_size) -> seconds`` (one timed call), so the algorithm is tested with a fake
one; :func:`module_runner` makes one from a loaded artifact and the export's check inputs.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.config import Strategy, Traffic
from fx_lightning.errors import first_line
from fx_lightning.export.load.loader import selection_for
from fx_lightning.export.manifest import Manifest, Sweep, SweepPoint
from fx_lightning.formats.batching import quiet_pieces
from fx_lightning.common.rows import with_rows

__all__ = ["SweepSettings", "REHEARSAL_SWEEP", "Runner", "sweep", "sweep_steps", "measure_batch_size", "module_runner",
           "sweep_module", "Batching", "recorded_batching", "IDLE_GAP_S", "timed_call"]

# The idle gap before a call in the ``idle`` traffic: long enough for a runtime's threads to go to sleep (the
# wake-up the idle traffic measures) and for one runtime's spinning threads to stop slowing the next (figures:
# docs/performance.md). timing.py's interleaved bench uses it too.
IDLE_GAP_S = 0.02

Runner = Callable[[int], float]  # one timed call at a batch size -> seconds


@dataclass(frozen=True)
class SweepSettings:
    """When a batch size's figure is stable and when the sweep stops (module docstring)."""

    growth: float = 0.05  # stop when throughput grows by less than this over the previous batch size
    agreement: float = 0.10  # windows agree when their throughputs are within this of each other
    stable_windows: int = 3  # ... this many in a row
    max_windows: int = 10  # give up on stability after this many (the point is kept, marked unstable)
    window_s: float = 0.2  # wall time a window takes (idle gaps included), within the calls' bounds below
    min_window_calls: int = 3
    max_window_calls: int = 50
    max_batch_size: int = 256
    time_limit_s: float = 60.0  # seconds one artifact's sweep in one traffic may spend measuring
    max_call_s: float = 5.0  # a batch size whose one call takes longer ends the sweep (no server would use it)


# The preflight's rehearsal: every artifact runs at batch 1 and 2 once, which proves the sweep can run.
REHEARSAL_SWEEP = SweepSettings(stable_windows=1, max_windows=1, window_s=0.0, min_window_calls=1, max_batch_size=2,
                                growth=-math.inf)


def measure_batch_size(run: Runner, batch_size: int, settings: SweepSettings) -> SweepPoint:
    """One point of the sweep: windows of calls at ``batch_size`` until the last ``stable_windows`` agree."""
    run(batch_size)  # the first call at a shape allocates (and some runtimes compile): not timed
    start = time.perf_counter()
    first = run(batch_size)
    wall = max(time.perf_counter() - start, first, 1e-9)  # with the idle gap: a window's wall time is bounded
    per_window = min(settings.max_window_calls, max(settings.min_window_calls, math.ceil(settings.window_s / wall)))
    windows: List[List[float]] = []
    stable = False
    while not stable and len(windows) < settings.max_windows:
        windows.append([run(batch_size) for _ in range(per_window)])
        last = windows[-settings.stable_windows:]
        rates = [batch_size * len(w) / max(sum(w), 1e-12) for w in last]
        stable = len(last) == settings.stable_windows and max(rates) <= min(rates) * (1 + settings.agreement)
    calls = sorted(t for w in windows[-settings.stable_windows:] for t in w)
    p99 = calls[min(len(calls) - 1, math.ceil(0.99 * len(calls)) - 1)]
    return SweepPoint(batch_size, 1e3 * statistics.median(calls), 1e3 * p99,
                      batch_size * len(calls) / max(sum(calls), 1e-12), len(calls), stable)


def sweep(run: Runner, settings: SweepSettings = SweepSettings()) -> Tuple[List[SweepPoint], str]:
    """Batch sizes 1, 2, 4, ... measured until throughput stops growing; returns the points and why it stopped."""
    steps = sweep_steps(run, settings)
    points: List[SweepPoint] = []
    while True:
        try:
            points.append(next(steps))
        except StopIteration as done:
            return points, str(done.value)


def sweep_steps(run: Runner, settings: SweepSettings = SweepSettings()) -> Generator[SweepPoint, None, str]:
    """:func:`sweep` a point at a time: yields each batch size's point and returns why it stopped. The time limit
    counts only the time spent in its own steps, so sweeps taking turns (timing.py) each get theirs."""
    previous: Optional[SweepPoint] = None
    spent = 0.0
    batch_size = 1
    while True:
        if batch_size > settings.max_batch_size:
            return f"batch {batch_size} is above the sweep's max_batch_size ({settings.max_batch_size})"
        start = time.perf_counter()
        try:
            point = measure_batch_size(run, batch_size, settings)
        except Exception as exc:  # noqa: BLE001 - e.g. an artifact built for some batch sizes only
            return f"batch {batch_size} raises {type(exc).__name__}: {first_line(exc)[:200]}"
        spent += time.perf_counter() - start
        yield point
        if previous is not None:
            growth = point.throughput / previous.throughput - 1
            if growth < settings.growth:
                return (f"throughput at batch {batch_size} grew {100 * growth:+.1f}% over batch "
                        f"{previous.batch_size} (less than {100 * settings.growth:.0f}%)")
        if point.p50_ms / 1e3 > settings.max_call_s:
            return f"a call at batch {batch_size} takes {point.p50_ms:.0f} ms (over {settings.max_call_s} s)"
        if spent > settings.time_limit_s:
            return f"time limit ({settings.time_limit_s:g} s) reached after batch {batch_size}"
        previous, batch_size = point, 2 * batch_size


def module_runner(module: nn.Module, inputs: Sequence[Any], axes: Sequence[Optional[int]], traffic: str) -> Runner:
    """``module`` called on ``inputs`` cut or repeated to each batch size along the sample ``axes``; in idle
    traffic each call after the idle gap."""
    cache: Dict[int, Tuple[Any, ...]] = {}
    idle = Traffic(traffic) is Traffic.idle
    quiet_pieces(module)  # the sweep's sizes are its own choice: no warning telling the user to change a setting

    def run(batch_size: int) -> float:
        if batch_size not in cache:
            cache.clear()  # one size at a time: large batches of images are large
            cache[batch_size] = tuple(with_rows(inputs, axes, batch_size))
        if idle:
            time.sleep(IDLE_GAP_S)
        with torch.no_grad():
            return timed_call(module, cache[batch_size])

    return run


def timed_call(module: nn.Module, args: Sequence[Any]) -> float:
    """Seconds one call of ``module`` on ``args`` takes."""
    start = time.perf_counter()
    module(*args)
    return time.perf_counter() - start


def sweep_module(module: nn.Module, inputs: Sequence[Any], axes: Sequence[Optional[int]], artifact: str,
                 runtime: str, traffic: str, settings: SweepSettings) -> Sweep:
    """The sweep of one loaded artifact in one traffic, in this process, as the manifest records it."""
    points, stop = sweep(module_runner(module, inputs, axes, traffic), settings)
    return Sweep(artifact, Traffic(traffic).value, points, stop, runtime)


@dataclass(frozen=True)
class Batching:
    """How a server should batch requests, from the recorded sweep: up to ``max_batch_size`` samples a run,
    ``preferred_batch_sizes`` formed first, a batch waiting at most ``queue_delay_s`` to fill."""

    max_batch_size: int
    preferred_batch_sizes: Tuple[int, ...]
    queue_delay_s: float
    why: str


def recorded_batching(manifest: Manifest, artifact: Optional[str] = None) -> Optional[Batching]:
    """The batching the export's sweep implies for ``artifact`` (default: its max-throughput pick in back to back
    traffic, the traffic a batching server makes), or None when no sweep was recorded for it: the largest batch
    size is the max-throughput point (within the export's latency budget when its selection had one); the
    preferred sizes are the swept sizes up to it that reach 95% of its throughput; a batch waits for nobody
    (``queue_delay_s`` 0): it is what waited while the worker ran the one before, so batches fill under load and a
    lone request runs at once. (Waiting one batch-1 call for company cost a lone client 13% of its requests/s
    against no batching on a Zen 3, docs/performance.md; under load the queue fills the batch anyway.)"""
    bench = manifest.bench
    if bench is None or not bench.sweeps:
        return None
    budget = manifest.selected.latency_budget_ms if manifest.selected is not None else None
    if artifact is None:
        pick = selection_for(manifest, traffic=Traffic.back_to_back.value, strategy=Strategy.max_throughput.value)
        if pick is None or pick.strategy != Strategy.max_throughput.value:
            return None
        artifact, runtime = pick.format, pick.runtime
    else:
        runtime = ""
    candidates = [w for w in bench.sweeps if w.artifact == artifact and w.traffic == Traffic.back_to_back.value]
    chosen = next((w for w in candidates if w.runtime == runtime), candidates[0] if candidates else None)
    best = chosen.best(budget) if chosen is not None else None
    if chosen is None or best is None:
        return None
    preferred = tuple(p.batch_size for p in chosen.points
                      if p.batch_size <= best.batch_size and p.throughput >= 0.95 * best.throughput)
    within = f" with p99 within {budget:g} ms" if budget is not None else ""
    return Batching(best.batch_size, preferred, 0.0,
                    f"the export's throughput sweep of {artifact} (back to back, {bench.threads} threads, {bench.isa}):"
                    f" most samples/s{within} at batch {best.batch_size} ({best.throughput:.1f}/s, p99 "
                    f"{best.p99_ms:.1f} ms); a batch is what waits when the worker is free")

