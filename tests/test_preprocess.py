"""``export.preprocess`` and ``export.labels``: the input normalisation compiled into every exported artifact, so a
client sends raw pixels (uint8), and the class names of the first output.

Every comparison is against an fp64 copy of the original (unfused) model in eval mode, on raw pixels normalised
by this file's own code (a third implementation, beside the prologue and parity's fp64 reference), with relative
error, and checks the output's structure.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, List, Optional, Sequence

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

import lightning_helpers as H
from fusion_helpers import real_cpu_has, randomize_batchnorms, rel_err
from fx_lightning import ConfigError, FXFuseCallback, fuse_and_export, load_fused
from fx_lightning.config import load_config
from fx_lightning.export import read_manifest
from fx_lightning.export.write.input_contract import LABELS_IGNORED, PREPROCESS_COMPILED, PREPROCESS_PROPOSED
from fx_lightning.export.check import read_check_file
from fx_lightning.pipeline.raw_input import RAW_PATH_PASSED

torchvision = pytest.importorskip("torchvision")
from torchvision import transforms as T  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
CLASSES = ["cat", "dog", "fox", "owl"]
SIZE = 8


class ConvBNClassifier(nn.Module):
    """A small conv+BN classifier (random weights, BatchNorm statistics randomised by the tests)."""

    def __init__(self, classes: int = len(CLASSES)) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(x + self.bn2(self.conv2(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _classifier(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return randomize_batchnorms(ConvBNClassifier(), seed).eval()


def normalised_fp64(raw: torch.Tensor, mean: Sequence[float], std: Sequence[float], scale: float = 1 / 255,
                    layout: str = "NCHW", order: str = "RGB") -> torch.Tensor:
    """What the training code computes from raw pixels, in fp64: this test's own normalisation."""
    x = raw.double()
    if layout == "NHWC":
        x = x.permute(0, 3, 1, 2)
    if order == "BGR":
        x = x[:, [2, 1, 0]]
    m = torch.tensor(mean, dtype=torch.float64)[None, :, None, None]
    s = torch.tensor(std, dtype=torch.float64)[None, :, None, None]
    return (x * scale - m) / s


def reference(model: nn.Module, raw: torch.Tensor, **how: Any) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).double().eval()(normalised_fp64(raw, MEAN, STD, **how))


