"""Serving artifacts: AOTInductor packages, int8 variants gated on accuracy, ONNX Runtime, and the selection of
the fastest artifact that passes its check. Every artifact is loaded in a fresh ``python -I`` process that
cannot see the training code."""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from export_helpers import run_fresh
from fusion_helpers import randomize_batchnorms, reference_fp64, rel_err
from fx_lightning import ExportError, load_fused
from fx_lightning.config import load_config
from fx_lightning.export import read_manifest
from fx_lightning.export.manifest import ArtifactCheck
from fx_lightning.export.select.selection import BenchTable, Timing, bench_export, select_fastest, tied_with
from fx_lightning.parity.gate import GATE_MISSED
from fx_lightning.pipeline import Batches, fuse_verify_export
from fx_lightning.pipeline.export_step import SELECTED, VARIANT_MISSED, VARIANT_PASSED

pytest.importorskip("torchao")


class SmallNet(nn.Module):
    """conv-BN-ReLU x2, pooling, a Linear head: 10 class scores."""

    def __init__(self, margin: float = 1.0) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)
        with torch.no_grad():  # margin -> 0: rows that differ by less than int8's rounding, so top-1 flips
            base = self.fc.weight[:1].clone()
            self.fc.weight.copy_(base + margin * (self.fc.weight - base))
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


# torchao's int8 written as pt2 and AOTInductor, NNCF's OpenVINO int8, ONNX Runtime's int8.
INT8 = ("pt2-int8", "aoti-int8", "openvino-int8", "onnx-int8")


