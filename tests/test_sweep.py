"""The throughput sweep (export/select/sweep.py), the selection strategies (export/select/selection.py) and the batching that
``fx-lightning serve`` and the Triton repository take from the sweep.

The algorithm is tested with fake runners (a throughput that saturates, windows that disagree, a batch size that
raises), the strategies and the batching with recorded tables, and the whole path once on a real export."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

import lightning_helpers as H
from fx_lightning import ExportError, load_fused
from fx_lightning.cli import main as cli_main
from fx_lightning.config import load_config
from fx_lightning.errors import ConfigError
from fx_lightning.export import read_manifest
from fx_lightning.export.load.loader import selection_for
from fx_lightning.export.manifest import (ArtifactCheck, BenchTable, Manifest, Sweep, SweepPoint, Timing,
                                         write_manifest)
from fx_lightning.export.select.selection import (select_all, select_by_strategy, select_max_throughput,
                                                  sweep_candidates, with_selection)
from fx_lightning.export.select.sweep import SweepSettings, measure_batch_size, recorded_batching, sweep
from fx_lightning.pipeline import Batches, fuse_verify_export
from fx_lightning.serve.triton_python import STRATEGY_PARAMETER, selection_options
from fx_lightning.serve.artifact import DEFAULT_BATCH_TIMEOUT, DEFAULT_MAX_BATCH_SIZE, ServeOptions, artifact_for

FAST = SweepSettings(window_s=0.0)  # fake runners take no wall time: windows of min_window_calls


def saturating(limit: int, ms_per_run: float = 10.0):
    """A fake runner whose run takes the same time up to ``limit`` samples, then grows in proportion: its
    throughput doubles with the batch size up to ``limit`` and stays flat beyond."""
    calls: List[int] = []

    def run(batch_size: int) -> float:
        calls.append(batch_size)
        return ms_per_run / 1e3 * max(1.0, batch_size / limit)

    return run, calls


@pytest.mark.parametrize("limit", [1, 4, 32])
def test_the_sweep_stops_where_throughput_stops_growing(limit: int) -> None:
    run, calls = saturating(limit)
    points, stop = sweep(run, FAST)
    sizes = [p.batch_size for p in points]
    assert sizes == [2 ** i for i in range(int(math.log2(limit)) + 2)]  # up to the first size that did not grow
    assert max(calls) == 2 * limit  # nothing beyond it was run
    for p in points:
        assert p.throughput == pytest.approx(min(p.batch_size, limit) / 0.010, rel=1e-9)
        assert p.p50_ms == pytest.approx(10.0 * max(1.0, p.batch_size / limit)) and p.stable
    assert f"batch {2 * limit}" in stop and "+0.0%" in stop and "less than 5%" in stop
    best = Sweep("fake", "back_to_back", points, stop).best()
    assert best is not None and best.batch_size == limit  # the tie at 2x goes to the smaller batch
    # Within 5% of the most is a tie too: 16 for 1% more than 8 would only add latency.
    assert Sweep("f", "idle", _points([(8, 400, 1), (16, 404, 2)]), "").best().batch_size == 8


def test_growth_just_under_the_threshold_stops_and_just_over_goes_on() -> None:
    def runner(growth: float):
        return lambda b: 0.01 * b / (1 + growth) ** math.log2(b)  # throughput grows by `growth` per doubling

    assert [p.batch_size for p in sweep(runner(0.049), FAST)[0]] == [1, 2]
    over, stop = sweep(runner(0.051), SweepSettings(window_s=0.0, max_batch_size=16))
    assert [p.batch_size for p in over] == [1, 2, 4, 8, 16] and "max_batch_size (16)" in stop


def test_a_batch_size_is_measured_until_three_windows_in_a_row_agree() -> None:
    # Windows of 3 calls; the first two windows are disturbed (a slow minute), then the runner settles.
    times = iter([0.01, 0.01] + [0.03] * 3 + [0.02] * 3 + [0.01] * 100)
    point = measure_batch_size(lambda b: next(times), 1, FAST)
    assert point.stable and point.calls == 9  # the last three windows, which agree
    assert point.p50_ms == pytest.approx(10.0) and point.throughput == pytest.approx(100.0)
    # Never settling: kept after max_windows, marked unstable, from the last three windows.
    noisy = iter([0.01, 0.01] + [0.01, 0.01, 0.01, 0.03, 0.03, 0.03] * 50)
    point = measure_batch_size(lambda b: next(noisy), 1, SweepSettings(window_s=0.0, max_windows=6))
    assert not point.stable and point.calls == 9
    assert point.p99_ms == pytest.approx(30.0)  # the slowest call kept


def test_the_sweep_stops_where_the_artifact_raises_and_keeps_what_it_measured() -> None:
    def run(batch_size: int) -> float:
        if batch_size > 2:
            raise RuntimeError("built for batch sizes 1 and 2")
        return 0.01

    points, stop = sweep(run, FAST)
    assert [p.batch_size for p in points] == [1, 2] and "batch 4 raises RuntimeError: built for" in stop


def test_the_time_limit_counts_the_sweeps_own_steps_not_the_turns_between(monkeypatch) -> None:
    """Sweeps in processes of their own take turns a batch size at a time (timing.py), so a sweep waits while the
    others measure: that wait is not its time. Its own measuring still stops it at the limit."""
    from fx_lightning.export.select import sweep as sweep_mod

    now = [0.0]
    monkeypatch.setattr(sweep_mod.time, "perf_counter", lambda: now[0])

    def run(batch_size: int) -> float:  # 10 ms a call whatever the batch: throughput doubles with it
        now[0] += 0.01
        return 0.01

    def swept(limit_s: float) -> Tuple[List[int], str]:
        steps = sweep_mod.sweep_steps(run, SweepSettings(window_s=0.0, max_batch_size=16, time_limit_s=limit_s))
        sizes = []
        while True:
            try:
                sizes.append(next(steps).batch_size)
            except StopIteration as done:
                return sizes, str(done.value)
            now[0] += 100.0  # the other processes' turns

    sizes, stop = swept(1.0)  # 11 calls a batch size: 0.11 s of its own each
    assert sizes == [1, 2, 4, 8, 16] and "max_batch_size (16)" in stop
    sizes, stop = swept(0.3)
    assert sizes == [1, 2, 4] and "time limit (0.3 s) reached after batch 4" in stop


# ------------------------------------------------------------------------------------------ recorded tables


def _points(rows: List[Tuple[int, float, float]]) -> List[SweepPoint]:
    return [SweepPoint(b, p99 / 2, p99, throughput, 30) for b, throughput, p99 in rows]


def recorded_table() -> BenchTable:
    """Three artifacts swept in back-to-back traffic: ``onnx`` has the most throughput at batch 8 but a slow p99,
    ``openvino-int8`` less at batch 4 within 12 ms, and ``aoti-int8`` the most of all but failed its check."""
    table = BenchTable(2, "AVX2", "x86_64", torch.__version__)
    table.checks = {"onnx": ArtifactCheck(True), "openvino-int8": ArtifactCheck(True), "aoti-int8": ArtifactCheck(False)}
    table.timings = [Timing("onnx", 1, 9.0, 9.5, 20, "back_to_back"), Timing("openvino-int8", 1, 6.0, 6.5, 20,
                                                                               "back_to_back"),
                     Timing("aoti-int8", 1, 2.0, 2.0, 20, "back_to_back")]
    table.sweeps = [
        Sweep("onnx", "back_to_back", _points([(1, 110, 10), (2, 200, 14), (4, 330, 20), (8, 400, 40), (16, 405, 80)]),
              "grew 1%", "spinning"),
        Sweep("openvino-int8", "back_to_back", _points([(1, 160, 7), (2, 250, 9), (4, 300, 12), (8, 305, 30)]),
              "grew 2%"),
        Sweep("aoti-int8", "back_to_back", _points([(1, 500, 2), (2, 900, 3)]), "grew 1%"),
    ]
    return table


def test_the_strategies_pick_from_a_recorded_table() -> None:
    table = recorded_table()
    fastest = select_by_strategy(table, "min_latency", 1, "back_to_back")
    assert fastest is not None and (fastest.format, fastest.strategy) == ("openvino-int8", "min_latency")
    most = select_by_strategy(table, "max_throughput", 1, "back_to_back")
    assert most is not None and (most.format, most.runtime, most.batch_size) == ("onnx", "spinning", 8)
    assert (most.strategy, most.throughput, most.p99_ms) == ("max_throughput", 400, 40)
    assert "400.0/s at batch 8" in most.why and "AVX2" in most.why
    within = select_by_strategy(table, "max_throughput", 1, "back_to_back", latency_budget_ms=15)
    assert within is not None and (within.format, within.batch_size, within.latency_budget_ms) == \
        ("openvino-int8", 4, 15)
    tight = select_max_throughput(table, "back_to_back", 8)
    assert tight is not None and (tight.format, tight.batch_size) == ("openvino-int8", 1)
    assert select_max_throughput(table, "idle") is None  # nothing swept in that traffic


def test_a_latency_budget_no_artifact_meets_is_refused_with_the_figures() -> None:
    with pytest.raises(ExportError) as info:
        select_by_strategy(recorded_table(), "max_throughput", 1, "back_to_back", latency_budget_ms=5)
    text = str(info.value)
    assert "latency_budget_ms: 5" in text and "back to back" in text and "2 threads, AVX2" in text
    assert "openvino-int8 7.00 ms at batch 1" in text and "onnx [spinning] 10.00 ms at batch 1" in text
    assert "aoti-int8" not in text  # its check failed: it was never a candidate


def test_the_manifest_records_every_pick_and_load_fused_reads_them_back() -> None:
    table = recorded_table()
    chosen = select_by_strategy(table, "max_throughput", 1, "back_to_back", latency_budget_ms=15)
    manifest = with_selection(Manifest(formats={}), table, chosen)
    manifest = Manifest.from_dict(json.loads(json.dumps(manifest.to_dict())))  # written and read back
    assert manifest.bench is not None and manifest.bench.sweeps == table.sweeps
    kinds = {(s.strategy, s.traffic, s.format, s.batch_size, s.latency_budget_ms) for s in manifest.selections}
    assert kinds == {("min_latency", "back_to_back", "openvino-int8", 1, None),
                     ("max_throughput", "back_to_back", "onnx", 8, None),
                     ("max_throughput", "back_to_back", "openvino-int8", 4, 15)}
    assert manifest.selected == chosen
    assert selection_for(manifest, strategy="max_throughput", traffic="back_to_back") == chosen  # the budgeted one
    assert selection_for(manifest, 1, "back_to_back").format == "openvino-int8"  # min_latency, as before
    assert select_all(table)[-1].format == "onnx"


def test_sweep_candidates_are_the_passing_artifacts_near_the_fastest() -> None:
    table = recorded_table()
    table.timings.append(Timing("onnx", 1, 20.0, 21.0, 20, "back_to_back", "spinning"))  # its slower runtime
    table.timings.append(Timing("pt2", 1, 30.0, 31.0, 20, "back_to_back"))
    table.checks["pt2"] = ArtifactCheck(True)
    assert sweep_candidates(table, "back_to_back") == [("openvino-int8", ""), ("onnx", "")]  # pt2: 5x behind


def test_serving_batching_comes_from_the_recorded_sweep() -> None:
    table = recorded_table()
    manifest = with_selection(Manifest(formats={}), table, select_by_strategy(table, "min_latency", 1, "back_to_back"))
    batching = recorded_batching(manifest)
    assert batching is not None
    # The max-throughput pick (onnx at 8); preferred: its sizes up to 8 within 95% of 400/s; no queue delay (a
    # batch is what waits when the worker is free).
    assert (batching.max_batch_size, batching.preferred_batch_sizes) == (8, (8,))
    assert batching.queue_delay_s == 0.0 and "onnx" in batching.why
    assert recorded_batching(manifest, "openvino-int8").max_batch_size == 4  # noqa: the artifact named
    options = ServeOptions().with_batching(manifest)
    assert (options.max_batch_size, options.batch_timeout) == (8, 0.0)
    given = ServeOptions(batch_timeout=0.02).with_batching(manifest)
    assert (given.max_batch_size, given.batch_timeout) == (8, 0.02) and "batch_timeout given" in given.batching
    assert artifact_for(manifest, ServeOptions()) == ("onnx", "spinning")  # the pick whose batching it is
    told = ServeOptions(max_batch_size=1).with_batching(manifest)
    assert told.max_batch_size == 1 and artifact_for(manifest, told)[0] == "openvino-int8"  # fastest at batch 1
    # An export without a sweep: the defaults, and saying so.
    bare = ServeOptions().with_batching(Manifest(formats={}))
    assert (bare.max_batch_size, bare.batch_timeout) == (DEFAULT_MAX_BATCH_SIZE, DEFAULT_BATCH_TIMEOUT)
    assert "no throughput sweep" in bare.batching


def test_config_refuses_budgets_and_strategies_that_cannot_apply() -> None:
    for bad, words in (({"latency_budget_ms": -1, "select": "fastest", "select_strategy": "max_throughput"},
                        "latency_budget_ms: -1"),
                       ({"latency_budget_ms": float("nan"), "select": "fastest", "select_strategy": "max_throughput"},
                        "latency_budget_ms: nan"),
                       ({"latency_budget_ms": 10, "select": "fastest"}, "select_strategy: min_latency"),
                       ({"select_strategy": "max_throughput"}, "select: preference"),
                       ({"select_strategy": "fastest_please", "select": "fastest"}, "select_strategy")):
        with pytest.raises(ConfigError) as info:
            load_config({"export": bad})
        assert words in str(info.value), str(info.value)


# ------------------------------------------------------------------------------------------ a real export


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, torch.nn.Module]:
    lit = H.randomize_batchnorms(H.LitClassifier())
    config = {"export": {"formats": ["pt2", "onnx"], "select": "fastest", "select_strategy": "max_throughput",
                         "select_traffic": "back_to_back"}}
    out = fuse_verify_export(lit, load_config(config), Batches(list(H.loaders()[1]), "val"),
                             export_dir=tmp_path_factory.mktemp("swept") / "fused")
    assert out.export_dir is not None
    return out.export_dir, lit.backbone


def test_an_export_records_the_sweep_and_serves_its_max_throughput_pick(swept: Tuple[Path, torch.nn.Module]
                                                                         ) -> None:
    swept_export, backbone = swept
    manifest = read_manifest(swept_export)
    bench = manifest.bench
    assert bench is not None and {w.traffic for w in bench.sweeps} == {"idle", "back_to_back"}
    for w in bench.sweeps:
        sizes = [p.batch_size for p in w.points]
        assert sizes == [2 ** i for i in range(len(sizes))] and w.stop and w.process == "own"
        assert all(p.p99_ms >= p.p50_ms > 0 and p.throughput > 0 for p in w.points)
        assert bench.checks[w.artifact].passed
    pick = manifest.selected
    assert pick is not None and pick.strategy == "max_throughput" and pick.traffic == "back_to_back"
    best = max((p.throughput for w in bench.sweeps if w.traffic == "back_to_back" for p in w.points))
    assert best / 1.05 <= pick.throughput <= best  # the most, or a smaller batch within 5% of it
    # load_fused(strategy=) loads it and it computes the model: fp64 reference, relative error.
    model = load_fused(swept_export, strategy="max_throughput", traffic="back_to_back")
    x = next(iter(H.loaders()[1]))[0][:3]
    reference = copy.deepcopy(backbone).double().eval()(x.double())
    got = model(x)
    assert got.shape == reference.shape and got.dtype == torch.float32
    assert ((got.double() - reference).norm() / reference.norm()).item() < 1e-4
    options = ServeOptions().with_batching(manifest)
    assert options.max_batch_size == pick.batch_size and "sweep" in options.batching


def test_fx_lightning_bench_select_reruns_the_sweep_and_refuses_an_impossible_budget(
        swept: Tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(swept[0], root)
    before = (root / "manifest.json").read_text()
    code = cli_main(["bench", str(root), "--no-unfused", "--iters", "2", "--warmup", "1", "--select",
                     "--strategy", "max_throughput", "--select-traffic", "back_to_back", "--latency-budget-ms",
                     "0.000001"])
    assert code == 1 and (root / "manifest.json").read_text() == before  # refused: the manifest as it was
    code = cli_main(["bench", str(root), "--no-unfused", "--iters", "2", "--warmup", "1", "--select",
                     "--strategy", "max_throughput", "--select-traffic", "back_to_back"])
    assert code == 0
    manifest = read_manifest(root)
    assert manifest.selected is not None and manifest.selected.strategy == "max_throughput"
    assert manifest.bench is not None and manifest.bench.sweeps
    assert cli_main(["bench", str(root), "--latency-budget-ms", "5", "--select"]) == 2  # min_latency: no budget


def test_an_export_refuses_a_budget_no_artifact_meets(tmp_path: Path) -> None:
    lit = H.randomize_batchnorms(H.LitClassifier())
    config = {"export": {"formats": ["pt2"], "select": "fastest", "select_strategy": "max_throughput",
                         "latency_budget_ms": 1e-6}}
    with pytest.raises(ExportError) as info:
        fuse_verify_export(lit, load_config(config), Batches(list(H.loaders()[1]), "val"),
                           export_dir=tmp_path / "fused")
    assert "latency_budget_ms: 1e-06" in str(info.value) and "pt2" in str(info.value) and "ms at batch" in \
        str(info.value)


def test_the_triton_repository_takes_its_batching_from_the_recorded_sweep(swept: Tuple[Path, torch.nn.Module],
                                                                          tmp_path: Path) -> None:
    from fx_lightning.serve.triton import write_triton_repository

    root = tmp_path / "export"
    shutil.copytree(swept[0], root)
    manifest = read_manifest(root)
    table = recorded_table()  # onnx swept: most throughput at 8; preferred (8,); no queue delay
    write_manifest(root, with_selection(manifest, table, select_by_strategy(table, "min_latency", 1,
                                                                               "back_to_back")))
    repository = write_triton_repository(root, tmp_path / "repo", python=False)
    onnx = next(m for m in repository.models if m.entry == "onnx")
    assert (onnx.max_batch_size, onnx.preferred_batch_sizes, onnx.max_queue_delay_us) == (8, [8], 0)
    assert any("from the export's throughput sweep of onnx" in note for note in onnx.notes)
    assert "max_batch_size: 8" in (onnx.directory / "config.pbtxt").read_text()
    # The selection's Python-backend model batches as the max-throughput pick's sweep says, so it serves that pick
    # (onnx), not the fastest at batch 8 (openvino-int8, whose only timing is at batch 1), as fx-lightning serve does.
    with_python = write_triton_repository(root, tmp_path / "python", python=True)
    selection = next(m for m in with_python.models if m.selection)
    assert selection.max_batch_size == 8 and selection.parameters[STRATEGY_PARAMETER] == "max_throughput"
    assert any("selection (onnx on this machine)" in note for note in selection.notes)
    assert artifact_for(read_manifest(root), selection_options(None, 8, "max_throughput"))[0] == "onnx"
    assert artifact_for(read_manifest(root), selection_options(None, 8, None))[0] == "openvino-int8"
    # Told otherwise: the flags win, the rest still from the sweep.
    told = write_triton_repository(root, tmp_path / "told", python=True, max_batch_size=2)
    onnx = next(m for m in told.models if m.entry == "onnx")
    assert (onnx.max_batch_size, onnx.preferred_batch_sizes, onnx.max_queue_delay_us) == (2, [], 0)
    assert STRATEGY_PARAMETER not in next(m for m in told.models if m.selection).parameters  # the fastest at 2
    # Without a sweep: the defaults, and no note claiming one.
    write_manifest(root, manifest.__class__.from_dict({**manifest.to_dict(), "bench": None, "selected": None,
                                                         "selections": []}))
    bare = next(m for m in write_triton_repository(root, tmp_path / "bare", python=False).models if m.entry == "onnx")
    assert (bare.max_batch_size, bare.preferred_batch_sizes, bare.max_queue_delay_us) == (8, [], 100)
    assert not any("sweep" in note for note in bare.notes)