def _raw(n: int, layout: str = "NCHW", seed: int = 1, size: int = SIZE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (n, 3, size, size) if layout == "NCHW" else (n, size, size, 3)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def _normalised_batches(count: int = 2, n: int = 6) -> List[Any]:
    """Parity batches as the training code makes them: raw pixels normalised (NCHW RGB float32), with labels."""
    return [(normalised_fp64(_raw(n, seed=10 + i), MEAN, STD).float(), torch.randint(0, 4, (n,)))
            for i in range(count)]


# ------------------------------------------------------------------------------- (a) every format, raw pixels

ALL_FORMATS = ["graph_module", "pt2", "code", "onnx", "openvino", "aoti"]


@pytest.mark.parametrize("layout, order, formats", [
    ("NHWC", "BGR", ALL_FORMATS),
    ("NCHW", "RGB", ALL_FORMATS[:-1]),  # aoti (a C++ build, ~20 s) once is enough
    ("NHWC", "RGB", ["pt2", "onnx"]),
    ("NCHW", "BGR", ["pt2", "openvino"]),
])
def test_every_format_takes_raw_uint8_pixels_and_matches_the_original_model(tmp_path, layout, order, formats):
    for fmt, module in (("onnx", "onnxruntime"), ("openvino", "openvino")):
        if fmt in formats:
            pytest.importorskip(module)
    model = _classifier()
    config = {"export": {"formats": formats, "preprocess": {"enabled": True, "mean": MEAN, "std": STD,
                                                            "layout": layout, "channel_order": order},
                         "labels": CLASSES}}
    outcome = fuse_and_export(model, tmp_path / "e", batches=_normalised_batches(), config=config)
    manifest = read_manifest(outcome.export_dir)

    assert set(manifest.formats) == set(formats)
    (spec,) = manifest.inputs
    # Height and width were shown to vary (trace.probe_sizes): the raw image takes any size too.
    assert spec["dtype"] == "uint8" and spec["shape"] == (["batch", 3, "n0", "n0"] if layout == "NCHW"
                                                    else ["batch", "n0", "n0", 3])
    pre = manifest.preprocess
    assert pre is not None and (pre.mean, pre.std) == (MEAN, STD) and pre.scale == pytest.approx(1 / 255)
    assert (pre.input_dtype, pre.layout, pre.channel_order, pre.source) == ("uint8", layout, order, "config")
    assert manifest.labels == CLASSES
    assert outcome.parity is not None and outcome.parity.passed
    assert outcome.parity.metrics["raw_path_relative_max_error"] <= 1e-5
    assert any(n.kind == RAW_PATH_PASSED for n in outcome.parity.notes)
    assert any(n.kind == PREPROCESS_COMPILED and n["source"] == "config" for n in outcome.notes)

    for batch, size in ((1, SIZE), (5, SIZE), (2, SIZE + 4)):
        raw = _raw(batch, layout, seed=batch, size=size)
        want = reference(model, raw, layout=layout, order=order)
        for name in formats:
            got = load_fused(outcome.export_dir, name)(raw)
            assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, name
            assert got.shape == (batch, len(CLASSES)), name
            assert rel_err(got, want) < 1e-5, (name, batch)
            assert manifest.formats[name].check.passed and "normalised in fp64" in manifest.formats[name].check.against

    # check.pt: raw inputs and the fp64 reference of (normalisation -> original model) on them.
    saved = read_check_file(outcome.export_dir)
    assert saved is not None and saved.inputs[0].dtype == torch.uint8
    want = reference(model, saved.inputs[0], layout=layout, order=order)
    assert saved.expected[0].dtype == torch.float64 and rel_err(saved.expected[0], want) < 1e-12


def test_a_prologue_is_one_graph_and_float32_raw_inputs_are_not_rounded(tmp_path):
    model = _classifier(3)
    config = {"export": {"formats": ["graph_module", "pt2"], "preprocess": {
        "enabled": True, "mean": MEAN, "std": STD, "scale": 1.0, "input_dtype": "float32"}}}
    raw = torch.rand(4, 3, SIZE, SIZE)  # float pixels in [0, 1]: scale 1
    outcome = fuse_and_export(model, tmp_path / "e", example_inputs=(normalised_fp64(raw, MEAN, STD, 1.0).float(),),
                              config=config)
    manifest = read_manifest(outcome.export_dir)
    assert manifest.inputs[0]["dtype"] == "float32" and manifest.preprocess.input_dtype == "float32"
    saved = read_check_file(outcome.export_dir)
    assert rel_err(saved.inputs[0], raw) < 1e-6  # the example turned back into pixels, not rounded to integers
    graph_module = load_fused(outcome.export_dir, "graph_module")
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 1 and not any(n.op == "call_module" for n in graph_module.graph.nodes
                                              if "prologue" in str(n.target))
    for name in ("graph_module", "pt2"):
        got = load_fused(outcome.export_dir, name)(raw)
        assert rel_err(got, reference(model, raw, scale=1.0)) < 1e-5


def test_without_preprocess_nothing_changes(tmp_path):
    model = _classifier(4)
    outcome = fuse_and_export(model, tmp_path / "e", batches=_normalised_batches(), config={
        "export": {"formats": ["pt2"]}})
    manifest = read_manifest(outcome.export_dir)
    assert manifest.preprocess is None and manifest.labels == [] and manifest.inputs[0]["dtype"] == "float32"
    assert "raw_path_relative_max_error" not in outcome.parity.metrics
    assert manifest.formats["pt2"].check.against == "an fp64 copy of the fused model"
    x = _normalised_batches()[0][0]
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double())
    assert rel_err(load_fused(outcome.export_dir, "pt2")(x), want) < 1e-5


# -------------------------------------------------------------------- (b) found in the datamodule, the callback


