"""Lossy variants (int8, bf16) judged on validation data: the accuracy-aware int8 search keeps the layers that
break the gate in float, every variant is gated before it is kept, a variant that misses is never selected, the
variants are made only where the CPU runs them natively and then raced against fp32 (faked CPUs), and the selection is recorded per batch size
and traffic, which ``load_fused`` picks from."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_helpers import randomize_batchnorms, real_cpu_has, reference_fp64, rel_err
from fx_lightning import load_fused
from fx_lightning.config import load_config
from fx_lightning.export import read_manifest
from fx_lightning.export.load.loader import selection_for
from fx_lightning.export.manifest import ArtifactCheck, BenchTable, Manifest, Timing
from fx_lightning.export.select.selection import select_all, select_fastest, tied_with, with_selection
from fx_lightning.common.machine import CPUINFO_ENV, cpu_info
from fx_lightning.parity.gate import GATE_MISSED
from fx_lightning.variants import BF16, INT8
from fx_lightning.variants.int8 import FLOAT_LAYERS
from fx_lightning.pipeline import Batches, fuse_verify_export
from fx_lightning.pipeline.export_step import VARIANT_MISSED, VARIANT_PASSED, VARIANT_SKIPPED

pytest.importorskip("torchao")


class OutlierHeadNet(nn.Module):
    """Two conv-BN-ReLU blocks and a Linear ``head`` whose input has one channel a thousand times larger than
    the others (a feature scaled by a buffer; the head's weight on it is tiny). One int8 scale for the whole
    input (per tensor, as the x86 quantiser sets it) is then too coarse for the 15 channels that decide the
    class: the all-int8 model misses its gate, and the head in float passes it."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)
        scale = torch.ones(16)
        scale[0] = 1000.0
        self.register_buffer("scale", scale)
        with torch.no_grad():
            self.head.weight.mul_(20.0)  # well separated classes: int8's rounding elsewhere keeps the top class
            self.head.weight[:, 0] = 1e-4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1) * self.scale)


def _data(n: int = 4, batch: int = 16, seed: int = 0) -> List[Any]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


def _export(model: nn.Module, directory: Path, **config: Any) -> Any:
    return fuse_verify_export(randomize_batchnorms(model).eval(), load_config(config), Batches(_data(), "val"),
                              export_dir=directory)


GATE = {"min_top1_agreement": 0.95, "max_accuracy_drop": 0.05, "min_cosine": 0.9}


def test_accuracy_aware_int8_keeps_the_layer_that_breaks_the_gate_in_float(tmp_path):
    torch.manual_seed(0)
    strict = _export(OutlierHeadNet(), tmp_path / "strict", export={"formats": ["pt2"]},
                     passes={"quantize_int8": {"enabled": True, "max_float_layers": 0, **GATE}})
    missed = read_manifest(strict.export_dir).variants["int8"]
    assert [o.entry for o in missed] == ["pt2-int8"] and not missed[0].kept and missed[0].gate is not None
    assert any(f.kind == GATE_MISSED for f in missed[0].gate.failures)  # all-or-nothing: int8 is left out

    torch.manual_seed(0)
    model = OutlierHeadNet()
    outcome = _export(model, tmp_path / "aware", export={"formats": ["pt2"]},
                      passes={"quantize_int8": {"enabled": True, **GATE}})
    manifest = read_manifest(outcome.export_dir)
    kept = manifest.formats["pt2-int8"]
    assert kept.gate is not None and kept.gate.passed
    made_with = manifest.variants["int8"][0].notes  # read back from the manifest
    assert [n.kind for n in made_with] == [FLOAT_LAYERS] and made_with[0]["float_layers"] == ("head",)
    assert made_with[0]["kept"] == 1 and made_with[0]["layers"] == 3
    assert any(n.kind == FLOAT_LAYERS for n in outcome.notes)
    assert any(n.kind == VARIANT_PASSED and n["artifact"] == "pt2-int8" for n in outcome.notes)
    # The artifact really runs the head in float (its weight is not dequantised) and the convs in int8.
    program = torch.export.load(str(outcome.export_dir / kept.path)).module()
    linears = [n for n in program.graph.nodes if n.target == torch.ops.aten.linear.default]
    convs = [n for n in program.graph.nodes if n.target == torch.ops.aten.conv2d.default]
    assert len(linears) == 1 and linears[0].args[1].op == "get_attr"
    assert convs and all("dequantize" in str(c.args[1].target) for c in convs)
    x = _data(1, seed=5)[0][0]
    out, ref = load_fused(outcome.export_dir, "pt2-int8")(x), reference_fp64(model, x)
    assert (out.argmax(1) == ref.argmax(1)).float().mean() >= 0.9 and rel_err(out, ref) < 0.1


