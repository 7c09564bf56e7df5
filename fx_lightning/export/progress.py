"""Progress through the pipeline, for people: each step as it starts and ends, with its time, how far a long step
is (timing, sweep, calibration), and the libraries' own chatter kept out of the way.

One small concept: the driver takes a :class:`Progress` and passes it down to the steps, which open
``progress.step(name)`` blocks and call ``progress.advance(what, done, total)`` in their long loops. The base class
draws nothing and records each step's time (the summary ends with them); :class:`LineProgress` writes a line per
event (plain logging lines by default: what a log file that is not a terminal wants), and says a step is still
running when it has been quiet for :attr:`LineProgress.heartbeat_s`, so a slow step never reads as a hung one.
The callback builds the one that matches the Trainer's own progress bar (``callback/progress_bar.py``).
It lives under ``export/`` because the export's own parts (formats, variants, timing) report through it too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

__all__ = ["Progress", "LineProgress", "StepTime", "StepEnd", "log_lines", "quiet_libraries", "times_text",
           "NOISY_LOGGERS"]

LOGGER = logging.getLogger("fx_lightning.progress")

# The libraries whose INFO output during an export is theirs, not the user's (ONNX exporter and optimiser, ONNX
# Runtime's quantiser, OpenVINO and NNCF, torchao): kept at WARNING unless the fx_lightning logger is at DEBUG.
NOISY_LOGGERS = ("onnx_ir", "onnxscript", "torch.onnx", "onnxruntime", "openvino", "nncf", "torchao")


@dataclass(frozen=True)
class StepTime:
    """How long one step took; ``depth`` 0 is a step of the pipeline, 1 a part of one (a format, a variant)."""

    name: str
    seconds: float
    depth: int
    ok: bool = True
    order: int = 0  # when it started, among the steps (recorded as each ends: parts before their step)


@dataclass
class StepEnd:
    """What a step says when it ends (the size written, the check's verdict): set inside its block."""

    result: str = ""


class Progress:
    """Records each step's time and draws nothing: what a rank other than zero, or a caller that wants silence,
    passes. Subclasses draw (:meth:`started`, :meth:`ended`, :meth:`advance`)."""

    def __init__(self) -> None:
        self.times: List[StepTime] = []
        self._open: List[Tuple[str, float]] = []
        self._started = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def step(self, name: str, detail: str = "") -> Iterator[StepEnd]:
        """A step: started now, ended (with its time, and ``failed`` when the block raises) when the block leaves."""
        end = StepEnd()
        with self._lock:  # monotonic, not perf_counter: a step's clock is not a timed call (tests count those)
            depth, order = len(self._open), self._started
            self._started += 1
            self._open.append((name, time.monotonic()))
        self.started(name, depth, detail)
        ok = False
        try:
            yield end
            ok = True
        finally:
            with self._lock:
                _, start = self._open.pop()
            seconds = time.monotonic() - start
            self.times.append(StepTime(name, seconds, depth, ok, order))
            self.ended(name, depth, seconds, end.result if ok else "failed")

    def started(self, name: str, depth: int, detail: str) -> None:
        """A step started (``detail``: what it will do)."""

    def ended(self, name: str, depth: int, seconds: float, result: str) -> None:
        """A step ended after ``seconds`` (``result``: what it made, or ``failed``)."""

    def advance(self, what: str, done: int, total: Optional[int]) -> None:
        """``done`` of ``total`` units of a long step's loop (None: no total known)."""

    def close(self) -> None:
        """No more steps (a bar still drawn is removed)."""

    def open_steps(self) -> List[Tuple[str, float]]:
        with self._lock:
            return list(self._open)


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds / 60:.1f} min"


