"""The driver's collective protocol, two ranks in one process: threads joined by a fake Collectives object.

Whatever happens on one rank (a failure while loading, a skip, a parity failure, rank 0's export failing), every
rank must make the same collective calls in the same order (or the real process group would wait forever) and
end with the same outcome. A rank that waits longer than the barrier's timeout fails the test instead of hanging.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from torch import nn

from fx_lightning.config import load_config
from fx_lightning.export.progress import Progress
from fx_lightning.pipeline import Batches, Destination, Outcome, Source, driver, load_source, run_pipeline

WORLD = 2


class ThreadCollectives:
    """Collectives for ``WORLD`` threads: each call meets the others at a barrier; ``calls`` records the order."""

    def __init__(self, barrier: threading.Barrier, slots: List[Any], rank: int) -> None:
        self.barrier, self.slots, self.rank, self.world_size = barrier, slots, rank, WORLD
        self.calls: List[str] = []

    def _exchange(self, obj: Any) -> List[Any]:
        self.slots[self.rank] = obj
        self.barrier.wait()
        out = copy.deepcopy(list(self.slots))  # as if sent: no rank shares another's objects
        self.barrier.wait()
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.calls.append(f"broadcast from {src}")
        return self._exchange(obj)[src]

    def all_gather(self, obj: Any) -> List[Any]:
        self.calls.append("all_gather")
        return self._exchange(obj)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():
        model[1].running_var.uniform_(0.5, 2)
    return model.eval()


def _run(tmp_path: Path, config: Dict[str, Any], monkeypatch: pytest.MonkeyPatch,
         load_fails_on: Optional[int] = None, skip_on: Optional[int] = None) -> List[Any]:
    """Run the pipeline on ``WORLD`` threads; every rank's outcome (or what it raised) and its calls."""
    lock = threading.Lock()  # torch.fx tracing is not thread-safe: the local work runs one rank at a time
    local = driver.run_locally
    monkeypatch.setattr(driver, "run_locally", lambda *a, **k: _locked(lock, local, *a, **k))
    barrier, slots = threading.Barrier(WORLD, timeout=60), [None] * WORLD
    collectives = [ThreadCollectives(barrier, slots, r) for r in range(WORLD)]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]
    results: List[Any] = [None] * WORLD

    def rank(r: int) -> None:
        def load() -> Source:
            if r == load_fails_on:
                raise RuntimeError(f"the data broke on rank {r}")
            return Source(_model(), Batches(batches, "val"))

        try:
            results[r] = run_pipeline(load_config(config), load_source(load, Progress()) if r != skip_on else None,
                                      Destination(tmp_path / "fused"),
                                      collectives=collectives[r], skip="skipped here" if r == skip_on else None)
        except BaseException as exc:  # noqa: BLE001 - the test says what was raised
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    assert not any(isinstance(r, BaseException) for r in results), results  # run_pipeline raises nothing
    assert collectives[0].calls == collectives[1].calls, [c.calls for c in collectives]
    return [(r, c.calls) for r, c in zip(results, collectives)]


def _locked(lock: threading.Lock, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with lock:
        return fn(*args, **kwargs)


def _same_failure(outcomes: List[Outcome]) -> str:
    failures = [o.failure for o in outcomes]
    assert all(f is not None for f in failures)
    assert len({(type(f.error).__name__, f.where) for f in failures}) == 1, failures  # type: ignore[union-attr]
    return str(failures[0].error)  # type: ignore[union-attr]


BASE = {"export": {"formats": ["pt2"]}}


def test_both_ranks_export_once_on_the_happy_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = _run(tmp_path, BASE, monkeypatch)
    (a, calls), (b, _) = ranks
    assert calls == ["all_gather", "broadcast from 0", "broadcast from 0"]
    assert a.failure is None and b.failure is None and a.export_dir == b.export_dir == tmp_path / "fused"
    assert a.parity.passed and a.parity.batches == 4  # both ranks' batches, merged
    assert a.manifest is not None and b.manifest is not None  # rank 1 received what rank 0 wrote


def test_a_failure_while_loading_on_one_rank_reaches_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = _run(tmp_path, BASE, monkeypatch, load_fails_on=1)
    assert ranks[0][1] == ["all_gather"]
    message = _same_failure([o for o, _ in ranks])
    assert "the data broke on rank 1" in message and not (tmp_path / "fused").exists()
    assert ranks[0][0].failure.where == " on rank 1 of 2" and ranks[0][0].failure.remote


def test_a_skip_on_one_rank_skips_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = _run(tmp_path, BASE, monkeypatch, skip_on=1)
    assert ranks[0][1] == ["all_gather"] and all(o.skipped == "skipped here" for o, _ in ranks)


def test_export_disabled_makes_no_export_broadcast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = _run(tmp_path, {"export": {"enabled": False}}, monkeypatch)
    assert ranks[0][1] == ["all_gather", "broadcast from 0"] and all(o.export_dir is None for o, _ in ranks)


@pytest.mark.parametrize("on_failure", ["raise", "warn"])
def test_a_parity_failure_is_the_same_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     on_failure: str) -> None:
    config = {**BASE, "parity": {"rtol": 0.0, "min_cosine": 1.0, "on_failure": on_failure}}
    if on_failure == "warn":
        with pytest.warns(UserWarning, match="parity FAILED"):
            ranks = _run(tmp_path, config, monkeypatch)
        assert all(o.failure is None for o, _ in ranks)
    else:
        ranks = _run(tmp_path, config, monkeypatch)
        assert "parity FAILED" in _same_failure([o for o, _ in ranks])
    assert ranks[0][1] == ["all_gather", "broadcast from 0"] and not (tmp_path / "fused").exists()
    assert all(o.parity is not None and not o.parity.passed for o, _ in ranks)


def test_rank_zeros_export_failure_reaches_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(driver, "export", broken)
    ranks = _run(tmp_path, BASE, monkeypatch)
    assert ranks[0][1] == ["all_gather", "broadcast from 0", "broadcast from 0"]
    assert "No space left on device" in _same_failure([o for o, _ in ranks])
    assert ranks[1][0].failure.where == " on rank 0 of 2" and all(o.export_dir is None for o, _ in ranks)


def test_the_load_function_itself_is_refused_with_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"pass load_source\(load, progress\), not the load function"):
        run_pipeline(load_config({}), lambda: Source(_model(), Batches([], "val")), Destination(None))
