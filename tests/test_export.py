"""Export: every format loads in a fresh process without the training code and matches the original model;
faults leave no partial directory and never touch an existing export; load_fused verifies what it loads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from torch import nn

import fx_lightning
import dataclasses

from fx_lightning.export import FORMATS
from fx_lightning.config import load_config, to_container
from fx_lightning.errors import ExportError
from fx_lightning.export import FORMAT_VERSION, export_fused, load_fused, read_manifest, sha256_file

from export_helpers import (
    REPO,
    leftovers,
    randomize_batchnorms,
    reference_fp64,
    rel_err,
    run_fresh,
    run_script,
    snapshot,
)

ALL_FORMATS = ["graph_module", "code", "pt2", "onnx", "openvino"]
MODES = ["fx", "export"]
TOL = 1e-5


# The model lives only here: a loader that needed the training code could not find it in the fresh process.
class ExportNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.BatchNorm2d(8), nn.Dropout(0.3))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 12)
        self.bn = nn.BatchNorm1d(12)
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = torch.relu(self.block(y) + y)
        y = self.pool(y).flatten(1)
        return self.head(torch.relu(self.bn(self.fc(y))))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return randomize_batchnorms(ExportNet(), seed).eval()


def example(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def cfg(**export: Any):
    return load_config({"export": {"formats": ["graph_module", "pt2"], **export}})


def fused(model: nn.Module, mode: str = "fx", x: torch.Tensor | None = None):
    x = example() if x is None else x
    return fx_lightning.fuse(model, {"trace": {"mode": mode}}, example_inputs=x)


def quick_export(directory: Path, seed: int = 0, **export: Any) -> Path:
    model = make_model(seed)
    result = fused(model)
    return export_fused(result.graph_module, directory, example_inputs=(example(),), config=cfg(**export),
                        report=result.report, parity={"passed": True, "metrics": {"rel_err": 1e-7}})


# ------------------------------------------------------------------------ round trip, fresh process


@pytest.fixture(scope="module")
def fresh_run(tmp_path_factory) -> Dict[str, Any]:
    """Export ExportNet in every format from both capture modes, then load all of them in one fresh process."""
    base = tmp_path_factory.mktemp("exports")
    model = make_model()
    x = example()
    specs: Dict[str, Dict[str, Any]] = {}
    folded = {}
    for mode in MODES:
        result = fused(model, mode, x)
        folded[mode] = result.report.batchnorms_folded
        out = export_fused(result.graph_module, base / mode, example_inputs=(x,),
                           config=load_config({"export": {"formats": ALL_FORMATS}}), report=result.report,
                           parity={"passed": True, "metrics": {}})
        for fmt in ALL_FORMATS:
            specs[f"{mode}/{fmt}/load_fused"] = {"dir": str(out), "format": fmt, "loader": "load_fused"}
        # Plain torch / onnxruntime / openvino, without fx_lightning's loader.
        for fmt, loader in (("pt2", "torch.export"), ("graph_module", "torch.load"), ("code", "code"),
                            ("onnx", "onnxruntime"), ("openvino", "openvino")):
            specs[f"{mode}/{fmt}/{loader}"] = {"dir": str(out), "format": fmt, "loader": loader}
    inputs = [torch.randn(b, 3, 8, 8, generator=torch.Generator().manual_seed(b)) for b in (1, 7)]
    run = run_fresh(base / "fresh", specs, inputs)
    run.update(model=model, inputs=inputs, folded=folded, base=base)
    return run


@pytest.mark.parametrize("loader", ["load_fused", "plain"])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("mode", MODES)
def test_format_matches_original_in_fresh_process(fresh_run, mode, fmt, loader):
    plain = {"pt2": "torch.export", "graph_module": "torch.load", "code": "code", "onnx": "onnxruntime",
             "openvino": "openvino"}[fmt]
    key = f"{mode}/{fmt}/{'load_fused' if loader == 'load_fused' else plain}"
    assert fresh_run["bad_imports"] == [], f"the fresh process imported training code: {fresh_run['bad_imports']}"
    assert key not in fresh_run["errors"], fresh_run["errors"].get(key)
    assert fresh_run["folded"][mode] >= 3, "the model should have had its BatchNorms folded"
    outs = fresh_run["results"][key]
    for x, out in zip(fresh_run["inputs"], outs):
        ref = reference_fp64(fresh_run["model"], x)
        err = rel_err(out, ref)
        assert err <= TOL, f"{key} batch {x.shape[0]}: relative error {err:.3e}"


def test_serve_example_runs_without_training_code(fresh_run, tmp_path):
    directory = fresh_run["base"] / "fx"
    x = torch.randn(7, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    torch.save(x, tmp_path / "batch.pt")
    proc = run_script([str(REPO / "examples" / "serve.py"), str(directory), "--input", str(tmp_path / "batch.pt"),
                       "--save", str(tmp_path / "out.pt")], tmp_path)
    assert "output (7, 5)" in proc.stdout
    saved = torch.load(tmp_path / "out.pt", weights_only=True)
    assert rel_err(saved["output"], reference_fp64(fresh_run["model"], x)) <= TOL



def test_serve_example_random_inputs_from_manifest(fresh_run, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_example", REPO / "examples" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    for fmt in ("onnx", "code"):
        assert serve.main([str(fresh_run["base"] / "export"), "--batch-size", "3", "--format", fmt]) == 0
        assert "inputs [(3, 3, 8, 8)] -> output (3, 5)" in capsys.readouterr().out
    # Without fx_lightning: the plain torch loaders give the same answers.
    x = torch.randn(3, 3, 8, 8)
    for fmt in ("pt2", "graph_module", "code", "onnx", "openvino"):
        model = serve._load_with_torch(str(fresh_run["base"] / "export"), fmt)
        assert rel_err(model(x), reference_fp64(fresh_run["model"], x)) <= TOL, fmt


def test_load_fused_in_process_every_format_is_eval_and_dynamic(fresh_run):
    for mode in MODES:
        directory = fresh_run["base"] / mode
        for fmt in ALL_FORMATS:
            model = load_fused(directory, fmt)
            assert isinstance(model, nn.Module)
            assert model.eval() is not None  # pt2 modules refuse eval() in plain torch; ours allow it
            assert not any(m.training for m in model.modules()), fmt
            x = torch.randn(5, 3, 8, 8)
            assert rel_err(model(x), reference_fp64(fresh_run["model"], x)) <= TOL, (mode, fmt)
        assert type(load_fused(directory)).__name__ != "OnnxRuntimeModule"


def test_default_format_is_pt2_then_the_next_available(tmp_path, monkeypatch):
    out = quick_export(tmp_path / "exp", formats=["code", "graph_module", "pt2"])
    manifest = read_manifest(out)
    assert list(manifest.formats) == ["code", "graph_module", "pt2"]  # config order
    used = []
    for fmt, record in list(FORMATS.items()):
        counting = lambda *a, f=fmt, real=record.load: used.append(f) or real(*a)  # noqa: E731
        monkeypatch.setitem(FORMATS, fmt, dataclasses.replace(record, load=counting))
    load_fused(out)
    (out / "model.pt2").unlink()
    manifest.formats.pop("pt2")
    (out / "manifest.json").write_text(json.dumps(manifest.to_dict()))
    load_fused(out)
    assert used == ["pt2", "graph_module"]


# ------------------------------------------------------------------------------------------ manifest


def test_manifest_content(tmp_path):
    model = make_model()
    result = fused(model)
    config = load_config({"export": {"formats": ["pt2", "code"]}, "parity": {"rtol": 1e-3}})
    parity = {"passed": True, "metrics": {"rel_err": 2.5e-7, "cosine": 1.0, "inf": float("inf")}}
    out = export_fused(result.graph_module, tmp_path / "exp", example_inputs=(example(),), config=config,
                       report=result.report, parity=parity, extra={"epoch": 3})
    manifest = json.loads((out / "manifest.json").read_text())  # strict JSON: no NaN/Infinity tokens
    json.dumps(manifest, allow_nan=False)
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["versions"]["torch"] == torch.__version__
    assert manifest["versions"]["fx_lightning"] == fx_lightning.__version__
    assert manifest["versions"]["lightning"]
    assert manifest["config"] == json.loads(json.dumps(to_container(config)))
    assert manifest["report"] == json.loads(json.dumps(result.report.to_dict()))
    assert manifest["parity"]["passed"] is True and manifest["parity"]["metrics"]["rel_err"] == 2.5e-7
    assert manifest["parity"]["metrics"]["inf"] == "inf"
    assert manifest["extra"] == {"epoch": 3}
    assert manifest["inputs"] == [{"name": "x", "kind": "tensor", "shape": ["batch", 3, 8, 8], "dtype": "float32",
                                   "example_shape": [4, 3, 8, 8], "device": "cpu"}]
    assert manifest["outputs"] == [{"name": "output_0", "shape": ["batch", 5], "dtype": "float32"}]
    assert manifest["formats"]["pt2"]["pickled_code"] is False
    assert manifest["formats"]["code"]["pickled_modules"] == []
    for fmt in ("pt2", "code"):
        check = manifest["formats"][fmt]["check"]
        assert check["passed"] and check["batch_sizes"] == [4, 1] and check["relative_error"] <= 1e-5
    # Every file on disk (but the manifest) is listed with its true size and sha256, and nothing else is.
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    for name, info in manifest["files"].items():
        assert info == {"size": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
    assert {"model.pt2", "fused_module/module.py", "fused_module/weights.pt", "README.md"} <= on_disk


def test_graph_module_says_weights_only_false(tmp_path):
    out = quick_export(tmp_path / "exp")
    entry = read_manifest(out).formats["graph_module"]
    assert entry.weights_only is False and entry.pickled_code is True
    assert "weights_only=False" in entry.loader
    assert "weights_only=False" in (out / "README.md").read_text()
    with pytest.raises(Exception):  # the safe default refuses it: it is code, not just weights
        torch.load(out / "model.pt")


def test_code_format_is_readable_python(tmp_path):
    out = quick_export(tmp_path / "exp", formats=["code"])
    source = (out / "fused_module" / "module.py").read_text()
    assert "class FusedModule(torch.nn.Module)" in source and "def forward(self, x" in source
    assert str(tmp_path) not in source  # relative paths: the directory can be moved
    assert "BatchNorm" not in source  # folded away
    assert not (out / "fused_module" / "modules").exists()  # every module rebuilt from its constructor
    moved = tmp_path / "elsewhere"
    shutil.move(str(out), moved)
    x = example(3)
    assert rel_err(load_fused(moved, "code")(x), reference_fp64(make_model(), x)) <= TOL


def test_static_batch_when_dynamic_batch_off(tmp_path):
    out = quick_export(tmp_path / "exp", formats=["pt2"], dynamic_batch=False)
    manifest = read_manifest(out)
    assert manifest.dynamic_batch is False and manifest.formats["pt2"].batch_sizes == [4]
    assert manifest.inputs[0]["shape"] == [4, 3, 8, 8]
    with pytest.raises(Exception):  # the artifact itself takes its one batch size
        torch.export.load(str(out / "model.pt2")).module()(example(7))
    model = load_fused(out)
    model(example(4))
    with pytest.warns(UserWarning, match="running it as pieces"):  # load_fused runs others as pieces of 4
        assert model(example(7)).shape[0] == 7


def test_example_batch_of_one_still_exports_dynamic(tmp_path):
    model = make_model()
    x1 = example(1)
    result = fused(model, "fx", x1)
    out = export_fused(result.graph_module, tmp_path / "exp", example_inputs=(x1,), config=cfg(formats=["pt2"]))
    loaded = load_fused(out)
    for b in (1, 2, 7):
        x = example(b)
        assert rel_err(loaded(x), reference_fp64(model, x)) <= TOL


# --------------------------------------------------------------------------------------------- faults


def test_overwrite_false_refuses_and_keeps_existing(tmp_path):
    out = quick_export(tmp_path / "exp")
    before = snapshot(out)
    with pytest.raises(ExportError, match="already exists and export.overwrite is false"):
        quick_export(tmp_path / "exp", seed=1, overwrite=False)
    assert snapshot(out) == before
    assert leftovers(tmp_path, "exp") == []


def test_overwrite_replaces_whole_export(tmp_path):
    out = quick_export(tmp_path / "exp", formats=["graph_module", "code"])
    out = quick_export(tmp_path / "exp", seed=1, formats=["pt2"])
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "check.pt", "manifest.json", "model.pt2", "report.html"]
    x = example(2)
    assert rel_err(load_fused(out)(x), reference_fp64(make_model(1), x)) <= TOL
    assert leftovers(tmp_path, "exp") == []


def test_refuses_to_replace_a_directory_that_is_not_an_export(tmp_path):
    target = tmp_path / "data"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not an fx-lightning export"):
        quick_export(target)
    assert (target / "precious.txt").read_text() == "keep me"
    assert leftovers(tmp_path, "data") == []


def test_parent_is_a_file(tmp_path):
    (tmp_path / "blocker").write_text("")
    with pytest.raises(ExportError, match="is a file, not a directory"):
        quick_export(tmp_path / "blocker" / "sub" / "exp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    os.chmod(parent, 0o555)
    try:
        with pytest.raises(ExportError, match="Permission denied"):
            quick_export(parent / "exp")
        assert list(parent.iterdir()) == []
    finally:
        os.chmod(parent, 0o755)


def test_unwritable_directory_simulated(tmp_path, monkeypatch):
    """Same as above where the tests run as root: the staging mkdir fails with EACCES."""
    out = quick_export(tmp_path / "exp")
    before = snapshot(out)
    real_mkdir = os.mkdir

    def deny(path, *args, **kwargs):
        if ".exp.tmp-" in os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", deny)
    with pytest.raises(ExportError, match=r"cannot write the export there: Permission denied"):
        quick_export(tmp_path / "exp", seed=1)
    assert snapshot(out) == before
    assert leftovers(tmp_path, "exp") == []


def test_writer_failing_halfway_leaves_nothing(tmp_path, monkeypatch):
    out = quick_export(tmp_path / "exp")
    before = snapshot(out)

    def half_save(program, path, *args, **kwargs):
        with open(path, "wb") as fh:  # a partial file, as a full disk would leave it
            fh.write(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.export, "save", half_save)
    with pytest.raises(ExportError, match=r"format 'pt2'.*No space left on device"):
        quick_export(tmp_path / "exp", seed=1, on_format_failure="raise")
    assert snapshot(out) == before
    assert leftovers(tmp_path, "exp") == []
    with pytest.raises(ExportError):
        quick_export(tmp_path / "new", seed=1, on_format_failure="raise")
    assert not (tmp_path / "new").exists() and leftovers(tmp_path, "new") == []


def _write_graph_module_with_wrong_weights(monkeypatch) -> None:
    """The graph_module writer saves weights 1% off: the round-trip check must catch it."""
    real = FORMATS["graph_module"].write

    def wrong_weights(root, ctx):
        entry = real(root, ctx)
        bad = torch.load(root / "model.pt", weights_only=False)
        with torch.no_grad():
            next(bad.parameters()).mul_(1.01)
        torch.save(bad, root / "model.pt")
        return entry

    monkeypatch.setitem(FORMATS, "graph_module", dataclasses.replace(FORMATS["graph_module"], write=wrong_weights))


def test_wrong_artifact_is_caught_before_rename(tmp_path, monkeypatch):
    """The writer's output is loaded back and compared: a graph_module holding other weights fails."""
    _write_graph_module_with_wrong_weights(monkeypatch)
    with pytest.raises(ExportError, match=r"format 'graph_module': the loaded model disagrees.*\(relative; allowed"):
        quick_export(tmp_path / "exp", on_format_failure="raise")
    assert not (tmp_path / "exp").exists() and leftovers(tmp_path, "exp") == []


