"""Timing artifacts: interleaved rounds in one process (the selection's bench), and each artifact alone in a process
of its own (the selection's finalists and throughput sweeps).

Interleaved: every round runs every candidate once, in a shuffled order, so a slow minute on a shared machine
lands on all of them; each candidate runs once after an idle gap (:data:`IDLE_GAP_S`: the runtime's threads have
gone to sleep, as under sparse traffic) and once right after (back to back); the gap also keeps one runtime's
spinning threads from slowing the next.

Alone: runtimes in one process steal each other's cores (figures: docs/performance.md). A server runs one model
per process, so the finalists are timed each in a fresh Python process (``python -m fx_lightning.export.select.timing``)
with the same loop, inputs (``check.pt``), threads and idle gap. The processes take turns: all load, then each in
turn runs a share of its work while the others wait on their pipes (the finalists: a share of their rounds,
:data:`TURNS` times; the sweeps: a batch size each turn), so a slow minute lands on all of them here too. Timed one after the other, the
host's drift decided near ties: ONNX Runtime with spinning threads ran 4.2 ms a call and without 4.5-5.2 ms when
interleaved, yet 7.4 against 6.9 ms when timed in turn-less processes a minute apart (mobilenet_v3_large, Zen 3).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Generator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.config import Traffic
from fx_lightning.errors import first_line
from fx_lightning.export.check import read_check_file
from fx_lightning.export.load.loader import load_artifact
from fx_lightning.export.manifest import Manifest, Sweep, SweepPoint, TimingFailure
from fx_lightning.export.select.sweep import IDLE_GAP_S, SweepSettings, module_runner, sweep_steps, timed_call
from fx_lightning.common.rows import with_rows

__all__ = ["IDLE_GAP_S", "Candidate", "Samples", "OwnSamples", "Tick", "TURNS", "WorkerRequest", "Turn", "Answer",
           "time_interleaved", "time_in_own_processes", "sweep_in_own_processes"]

OWN_PROCESS_TIMEOUT_S = 600.0
# The turns the finalists' processes take: each runs its rounds in this many shares, the others waiting meanwhile.
TURNS = 5
# The command that starts one timing process (a request file's path follows).
WORKER_COMMAND = [sys.executable, "-m", "fx_lightning.export.select.timing"]

Candidate = Tuple[str, str]  # (artifact or baseline, runtime choice)
Samples = Dict[Tuple[Candidate, int], Dict[str, List[float]]]  # (candidate, batch size) -> traffic -> seconds
Tick = Callable[[str, int, int], None]  # (what, done, total): a long loop's progress


def time_interleaved(models: Dict[Candidate, nn.Module], inputs: Sequence[Any], batch_sizes: Sequence[int],
                     rounds: int, warmup: int, progress: Optional[Tick] = None,
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
                        idle = timed_call(models[cell[0]], args[b])
                        back_to_back = timed_call(models[cell[0]], args[b])
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


OwnSamples = Dict[Tuple[int, str], List[float]]  # (batch size, traffic) -> seconds


@dataclass
class WorkerRequest:
    """What one timing process loads and does: time ``batch_sizes`` in rounds (after ``warmup`` rounds), or sweep
    in ``sweep_traffics`` with ``sweep_settings`` (SweepSettings' fields) when those are given."""

    root: str
    manifest: Dict[str, object]
    candidate: Tuple[str, str]
    threads: int
    batch_sizes: List[int] = field(default_factory=list)
    warmup: int = 0
    sweep_traffics: List[str] = field(default_factory=list)
    sweep_settings: Dict[str, float] = field(default_factory=dict)


@dataclass
class Turn:
    """The parent's word to a timing process: run ``rounds`` more (a sweep: its next batch size), or ``finish``."""

    rounds: int = 0
    finish: bool = False


@dataclass
class Answer:
    """A timing process's reply: ``ready`` (loaded and warm), ``done`` (its turn), ``result`` or ``error``."""

    status: str
    result: object = None
    error: str = ""


def time_in_own_processes(root: Path, manifest_json: Dict[str, object], candidates: Dict[Candidate, Sequence[int]],
                          rounds: int, warmup: int, threads: int, turns: int = TURNS, progress: Optional[Tick] = None
                          ) -> Dict[Candidate, Tuple[Optional[OwnSamples], str]]:
    """Each candidate timed by :func:`time_interleaved` at its batch sizes in a fresh process of its own, the
    processes taking turns: all load and warm up, then ``turns`` times, in a shuffled order, each runs its share
    of ``rounds`` while the others wait. Returns per candidate its samples as ``{(batch size, traffic): seconds}``,
    or None and why its process failed (the others go on)."""
    shares = [rounds // turns + (1 if i < rounds % turns else 0) for i in range(max(1, min(turns, rounds)))]
    requests = {c: WorkerRequest(str(root), manifest_json, c, threads, batch_sizes=list(sizes), warmup=warmup)
                for c, sizes in candidates.items()}
    return _take_turns(requests, lambda turn: Turn(rounds=shares[turn]) if turn < len(shares) else Turn(finish=True),
                       lambda result: {(int(b), str(t)): list(ts) for b, t, ts in result},
                       progress, "timing the finalists alone", len(candidates) * (len(shares) + 1))


def sweep_in_own_processes(root: Path, manifest_json: Dict[str, object], candidates: Dict[Candidate, Sequence[str]],
                           settings: SweepSettings, threads: int, progress: Optional[Tick] = None
                           ) -> Dict[Candidate, Tuple[Optional[List[Sweep]], str]]:
    """Each candidate's throughput sweep (export/select/sweep.py) in each of its traffics, in a fresh process of its own, as
    a server runs it, the processes taking turns a batch size at a time (so the host's drift lands on all of
    them). Returns per candidate its sweeps, or None and why its process failed."""
    requests = {c: WorkerRequest(str(root), manifest_json, c, threads, sweep_traffics=list(traffics),
                                 sweep_settings=dataclasses.asdict(settings)) for c, traffics in candidates.items()}
    # A turn is one batch size of 1, 2, 4, ... up to max_batch_size: the total is at most that many (it stops earlier).
    most = len(candidates) * (int(settings.max_batch_size).bit_length() + 1)
    return _take_turns(requests, lambda turn: Turn(rounds=1), lambda result: [Sweep.from_dict(w) for w in result],
                       progress, "sweep (batch sizes, at most)", most)


def _take_turns(requests: Dict[Candidate, WorkerRequest], turn_for: Callable[[int], Turn], read: Callable[[Any], Any],
                progress: Optional[Tick], what: str, total: int) -> Dict[Candidate, Tuple[Any, str]]:
    """One process per candidate on its request; once all have loaded and warmed up, each in turn (a shuffled
    order every turn) gets ``turn_for(turn)`` while the others wait, until each answers with its result. Returns
    per candidate its result as ``read`` makes it, or None and why its process failed (the others go on); tells
    ``progress`` of each answer as ``what``, of at most ``total``."""
    results: Dict[Candidate, Tuple[Any, str]] = {}
    with tempfile.TemporaryDirectory(prefix="fxl-own-process-") as tmp:
        workers: Dict[Candidate, _Worker] = {}
        try:
            for i, (candidate, request) in enumerate(requests.items()):
                workers[candidate] = _Worker(Path(tmp) / str(i), request)
            for candidate, worker in workers.items():  # every one loaded and warm before any is timed
                _, why = worker.reply()
                if why:
                    results[candidate] = (None, why)
            rng = random.Random(0)
            turn = done = 0
            while len(results) < len(workers):
                order = [c for c in workers if c not in results]
                rng.shuffle(order)
                for candidate in order:
                    answer, why = workers[candidate].ask(turn_for(turn))
                    if answer is None or answer.status == "result":
                        results[candidate] = (read(answer.result) if answer is not None else None, why)
                    done += 1
                    if progress is not None:
                        progress(what, min(done, total), total)
                turn += 1
        finally:
            for worker in workers.values():
                worker.close()
    return {c: results[c] for c in requests}


class _Worker:
    """One timing process on a request file, spoken to in JSON lines (a :class:`Turn` each way down, an
    :class:`Answer` up) on a channel of its own: the libraries' prints go to its stderr, kept in a file for the
    reason when it fails."""

    def __init__(self, folder: Path, request: WorkerRequest) -> None:
        folder.mkdir(parents=True)
        path = folder / "request.json"
        path.write_text(json.dumps(dataclasses.asdict(request)), encoding="utf-8")
        self.stderr_path = folder / "stderr.txt"
        self.stderr = open(self.stderr_path, "w", encoding="utf-8")
        # The parent's import path, so an artifact that imports the user's modules loads as it did here.
        child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([*WORKER_COMMAND, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=child_env)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, turn: Turn) -> Tuple[Optional[Answer], str]:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(dataclasses.asdict(turn)) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it has exited: reply() says why
        return self.reply()

    def reply(self) -> Tuple[Optional[Answer], str]:
        """Its next answer, or None and why there is none (it exited, failed or took too long)."""
        answer = None
        while answer is None:
            try:
                line = self.lines.get(timeout=OWN_PROCESS_TIMEOUT_S)
            except queue.Empty:
                self.close()
                return None, f"timed out after {OWN_PROCESS_TIMEOUT_S:.0f} s"
            if line is None:
                code = self.proc.wait()
                self.stderr.flush()
                tail = (self.stderr_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
                        or ["no output"])
                return None, f"exit code {code}: {tail[0][:200]}"
            try:  # a line printed before its stdout went to stderr is not an answer
                answer = Answer(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue
        return (None, answer.error[:200]) if answer.status == "error" else (answer, "")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def _time_request(path: Path) -> None:
    """The worker of :func:`time_in_own_processes` and :func:`sweep_in_own_processes`: load the one artifact, warm
    it up, say so, then do what its parent asks each turn, answering on stdout's own descriptor (whatever else
    prints goes to stderr) until it answers with its result."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    request = WorkerRequest(**json.loads(path.read_text(encoding="utf-8")))
    torch.set_num_threads(request.threads)
    root = Path(request.root)
    manifest = Manifest.from_dict(request.manifest)
    module = load_artifact(root, manifest, request.candidate[0], device="cpu", runtime=request.candidate[1])
    saved = read_check_file(root)
    if saved is None:
        raise SystemExit("no check.pt: nothing to time the artifact on")
    signature = manifest.call_signature()
    axes = signature.input_axes() if signature.batched else None
    turns = (_sweep_turns(module, saved.inputs, request, axes) if request.sweep_traffics
             else _round_turns(module, saved.inputs, request, axes))
    answer = next(turns)  # loaded and warm, or why not
    while True:
        channel.write(json.dumps(dataclasses.asdict(answer)) + "\n")
        channel.flush()
        line = sys.stdin.readline()
        if answer.status in ("result", "error") or not line:  # done, failed, or the parent has gone
            return
        answer = turns.send(Turn(**json.loads(line)))


Turns = Generator[Answer, Turn, None]


def _round_turns(module: nn.Module, inputs: Sequence[Any], request: WorkerRequest,
                 axes: Optional[Sequence[Optional[int]]]) -> Turns:
    """Warm up; then each turn run the rounds asked for, until asked to finish: the samples."""
    candidate = (request.candidate[0], request.candidate[1])
    kept: Dict[Tuple[int, str], List[float]] = {}
    turn, warmup, answer = Turn(rounds=0), request.warmup, "ready"  # the first run is the warm-up alone
    while not turn.finish:
        samples, failures = time_interleaved({candidate: module}, inputs, request.batch_sizes, turn.rounds, warmup,
                                             axes=axes)
        if failures:
            yield Answer("error", error=failures[0].reason)
            return
        for (_, b), by_traffic in samples.items():
            for traffic, ts in by_traffic.items():
                kept.setdefault((b, traffic), []).extend(ts)
        turn = yield Answer(answer)
        warmup, answer = 0, "done"
    yield Answer("result", [[b, traffic, ts] for (b, traffic), ts in kept.items()])


def _sweep_turns(module: nn.Module, inputs: Sequence[Any], request: WorkerRequest,
                 axes: Optional[Sequence[Optional[int]]]) -> Turns:
    """Each turn the next batch size of the sweep in each traffic not done yet; the sweeps once all are done."""
    name, runtime = request.candidate
    settings = SweepSettings(**request.sweep_settings)
    steps = {traffic: sweep_steps(module_runner(module, inputs, axes or [], traffic), settings)
             for traffic in request.sweep_traffics}
    points: Dict[str, List[SweepPoint]] = {traffic: [] for traffic in steps}
    stops: Dict[str, str] = {}
    yield Answer("ready")  # each sweep's first call at a batch size is its warm-up
    while len(stops) < len(steps):
        for traffic, step in steps.items():
            if traffic not in stops:
                try:
                    points[traffic].append(next(step))
                except StopIteration as done:
                    stops[traffic] = str(done.value)
        if len(stops) < len(steps):
            yield Answer("done")
    yield Answer("result", [dataclasses.asdict(Sweep(name, Traffic(traffic).value, points[traffic], stops[traffic],
                                                     runtime, "own")) for traffic in steps])


if __name__ == "__main__":
    _time_request(Path(sys.argv[1]))
