"""``fx-lightning triton``: a Triton Inference Server model repository from an export.

Every generated ``config.pbtxt`` is parsed with Triton's own ``ModelConfig`` message (tritonclient's generated
module, loaded from its file: importing ``tritonclient.grpc`` needs grpc), and what it states is compared with the
copied artifact itself (ONNX graph, OpenVINO IR), independently of the code that wrote it. The ONNX model is also
run with the shapes its config states and compared with the export's fp64 ``check.pt`` outputs."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch
from torch import nn

from fusion_helpers import randomize_batchnorms, rel_err
from fx_lightning import ConfigError, ExportError, FuseConfig, fuse_and_export
from fx_lightning.cli import main
from fx_lightning.config import ExportFormat, load_config
from fx_lightning.export import read_manifest
from fx_lightning.export.check import read_check_file
from fx_lightning.serve.triton import TritonRepository, triton_dtype, write_triton_repository

tritonclient = pytest.importorskip("tritonclient")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
ov = pytest.importorskip("openvino")
text_format = pytest.importorskip("google.protobuf.text_format")


def _model_config_module() -> Any:
    path = os.path.join(os.path.dirname(tritonclient.__file__), "grpc", "model_config_pb2.py")
    spec = importlib.util.spec_from_file_location("model_config_pb2", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PB = _model_config_module()


def parse_config(directory: Path) -> Any:
    """A model's config.pbtxt as Triton's ModelConfig (text_format rejects unknown fields and bad values)."""
    return text_format.Parse((directory / "config.pbtxt").read_text(encoding="utf-8"), PB.ModelConfig())


def type_name(data_type: int) -> str:
    return PB.DataType.Name(data_type)


# Independent of the writer's tables: what each artifact's element types are called in Triton.
ONNX_TYPES = {onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.UINT8: "TYPE_UINT8",
              onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.BOOL: "TYPE_BOOL",
              onnx.TensorProto.FLOAT16: "TYPE_FP16"}
OPENVINO_TYPES = {"f32": "TYPE_FP32", "u8": "TYPE_UINT8", "i64": "TYPE_INT64", "boolean": "TYPE_BOOL",
                  "f16": "TYPE_FP16"}
NUMPY_TYPES = {"TYPE_FP32": np.float32, "TYPE_UINT8": np.uint8, "TYPE_INT64": np.int64, "TYPE_BOOL": np.bool_}


# --- models and exports ------------------------------------------------------------------------------------------


class TwoInTwoOut(nn.Module):
    """A uint8 image (cast to float inside) and a float vector in; image features and vector scores out."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc = nn.Linear(5, 3)

    def forward(self, img: torch.Tensor, vec: torch.Tensor) -> Any:
        features = torch.relu(self.bn(self.conv(img.float() / 255.0))).mean((2, 3))
        return features, self.fc(vec)


class Classifier(nn.Module):
    """conv-BN-ReLU, pooling, a Linear head: class scores, and (``with_top``) each row's best score, a tensor with no
    axis but the batch one."""

    def __init__(self, classes: int = 3, with_top: bool = False) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, classes)
        self.with_top = with_top

    def forward(self, x: torch.Tensor) -> Any:
        logits = self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))
        return (logits, logits.amax(1)) if self.with_top else logits


def _config(formats: List[ExportFormat], **export: Any) -> FuseConfig:
    cfg = FuseConfig()
    cfg.export.formats = formats
    for key, value in export.items():
        setattr(cfg.export, key, value)
    return cfg


def _write(export_dir: Path, out: Path, **options: Any) -> Dict[str, Any]:
    repository = write_triton_repository(export_dir, out, **options)
    return {"dir": export_dir, "out": out, "repository": repository, "manifest": read_manifest(export_dir)}


@pytest.fixture(scope="module")
def two_io(tmp_path_factory) -> Dict[str, Any]:
    """Two inputs (one uint8), two outputs, a dynamic batch; onnx, openvino, and pt2 (which Triton is not given)."""
    base = tmp_path_factory.mktemp("two_io")
    torch.manual_seed(0)
    model = randomize_batchnorms(TwoInTwoOut()).eval()
    g = torch.Generator().manual_seed(1)
    example = (torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=g), torch.randn(4, 5, generator=g))
    outcome = fuse_and_export(model, base / "exp", example_inputs=example,
                              config=_config([ExportFormat.onnx, ExportFormat.openvino, ExportFormat.pt2]))
    return _write(outcome.export_dir, base / "repo")