def test_a_variant_that_misses_its_gate_is_never_kept_nor_selected(tmp_path):
    torch.manual_seed(0)
    model = OutlierHeadNet()
    outcome = _export(model, tmp_path / "e", export={"formats": ["pt2", "onnx"], "select": "fastest"},
                      passes={"quantize_int8": {"enabled": True, "max_float_layers": 0, **GATE}})
    manifest = read_manifest(outcome.export_dir)
    assert set(manifest.formats) == {"pt2", "onnx"}
    assert {o.entry for o in manifest.variants["int8"]} >= {"pt2-int8", "onnx-int8"}
    assert all(not o.kept for o in manifest.variants["int8"])
    assert any(n.kind == VARIANT_MISSED for n in outcome.notes)
    assert manifest.selected is not None and manifest.selected.format in {"pt2", "onnx"}
    assert all(s.format in {"pt2", "onnx"} for s in manifest.selections)
    x = _data(1, seed=5)[0][0]
    assert rel_err(load_fused(outcome.export_dir)(x), reference_fp64(model, x)) <= 1e-5


def _table(rows: List[tuple], checks: dict) -> BenchTable:
    table = BenchTable(2, "AVX512", "x86_64", torch.__version__)
    table.timings = [Timing(a, b, ms, ms, 5, traffic, runtime) for a, b, traffic, runtime, ms in rows]
    table.checks = {k: ArtifactCheck(v) for k, v in checks.items()}
    return table


def test_a_variant_whose_check_failed_is_not_selected_even_when_fastest():
    table = _table([("aoti-int8", 1, "idle", "", 1.0), ("onnx", 1, "idle", "", 3.0), ("eager", 1, "idle", "", 9.0)],
                   {"aoti-int8": False, "onnx": True})
    picked = select_fastest(table, 1)
    assert picked is not None and picked.format == "onnx"
    assert select_fastest(_table([("aoti-int8", 1, "idle", "", 1.0)], {"aoti-int8": False}), 1) is None


def test_the_selection_is_recorded_per_batch_size_and_traffic_and_load_fused_picks_from_it():
    rows = [
        ("openvino-int8", 1, "idle", "", 2.0), ("openvino-int8", 1, "back_to_back", "", 1.9),
        ("onnx", 1, "idle", "", 5.0), ("onnx", 1, "idle", "spinning", 2.5), ("onnx", 1, "back_to_back", "", 1.5),
        ("onnx", 1, "back_to_back", "spinning", 1.6),
        ("aoti", 8, "idle", "", 10.0), ("aoti", 8, "back_to_back", "", 9.0),
        ("openvino-int8", 8, "idle", "", 11.0), ("openvino-int8", 8, "back_to_back", "", 8.5),
        ("eager", 1, "idle", "", 0.1), ("eager", 8, "back_to_back", "", 0.1),  # a baseline is never picked
    ]
    table = _table(rows, {"openvino-int8": True, "onnx": True, "aoti": True})
    picks = {(s.batch_size, s.traffic): (s.format, s.runtime) for s in select_all(table)}
    assert picks == {(1, "idle"): ("openvino-int8", ""), (1, "back_to_back"): ("onnx", ""),
                     (8, "idle"): ("aoti", ""), (8, "back_to_back"): ("openvino-int8", "")}
    from fx_lightning.formats.base import FormatEntry

    manifest = Manifest({name: FormatEntry(name, format=name.split("-")[0]) for name in ("openvino-int8", "onnx", "aoti")})
    manifest = with_selection(manifest, table, select_fastest(table, 1, "idle"))
    assert selection_for(manifest).format == "openvino-int8"  # the default: batch 1, idle
    assert (selection_for(manifest, 8, "back_to_back").format, selection_for(manifest, 8).traffic) == \
        ("openvino-int8", "idle")
    assert selection_for(manifest, 6).format == "aoti"  # the nearest batch size timed, the default traffic
    assert selection_for(manifest, traffic="back_to_back").format == "onnx"
    # A runtime setting that wins is recorded with what it sets, for loaders without fx-lightning.
    spin = _table([("onnx", 1, "idle", "spinning", 1.0), ("onnx", 1, "idle", "", 2.0)], {"onnx": True})
    picked = with_selection(manifest, spin, select_fastest(spin, 1)).selected
    assert picked is not None and picked.runtime == "spinning"
    assert picked.runtime_options["session_options"]["config_entries"]["session.intra_op.allow_spinning"] == "1"
    # Written and read back.
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))).selections == manifest.selections


ZEN1 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\n"
        "model name\t: AMD EPYC 7571\nflags\t\t: fpu sse2 avx avx2 fma\n")
