"""The pipeline's progress drawn the way the Trainer draws its own: a TQDM bar beside ``TQDMProgressBar``, a Rich
one beside ``RichProgressBar``, plain lines when the Trainer has none (``enable_progress_bar=False``) or its output
is not a terminal (a log file wants lines, not a redrawn bar); nothing on ranks other than zero.

:func:`progress_for` builds it from the Trainer; the callback passes it down to the driver (data flows down: nothing
here calls back into the callback).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Dict, Optional

import lightning.pytorch as pl

from fx_lightning.callback.namespaces import lightning_classes
from fx_lightning.export.progress import LOGGER, LineProgress, Progress

if TYPE_CHECKING:
    from rich.progress import TaskID
    from tqdm import tqdm as Tqdm

__all__ = ["progress_for", "TqdmProgress", "RichProgress", "plain_lines"]


class TqdmProgress(LineProgress):
    """Lines through ``tqdm.write`` (so they do not break a bar being drawn), and a tqdm bar per long loop."""

    def __init__(self, title: str = "") -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        super().__init__(lambda line: tqdm.write(line, file=sys.stderr), title)
        self._bars: Dict[str, "Tqdm"] = {}

    def advance(self, what: str, done: int, total: Optional[int]) -> None:
        bar = self._bars.get(what)
        if bar is None:
            bar = self._bars[what] = self._tqdm(total=total, desc=f"{self.prefix}{what}", leave=False,
                                                file=sys.stderr, dynamic_ncols=True)
        bar.n = done
        bar.refresh()
        self.touch()
        if total is not None and done >= total:
            self._bars.pop(what).close()

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()
        super().close()


class RichProgress(LineProgress):
    """Lines through a Rich console, and a transient Rich bar per long loop."""

    def __init__(self, console: Any, title: str = "") -> None:
        super().__init__(lambda line: console.print(line, markup=False, highlight=False), title)
        self._console = console
        self._bars: Optional[Any] = None
        self._tasks: Dict[str, "TaskID"] = {}

    def advance(self, what: str, done: int, total: Optional[int]) -> None:
        from rich.progress import BarColumn, Progress as Bars, TextColumn, TimeRemainingColumn

        if self._bars is None:
            self._bars = Bars(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                              TimeRemainingColumn(), console=self._console, transient=True)
            self._bars.start()
        if what not in self._tasks:
            self._tasks[what] = self._bars.add_task(f"{self.prefix}{what}", total=total)
        self._bars.update(self._tasks[what], completed=done, total=total)
        self.touch()
        if total is not None and done >= total:
            self._bars.remove_task(self._tasks.pop(what))

    def close(self) -> None:
        if self._bars is not None:
            self._bars.stop()
            self._bars = None
            self._tasks.clear()
        super().close()


def plain_lines(title: str) -> LineProgress:
    """Plain lines through the ``fx_lightning.progress`` logger. When nothing configured logging (no Hydra, no
    ``basicConfig``), the ``fx_lightning`` logger gets a handler of its own at INFO, as Lightning does for its own
    logger; a level the user set is kept (at WARNING the lines are gone)."""
    ours = logging.getLogger("fx_lightning")
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
    if not LOGGER.hasHandlers():
        ours.addHandler(logging.StreamHandler())
        ours.propagate = False
    return LineProgress(LOGGER.info, title)


def progress_for(trainer: "pl.Trainer", title: str) -> Progress:
    """The progress the Trainer's own progress bar implies (module docstring); ``title``: "preflight" or "end of
    fit"."""
    if not trainer.is_global_zero:
        return Progress()
    bar = trainer.progress_bar_callback
    rich_bars, tqdm_bars = lightning_classes("callbacks.RichProgressBar"), lightning_classes("callbacks.TQDMProgressBar")
    if bar is not None and rich_bars and isinstance(bar, rich_bars):
        from rich import get_console

        console = get_console()
        if console.is_terminal:
            return RichProgress(console, title)
    elif bar is not None and tqdm_bars and isinstance(bar, tqdm_bars) and sys.stderr.isatty():
        return TqdmProgress(title)
    return plain_lines(title)