def _data(n: int = 4, batch: int = 8, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def _export(model: nn.Module, directory: Path, **config: Any) -> Any:
    torch.manual_seed(0)
    return fuse_verify_export(randomize_batchnorms(model).eval(), load_config(config), Batches(_data(), "val"),
                              export_dir=directory)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Dict[str, Any]:
    """One export with every serving artifact: pt2, onnx, openvino, a dynamic-batch AOTInductor package, int8 variants,
    the fastest selected; then every artifact loaded in one fresh process."""
    base = tmp_path_factory.mktemp("served")
    torch.manual_seed(0)  # the same model whatever ran before in this worker (the int8 checks compare top-1 at batch 1)
    model = randomize_batchnorms(SmallNet()).eval()
    outcome = _export(model, base / "exp", export={"formats": ["pt2", "onnx", "openvino", "aoti"], "select": "fastest"},
                      passes={"quantize_int8": {"enabled": True, "calibration_batches": 4,
                                                "min_top1_agreement": 0.5, "max_accuracy_drop": 0.5,
                                                "min_cosine": 0.9}})
    out = outcome.export_dir
    manifest = read_manifest(out)
    specs = {name: {"dir": str(out), "format": name, "loader": "load_fused"} for name in manifest.formats}
    specs["selected"] = {"dir": str(out), "format": None, "loader": "load_fused"}
    inputs = [torch.randn(b, 3, 16, 16, generator=torch.Generator().manual_seed(b)) for b in (1, 7)]
    return {"model": model, "dir": out, "manifest": manifest, "outcome": outcome, "inputs": inputs,
            "fresh": run_fresh(base / "fresh", specs, inputs)}


def test_the_export_has_every_artifact_and_says_what_each_is_built_for(served):
    manifest = served["manifest"]
    assert set(manifest.formats) == {"pt2", "onnx", "openvino", "aoti", *INT8}, (manifest.failed_formats,
                                                                                   manifest.variants)
    built = manifest.formats["aoti"].options["built_for"]
    assert built["isa"] == torch.backends.cpu.get_cpu_capability() and built["torch"] == torch.__version__
    assert built["compiler"] and built["machine"]
    for name in INT8:
        gate = manifest.formats[name].gate
        assert gate is not None
        assert gate.passed and gate.metrics["top1_agreement"] >= 0.5 and "accuracy_drop" in gate.metrics


@pytest.mark.parametrize("name", ["pt2", "onnx", "openvino", "aoti", *INT8, "selected"])
def test_every_artifact_runs_in_a_fresh_process_at_batch_1_and_7(served, name):
    fresh = served["fresh"]
    assert fresh["bad_imports"] == [] and name not in fresh["errors"], fresh["errors"].get(name)
    selected = served["manifest"].selected
    assert selected is not None
    resolved = selected.format if name == "selected" else name
    for x, out in zip(served["inputs"], fresh["results"][name]):
        ref = reference_fp64(served["model"], x)
        if resolved.endswith("int8"):  # lossy (the selection may pick a variant that passed its gate)
            assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.5 and rel_err(out, ref) < 0.2
        else:
            assert rel_err(out, ref) <= 1e-5, (name, x.shape[0])


def test_the_fastest_artifact_that_passed_is_selected_and_loaded_by_default(served):
    manifest = served["manifest"]
    selected = manifest.selected
    table = manifest.bench
    assert selected is not None and table is not None
    passed = {n for n, c in table.checks.items() if c.passed}
    # The pick is for one batch size under one traffic (idle gap or back to back): compare with those timings only
    # (before, the fastest under either traffic was expected: a flaky test where the two orders differ).
    at = [t for t in table.timings if t.batch_size == selected.batch_size and t.traffic == selected.traffic
          and t.artifact in passed]
    fastest = min(at, key=lambda t: t.median_ms)
    picked = next(t for t in at if (t.artifact, t.runtime) == (selected.format, selected.runtime))
    # The fastest, or one its processes' medians cannot tell from it (a tie, decided by the other traffic and said).
    assert picked is fastest or (tied_with(picked, fastest) and "tied with" in selected.why), selected.why
    assert any(t.artifact == "eager" for t in table.timings)  # timed against the unfused model
    assert any(n.kind == SELECTED for n in served["outcome"].notes)
    default = load_fused(served["dir"])
    chosen = load_fused(served["dir"], selected.format)
    assert type(default) is type(chosen)


def test_the_serve_example_loads_every_artifact_with_torch_alone(served):
    """examples/serve.py without fx_lightning: the plain loaders follow the manifest (aoti packages by batch
    size, a variant's format and imports, the selected artifact by default)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_example", Path(__file__).parents[1] / "examples" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    assert served["manifest"].selected is not None
    selected = served["manifest"].selected.format  # may be an int8 variant: it passed its gate
    for name in [None, *served["manifest"].formats]:
        model = serve._load_with_torch(str(served["dir"]), name)
        lossy = (name or selected).endswith("int8")
        for x in served["inputs"]:
            out, ref = model(x), reference_fp64(served["model"], x)
            assert rel_err(out, ref) <= (0.2 if lossy else 1e-5), (name, x.shape[0])


def test_a_corrupted_package_is_refused(served, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(served["dir"], copy)
    with open(copy / "aoti" / "dynamic.pt2", "ab") as fh:
        fh.write(b"x")
    with pytest.raises(ExportError, match="corrupt file"):
        load_fused(copy, "aoti")


@pytest.mark.parametrize("field, value, message", [
    ("isa", "AMX", "built for CPUs with AMX"),
    ("torch", "1.13.0", "built with torch 1.13.0"),
    ("machine", "aarch64", "built for aarch64"),
])
def test_a_package_for_another_machine_is_refused_clearly(served, tmp_path, field, value, message):
    copy = tmp_path / "copy"
    shutil.copytree(served["dir"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["formats"]["aoti"]["built_for"][field] = value
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=f"format 'aoti' cannot run here: {message}.*pt2 runs anywhere"):
        load_fused(copy, "aoti")


@pytest.mark.parametrize("name", ["pt2", "pt2-int8"])
def test_load_fused_compiled_for_a_python_server(served, name):
    model = load_fused(served["dir"], name, compile=True)
    for x in served["inputs"]:  # a second batch size recompiles
        assert rel_err(model(x), reference_fp64(served["model"], x)) <= (0.2 if "int8" in name else 1e-5)


# ----------------------------------------------------------------------------------------- the int8 gate


@pytest.mark.parametrize("margin, gate, key", [
    # Class scores closer than int8's rounding: top-1 flips, so a strict agreement gate refuses int8.
    (1e-3, {"min_top1_agreement": 1.0, "max_accuracy_drop": 0.0}, "min_top1_agreement"),
    # The classes hold, but no int8 model reaches a cosine of exactly 1 with the fp32 scores.
    (1.0, {"min_top1_agreement": 0.0, "max_accuracy_drop": 1.0, "min_cosine": 1.0}, "min_cosine"),
])
def test_int8_that_misses_its_gate_is_not_exported_and_the_fp32_model_is(tmp_path, margin, gate, key):
    model = SmallNet(margin=margin)
    outcome = _export(model, tmp_path / "exp", export={"formats": ["pt2"]},
                      passes={"quantize_int8": {"enabled": True, "max_float_layers": 0, **gate}})
    manifest = read_manifest(outcome.export_dir)
    assert list(manifest.formats) == ["pt2"] and not (outcome.export_dir / "int8").exists()
    missed = {o.entry: o for o in manifest.variants["int8"]}["pt2-int8"]
    assert missed.kept is False and missed.gate is not None, missed
    assert missed.gate.passed is False
    # Read back from the manifest, a failure is its declared kind again.
    assert any(f.kind == GATE_MISSED and f["key"] == f"passes.quantize_int8.{key}"
               for f in missed.gate.failures), missed.gate.failures
    note = next(n for n in outcome.notes if n.kind == VARIANT_MISSED and n["artifact"] == "pt2-int8")
    assert f"passes.quantize_int8.{key}" in note["failures"]  # type: ignore[operator]
    assert not any(n.kind == VARIANT_PASSED for n in outcome.notes)
    x = _data(1)[0][0]
    assert rel_err(load_fused(outcome.export_dir)(x), reference_fp64(model, x)) <= 1e-5


def test_int8_within_its_gate_is_exported(tmp_path):
    outcome = _export(SmallNet(), tmp_path / "exp", export={"formats": ["pt2"]},
                      passes={"quantize_int8": {"enabled": True, "min_top1_agreement": 0.5, "max_accuracy_drop": 0.5}})
    manifest = read_manifest(outcome.export_dir)
    assert "pt2-int8" in manifest.formats
    gate = manifest.formats["pt2-int8"].gate
    assert gate is not None and gate.passed
    note = next(n for n in outcome.notes if n.kind == VARIANT_PASSED and n["artifact"] == "pt2-int8")
    assert note["top1_agreement"] == round(gate.metrics["top1_agreement"], 4)


# ---------------------------------------------------------------------------------------- the selection


def _table(checks: Dict[str, bool], medians: Dict[str, float]) -> BenchTable:
    table = BenchTable(2, "AVX2", "x86_64", torch.__version__)
    table.timings = [Timing(name, 1, ms, ms, 10) for name, ms in medians.items()]
    table.checks = {name: ArtifactCheck(passed=ok) for name, ok in checks.items()}
    return table


def test_selection_picks_the_fastest_artifact_that_passed():
    table = _table({"pt2": True, "onnx": True, "aoti": True}, {"eager": 5.0, "pt2": 4.0, "onnx": 2.5, "aoti": 3.0})
    selected = select_fastest(table, 1)
    assert selected is not None and selected.format == "onnx"


def test_an_artifact_whose_outputs_disagree_is_never_selected():
    table = _table({"pt2": True, "onnx": False, "aoti": True}, {"eager": 0.5, "pt2": 4.0, "onnx": 1.0, "aoti": 3.0})
    selected = select_fastest(table, 1)
    assert selected is not None and selected.format == "aoti"  # neither the failed onnx nor the eager baseline
    assert select_fastest(_table({"pt2": False}, {"pt2": 1.0}), 1) is None


def test_bench_checks_each_artifact_on_the_saved_batch(tmp_path, monkeypatch):
    from fx_lightning.export import FORMATS

    outcome = _export(SmallNet(), tmp_path / "exp", export={"formats": ["graph_module", "pt2"]})
    real = FORMATS["graph_module"].load

    class OffByOne(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) + 1.0

    monkeypatch.setitem(FORMATS, "graph_module", dataclasses.replace(
        FORMATS["graph_module"], load=lambda *a: OffByOne(real(*a))))
    table = bench_export(outcome.export_dir, batch_sizes=[1], rounds=3, warmup=1)
    assert table.checks["graph_module"].passed is False and table.checks["pt2"].passed is True
    selected = select_fastest(table, 1)
    assert selected is not None and selected.format == "pt2"


@pytest.mark.parametrize("compiled, size", [((1, 4), 7), ((4,), 6), ((8,), 3), ((2, 3), 5)])
def test_aoti_packages_run_a_batch_size_they_were_not_built_for_as_pieces(compiled, size):
    """Each fake package accepts only its own batch size; the output (a dict with a batched tensor and a
    scalar) on the whole batch equals the function on the whole batch."""
    from fx_lightning.formats.aoti import AotiModule

    weight = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))

    def model(x: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"logits": x @ weight.T, "temperature": torch.tensor(2.0)}

    def package(n: int):
        def run(x: torch.Tensor) -> Dict[str, torch.Tensor]:
            assert x.shape[0] == n, f"package for batch {n} called with {x.shape[0]}"
            return model(x)
        return run

    aoti = AotiModule({str(n): package(n) for n in compiled})
    x = torch.randn(size, 3)
    with pytest.warns(UserWarning, match=f"no AOTInductor package for batch size {size}"):
        out = aoti(x)
    assert set(out) == {"logits", "temperature"} and out["temperature"].item() == 2.0
    assert out["logits"].shape == (size, 5) and rel_err(out["logits"], model(x)["logits"]) == 0.0


def test_aoti_built_for_batch_1_is_checked_and_selectable_on_batches_of_8(tmp_path):
    """The parity and check batches hold 8 samples; packages built for batch 1 alone still pass the check,
    the int8 package its gate, and the selection can pick either."""
    outcome = _export(SmallNet(), tmp_path / "exp", export={"formats": ["aoti"], "aoti_batch_sizes": [1],
                                                            "select": "fastest", "select_batch_size": 1},
                      passes={"quantize_int8": {"enabled": True, "calibration_batches": 2,
                                                "min_top1_agreement": 0.5, "max_accuracy_drop": 0.5}})
    manifest = read_manifest(outcome.export_dir)
    assert manifest.formats["aoti"].options["packages"] == {"1": "batch_1.pt2"}
    assert manifest.bench is not None
    assert manifest.bench.checks["aoti"].passed, manifest.bench.checks["aoti"]
    assert "aoti-int8" in manifest.formats, manifest.variants
    assert manifest.selected is not None and manifest.selected.format in {"aoti", "aoti-int8"}


def test_each_candidate_is_timed_after_an_idle_gap_and_then_back_to_back(tmp_path, monkeypatch):
    """torch's OpenMP threads spin after a call and slowed ONNX Runtime timed right after by 12%; and a runtime
    whose threads went to sleep pays a wake-up on the next call: every candidate (each artifact with each of its
    format's runtime settings) is called once after the idle gap and once right after, and both traffics are
    recorded."""
    from fx_lightning.export.select import selection, timing

    outcome = _export(SmallNet(), tmp_path / "exp", export={"formats": ["pt2", "onnx"]})
    events = []
    real_perf_counter = timing.time.perf_counter
    monkeypatch.setattr(timing.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: events.append(("clock", None)) or real_perf_counter())
    table = bench_export(outcome.export_dir, batch_sizes=[1, 2], rounds=3, warmup=1)
    starts = [i for i, (kind, _) in enumerate(events) if kind == "clock"][::2]  # start, stop per call
    candidates = 4  # pt2, onnx, onnx with its threads spinning, onnx with ONNX Runtime's own defaults
    assert len(starts) == (1 + 3) * 2 * candidates * 2
    idle, back_to_back = starts[0::2], starts[1::2]
    assert all(events[i - 1] == ("sleep", selection.IDLE_GAP_S) for i in idle) and selection.IDLE_GAP_S >= 0.01
    assert all(events[i - 1] == ("clock", None) for i in back_to_back)  # right after the previous call's stop
    cells = {(t.artifact, t.runtime, t.batch_size, t.traffic) for t in table.timings}
    assert cells == {(a, r, b, t) for a, r in [("pt2", ""), ("onnx", ""), ("onnx", "spinning"), ("onnx", "defaults")]
                     for b in (1, 2)
                     for t in ("idle", "back_to_back")}
    assert all(t.rounds == 3 for t in table.timings)


def test_the_finalists_are_timed_each_in_a_process_of_its_own(tmp_path, monkeypatch):
    """Runtimes in one process steal each other's cores (ONNX Runtime ran 1.4-1.6x slower in the shared bench than
    alone) and a near tie in the shared bench went to the slower artifact: the fastest passing artifacts are timed
    again each in a fresh process, and those timings decide."""
    from fx_lightning.export.select import selection

    outcome = _export(SmallNet(), tmp_path / "exp", export={"formats": ["graph_module", "pt2"]})
    monkeypatch.setattr(selection, "FINALIST_WITHIN", float("inf"))  # both are finalists, whatever their speed
    monkeypatch.setattr(selection, "FINALIST_ROUNDS", 4)
    table = bench_export(outcome.export_dir, batch_sizes=[1, 2], rounds=4, warmup=1, own_process_finalists=2,
                         baselines={"eager": SmallNet().eval()})
    by_cell = {(t.artifact, t.batch_size, t.traffic): t for t in table.timings}
    for artifact in ("graph_module", "pt2"):
        for b in (1, 2):
            for traffic in ("idle", "back_to_back"):
                timing = by_cell[(artifact, b, traffic)]
                assert (timing.process, timing.rounds) == ("own", 4 * selection.FINALIST_PROCESSES)
                assert len(timing.process_medians_ms) == selection.FINALIST_PROCESSES and timing.median_ms > 0
    assert {t.process for t in table.timings if t.artifact == "eager"} == {"shared"}
    assert not table.failures
    pick = select_fastest(table, 1)
    assert pick is not None and "timed in a process of its own" in pick.why
    # Written to and read from the manifest with the rest of the table.
    from fx_lightning.export.manifest import BenchTable as Table
    assert Table.from_dict(table.to_dict()).timings == table.timings


# A timing process that speaks time_in_own_processes' protocol and times nothing. The host it runs on slows down
# steadily: each round anyone runs ticks a clock shared by all of them (a file), and a round's "call" takes
# 1 ms + 0.1 ms per tick before it. Each turn logs the ticks it ran, so a turn that overlapped another's shows.
DRIFTING_WORKER = """
import json, os, sys
request = json.load(open(sys.argv[1]))
clock, log = os.environ["FAKE_CLOCK"], os.environ["FAKE_LOG"]
def say(answer):
    print(json.dumps(answer), flush=True)
print("a library's banner on stdout")
say({"status": "ready"})
kept = {}
for line in sys.stdin:
    command = json.loads(line)
    if request["candidate"][0] == "broken" and kept:
        sys.exit("boom in its second turn")
    if command["finish"]:
        say({"status": "result", "result": [[b, t, ts] for (b, t), ts in kept.items()]})
        break
    ticks = []
    for _ in range(command["rounds"]):
        tick = int(open(clock).read()) + 1
        open(clock, "w").write(str(tick))
        ticks.append(tick)
        for b in request["batch_sizes"]:
            for traffic in ("idle", "back_to_back"):
                kept.setdefault((b, traffic), []).append(0.001 * (1 + 0.1 * tick))
    with open(log, "a") as handle:
        handle.write(json.dumps([request["candidate"][0] + request["candidate"][1], ticks]) + "\\n")
    say({"status": "done"})
"""


def test_the_finalists_processes_take_turns_so_the_hosts_drift_lands_on_all(tmp_path, monkeypatch):
    """The finalists were timed one process after another, and on a shared host a minute's drift decided near
    ties (ONNX Runtime with spinning threads: 4.2 ms interleaved against 4.5-5.2 ms without, yet 7.4 against 6.9 ms
    timed a minute apart). Their processes now take turns, one running at a time: on a host that slows steadily,
    three equally fast candidates come out several times closer than in one turn each (the old way)."""
    from fx_lightning.export.select import timing

    worker = tmp_path / "worker.py"
    worker.write_text(DRIFTING_WORKER)
    monkeypatch.setattr(timing, "WORKER_COMMAND", [sys.executable, str(worker)])
    candidates = {("onnx", ""): [1], ("onnx", "spinning"): [1], ("openvino", ""): [1, 8]}
    spread = {}
    for turns in (1, timing.TURNS):
        clock, log = tmp_path / f"clock{turns}", tmp_path / f"turns{turns}.jsonl"
        clock.write_text("0")
        monkeypatch.setenv("FAKE_CLOCK", str(clock))
        monkeypatch.setenv("FAKE_LOG", str(log))
        timed = timing.time_in_own_processes(tmp_path, {}, candidates, rounds=20, warmup=0, threads=1, turns=turns)
        assert list(timed) == list(candidates) and all(why == "" for _, why in timed.values())
        for candidate, (samples, _) in timed.items():
            assert set(samples) == {(b, t) for b in candidates[candidate] for t in ("idle", "back_to_back")}
            assert all(len(ts) == 20 for ts in samples.values())
        medians = [statistics.median(samples[(1, "idle")]) for samples, _ in timed.values()]
        spread[turns] = max(medians) / min(medians) - 1
        runs = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(runs) == len(candidates) * turns
        ticks = [t for _, ts in runs for t in ts]
        assert ticks == list(range(1, 61)), "a turn ran while another did"  # each turn's ticks in one run
        names = [name for name, _ in runs]
        assert sum(1 for x, y in zip(names, names[1:]) if x != y) >= len(candidates) * turns - turns
    assert spread[1] > 1.0 and spread[timing.TURNS] < spread[1] / 3, spread


def test_a_finalist_process_that_dies_between_turns_says_why_and_the_others_are_timed(tmp_path, monkeypatch):
    from fx_lightning.export.select import timing

    worker = tmp_path / "worker.py"
    worker.write_text(DRIFTING_WORKER)
    (tmp_path / "clock").write_text("0")
    monkeypatch.setattr(timing, "WORKER_COMMAND", [sys.executable, str(worker)])
    monkeypatch.setenv("FAKE_CLOCK", str(tmp_path / "clock"))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "turns.jsonl"))
    candidates = {("onnx", ""): [1], ("broken", ""): [1], ("openvino", ""): [1]}
    timed = timing.time_in_own_processes(tmp_path, {}, candidates, rounds=6, warmup=0, threads=1, turns=3)
    assert timed[("broken", "")] == (None, "exit code 1: boom in its second turn")
    for candidate in (("onnx", ""), ("openvino", "")):
        samples, why = timed[candidate]
        assert why == "" and {k: len(v) for k, v in samples.items()} == {(1, "idle"): 6, (1, "back_to_back"): 6}


def test_a_finalist_that_fails_alone_keeps_its_shared_timing_and_says_why(tmp_path, monkeypatch):
    from fx_lightning.export.select import selection

    outcome = _export(SmallNet(), tmp_path / "exp", export={"formats": ["graph_module", "pt2"]})
    monkeypatch.setattr(selection, "FINALIST_WITHIN", float("inf"))
    monkeypatch.setattr(selection, "time_in_own_processes",
                        lambda root, manifest, candidates, *a, **kw: {c: (None, "exit code 1: boom") for c in candidates})
    table = bench_export(outcome.export_dir, batch_sizes=[1], rounds=2, warmup=0, own_process_finalists=2)
    assert {t.process for t in table.timings} == {"shared"} and {t.rounds for t in table.timings} == {2}
    assert sorted(f.artifact for f in table.failures) == ["graph_module", "pt2"]
    assert all("boom" in f.reason and "shared-process timing stands" in f.reason for f in table.failures)