NO_AVX2 = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 45\n"
           "model name\t: Intel Xeon E5-2670\nflags\t\t: fpu sse2 sse4_2 avx\n")


def _fake_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    monkeypatch.setenv(CPUINFO_ENV, str(path))


def test_on_an_avx2_only_cpu_int8_is_made_gated_and_timed_against_fp32(tmp_path, monkeypatch):
    """AVX2 has SIMD integer dot products: int8 is made, gated and timed beside fp32, and the selection (which
    takes the fastest artifact that passed) decides; bf16 would run emulated and is skipped, saying why."""
    _fake_cpu(tmp_path, monkeypatch, ZEN1)
    assert INT8.lacks(cpu_info()) is None and BF16.lacks(cpu_info())
    torch.manual_seed(0)
    outcome = _export(OutlierHeadNet(), tmp_path / "e", export={"formats": ["pt2", "onnx"], "select": "fastest"},
                      passes={"quantize_int8": {"enabled": True, **GATE}, "cast_bf16": {"enabled": True}})
    manifest = read_manifest(outcome.export_dir)
    made = {o.entry: o for o in manifest.variants["int8"]}
    assert set(made) == {"pt2-int8", "onnx-int8"} and all(o.gate is not None for o in made.values())
    kept = [name for name, o in made.items() if o.kept]
    assert kept and set(kept) <= set(manifest.formats)  # the accuracy-aware torchao int8 passes this gate
    assert manifest.bench is not None and manifest.selected is not None
    timed = {t.artifact for t in manifest.bench.timings}
    assert set(kept) <= timed and {"pt2", "onnx"} <= timed  # each kept int8 raced the fp32 artifacts
    assert manifest.selected.format in manifest.formats and manifest.bench.checks[manifest.selected.format].passed
    # Selected only when faster and passing: the pick is the fastest passing row or one whose processes' medians
    # overlap it (a tie, said in the why), and an int8 that missed its gate is timed but never picked.
    pick = manifest.selected
    rows = [t for t in manifest.bench.timings if (t.batch_size, t.traffic) == (pick.batch_size, pick.traffic)
            and t.artifact != "eager"]
    passing = [t for t in rows if manifest.bench.checks[t.artifact].passed]
    fastest = min(passing, key=lambda t: t.median_ms)
    picked = next(t for t in passing if (t.artifact, t.runtime) == (pick.format, pick.runtime))
    assert picked is fastest or (tied_with(picked, fastest) and "tied with" in pick.why), pick.why
    assert manifest.bench.checks[pick.format].passed
    missed = [name for name, o in made.items() if not o.kept]
    assert not set(missed) & {s.format for s in manifest.selections}
    skipped = {n["variant"]: str(n) for n in outcome.notes if n.kind == VARIANT_SKIPPED}
    assert set(skipped) == {"bf16"} and "AVX512-BF16" in skipped["bf16"] and "AMD EPYC 7571" in skipped["bf16"]
    # The skip says what was measured here, not only which flag is missing.
    assert re.search(r"measured here .*bf16 [0-9.]+ ms against fp32 [0-9.]+ ms \([0-9.]+x\)", skipped["bf16"])


def test_on_a_cpu_without_avx2_the_variants_are_skipped_and_the_report_says_why(tmp_path, monkeypatch):
    _fake_cpu(tmp_path, monkeypatch, NO_AVX2)
    assert INT8.lacks(cpu_info()) and BF16.lacks(cpu_info())
    model = OutlierHeadNet()
    outcome = _export(model, tmp_path / "e", export={"formats": ["pt2", "onnx"], "select": "fastest"},
                      passes={"quantize_int8": {"enabled": True}, "cast_bf16": {"enabled": True}})
    manifest = read_manifest(outcome.export_dir)
    assert set(manifest.formats) == {"pt2", "onnx"}  # fp32 only: nothing faster could pass here
    skipped = {n["variant"]: str(n) for n in outcome.notes if n.kind == VARIANT_SKIPPED}
    assert set(skipped) == {"int8", "bf16"}
    assert "no AVX2" in skipped["int8"] and "Intel Xeon E5-2670" in skipped["int8"]
    assert "require_cpu_features" in skipped["int8"] and "AVX512-BF16" in skipped["bf16"]
    assert manifest.variants["int8"][0].skipped and manifest.selected is not None
    assert manifest.selected.format in {"pt2", "onnx"}
    # Asked for anyway (a model trained here for another CPU): made and judged.
    forced = _export(OutlierHeadNet(), tmp_path / "forced", export={"formats": ["pt2"]},
                     passes={"cast_bf16": {"enabled": True, "require_cpu_features": False}})
    assert "pt2-bf16" in read_manifest(forced.export_dir).formats