@pytest.fixture(scope="module")
def static(tmp_path_factory) -> Dict[str, Any]:
    """A fixed batch of 4 (export.dynamic_batch false) and class names."""
    base = tmp_path_factory.mktemp("static")
    torch.manual_seed(0)
    model = randomize_batchnorms(Classifier()).eval()
    outcome = fuse_and_export(model, base / "exp", example_inputs=torch.randn(4, 3, 8, 8),
                              config=_config([ExportFormat.onnx, ExportFormat.openvino], dynamic_batch=False,
                                             labels=["cat", "dog", "eel"]))
    return _write(outcome.export_dir, base / "repo", name="fixed")


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> Dict[str, Any]:
    """onnx and openvino with their int8 and bf16 variants (gates open: random weights); an output with no axis but
    the batch one."""
    base = tmp_path_factory.mktemp("variants")
    torch.manual_seed(0)
    model = randomize_batchnorms(Classifier(4, with_top=True)).eval()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]
    gate = {"min_top1_agreement": 0.0, "max_accuracy_drop": 1.0, "min_cosine": 0.0}
    config = load_config({"export": {"formats": ["onnx", "openvino"]},
                          "passes": {"quantize_int8": {"enabled": True, "calibration_batches": 4, **gate},
                                     "cast_bf16": {"enabled": True, **gate}}})
    outcome = fuse_and_export(model, base / "exp", batches=batches, config=config)
    return _write(outcome.export_dir, base / "repo")


@pytest.fixture(scope="module")
def written(two_io, static, variants) -> List[Dict[str, Any]]:
    return [two_io, static, variants]


def _models(written: List[Dict[str, Any]], python: bool = False) -> List[Any]:
    """(fixture, model) of every native-backend model, or (``python``) every Python-backend one."""
    return [(w, m) for w in written for m in w["repository"].models if (m.backend == "python") == python]


# --- the configs are Triton's and state the artifacts ------------------------------------------------------------


def test_every_config_parses_with_tritons_model_config(written):
    models = _models(written)
    assert len(models) == 2 + 2 + 5
    # The Python backend: each export's selection, and two_io's pt2.
    python = _models(written, python=True)
    assert sorted(m.name for _, m in python) == ["exp", "exp", "exp_pt2", "fixed"]
    assert [m.selection for _, m in python] == [m.name in ("exp", "fixed") for _, m in python]
    for _, model in models + python:
        cfg = parse_config(model.directory)
        assert cfg.name == model.directory.name
        assert cfg.backend == {"onnx": "onnxruntime", "openvino": "openvino"}.get(model.entry.split("-")[0], "python") \
            if model.backend != "python" else cfg.backend == "python"
        assert [(g.kind, g.count) for g in cfg.instance_group] == [(PB.ModelInstanceGroup.KIND_CPU, 1)]
        assert cfg.dynamic_batching.max_queue_delay_microseconds == (100 if cfg.max_batch_size else 0)
    # The parser refuses what Triton would: this check can fail.
    with pytest.raises(text_format.ParseError):
        text_format.Parse('name: "m"\nmax_batch_sizes: 8\n', PB.ModelConfig())


def _stated_shape(tensor: Any, batching: bool) -> List[Optional[int]]:
    """The shape the model sees, as the config states it (None: any size)."""
    dims = list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
    return ([None] if batching else []) + [None if d == -1 else int(d) for d in dims]