def test_onnx_requested_but_not_installed(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else real(name, *a))
    with pytest.raises(ExportError, match=r"'onnx' but onnx is not installed.*fx-lightning\[onnx\]"):
        quick_export(tmp_path / "exp", formats=["pt2", "onnx"])
    assert list(tmp_path.iterdir()) == []


def test_corrupted_file_is_refused(tmp_path):
    out = quick_export(tmp_path / "exp")
    data = bytearray((out / "model.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "model.pt2").write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"model.pt2: corrupt file: sha256"):
        load_fused(out)
    load_fused(out, "graph_module")  # the other format is intact and still loads


def test_truncated_and_missing_files_are_refused(tmp_path):
    out = quick_export(tmp_path / "exp")
    with open(out / "model.pt", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(ExportError, match=r"model.pt: corrupt file: size 100 bytes"):
        load_fused(out, "graph_module")
    (out / "model.pt2").unlink()
    with pytest.raises(ExportError, match=r"model.pt2: missing file"):
        load_fused(out)


def test_unverified_corrupt_file_still_gives_export_error(tmp_path):
    out = quick_export(tmp_path / "exp")
    (out / "model.pt2").write_bytes(b"not a zip file")
    with pytest.raises(ExportError, match=r"could not load format 'pt2'"):
        load_fused(out, verify=False)


def test_unknown_manifest_version(tmp_path):
    out = quick_export(tmp_path / "exp")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=rf"manifest format_version {FORMAT_VERSION + 1} is newer.*upgrade fx-lightning"):
        load_fused(out)


def test_missing_or_broken_manifest_and_unknown_format(tmp_path):
    with pytest.raises(ExportError, match="no such export directory"):
        load_fused(tmp_path / "nothing")
    out = quick_export(tmp_path / "exp")
    with pytest.raises(ExportError, match=r"format 'onnx' was not exported; available: pt2, graph_module"):
        load_fused(out, "onnx")
    with pytest.raises(ExportError, match=r"unknown format 'tflite'"):
        load_fused(out, "tflite")
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(ExportError, match="corrupt manifest"):
        load_fused(out)
    (out / "manifest.json").unlink()
    with pytest.raises(ExportError, match="manifest.json: missing"):
        load_fused(out)


def test_export_does_not_change_the_fused_model(tmp_path):
    result = fused(make_model(), "export")
    gm = result.graph_module
    code_before = gm.code
    state_before = {k: v.clone() for k, v in gm.state_dict().items()}
    export_fused(gm, tmp_path / "exp", example_inputs=(example(),), config=cfg())
    assert gm.code == code_before
    assert all(torch.equal(state_before[k], v) for k, v in gm.state_dict().items())


def test_onnx_falls_back_to_torchscript_exporter(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("dynamo exporter cannot handle this graph")

    import fx_lightning.formats.onnx as onnx_format

    monkeypatch.setattr(onnx_format, "onnx_dynamo", broken)
    model = make_model()
    result = fused(model)
    out = export_fused(result.graph_module, tmp_path / "exp", example_inputs=(example(),),
                       config=cfg(formats=["onnx"]))
    entry = read_manifest(out).formats["onnx"]
    assert entry.options["exporter"] == "torchscript" and "cannot handle this graph" in entry.options["dynamo_failure"]
    loaded = load_fused(out, "onnx")
    for b in (1, 7):
        x = example(b)
        assert rel_err(loaded(x), reference_fp64(model, x)) <= TOL


def test_openvino_falls_back_to_torchscript_route_and_keeps_fp32(tmp_path, monkeypatch):
    import fx_lightning.formats.pt2 as pt2_format

    def broken(ctx):
        raise RuntimeError("torch.export cannot handle this graph")

    monkeypatch.setattr(pt2_format, "export_program", broken)
    model = make_model()
    out = export_fused(fused(model).graph_module, tmp_path / "exp", example_inputs=(example(),),
                       config=cfg(formats=["openvino"]))
    entry = read_manifest(out).formats["openvino"]
    options = entry.options
    assert options["converted_from"] == "torchscript" and "cannot handle this graph" in options["export_failure"]
    assert options["input_shapes"] == [[-1, 3, 8, 8]] and options["compile_config"]["INFERENCE_PRECISION_HINT"] == "f32"
    # fp32 weights: ov.save_model halves them to fp16 unless told not to; fp16 would miss 1e-5 by far.
    weights = sum(p.numel() for p in fused(model).graph_module.parameters())
    assert (out / "openvino" / "model.bin").stat().st_size >= 4 * weights
    loaded = load_fused(out, "openvino")
    for b in (1, 7):
        x = example(b)
        assert rel_err(loaded(x), reference_fp64(model, x)) <= TOL
    with pytest.raises(ExportError, match=r"format 'openvino' runs on the CPU.*device='cpu'"):
        FORMATS["openvino"].load(out, entry, torch.device("cuda"))


def test_openvino_compiles_one_static_copy_per_shape_and_keeps_a_few(tmp_path):
    from fx_lightning.formats.openvino import MAX_SHAPES

    model = make_model()
    out = quick_export(tmp_path / "exp", formats=["openvino"])
    loaded = load_fused(out, "openvino")
    sizes = [1, 7, 1, *range(2, 2 + MAX_SHAPES)]
    for b in sizes:
        x = example(b)
        assert rel_err(loaded(x), reference_fp64(model, x)) <= TOL, b
    assert len(loaded.compiled) == MAX_SHAPES and ((1, 3, 8, 8),) not in loaded.compiled
    assert next(reversed(loaded.compiled)) == ((1 + MAX_SHAPES, 3, 8, 8),)
    # Another spatial size than every call showed: refused by name before the runtime sees it (every loaded artifact
    # is behind its signature; with trace.probe_sizes the sizes a resized call ran at are dynamic instead).
    with pytest.raises(ExportError, match=r"dim 2 is 9; the artifact was built for 8"):
        loaded(torch.randn(2, 3, 9, 9))
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle

        pickle.dumps(loaded)


def test_openvino_requested_but_not_installed(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with pytest.raises(ExportError, match=r"'openvino' but openvino is not installed.*fx-lightning\[openvino\]"):
        quick_export(tmp_path / "exp", formats=["pt2", "openvino"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.ddp
def test_ddp_only_rank_zero_writes(tmp_path):
    import torch.multiprocessing as mp

    from export_helpers import ddp_export_worker, free_port

    mp.spawn(ddp_export_worker, args=(2, str(tmp_path), free_port()), nprocs=2, join=True)
    results = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in tmp_path.glob("rank_*.json")}
    assert set(results) == {0, 1}
    # Rank 1 returns the path at once and writes nothing; rank 0 writes the export.
    assert results[0]["wrote"] and not results[1]["wrote"]
    assert results[0]["returned"] == results[1]["returned"] == str(tmp_path / "exp")
    assert results[0]["saw_manifest_after_barrier"] and results[1]["saw_manifest_after_barrier"]


def test_a_failing_format_is_dropped_and_reported_the_others_exported(tmp_path, monkeypatch):
    """on_format_failure: skip (the default): the user gets the formats that work, and is told which did not."""
    _write_graph_module_with_wrong_weights(monkeypatch)
    with pytest.warns(UserWarning, match=r"format 'graph_module': the loaded model disagrees"):
        out = quick_export(tmp_path / "exp")
    manifest = read_manifest(out)
    assert list(manifest.formats) == ["pt2"] and not (out / "model.pt").exists()
    assert "disagrees" in manifest.failed_formats["graph_module"]
    x = example(3)
    assert rel_err(load_fused(out)(x), reference_fp64(make_model(), x)) <= TOL
    with pytest.raises(ExportError, match="no format could be written"), pytest.warns(UserWarning):
        quick_export(tmp_path / "none", formats=["graph_module"])
    assert not (tmp_path / "none").exists()


def test_artifacts_are_judged_against_fp64_scaled_to_the_fused_models_own_error(tmp_path):
    """A runtime with other kernels is not expected to match the fused model bit for bit: each artifact is
    judged against an fp64 copy of the fused model, allowing a few times the fused model's own error."""
    out = quick_export(tmp_path / "exp", formats=["pt2", "onnx"])
    manifest = read_manifest(out)
    for name in ("pt2", "onnx"):
        check = manifest.formats[name].check
        assert check is not None and check.passed
        assert check.against == "an fp64 copy of the fused model"
        assert check.relative_error <= check.tolerance and check.fused_error > 0
        assert check.tolerance >= 1e-5
    options = manifest.formats["onnx"].options["session_options"]
    assert options["graph_optimization_level"] == "ORT_ENABLE_ALL"
    # Spinning ORT threads took the cores from torch in the same process (eager 1.6x slower): off, recorded.
    assert options["config_entries"] == {"session.intra_op.allow_spinning": "0"}
    session = load_fused(out, "onnx").session.get_session_options()
    assert session.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    saved = torch.load(out / "check.pt", weights_only=True)
    assert saved["expected"][0].dtype == torch.float64 and len(saved["inputs"]) == 1