def test_bf16_variants_are_gated_and_keep_the_fp32_interface(tmp_path):
    pytest.importorskip("openvino")
    torch.manual_seed(0)
    model = OutlierHeadNet()
    outcome = _export(model, tmp_path / "e", export={"formats": ["pt2", "openvino"]},
                      passes={"cast_bf16": {"enabled": True, **GATE}})
    manifest = read_manifest(outcome.export_dir)
    assert {"pt2-bf16", "openvino-bf16"} <= set(manifest.formats), manifest.variants
    ov = manifest.formats["openvino-bf16"]
    assert ov.options["compile_config"]["INFERENCE_PRECISION_HINT"] == "bf16"
    assert ov.files == manifest.formats["openvino"].files  # the fp32 IR, run at bf16
    x = _data(1, seed=5)[0][0]
    ref = reference_fp64(model, x)
    for name in ("pt2-bf16", "openvino-bf16"):
        out = load_fused(outcome.export_dir, name)(x)
        assert out.dtype == torch.float32 and out.shape == ref.shape, name
        assert (out.argmax(1) == ref.argmax(1)).float().mean() >= 0.9 and rel_err(out, ref) < 0.05, name
        # bf16 arithmetic shows in the numbers where it really runs: torch emulates it anywhere; OpenVINO runs
        # its bf16 hint only on a CPU with bf16 instructions (elsewhere in f32).
        if name == "pt2-bf16" or real_cpu_has("avx512_bf16") or real_cpu_has("amx_bf16"):
            assert rel_err(out, ref) > 1e-6, name


def test_nncf_and_onnx_runtime_int8_are_gated_like_torchao_int8(tmp_path):
    pytest.importorskip("nncf")
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = OutlierHeadNet()
    with torch.no_grad():
        model.scale.fill_(1.0)  # no outlier: every int8 passes
    outcome = _export(model, tmp_path / "e", export={"formats": ["onnx", "openvino"]},
                      passes={"quantize_int8": {"enabled": True, **GATE}})
    manifest = read_manifest(outcome.export_dir)
    assert {"onnx-int8", "openvino-int8"} <= set(manifest.formats), manifest.variants
    assert "pt2-int8" not in manifest.formats  # no torch format configured: torchao's int8 is not written
    x = _data(1, seed=5)[0][0]
    ref = reference_fp64(model, x)
    for name in ("onnx-int8", "openvino-int8"):
        entry = manifest.formats[name]
        assert entry.gate is not None and entry.gate.passed and entry.variant == "int8"
        assert entry.options["quantized_with"]["calibration_batches"] == 4
        out = load_fused(outcome.export_dir, name)(x)
        assert out.shape == ref.shape and (out.argmax(1) == ref.argmax(1)).float().mean() >= 0.9, name
        assert 1e-6 < rel_err(out, ref) < 0.1, name  # int8 really ran


def test_the_callback_calibrates_on_training_data_and_judges_on_validation_data(tmp_path, monkeypatch):
    """int8 calibrated on the very images its gate reads would be judged on data it was fitted to: the callback
    takes the calibration batches from the training loader, and the report says so."""
    import lightning_helpers as H
    from fx_lightning import FXFuseCallback
    from fx_lightning.callback.trainer_data import CALIBRATION_READ
    from fx_lightning.variants import int8 as quantize

    seen: List[torch.Tensor] = []
    real_convert = quantize.calibrate_int8

    def spying_convert(program, batches, float_nodes, **kwargs):
        seen.extend(b[0] for b in batches)
        return real_convert(program, batches, float_nodes, **kwargs)

    monkeypatch.setattr(quantize, "calibrate_int8", spying_convert)
    train, val = H.loaders()
    callback = FXFuseCallback(export={"formats": ["pt2"]}, preflight="off",
                              passes={"quantize_int8": {"enabled": True, "calibration_batches": 2,
                                                        "min_top1_agreement": 0.0, "max_accuracy_drop": 1.0,
                                                        "min_cosine": -1.0}})
    H.make_trainer(tmp_path, [callback], max_epochs=1).fit(H.FlatLit(), train, val)
    assert callback.outcome is not None
    notes = [n for n in callback.outcome.notes if n.kind == CALIBRATION_READ]
    assert len(notes) == 1 and notes[0]["count"] == 2
    train_rows = {tuple(r.flatten().tolist()) for r in train.dataset.tensors[0]}
    val_rows = {tuple(r.flatten().tolist()) for r in val.dataset.tensors[0]}
    calibrated = [tuple(r.flatten().tolist()) for b in seen for r in b]
    assert len(calibrated) == 2 * train.batch_size
    assert all(r in train_rows and r not in val_rows for r in calibrated)
    assert "pt2-int8" in read_manifest(callback.export_dir).formats