class PixelImages(Dataset):
    """Tiny in-memory uint8 images (HWC, as decoded) whose class is the bright quadrant; ``transform`` makes
    the model input, as torchvision datasets do."""

    def __init__(self, n: int, seed: int, transform: Any, classes: Optional[List[str]] = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        images = torch.randint(0, 100, (n, SIZE, SIZE, 3), generator=g, dtype=torch.uint8)
        h = SIZE // 2
        for i, label in enumerate(self.labels.tolist()):
            r, c = divmod(label, 2)
            images[i, r * h:(r + 1) * h, c * h:(c + 1) * h] += 150
        self.images = images.numpy()
        self.transform = transform
        if classes is not None:
            self.classes = classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Any:
        return self.transform(self.images[i]), int(self.labels[i])


class PixelData(pl.LightningDataModule):
    def __init__(self, transform: Any, classes: Optional[List[str]] = None, subset: bool = False) -> None:
        super().__init__()
        self.transform = transform
        self.subset = subset
        if classes is not None:
            self.classes = classes

    def train_dataloader(self) -> DataLoader:
        return DataLoader(PixelImages(64, 0, self.transform), batch_size=16, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        val = PixelImages(40, 1, self.transform)
        return DataLoader(Subset(val, list(range(32))) if self.subset else val, batch_size=16)


class LitPixels(pl.LightningModule):
    """The whole module is the target: its output is the class scores."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ConvBNClassifier()
        self.training_steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.training_steps += 1
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(tmp_path: Path, data: PixelData, **export: Any) -> tuple:
    model = LitPixels()
    cb = FXFuseCallback(target="", export={"formats": ["pt2", "onnx"], **export})
    H.make_trainer(tmp_path, [cb]).fit(model, datamodule=data)
    return model, cb


def test_the_callback_finds_normalize_in_the_val_transform_and_compiles_it(tmp_path):
    pytest.importorskip("onnxruntime")
    transform = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    model, cb = _fit(tmp_path, PixelData(transform, classes=CLASSES), preprocess={"enabled": True})
    manifest = read_manifest(cb.export_dir)
    pre = manifest.preprocess
    assert pre is not None and pre.source == "datamodule.val_dataloader().dataset.transform"
    assert pre.mean == pytest.approx(MEAN) and pre.std == pytest.approx(STD) and pre.scale == pytest.approx(1 / 255)
    assert manifest.inputs[0]["dtype"] == "uint8" and manifest.labels == CLASSES
    assert "from datamodule.val_dataloader().dataset.transform" in (cb.summary or "")
    assert cb.preflight is not None and "export.preprocess" in cb.preflight.stages
    # Raw pixels (NCHW uint8) through each artifact = the training transform's normalisation -> the trained model.
    images = PixelImages(6, 7, transform)
    raw = torch.from_numpy(images.images).permute(0, 3, 1, 2).contiguous()
    want = reference(model, raw)
    with torch.no_grad():  # and the same in fp32 through torchvision's own transform
        trained = copy.deepcopy(model).eval()(torch.stack([transform(im) for im in images.images]))
    for name in ("pt2", "onnx"):
        got = load_fused(cb.export_dir, name)(raw)
        assert got.shape == (6, len(CLASSES)) and rel_err(got, want) < 1e-5 and rel_err(got, trained) < 1e-5


def test_v2_transforms_in_a_subset_are_found_and_a_disabled_prologue_is_proposed(tmp_path):
    pytest.importorskip("onnxruntime")
    transform = v2.Compose([v2.ToImage(), v2.Compose([v2.ToDtype(torch.float32, scale=True),
                                                      v2.Normalize(MEAN, STD)])])
    _, cb = _fit(tmp_path / "off", PixelData(transform, subset=True))
    assert cb.outcome is not None
    proposed = [n for n in cb.outcome.notes if n.kind == PREPROCESS_PROPOSED]
    source = "datamodule.val_dataloader().dataset.dataset.transform"  # through the Subset
    assert len(proposed) == 1 and proposed[0]["source"] == source
    assert str(proposed[0]) == (f"found Normalize(mean={tuple(MEAN)}, std={tuple(STD)}) in {source}; set "
                                "export.preprocess.enabled: true to compile it into the export")
    assert str(proposed[0]) in (cb.summary or "")
    manifest = read_manifest(cb.export_dir)
    assert manifest.preprocess is None and manifest.inputs[0]["dtype"] == "float32"

    # Enabled: the same transform is compiled, NHWC as images decode.
    model, cb = _fit(tmp_path / "on", PixelData(transform, subset=True), preprocess={"enabled": True,
                                                                                     "layout": "NHWC"})
    manifest = read_manifest(cb.export_dir)
    assert manifest.preprocess.source == source and manifest.inputs[0]["shape"] == ["batch", "n0", "n0", 3]
    raw = torch.from_numpy(PixelImages(5, 9, transform).images)
    got = load_fused(cb.export_dir, "pt2")(raw)
    assert rel_err(got, reference(model, raw, layout="NHWC")) < 1e-5


def test_normalize_after_a_float_conversion_without_scaling_has_scale_one():
    from fx_lightning.callback.transforms import normalisation_of

    found = normalisation_of(v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32), v2.Normalize([100.0], [50.0])]),
                             "here")
    assert found is not None and found.scale == 1.0 and found.mean == [100.0] and found.source == "here"
    assert normalisation_of(T.Compose([T.ToTensor()]), "here") is None
    assert normalisation_of(T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)]), "here").scale == pytest.approx(1 / 255)


def test_class_names_that_do_not_fit_the_output_are_left_out_with_a_note(tmp_path):
    transform = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    _, cb = _fit(tmp_path, PixelData(transform, classes=["a", "b", "c"]), formats=["pt2"])
    ignored = [n for n in cb.outcome.notes if n.kind == LABELS_IGNORED]
    assert len(ignored) == 1 and ignored[0]["count"] == 3 and ignored[0]["width"] == len(CLASSES)
    assert ignored[0]["source"] == "datamodule.classes"
    assert read_manifest(cb.export_dir).labels == []


# --------------------------------------------------------------------------------------------- (c) bad values


@pytest.mark.parametrize("preprocess, key, shown", [
    ({"mean": MEAN, "std": [0.2, -0.1, 0.2]}, "export.preprocess.std", "-0.1"),
    ({"mean": MEAN, "std": [0.2, 0.2]}, "export.preprocess.std", "[0.2, 0.2]"),
    ({"mean": MEAN}, "export.preprocess.mean", "given without std"),
    ({"scale": 0.0}, "export.preprocess.scale", "0.0"),
    ({"layout": "HWC"}, "export.preprocess.layout", "HWC"),
])
def test_bad_values_are_config_errors_naming_the_key_and_the_value(preprocess, key, shown):
    with pytest.raises(ConfigError) as info:
        load_config({"export": {"preprocess": {"enabled": True, **preprocess}}})
    assert str(info.value).startswith(f"{key}:") and shown in str(info.value)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):  # the callback refuses it when built
        FXFuseCallback(export={"preprocess": {"enabled": True, **preprocess}})


def test_a_channel_count_that_is_not_len_mean_is_refused(tmp_path):
    config = {"export": {"formats": ["pt2"], "preprocess": {"enabled": True, "mean": [0.5], "std": [0.2]}}}
    with pytest.raises(ConfigError, match=r"export\.preprocess\.mean: 1 value\(s\) \[0\.5\].* 3 channels"):
        fuse_and_export(_classifier(), tmp_path / "e", batches=_normalised_batches(), config=config)
    assert not (tmp_path / "e").exists()


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).mean((2, 3)) + y


@pytest.mark.parametrize("model, inputs", [
    (TwoInputs(), (torch.randn(2, 3, 4, 4), torch.randn(2, 4))),
    (nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), (torch.randn(2, 3),)),
])
def test_a_model_whose_input_is_not_one_image_is_refused(tmp_path, model, inputs):
    config = {"export": {"formats": ["pt2"], "preprocess": {"enabled": True, "mean": MEAN, "std": STD}}}
    with pytest.raises(ConfigError, match=r"export\.preprocess: the prologue needs one 4-D NCHW image tensor"):
        fuse_and_export(randomize_batchnorms(model).eval(), tmp_path / "e", example_inputs=inputs, config=config)


def test_enabled_without_mean_and_std_fails_before_training_when_nothing_is_found(tmp_path):
    plain = T.Compose([T.ToTensor()])  # no Normalize
    model, cb = LitPixels(), FXFuseCallback(target="", export={"formats": ["pt2"], "preprocess": {"enabled": True}})
    with pytest.raises(ConfigError) as info:
        H.make_trainer(tmp_path, [cb]).fit(model, datamodule=PixelData(plain))
    message = str(info.value)
    assert "preflight failed at stage 'export.preprocess'" in message and "export.preprocess.enabled: true" in message
    assert "datamodule.val_dataloader().dataset.transform" in message and model.training_steps == 0
    # Without Lightning there is nothing to find: the same error, naming the keys to set.
    with pytest.raises(ConfigError, match=r"export\.preprocess\.mean and export\.preprocess\.std"):
        fuse_and_export(_classifier(), tmp_path / "e", batches=_normalised_batches(),
                        config={"export": {"preprocess": {"enabled": True}}})


def test_configured_labels_of_the_wrong_length_fail_before_training(tmp_path):
    transform = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    model = LitPixels()
    cb = FXFuseCallback(target="", export={"formats": ["pt2"], "labels": ["a", "b"]})
    with pytest.raises(ConfigError, match=r"export\.labels: 2 class names \['a', 'b'\] .* 4 columns") as info:
        H.make_trainer(tmp_path, [cb]).fit(model, datamodule=PixelData(transform))
    H.assert_stopped_before_training(str(info.value), model, "export")  # the output's width: a model run


def test_a_wrong_channel_count_fails_before_training(tmp_path):
    transform = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    model = LitPixels()
    cb = FXFuseCallback(target="", export={"formats": ["pt2"], "preprocess": {
        "enabled": True, "mean": [0.5, 0.5], "std": [0.2, 0.2]}})
    with pytest.raises(ConfigError, match=r"export\.preprocess\.mean: 2 value\(s\)") as info:
        H.make_trainer(tmp_path, [cb]).fit(model, datamodule=PixelData(transform))
    H.assert_stopped_before_training(str(info.value), model, "parity")  # the input's channels: a model run


def test_the_selection_times_the_eager_baseline_on_the_same_raw_pixels(tmp_path):
    pytest.importorskip("onnxruntime")
    config = {"export": {"formats": ["pt2", "onnx"], "select": "fastest",
                         "preprocess": {"enabled": True, "mean": MEAN, "std": STD}}}
    outcome = fuse_and_export(_classifier(6), tmp_path / "e", batches=_normalised_batches(2, 4), config=config)
    bench = read_manifest(outcome.export_dir).bench
    assert bench is not None and all(check.passed for check in bench.checks.values()), bench.checks
    assert {t.artifact for t in bench.timings} >= {"eager", "pt2", "onnx"}  # eager ran on check.pt's uint8 pixels
    assert not [f for f in bench.failures if f.artifact == "eager"]
    assert read_manifest(outcome.export_dir).selected is not None


# ------------------------------------------------------------------------------------ (d) the lossy variants


def test_int8_and_bf16_variants_take_raw_pixels_and_pass_their_gates(tmp_path):
    pytest.importorskip("torchao")
    pytest.importorskip("openvino")
    pytest.importorskip("onnxruntime")
    gate = {"min_top1_agreement": 0.9, "max_accuracy_drop": 0.1, "min_cosine": 0.9}
    model = _classifier(5)
    config = {"export": {"formats": ["pt2", "onnx", "openvino"], "preprocess": {"enabled": True, "mean": MEAN, "std": STD,
                                                                        "layout": "NHWC"}},
              "passes": {"quantize_int8": {"enabled": True, **gate}, "cast_bf16": {"enabled": True, **gate}}}
    outcome = fuse_and_export(model, tmp_path / "e", batches=_normalised_batches(4, 16), config=config)
    manifest = read_manifest(outcome.export_dir)
    variants = {n for n in manifest.formats if "-" in n}
    wanted = {"pt2-int8", "openvino-int8", "pt2-bf16", "openvino-bf16"}
    # ONNX Runtime's int8 saturates its 8-bit activations on a CPU without VNNI: it may miss this gate there.
    if real_cpu_has("avx512_vnni") or real_cpu_has("avx_vnni"):
        wanted.add("onnx-int8")
    assert wanted <= variants and all(o.gate is not None for o in manifest.variants["int8"]), manifest.variants
    raw = _raw(8, "NHWC", seed=3)
    want = reference(model, raw, layout="NHWC")
    for name in sorted(variants):
        assert manifest.formats[name].gate.passed, name
        got = load_fused(outcome.export_dir, name)(raw)
        assert got.shape == want.shape and got.dtype == torch.float32, name
        assert (got.argmax(1) == want.argmax(1)).float().mean() >= 0.75 and rel_err(got, want) < 0.1, name
    assert json.loads((outcome.export_dir / "manifest.json").read_text())["inputs"][0]["dtype"] == "uint8"


def test_a_todtype_without_scale_keeps_the_scale_of_totensor() -> None:
    """ToTensor scales to 0..1; a ToDtype(float32) after it (no scale=True) changes nothing, so 1/255 stands."""
    from torchvision.transforms import v2

    from fx_lightning.callback.transforms import normalisation_of

    found = normalisation_of(v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                                         v2.ToDtype(torch.float32), v2.Normalize([0.5], [0.25])]), "t")
    assert found is not None and abs(found.scale - 1 / 255) < 1e-12
    found = normalisation_of(v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32), v2.Normalize([0.5], [0.25])]), "t")
    assert found is not None and found.scale == 1.0  # no scaling conversion at all: raw values