def test_the_configs_state_the_onnx_graphs_names_types_and_shapes(written):
    checked = 0
    for _, model in _models(written):
        if model.backend != "onnxruntime":
            continue
        cfg = parse_config(model.directory)
        graph = onnx.load(str(model.directory / "1" / "model.onnx")).graph
        initializers = {i.name for i in graph.initializer}
        for stated, declared in ((cfg.input, [v for v in graph.input if v.name not in initializers]),
                                 (cfg.output, list(graph.output))):
            assert [t.name for t in stated] == [v.name for v in declared]
            for t, v in zip(stated, declared):
                assert type_name(t.data_type) == ONNX_TYPES[v.type.tensor_type.elem_type]
                shape = [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
                assert _stated_shape(t, cfg.max_batch_size > 0) == shape, (model.name, t.name)
        checked += 1
    assert checked == 4


def test_the_configs_state_the_openvino_irs_names_types_and_shapes(written):
    checked = 0
    for _, model in _models(written):
        if model.backend != "openvino":
            continue
        cfg = parse_config(model.directory)
        ir = ov.Core().read_model(str(model.directory / "1" / "model.xml"))
        for stated, ports in ((cfg.input, ir.inputs), (cfg.output, ir.outputs)):
            assert [t.name for t in stated] == [p.get_any_name() for p in ports]
            for t, port in zip(stated, ports):
                assert type_name(t.data_type) == OPENVINO_TYPES[port.get_element_type().get_type_name()]
                shape = [d.get_length() if d.is_static else None for d in port.get_partial_shape()]
                assert _stated_shape(t, cfg.max_batch_size > 0) == shape, (model.name, t.name)
        checked += 1
    assert checked == 5


def _copied(model: Any) -> List[str]:
    return sorted(p.relative_to(model.directory / "1").as_posix() for p in (model.directory / "1").rglob("*")
                  if p.is_file())


def test_the_copied_files_are_the_manifests(written):
    for w, model in _models(written):
        manifest = w["manifest"]
        entry = manifest.formats[model.entry]
        assert _copied(model) == sorted(Path(f).name for f in entry.files)
        for name in entry.files:
            digest = hashlib.sha256((model.directory / "1" / Path(name).name).read_bytes()).hexdigest()
            assert digest == manifest.files[name].sha256, (model.name, name)
    # A Python-backend model: model.py and, under export/, the manifest, check.pt and its artifact (all for the
    # selection), byte for byte.
    for w, model in _models(written, python=True):
        manifest = w["manifest"]
        exported = sorted(manifest.files) if model.selection else sorted(
            [*manifest.formats[model.entry].files, manifest.check_file])
        assert _copied(model) == sorted(["model.py", "export/manifest.json", *[f"export/{f}" for f in exported]])
        for name in exported:
            digest = hashlib.sha256((model.directory / "1" / "export" / name).read_bytes()).hexdigest()
            assert digest == manifest.files[name].sha256, (model.name, name)


def test_two_inputs_two_outputs_and_a_uint8_input(two_io):
    cfg = parse_config(two_io["out"] / "exp_onnx")
    assert cfg.max_batch_size == 8
    assert [(t.name, type_name(t.data_type), list(t.dims)) for t in cfg.input] == [
        ("img", "TYPE_UINT8", [3, -1, -1]), ("vec", "TYPE_FP32", [5])]  # height and width shown to vary
    assert [(t.name, type_name(t.data_type), list(t.dims)) for t in cfg.output] == [
        ("output_0", "TYPE_FP32", [4]), ("output_1", "TYPE_FP32", [3])]
    ov_cfg = parse_config(two_io["out"] / "exp_openvino")
    assert [type_name(t.data_type) for t in ov_cfg.input] == ["TYPE_UINT8", "TYPE_FP32"]
    # OpenVINO names outputs after the operation that made them: the result maps them to the export's names.
    model = next(m for m in two_io["repository"].models if m.entry == "openvino")
    assert [model.export_names.get(t.name, t.name) for t in model.outputs] == ["output_0", "output_1"]
    assert ov_cfg.parameters["ENABLE_BATCH_PADDING"].string_value == "YES"


def test_a_fixed_batch_export_gets_max_batch_size_0_and_full_dims(static, tmp_path):
    for _, model in _models([static]):
        cfg = parse_config(model.directory)
        assert cfg.max_batch_size == 0
        assert [list(t.dims) for t in cfg.input] == [[4, 3, -1, -1]]  # height and width shown to vary
        assert [list(t.dims) for t in cfg.output] == [[4, 3]]
        assert not cfg.HasField("dynamic_batching")
        assert "ENABLE_BATCH_PADDING" not in cfg.parameters
        assert any("export.dynamic_batch: false" in n and "batch size 4 only" in n for n in model.notes)
    # The Python backend runs it through the export's loader, which cuts and pads along the proven sample axis
    # (as fx-lightning serve does): it batches.
    (_, selection), = _models([static], python=True)
    cfg = parse_config(selection.directory)
    assert cfg.max_batch_size == 8 and [list(t.dims) for t in cfg.input] == [[3, -1, -1]]
    with pytest.raises(ConfigError, match=r"max_batch_size: 8.*allowed: 0"):
        write_triton_repository(static["dir"], tmp_path / "repo", max_batch_size=8)
    assert not (tmp_path / "repo").exists()


def test_the_export_labels_become_the_first_outputs_label_file(static):
    for model in static["repository"].models:
        cfg = parse_config(model.directory)
        assert cfg.output[0].label_filename == "labels.txt"
        assert (model.directory / "labels.txt").read_text().split() == ["cat", "dog", "eel"]


def test_lossy_variants_are_models_of_their_own(variants):
    models = {m.entry: m for _, m in _models([variants])}
    assert set(models) == {"onnx", "onnx-int8", "openvino", "openvino-int8", "openvino-bf16"}
    bf16 = parse_config(models["openvino-bf16"].directory)
    assert bf16.parameters["HINT_BF16"].string_value == "YES"
    assert "HINT_BF16" not in parse_config(models["openvino"].directory).parameters
    # The bf16 variant is the fp32 IR compiled differently: the same files.
    assert sorted(models["openvino-bf16"].files) == sorted(models["openvino"].files)
    top = parse_config(models["onnx-int8"].directory).output[1]
    assert list(top.dims) == [1] and list(top.reshape.shape) == []  # Triton wants a dim; the model sees [batch]


def test_pt2_is_served_by_the_python_backend_and_without_it_not_written_with_the_reason(two_io, tmp_path):
    assert two_io["repository"].skipped == []
    pt2 = parse_config(two_io["out"] / "exp_pt2")
    assert pt2.backend == "python" and pt2.parameters["fx_lightning_entry"].string_value == "pt2"
    without = write_triton_repository(two_io["dir"], tmp_path / "repo", python=False)
    skipped = {s.entry: s.reason for s in without.skipped}
    assert set(skipped) == {"pt2"} and "python=False" in skipped["pt2"]
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert "## Not written" in readme and "`pt2`" in readme
    assert not (tmp_path / "repo" / "exp_pt2").exists() and not (tmp_path / "repo" / "exp").exists()
    with pytest.raises(ConfigError, match=r"formats: 'pt2' cannot be served.*allowed: onnx, openvino"):
        write_triton_repository(two_io["dir"], tmp_path / "repo2", formats=["pt2"], python=False)


def test_the_readme_says_how_to_run_and_query_each_model(two_io):
    readme = (two_io["out"] / "README.md").read_text()
    assert "tritonserver --model-repository=" in readme and "nvcr.io/nvidia/tritonserver:<yy.mm>-py3" in readme
    for name in ("exp_onnx", "exp_openvino"):
        assert f"localhost:8000/v2/models/{name}/infer" in readme and f"client.infer('{name}', inputs)" in readme
    assert "httpclient.InferInput('img', x.shape, 'UINT8')" in readme


# --- refusals ----------------------------------------------------------------------------------------------------


def _copy_export(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "exp"
    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize("name", ["model.onnx", "openvino/model.bin"])
def test_a_corrupted_artifact_is_refused_naming_the_file(two_io, tmp_path, name):
    export = _copy_export(two_io["dir"], tmp_path)
    data = bytearray((export / name).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 tells
    (export / name).write_bytes(bytes(data))
    with pytest.raises(ExportError, match=rf"{name}: corrupt file: sha256"):
        write_triton_repository(export, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()  # nothing written, not even the models whose files are intact


@pytest.mark.parametrize("dtype, message", [
    ("complex64", r"dtype 'complex64' has no Triton data type; allowed: float32"),
    ("float32", r"input 'img' is TYPE_UINT8 in the artifact, the manifest says float32"),
])
def test_a_manifest_that_disagrees_with_the_artifact_is_refused(two_io, tmp_path, dtype, message):
    """Both statements of the inputs edited alike (one edited alone is refused when read: the next test)."""
    export = _copy_export(two_io["dir"], tmp_path)
    data = json.loads((export / "manifest.json").read_text())
    data["inputs"][0]["dtype"] = data["signature"]["inputs"][0]["dtype"] = dtype
    (export / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ExportError, match=message):
        write_triton_repository(export, tmp_path / "repo", formats=["onnx"])


def test_a_manifest_whose_inputs_disagree_with_its_signature_is_refused(two_io, tmp_path):
    export = _copy_export(two_io["dir"], tmp_path)
    data = json.loads((export / "manifest.json").read_text())
    data["inputs"][0]["dtype"] = "float32"  # the signature (what fx-lightning reads) still says uint8
    (export / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ExportError, match=r"corrupt manifest: the dtypes of its inputs \(float32, .*\) and of its "
                                          r"signature's inputs \(uint8, .*\) disagree"):
        write_triton_repository(export, tmp_path / "repo", formats=["onnx"])


class WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.fc(x)
        return y, y.sum()


def test_a_scalar_output_is_refused_since_triton_cannot_state_it(tmp_path):
    outcome = fuse_and_export(WithScalar().eval(), tmp_path / "exp", example_inputs=torch.randn(4, 5),
                              config=_config([ExportFormat.onnx]))
    with pytest.raises(ExportError, match=r"nothing Triton can serve: .*selection.*'output_1' is a scalar.*"
                                          r"onnx: 'output_1' is a scalar"):
        write_triton_repository(outcome.export_dir, tmp_path / "repo")
    with pytest.raises(ExportError, match=r"onnx cannot be served by Triton: 'output_1' is a scalar"):
        write_triton_repository(outcome.export_dir, tmp_path / "repo", formats=["onnx"])
    assert not (tmp_path / "repo").exists()


def test_an_unknown_torch_dtype_has_no_triton_type():
    assert triton_dtype("bfloat16", "x") == "TYPE_BF16" and triton_dtype("bool", "x") == "TYPE_BOOL"
    with pytest.raises(ExportError, match=r"input 'x': dtype 'qint8' has no Triton data type; allowed: .*uint8"):
        triton_dtype("qint8", "input 'x'")


@pytest.mark.parametrize("options, message", [
    ({"instances": 0}, r"triton instances: 0; allowed: an integer >= 1"),
    ({"max_batch_size": -1}, r"triton max_batch_size: -1; allowed: an integer >= 0 or None"),
    ({"max_batch_size": 4, "preferred_batch_sizes": [8]}, r"preferred_batch_sizes: \[8\]; allowed: .* \(4\)"),
    ({"max_batch_size": 0, "preferred_batch_sizes": [2]}, r"preferred_batch_sizes: \[2\]; allowed: none with max"),
    ({"name": "../up"}, r"triton name: '../up'; allowed: letters"),
    ({"formats": ["onnx", "tflite"]}, r"formats: 'tflite' is not in this export .*; allowed: onnx, openvino"),
])
def test_bad_options_are_refused_naming_the_key_and_what_is_allowed(two_io, tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        write_triton_repository(two_io["dir"], tmp_path / "repo", **options)
    assert not (tmp_path / "repo").exists()


# --- the command line --------------------------------------------------------------------------------------------


def test_the_cli_subcommand_writes_the_repository(two_io, tmp_path, capsys):
    out = tmp_path / "repo"
    args = ["triton", str(two_io["dir"]), str(out), "--name", "cli", "--format", "onnx", "--instances", "2"]
    assert main([*args, "--max-batch-size", "4", "--preferred-batch-size", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "cli_onnx"]
    cfg = parse_config(out / "cli_onnx")
    assert cfg.max_batch_size == 4 and cfg.instance_group[0].count == 2
    assert list(cfg.dynamic_batching.preferred_batch_size) == [2]
    assert "cli_onnx: onnx on the onnxruntime backend, max_batch_size 4" in capsys.readouterr().out
    # An existing model is replaced only when asked to.
    assert main(args) == 1
    assert "already exist" in capsys.readouterr().err
    assert main([*args, "--overwrite", "--max-batch-size", "0"]) == 0
    cfg = parse_config(out / "cli_onnx")
    assert cfg.max_batch_size == 0 and [list(t.dims) for t in cfg.input] == [[-1, 3, -1, -1], [-1, 5]]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging left behind
    assert main(["triton", str(two_io["dir"]), str(tmp_path / "other"), "--instances", "0"]) == 1
    assert "instances: 0" in capsys.readouterr().err


# --- the config's meaning: the copied ONNX model run with the shapes it states -----------------------------------


@pytest.mark.parametrize("fixture, entry, tolerance", [("two_io", "onnx", 1e-5), ("variants", "onnx", 1e-5),
                                                       ("variants", "onnx-int8", 0.1)])
def test_the_copied_onnx_model_runs_batches_of_3_as_its_config_states(request, fixture, entry, tolerance):
    w = request.getfixturevalue(fixture)
    model = next(m for _, m in _models([w]) if m.entry == entry)
    cfg = parse_config(model.directory)
    check = read_check_file(w["dir"])
    assert check is not None
    inputs = [t[:3].numpy() for t in check.inputs if isinstance(t, torch.Tensor)]
    assert cfg.max_batch_size >= 3
    feed = {}
    for stated, array in zip(cfg.input, inputs):
        stated_shape = [3, *_stated_shape(stated, False)]  # None: any size (height and width shown to vary)
        assert [a if s is None else s for a, s in zip(array.shape, stated_shape)] == list(array.shape)
        assert len(stated_shape) == array.ndim
        feed[stated.name] = array.astype(NUMPY_TYPES[type_name(stated.data_type)], copy=False)
        assert feed[stated.name].dtype == array.dtype  # the config's type is the data's own
    session = ort.InferenceSession(str(model.directory / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    outputs = session.run([t.name for t in cfg.output], feed)
    assert len(outputs) == len(check.expected)
    for stated, got, want in zip(cfg.output, outputs, check.expected):
        assert got.dtype == NUMPY_TYPES[type_name(stated.data_type)]
        assert list(got.shape) == [3, *[d for d in _stated_shape(stated, False)]]
        assert rel_err(torch.from_numpy(got), want[:3]) < tolerance, (entry, stated.name)


def test_the_result_lists_the_written_directories(two_io):
    repository: TritonRepository = two_io["repository"]
    assert repository.directories == [two_io["out"] / name for name in ("exp", "exp_onnx", "exp_openvino", "exp_pt2")]
    assert repository.readme == two_io["out"] / "README.md"


class LengthBranch(nn.Module):
    """Pads to its stride only when the length is not a multiple of it (torchaudio's ConvTasNet)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(1, 4, 3, padding=1), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return y if x.shape[-1] % 8 == 0 else y * 2 + 1


def test_a_condition_on_a_size_the_config_leaves_free_is_refused(tmp_path):
    """The model's branch on the length is a condition load_fused and serve check on every call; a Triton config
    cannot state it, and Triton would run the captured side of the branch for every length."""
    model = randomize_batchnorms(LengthBranch()).eval()
    outcome = fuse_and_export(model, tmp_path / "exp", batches=[torch.randn(4, 1, 64), torch.randn(2, 1, 32)],
                              config=_config([ExportFormat.onnx]))
    signature = read_manifest(outcome.export_dir).signature
    assert signature.conditions == ["size0_2 % 8 == 0"]
    with pytest.raises(ExportError, match=r"takes only sizes where x.shape\[2\] % 8 == 0 .* a Triton config cannot"):
        write_triton_repository(outcome.export_dir, tmp_path / "repo")


def test_an_input_with_a_proven_stand_in_is_optional_in_the_python_backends_config_and_left_out_it_is_filled(tmp_path):
    """The Triton configs required every input, so a request leaving out Wav2Vec2's attention_mask (which
    ``load_fused`` and ``fx-lightning serve`` take, a mask of ones proven to mean leaving it out) was refused by
    Triton. The Python-backend model now marks it ``optional: true`` and fills the stand-in; the native backends'
    artifacts need every input, so their configs keep it required and say so."""
    import lightning_helpers as H
    from fx_lightning.serve.triton import VERSION
    from fx_lightning.serve.triton_config import config_json
    from fx_lightning.serve.triton_python import ExportRunner
    from test_zero_config import OptionalMask, _fit_with_masks

    module = OptionalMask()
    cb = _fit_with_masks(tmp_path / "fit", module, call_forms=False)
    repo = write_triton_repository(cb.export_dir, tmp_path / "triton")
    selection = next(m for m in repo.models if m.backend == "python" and m.selection)
    config = parse_config(selection.directory)
    assert [(i.name, i.optional) for i in config.input] == [("x", False), ("attention_mask", True)]
    assert [i.get("optional", False) for i in config_json(selection)["input"]] == [False, True]
    for native in (m for m in repo.models if m.backend != "python"):
        assert not any(i.optional for i in parse_config(native.directory).input), native.entry
        assert any("attention_mask required here" in n for n in native.notes), native.notes
    # What Triton hands the Python backend for requests without the mask: None in its place.
    runner = ExportRunner(selection.directory / VERSION / "export", None, selection.max_batch_size)
    reference = H.fp64_copy(module)
    a, b, c = torch.randn(2, 23), torch.randn(3, 23), torch.randn(1, 31)
    mask = torch.ones(1, 31, dtype=torch.long)
    mask[0, 20:] = 0
    answers = runner.run([[a, None], [b, None], [c, mask]])
    for (got,), want in zip(answers, (reference(a.double()), reference(b.double()), reference(c.double(), mask))):
        assert got.shape == want.shape and rel_err(got, want) < 1e-5