class LineProgress(Progress):
    """A line per step as it starts and ends, a line of a long loop's progress at most every ``every_s`` (with
    what is left, estimated from the pace so far), and a "still running" line when a step has been quiet for
    ``heartbeat_s``. ``write`` takes each line; ``title`` says whose steps they are ("preflight", "end of fit")."""

    every_s = 3.0
    heartbeat_s = 5.0

    def __init__(self, write: Callable[[str], None], title: str = "") -> None:
        super().__init__()
        self.write_line = write
        self.prefix = f"fx-lightning {title}: " if title else "fx-lightning: "
        self._last_output = time.monotonic()
        self._last_advance: Dict[str, Tuple[float, float]] = {}  # what -> (time of its last line, time of its first unit)
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None

    def emit(self, text: str) -> None:
        self.touch()
        self.write_line(self.prefix + text)

    def touch(self) -> None:
        """Something was drawn now (a bar moved): no "still running" line is due."""
        self._last_output = time.monotonic()

    def started(self, name: str, depth: int, detail: str) -> None:
        self.emit("  " * depth + f"{name} ..." + (f" ({detail})" if detail else ""))
        if depth == 0:
            self._start_heartbeat()

    def ended(self, name: str, depth: int, seconds: float, result: str) -> None:
        verdict = "FAILED" if result == "failed" else "done"
        self.emit("  " * depth + f"{name}: {verdict} in {_seconds(seconds)}" + (
            f" ({result})" if result and result != "failed" else ""))
        if depth == 0:
            self._stop_heartbeat()

    def advance(self, what: str, done: int, total: Optional[int]) -> None:
        now = time.monotonic()
        last, first = self._last_advance.setdefault(what, (now, now))
        finished = total is not None and done >= total
        if not finished and now - last < self.every_s:
            return
        self._last_advance[what] = (now, first)
        if total:
            left = (now - first) / max(done, 1) * (total - done)
            self.emit(f"  {what}: {done}/{total} ({100 * done // total}%)"
                      + ("" if finished else f", about {_seconds(left)} left"))
        else:
            self.emit(f"  {what}: {done} done")
        if finished:
            self._last_advance.pop(what, None)

    def close(self) -> None:
        self._stop_heartbeat()

    def _start_heartbeat(self) -> None:
        self._stop_heartbeat()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(self._stop,), name="fx-lightning-progress",
                                      daemon=True)
        self._beat.start()

    def _stop_heartbeat(self) -> None:
        self._stop.set()
        beat, self._beat = self._beat, None
        if beat is not None and beat is not threading.current_thread():
            beat.join()

    def _heartbeat(self, stop: threading.Event) -> None:
        """While a step is open: a line when nothing was written for ``heartbeat_s`` (a compile, a calibration)."""
        while not stop.wait(min(1.0, self.heartbeat_s / 2)):
            open_steps = self.open_steps()
            if open_steps and time.monotonic() - self._last_output >= self.heartbeat_s:
                name, start = open_steps[-1]
                self.emit("  " * (len(open_steps) - 1) + f"{name}: still running "
                          f"({_seconds(time.monotonic() - start)})")


def log_lines() -> LineProgress:
    """Plain lines through the ``fx_lightning.progress`` logger at INFO: the default."""
    return LineProgress(LOGGER.info)


class _Quieted:
    """The pipelines running at once (ranks run as threads): the first quiets the loggers, the last restores them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved: List[Tuple[logging.Logger, int]] = []


_QUIETED = _Quieted()


@contextlib.contextmanager
def quiet_libraries(names: Tuple[str, ...] = NOISY_LOGGERS) -> Iterator[None]:
    """The libraries' loggers at WARNING for the block (their INFO lines are about their own internals), unless
    the ``fx_lightning`` logger is at DEBUG: then the user asked to see everything."""
    if logging.getLogger("fx_lightning").isEnabledFor(logging.DEBUG):
        yield
        return
    state = _QUIETED
    with state.lock:
        state.depth += 1
        if state.depth == 1:
            state.saved = [(lg, lg.level) for lg in map(logging.getLogger, names)]
            for lg, _ in state.saved:
                if lg.getEffectiveLevel() < logging.WARNING:
                    lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        with state.lock:
            state.depth -= 1
            if state.depth == 0:
                for lg, level in state.saved:
                    lg.setLevel(level)
                state.saved = []


def times_text(times: List[StepTime], depth: int = 1) -> List[str]:
    """The summary's last lines: each step's time (parts of a step indented), up to ``depth``."""
    if not times:
        return []
    lines = ["time per step:"]
    for t in sorted(times, key=lambda t: t.order):
        if t.depth <= depth:
            lines.append("  " + "  " * t.depth + f"{t.name}: {_seconds(t.seconds)}" + ("" if t.ok else " (failed)"))
    return lines

