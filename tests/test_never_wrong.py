"""Never a wrong or broken answer (issue 36): one test per defect, each failing on cb4e1ca.

    item  defect                                                         test
    1     the low-precision gate lifted by outputs it does not compare   test_low_precision_gate_own_error_is_measured_on_compared_outputs_only
"""

from __future__ import annotations

import collections
import copy
import re

import pytest
import torch
from torch import nn

from fx_lightning.export import read_manifest
from fx_lightning.parity.gate import judge_parity, measure_parity


class _NoisyHead(nn.Module):
    """A model with a value output, an output drawn at random in eval and a discrete output (labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor):
        y = self.linear(x)
        return y, y + torch.randn_like(y), y.argmax(-1)


class _Scaled(nn.Module):
    """The reference with its value output wrong by 50%."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor):
        y, noisy, labels = self.model(x)
        return y * 1.5, noisy, labels


def test_low_precision_gate_own_error_is_measured_on_compared_outputs_only() -> None:
    torch.manual_seed(0)
    model = _NoisyHead().eval().to(torch.bfloat16)
    precise = copy.deepcopy(model).double()
    batches = [torch.randn(16, 8).to(torch.bfloat16) for _ in range(3)]
    cfg = {"rtol": 1e-4, "min_discrete_agreement": 0.0}

    def run(candidate: nn.Module):
        state = measure_parity(model, candidate, batches, cfg, precise_reference=precise, stochastic=[1])
        return judge_parity(state, cfg)

    wrong = run(_Scaled(model))
    own = wrong.metrics["reference_error_vs_fp64"]
    # The bf16 value output's own error against fp64 is bf16 rounding, not the noise of the drawn output.
    assert own < 0.05, own
    assert wrong.thresholds["relative_max_error"] <= max(1e-4, 4 * own) < 0.2
    assert not wrong.passed and any("relative_max_error" in str(f) for f in wrong.failures)
    assert run(model).passed


# ------------------------------------------------------------------------------------- items 10 and 11

import lightning_helpers as H  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fusion_helpers import randomize_batchnorms  # noqa: E402


class ResizingLit(H.LitClassifier):
    """Steps that resize the batch (8x8 loader images to 16x16) before calling forward: the backbone never
    receives the loader's raw batch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(F.interpolate(x, size=16)), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(F.interpolate(x, size=16)), y))


def test_variants_calibrate_only_on_calls_the_target_received(tmp_path, monkeypatch):
    """Item 11: the preflight (before any training step) calibrated int8 on the loader's 8x8 batches through the
    module's forward, for a backbone the steps feed at 16x16; the variant's export then failed its guard and the
    preflight stopped training."""
    pytest.importorskip("torchao")
    from fx_lightning import FXFuseCallback
    from fx_lightning.pipeline.inputs import CALIBRATED_ON_OBSERVED
    from fx_lightning.variants import int8 as quantize

    sizes = []
    real = quantize.calibrate_int8

    def spy(program, batches, float_nodes, **kwargs):
        sizes.extend(tuple(b[0].shape[-2:]) for b in batches)
        return real(program, batches, float_nodes, **kwargs)

    monkeypatch.setattr(quantize, "calibrate_int8", spy)
    train, val = H.loaders()
    callback = FXFuseCallback(export={"formats": ["pt2"]}, preflight="full",
                              passes={"quantize_int8": {"enabled": True, "require_cpu_features": False,
                                                        "calibration_batches": 2, "min_top1_agreement": 0.0,
                                                        "max_accuracy_drop": 1.0, "min_cosine": -1.0}})
    H.make_trainer(tmp_path, [callback], max_epochs=1, num_sanity_val_steps=1).fit(ResizingLit(), train, val)
    assert sizes and set(sizes) == {(16, 16)}, sizes  # the preflight's and the end of fit's calibration
    assert callback.preflight is not None
    assert "pt2-int8" in read_manifest(callback.export_dir).formats
    assert not any(n.kind == CALIBRATED_ON_OBSERVED for n in callback.outcome.notes)  # enough training calls


def test_a_variant_that_misses_its_gate_leaves_room_for_the_next_artifact(tmp_path):
    """Item 10: pt2-int8 missed its gate, its files were removed with every empty folder, int8/ included, and
    aoti-int8 then failed with FileNotFoundError (under the serving preset, in the preflight: a stopped training)."""
    pytest.importorskip("torchao")
    from test_lossy_variants import GATE, OutlierHeadNet, _data
    from fx_lightning.config import load_config
    from fx_lightning.pipeline import Batches, fuse_verify_export

    torch.manual_seed(0)
    outcome = fuse_verify_export(
        randomize_batchnorms(OutlierHeadNet()).eval(),
        load_config({"export": {"formats": ["pt2", "aoti"], "aoti_batch_sizes": [16]},
                     "passes": {"quantize_int8": {"enabled": True, "require_cpu_features": False,
                                                  "max_float_layers": 0, **GATE}}}),
        Batches(_data(), "val"), export_dir=tmp_path / "e")
    outcomes = read_manifest(outcome.export_dir).variants["int8"]
    assert {o.entry for o in outcomes} == {"pt2-int8", "aoti-int8"}
    assert all(o.error is None and o.gate is not None and not o.kept for o in outcomes), outcomes
    assert not (outcome.export_dir / "int8").exists()  # nothing kept: the folder is gone


# ------------------------------------------------------------------------------------- items 2, 3 and 6

import dataclasses  # noqa: E402

from fx_lightning.errors import ExportError  # noqa: E402
from fx_lightning.export.check import Reference, check_roundtrip  # noqa: E402
from fx_lightning.export.manifest import Manifest  # noqa: E402
from fx_lightning.formats import FORMATS  # noqa: E402
from fx_lightning.formats.base import FormatEntry  # noqa: E402


class _Labels(nn.Module):
    """Returns ``labels`` with every ``every``-th element flipped: a discrete output that agrees on a known share."""

    def __init__(self, labels: torch.Tensor, every: int) -> None:
        super().__init__()
        self.labels, self.every = labels, every

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.labels.clone()
        out[:: self.every] = 1 - out[:: self.every]
        return out


def test_min_discrete_agreement_reaches_the_artifacts_checks(tmp_path):
    """Item 3: the export's round trip, the selection and the server used a constant 0.999 for discrete outputs,
    whatever parity.min_discrete_agreement said."""
    from fx_lightning.export.select.selection import check_entry

    labels = (torch.arange(200) % 3 == 0).long()
    reference = Reference([(torch.zeros(200, 2),)], [[labels]], 0.0)
    flipped = _Labels(labels, 20)  # 95% agreement
    loose = Manifest({"pt2": FormatEntry("model.pt2")}, config={"parity": {"min_discrete_agreement": 0.9}})
    strict = dataclasses.replace(loose, config={"parity": {"min_discrete_agreement": 0.99}})
    assert check_entry(flipped, loose, "pt2", reference).passed
    failed = check_entry(flipped, strict, "pt2", reference)
    assert not failed.passed and "95.0000%" in (failed.reason or "")
    fmt = dataclasses.replace(FORMATS["pt2"], load=lambda root, entry, device: flipped)
    assert check_roundtrip(tmp_path, fmt, FormatEntry("model.pt2", device="cpu"), reference, False, 0.9).passed
    with pytest.raises(ExportError, match="95.0000%"):
        check_roundtrip(tmp_path, fmt, FormatEntry("model.pt2", device="cpu"), reference, False, 0.99)


def test_a_discrete_output_may_flip_as_often_as_the_fused_models_own_against_fp64(tmp_path):
    """torchvision's Faster R-CNN (held-out check 7): its labels on the check's random image flipped against fp64 on
    1 in 100 in the fp32 model itself, so an artifact identical to it failed the 99.9% agreement and the export was
    refused after training. An artifact may flip twice as many as the fused model (and no more), also when the
    check is read back from check.pt."""
    from fx_lightning.export.check import read_check_file, write_check_file

    labels = (torch.arange(200) % 3 == 0).long()
    reference = Reference([(torch.zeros(200, 2),)], [[labels]], 0.0, fused_agreement=0.99)  # 2 of 200 flipped
    fmt = dataclasses.replace(FORMATS["pt2"], load=lambda root, entry, device: _Labels(labels, 67))  # 3 of 200
    assert check_roundtrip(tmp_path, fmt, FormatEntry("model.pt2", device="cpu"), reference, False).passed
    write_check_file(tmp_path, reference)
    again = read_check_file(tmp_path)
    assert again is not None and again.fused_agreement == 0.99
    assert check_roundtrip(tmp_path, fmt, FormatEntry("model.pt2", device="cpu"), again, False).passed
    fmt = dataclasses.replace(FORMATS["pt2"], load=lambda root, entry, device: _Labels(labels, 20))  # 10 of 200
    with pytest.raises(ExportError, match="95.0000%"):
        check_roundtrip(tmp_path, fmt, FormatEntry("model.pt2", device="cpu"), reference, False)
    flippy = dataclasses.replace(reference, fused_agreement=0.4)  # a fused model flipping more excuses 2% at most
    assert flippy.discrete_agreement(0.999) == pytest.approx(0.979)
    with pytest.raises(ExportError, match="95.0000%"):
        check_roundtrip(tmp_path, fmt, FormatEntry("model.pt2", device="cpu"), flippy, False)


def test_a_round_trip_on_zero_examples_fails(tmp_path):
    """Item 6: an artifact built for batch sizes none of the examples has was 'checked' on nothing and passed."""
    x = torch.randn(4, 3)
    reference = Reference([(x,)], [[x.double()]], 0.0, axes=[0], output_axes=[0])
    fmt = dataclasses.replace(FORMATS["pt2"], load=lambda root, entry, device: nn.Identity())
    entry = FormatEntry("model.pt2", device="cpu", batch_sizes=[3])
    with pytest.raises(ExportError, match="no example"):
        check_roundtrip(tmp_path, fmt, entry, reference, False)
    assert check_roundtrip(tmp_path, fmt, dataclasses.replace(entry, batch_sizes=[4]), reference, False).passed


class _Raises(nn.Module):
    def forward(self, *args):
        raise RuntimeError("no kernel for this CPU")


class _NaN(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args) * float("nan")


def test_a_lossy_artifact_that_fails_on_check_pt_is_never_selected(tmp_path, monkeypatch):
    """Item 2: the selection replaced a lossy artifact's run on check.pt (it raised, returned NaN) by its gate's
    verdict at export, so `bench --select` on another machine could pick, and load_fused load, an artifact that
    does not run there."""
    from fx_lightning.config import load_config
    from fx_lightning.export.select import selection
    from fx_lightning.pipeline import Batches, fuse_verify_export

    torch.manual_seed(0)
    model = randomize_batchnorms(H.LitClassifier().backbone).eval()
    data = [(torch.randn(8, 3, 8, 8), torch.zeros(8, dtype=torch.long)) for _ in range(2)]
    loose = {"enabled": True, "require_cpu_features": False, "min_top1_agreement": 0.0, "max_accuracy_drop": 1.0,
             "min_cosine": 0.9}
    outcome = fuse_verify_export(model, load_config({"export": {"formats": ["pt2"]}, "passes": {"cast_bf16": loose}}),
                                 Batches(data, "val"), export_dir=tmp_path / "e")
    manifest = read_manifest(outcome.export_dir)
    assert manifest.formats["pt2-bf16"].gate.passed
    real = selection.load_artifact
    for broken, why in ((_Raises(), "raises"), (None, "NaN")):
        def load(root, manifest, name, broken=broken, **kwargs):
            module = real(root, manifest, name, **kwargs)
            return module if name != "pt2-bf16" else broken if broken is not None else _NaN(module)

        monkeypatch.setattr(selection, "load_artifact", load)
        table = selection.bench_export(outcome.export_dir, batch_sizes=[1], rounds=1, warmup=0)
        check = table.checks["pt2-bf16"]
        assert not check.passed and check.lossy and why in (check.reason or ""), check
        assert table.checks["pt2"].passed
        assert selection.select_fastest(table, 1).format == "pt2"


# ------------------------------------------------------------------------------------------------ item 7


def test_serve_takes_every_dtype_the_export_states() -> None:
    """Item 7: the server's own numpy table lacked bfloat16 and uint16/32/64, which the manifest, Triton and OIP
    records state; `fx-lightning serve` refused such exports."""
    import json as _json

    import numpy as np

    from fx_lightning.common.dtypes import DTYPES
    from fx_lightning.serve.contract import Contract

    for dtype in DTYPES:
        manifest = Manifest(formats={}, inputs=[{"name": "x", "kind": "tensor", "shape": ["batch", 3],
                                                 "dtype": dtype.torch}])
        contract = Contract.of(manifest)
        values = [[0, 1, 1]] if dtype.torch != "bool" else [[False, True, True]]
        decoded = contract.decode(_json.dumps({"inputs": [values]}).encode(), "application/json")
        assert decoded.arrays[0].dtype == np.dtype(dtype.numpy) and decoded.arrays[0].tolist() == values, dtype


# ------------------------------------------------------------------------------------------------ item 4


def test_a_triton_repository_is_replaced_all_or_nothing(tmp_path, monkeypatch):
    """Item 4: each model directory was replaced as soon as it was copied, so a later model's failed copy left the
    repository half new, and a failed second rename lost the old model."""
    from fx_lightning import fuse_and_export
    from fx_lightning.config import ExportFormat, FuseConfig
    from fx_lightning.export.write import atomic
    from fx_lightning.serve import triton

    torch.manual_seed(0)
    model = randomize_batchnorms(H.LitClassifier().backbone).eval()
    config = FuseConfig()
    config.export.formats = [ExportFormat.onnx, ExportFormat.pt2]
    export = fuse_and_export(model, tmp_path / "exp", example_inputs=(torch.randn(4, 3, 8, 8),),
                             config=config).export_dir
    repo = tmp_path / "repo"
    models = [m.directory for m in triton.write_triton_repository(export, repo).models]
    assert len(models) >= 2
    for directory in models:
        (directory / "old").write_text("the model before")
    real_copy = triton._copy_checked

    def copy_failing_on_the_last_model(source, target, sha256):
        if target.relative_to(repo).parts[0].startswith(f".{models[-1].name}."):  # the last model's staging
            raise OSError("disk full")
        real_copy(source, target, sha256)

    monkeypatch.setattr(triton, "_copy_checked", copy_failing_on_the_last_model)
    with pytest.raises(OSError, match="disk full"):
        triton.write_triton_repository(export, repo, overwrite=True)
    assert all((d / "old").is_file() for d in models)  # no model replaced
    assert sorted(p.name for p in repo.iterdir()) == sorted([*(d.name for d in models), "README.md"])  # no leftovers
    monkeypatch.setattr(triton, "_copy_checked", real_copy)

    real_rename, renames = atomic.os.rename, []

    def rename_failing_on_the_second_model(source, target):
        renames.append(target)
        if len(renames) == 4:  # model 1 aside, model 1 in, model 2 aside, model 2 in: fails
            raise OSError("rename failed")
        real_rename(source, target)

    monkeypatch.setattr(atomic.os, "rename", rename_failing_on_the_second_model)
    with pytest.raises(OSError, match="rename failed"):
        triton.write_triton_repository(export, repo, overwrite=True)
    monkeypatch.setattr(atomic.os, "rename", real_rename)
    assert all((d / "old").is_file() and (d / "config.pbtxt").is_file() for d in models)  # old models back


# ------------------------------------------------------------------------------------------------ item 5


@pytest.mark.parametrize("rank_zero_fails", [False, True])
def test_other_ranks_get_the_export_path_only_after_rank_zero_wrote_it(tmp_path, monkeypatch, rank_zero_fails):
    """Item 5: under torch.distributed a non-zero rank returned the path at once, before rank zero's export existed
    (and never heard that it failed). Rank zero's side is faked here: its message arrives by the broadcast."""
    import torch.distributed as dist

    from fx_lightning.config import FuseConfig
    from fx_lightning.export.write.writer import export_fused

    waited = []

    def broadcast(message, src):
        assert src == 0
        waited.append(True)
        message[0] = "ExportError: disk full" if rank_zero_fails else None

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    call = lambda: export_fused(nn.Linear(2, 2), tmp_path / "e", example_inputs=(torch.randn(2, 2),),  # noqa: E731
                                config=FuseConfig())
    if rank_zero_fails:
        with pytest.raises(ExportError, match="rank 0 failed to write the export: ExportError: disk full"):
            call()
    else:
        assert call() == tmp_path / "e"
    assert waited == [True]
    assert not (tmp_path / "e").exists()  # rank 1 itself writes nothing


# ------------------------------------------------------------------------------------------- items 8 and 9

from typing import Any, NamedTuple  # noqa: E402

import fx_lightning  # noqa: E402
from test_third_party import Pair, Prediction, RecordHead  # noqa: E402


class TextClassifier(nn.Module):
    """``forward(self, **inputs)`` as text classifiers write it: the loss only when ``labels`` are given."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(50, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, **inputs: torch.Tensor):
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        pooled = (self.embed(inputs["input_ids"]) * mask).sum(1) / mask.sum(1)
        logits = self.head(self.norm(pooled))
        out = {"logits": logits}
        if "labels" in inputs:
            out["loss"] = F.cross_entropy(logits, inputs["labels"])
        return out


def test_an_input_the_artifact_was_not_built_for_is_refused(tmp_path):
    """Item 8: called with labels= as in training, the artifact built for input_ids and attention_mask ignored
    them and answered {logits} only; a list built for 2 tensors given 5 answered for the first 2."""
    torch.manual_seed(0)
    model = randomize_batchnorms(TextClassifier()).eval()
    g = torch.Generator().manual_seed(0)
    ids, mask = torch.randint(0, 50, (4, 6), generator=g), torch.ones(4, 6, dtype=torch.long)
    outcome = fx_lightning.fuse_and_export(model, tmp_path / "e", example_inputs={"input_ids": ids,
                                                                                  "attention_mask": mask},
                                           config={"export": {"formats": ["pt2", "graph_module"]}})
    for fmt in ("pt2", "graph_module"):
        loaded = fx_lightning.load_fused(outcome.export_dir, fmt)
        out = loaded(input_ids=ids, attention_mask=mask)
        assert set(out) == {"logits"}
        with pytest.raises(ExportError, match=r"labels given, which the artifact was not built for"):
            loaded(input_ids=ids, attention_mask=mask, labels=torch.zeros(4, dtype=torch.long))

    class TwoViews(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, views):
            return torch.stack([self.bn(self.conv(v)).mean((1, 2, 3)) for v in views], 1)

    views = [torch.randn(4, 3, 8, 8) for _ in range(2)]
    outcome = fx_lightning.fuse_and_export(randomize_batchnorms(TwoViews()).eval(), tmp_path / "v",
                                           example_inputs=(views,), config={"export": {"formats": ["pt2"]}})
    loaded = fx_lightning.load_fused(outcome.export_dir)
    assert loaded(views).shape == (4, 2)
    with pytest.raises(ExportError, match=r"given, which the artifact was not built for") as info:
        loaded(views + [torch.randn(4, 3, 8, 8) for _ in range(3)])
    # FrEIA's inn(z, rev=True): leaving the flag out computes another thing; the advice says so, never just "drop it"
    assert "leave it out only if that is the call you want" in str(info.value), str(info.value)


def _local_record_head():
    class Local(NamedTuple):  # defined inside a function: not importable, not picklable
        logits: torch.Tensor
        features: torch.Tensor

    return RecordHead(Local), Local


@pytest.mark.parametrize("record", [Pair, Prediction, None])
def test_named_tuple_and_dataclass_outputs_come_back_as_such_from_every_format(tmp_path, record):
    """Item 9: a named tuple came back as a plain tuple (out.logits failed) and a dataclass as a dict from the
    torch.export formats; a named tuple defined in a function stopped the pickled formats."""
    torch.manual_seed(0)
    model, cls = (RecordHead(record), record) if record is not None else _local_record_head()
    model = randomize_batchnorms(model).eval()
    formats = ["pt2", "onnx", "graph_module"]  # "code": its generated module lacks _resolve there (left alone)
    outcome = fx_lightning.fuse_and_export(model, tmp_path / "e", example_inputs=(torch.randn(4, 3, 8, 8),),
                                           config={"export": {"formats": formats}})
    assert list(outcome.manifest.formats) == formats, outcome.manifest.failed_formats
    tree = outcome.manifest.signature.output_tree
    assert tree["fields"] == ["logits", "features"] and tree["importable"] is (record is not None)
    x = torch.randn(3, 3, 8, 8)
    want = H.fp64_copy(model)(x.double())
    for fmt in formats:
        got = fx_lightning.load_fused(tmp_path / "e", fmt)(x)
        if record is not None:
            assert type(got) is cls, (fmt, type(got))
        else:  # a stand-in named tuple with the same fields
            assert isinstance(got, tuple) and got._fields == ("logits", "features"), (fmt, type(got))
        assert H.rel_err(got.logits, want.logits) < 1e-5 and H.rel_err(got.features, want.features) < 1e-5, fmt
        assert got.logits.dtype == torch.float32 and got.features.shape == (3, 4)


# ------------------------------------------------------------------- constants of any type (W1, found by trying)

import enum  # noqa: E402


class Stage(enum.Enum):
    TRAIN = "train"
    VAL = "val"


class ScaledByConstants(nn.Module):
    """A tuple and an enum argument, built into the graph as the constants of every observed call."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x, scale, stage):
        y = self.bn(self.conv(x)).mean((2, 3)) * scale[0]
        return y * 2 if stage is Stage.VAL else y


def test_a_built_in_constant_of_any_type_is_checked_never_ignored(tmp_path):
    """A tuple, a torch.dtype or a plain Enum built into the graph was not in the signature's constants, so
    another value was ignored without a word: a wrong answer (relative error 0.75 measured on a darts-like model)."""
    torch.manual_seed(0)
    model = randomize_batchnorms(ScaledByConstants()).eval()
    x = torch.randn(4, 3, 8, 8)
    fx_lightning.fuse_and_export(model, tmp_path / "e", example_inputs=(x, (1.5, 1.0), Stage.VAL),
                                 config={"export": {"formats": ["pt2", "graph_module"]}})
    for fmt in ("pt2", "graph_module"):
        loaded = fx_lightning.load_fused(tmp_path / "e", fmt)
        want = H.fp64_copy(model)(x.double(), (1.5, 1.0), Stage.VAL)
        assert H.rel_err(loaded(x, (1.5, 1.0), Stage.VAL), want) < 1e-5  # the same values, after the manifest
        with pytest.raises(ExportError, match=r"scale is \(2.0, 2.0\); the artifact was built with scale=\(1.5, 1.0\)"):
            loaded(x, (2.0, 2.0), Stage.VAL)
        with pytest.raises(ExportError, match=r"stage is <Stage.TRAIN: 'train'>"):
            loaded(x, (1.5, 1.0), Stage.TRAIN)


class LengthBranch(nn.Module):
    """A branch on the length (torchaudio's ConvTasNet pads to its stride only when the length is not a multiple):
    trained and validated at lengths that are multiples of 8, so the capture holds that side of the branch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(1, 8, 5, padding=2), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        if x.shape[-1] % 8 == 0:
            return y
        return y * 2 + 1


def test_a_branch_on_a_size_is_kept_as_a_condition_and_other_sizes_are_refused(tmp_path) -> None:
    """Wrong at first: torch.export guarded the branch (x.size()[2] % 8 == 0), the fused graph dropped the guard, and
    every artifact computed the multiple-of-8 side for every length (relative error 0.58 at 1234), the manifest
    saying the length varies. The guard is now a condition of the signature, checked on every call."""
    import lightning_helpers as H
    from fx_lightning import load_fused
    from fx_lightning.errors import ExportError

    cb, module = _fit_with_callback(tmp_path, LengthBranch(), torch.randn(8, 1, 64), batch_size=4)
    signature = read_manifest(cb.export_dir).signature
    assert signature is not None and signature.conditions == ["size0_2 % 8 == 0"]
    reference = H.fp64_copy(module.model)
    for name in read_manifest(cb.export_dir).formats:
        fused = load_fused(cb.export_dir, format=name)
        x = torch.randn(2, 1, 96)  # a length never seen, on the side of the branch the capture holds
        assert H.rel_err(fused(x), reference(x.double())) < 1e-5, name
        for length in (100, 67):
            with pytest.raises(ExportError, match=r"takes only sizes where x.shape\[2\] % 8 == 0"):
                fused(torch.randn(2, 1, length))


class PadToStride(nn.Module):
    """torchaudio's ConvTasNet: pads the input to a multiple of its stride and crops the output back."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv1d(1, 8, 16, stride=8, padding=8, bias=False)
        self.bn = nn.BatchNorm1d(8)
        self.dec = nn.ConvTranspose1d(8, 1, 16, stride=8, padding=8, bias=False)

    def forward(self, mix: torch.Tensor) -> torch.Tensor:
        length, rest = mix.shape[-1], mix.shape[-1] % 8
        if rest:
            mix = F.pad(mix, [0, 8 - rest])
        out = self.dec(torch.relu(self.bn(self.enc(mix))))
        return out[..., :length] if rest else out


def test_a_length_a_condition_refuses_is_padded_as_the_model_pads_where_proven(tmp_path) -> None:
    """ConvTasNet trained on multiples of 8: every other length was refused by the condition T % 8 == 0. The model
    pads to a multiple and crops back; so does the artifact now, as shown on the observed call cut to refused lengths.
    (LengthBranch above, whose other side is not padding, stays refused.)"""
    import lightning_helpers as H
    from fx_lightning import load_fused

    cb, module = _fit_with_callback(tmp_path, PadToStride(), torch.randn(16, 1, 400), batch_size=4)
    signature = read_manifest(cb.export_dir).signature
    assert signature is not None and "size0_2 % 8 == 0" in signature.conditions and signature.padded
    reference = H.fp64_copy(module.model)
    for name in read_manifest(cb.export_dir).formats:
        fused = load_fused(cb.export_dir, format=name)
        for shape in ((2, 1, 400), (1, 1, 1234), (3, 1, 77), (2, 1, 8003)):
            x = torch.randn(*shape)
            got = fused(x)
            assert got.shape == shape and H.rel_err(got, reference(x.double())) < 1e-5, (name, shape)


def test_a_condition_in_a_manifest_is_never_run_as_code() -> None:
    from fx_lightning.signature.conditions import condition_holds

    x = torch.zeros(2, 3, 16)
    assert condition_holds("size0_2 % 8 == 0 and size0_1 >= 3", [x])
    assert not condition_holds("(size0_2 // 3) == 4", [x])
    for text in ("__import__('os').system('true')", "size0_2.bit_length() > 0", "[size0_2][0] == 16",
                 "max(size0_2) > 3"):
        with pytest.raises(ValueError, match="not a size condition"):
            condition_holds(text, [x])


class FramesAtLeastOne(nn.Module):
    """Wav2Vec2's frame count, ``max(1, frames - 1)``: torch.export guards it with ``torch.sym_max``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(1, 8, 20, stride=20), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        frames = max(1, h.shape[-1] - 1)
        return h[..., :frames].mean(-1) * frames


def test_a_guard_calling_sym_max_is_a_condition_and_the_length_stays_dynamic(tmp_path) -> None:
    """Wav2Vec2 stopped training in the preflight: a guard calling torch.sym_max could not be read, so the capture
    was fixed to the example's length, and parity on the next validation length failed ("built for 3067 there")."""
    import lightning_helpers as H
    from fx_lightning import load_fused
    from fx_lightning.errors import ExportError

    cb, module = _fit_with_callback(tmp_path, FramesAtLeastOne(), torch.randn(8, 1, 400), batch_size=4)
    signature = read_manifest(cb.export_dir).signature
    assert signature is not None and any("max(" in c for c in signature.conditions)
    reference = H.fp64_copy(module.model)
    for name in read_manifest(cb.export_dir).formats:
        fused = load_fused(cb.export_dir, format=name)
        for shape in ((1, 1, 400), (3, 1, 1000), (2, 1, 77)):
            x = torch.randn(*shape)
            assert H.rel_err(fused(x), reference(x.double())) < 1e-5, (name, shape)
        with pytest.raises(ExportError, match="takes only sizes where"):
            fused(torch.randn(2, 1, 39))  # one frame: the other side of max(1, ...)


class SizeBranches(nn.Module):
    """Branches on a size the training calls never took: a batch of one, a long input beyond the size probe's 2x."""

    def __init__(self, branch: str) -> None:
        super().__init__()
        self.branch = branch
        self.conv, self.bn, self.fc = nn.Conv1d(2, 8, 3, padding=1), nn.BatchNorm1d(8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).mean(-1)
        taken = x.shape[0] == 1 if self.branch == "batch_of_one" else x.shape[-1] > 200
        return self.fc(h * 3 - 1 if taken else h)


@pytest.mark.parametrize("branch, refused, condition", [
    ("batch_of_one", (1, 2, 64), r"x.shape\[0\] != 1"),
    ("long_input", (3, 2, 300), r"x.shape\[2\] <= 200"),
])
def test_a_branch_on_a_size_never_observed_is_refused_by_name(tmp_path, branch, refused, condition) -> None:
    """Wrong at first (relative error 0.3 at batch 1, 0.9 at length 300): torch.export takes a dynamic size to be 2
    or more, so the batch-of-one branch is neither in the graph nor guarded; the long-input branch was guarded, and
    the guard dropped. Now the graph is run on one row against the model at capture, and both are conditions."""
    import lightning_helpers as H
    from fx_lightning import load_fused
    from fx_lightning.errors import ExportError

    cb, module = _fit_with_callback(tmp_path, SizeBranches(branch), torch.randn(16, 2, 64), batch_size=8)
    reference = H.fp64_copy(module.model)
    for name in read_manifest(cb.export_dir).formats:
        fused = load_fused(cb.export_dir, format=name)
        x = torch.randn(3, 2, 96)
        assert H.rel_err(fused(x), reference(x.double())) < 1e-5, name
        with pytest.raises(ExportError, match=f"takes only sizes where {condition}"):
            fused(torch.randn(*refused))


def _fit_with_callback(tmp_path, model: nn.Module, inputs: torch.Tensor, batch_size: int):
    """``model`` trained one epoch on ``inputs`` in a LightningModule whose steps call it, with ``FXFuseCallback()``
    alone; the callback and the module."""
    import lightning_helpers as H
    from fx_lightning import FXFuseCallback

    class Steps(H.CrossEntropySteps):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch, batch_idx):
            return self(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self(batch[0])

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=batch_size)
    cb, module = FXFuseCallback(), Steps()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    return cb, module


class KeyLayer:
    """transformers' DynamicLayer: tensors, a flag, the dtype and the device."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys, self.is_initialized, self.dtype, self.device = keys, True, keys.dtype, keys.device


class KeyCache:
    """A cache object as transformers returns one beside the logits (``DynamicCache``): public fields, a list of
    layer objects among them."""

    def __init__(self, keys: torch.Tensor, step: int) -> None:
        self.layers, self.step, self.replicate, self.is_updated = [KeyLayer(keys)], step, None, {0: True}


class WithCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.out = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.bn(self.lin(x))
        return self.out(h), KeyCache(h * 2, 1)


class AffineFlow(nn.Module):
    """zuko's flows: a distribution whose tensors sit in its transforms, not in its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 6))

    def forward(self, c: torch.Tensor) -> torch.distributions.Distribution:
        loc, s = self.net(c).chunk(2, -1)
        base = torch.distributions.Independent(torch.distributions.Normal(torch.zeros_like(loc), torch.ones_like(loc)), 1)
        return torch.distributions.TransformedDistribution(
            base, [torch.distributions.AffineTransform(loc, F.softplus(s) + 1e-3, event_dim=1)])


def _fit_returning(tmp_path, model: nn.Module, loss: Any, inputs: torch.Tensor):
    import lightning_helpers as H
    from fx_lightning import FXFuseCallback

    class Steps(H.CrossEntropySteps):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> Any:
            return self.model(x)

        def training_step(self, batch, batch_idx):
            return loss(self(batch[0]))

        def validation_step(self, batch, batch_idx):
            self(batch[0])

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=8)
    cb, module = FXFuseCallback(), Steps()
    H.make_trainer(tmp_path, [cb], max_epochs=1).fit(module, loader, loader)
    return cb, module


def test_an_object_of_the_outputs_comes_back_as_its_class(tmp_path) -> None:
    """transformers' T5 returns its cache as an object of tensor fields: it came back as a dict of them."""
    import lightning_helpers as H
    from fx_lightning import load_fused

    cb, module = _fit_returning(tmp_path, WithCache(), lambda out: out[0].pow(2).mean(), torch.randn(32, 8))
    assert set(read_manifest(cb.export_dir).formats) >= {"pt2", "graph_module"}  # the dtype kept out of the graph
    reference = H.fp64_copy(module.model)
    for name in read_manifest(cb.export_dir).formats:
        x = torch.randn(3, 8)
        logits, cache = load_fused(cb.export_dir, format=name)(x)
        want_logits, want_cache = reference(x.double())
        assert type(cache) is KeyCache and cache.step == 1 and cache.replicate is None, name
        assert cache.is_updated == {0: True}, name
        layer = cache.layers[0]
        assert type(layer) is KeyLayer and set(vars(layer)) == {"keys", "is_initialized", "dtype", "device"}, name
        assert (layer.dtype, layer.device, layer.is_initialized) == (torch.float32, torch.device("cpu"), True), name
        assert H.rel_err(logits, want_logits) < 1e-5, name
        assert H.rel_err(layer.keys, want_cache.layers[0].keys) < 1e-5, name


def test_a_distribution_an_artifact_cannot_build_again_is_refused_before_training(tmp_path) -> None:
    """zuko's flow: a TransformedDistribution (its tensors in an AffineTransform) came back as {} without a word."""
    from fx_lightning.errors import FXLightningError

    torch.manual_seed(0)
    with pytest.raises(FXLightningError, match=r"(?s)stopped before the first optimizer step.*output is a torch."
                                               r"distributions.transformed_distribution.TransformedDistribution, a "
                                               r"distribution an artifact cannot build"):
        _fit_returning(tmp_path, AffineFlow(), lambda d: -d.log_prob(torch.zeros(8, 3)).mean(), torch.randn(32, 2))


def test_a_distribution_refused_names_the_target_that_works_and_it_does(tmp_path) -> None:
    """The refusal's advice (test_advice's convention): the submodule it names, set as target, exports and is right."""
    import lightning_helpers as H
    from fx_lightning import FXFuseCallback, load_fused
    from fx_lightning.errors import FXLightningError

    with pytest.raises(FXLightningError, match=r"set target: model.net \(") as raised:
        _fit_returning(tmp_path / "a", AffineFlow(), lambda d: -d.log_prob(torch.zeros(8, 3)).mean(), torch.randn(32, 2))
    target = re.search(r"set target: (\S+) \(", str(raised.value)).group(1)
    flow = AffineFlow()

    class Steps(H.CrossEntropySteps):
        def __init__(self) -> None:
            super().__init__()
            self.model = flow

        def training_step(self, batch, batch_idx):
            return -self.model(batch[0]).log_prob(torch.zeros(8, 3)).mean()

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 2)), batch_size=8)
    cb = FXFuseCallback(target=target)
    H.make_trainer(tmp_path / "b", [cb], max_epochs=1).fit(Steps(), loader)
    c = torch.randn(5, 2)
    assert H.rel_err(load_fused(cb.export_dir)(c), H.fp64_copy(flow.net)(c.double())) < 1e-5


class WithDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.bn(self.conv(x))
        return y, y.dtype


def test_a_dtype_among_plain_outputs_stays_a_dtype() -> None:
    """Review: the dtype kept out of the graph's outputs (for torch.export) came back as None from a fused model
    whose outputs are not rebuilt from their recorded tree."""
    model = randomize_batchnorms(WithDtype()).eval()
    x = torch.randn(2, 3, 8, 8)
    out = fx_lightning.fuse(model, example_inputs=(x,)).module(x)
    assert out[1] is torch.float32


def test_an_output_tree_in_a_manifest_is_read_never_run_and_a_bad_one_is_named() -> None:
    """Review: a constant's dtype was read with getattr(torch, text) (any attribute), a device or a literal that
    cannot be read raised an unnamed error, and an object whose class does not import came back as a dict."""
    from fx_lightning.errors import ExportError
    from fx_lightning.signature.outputs import rebuild_outputs

    assert rebuild_outputs({"kind": "const", "literal": "{0: True}"}, []) == {0: True}
    assert rebuild_outputs({"kind": "const", "dtype": "bfloat16"}, []) is torch.bfloat16
    for node, words in (({"kind": "const", "dtype": "nn"}, "dtype 'nn' cannot be read"),
                        ({"kind": "const", "literal": "__import__('os')"}, "literal"),
                        ({"kind": "const", "device": "nowhere:7"}, "device 'nowhere:7' cannot be read"),
                        ({"kind": "object", "class": "no_such_package.cache:Cache", "keys": ["k"],
                          "items": [{"kind": "tensor"}]}, "cannot be imported here")):
        with pytest.raises(ExportError, match=words):
            rebuild_outputs(node, [torch.zeros(1)])


class Features(collections.UserDict):
    """transformers' BatchEncoding: a mapping of its own class."""


class ReturnsFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> Features:
        return Features(embedding=self.f(x), scale=2)


def test_a_mapping_of_its_own_class_comes_back_as_that_class(tmp_path) -> None:
    """It came back as a plain dict (changed structure)."""
    import lightning_helpers as H
    from fx_lightning import load_fused

    cb, module = _fit_returning(tmp_path, ReturnsFeatures(), lambda out: out["embedding"].pow(2).mean(),
                                torch.randn(32, 8))
    reference = H.fp64_copy(module.model)
    for name in read_manifest(cb.export_dir).formats:
        x = torch.randn(3, 8)
        got = load_fused(cb.export_dir, format=name)(x)
        assert type(got) is Features and got["scale"] == 2, name
        assert H.rel_err(got["embedding"], reference(x.double())["embedding"]) < 1e-5, name


class LazyCovarianceNormal(torch.distributions.Distribution):
    """gpytorch's MultivariateNormal: built from ``(mean, covariance)`` under other names, the covariance kept in a
    private lazy attribute; only ``loc`` is a parameter of its ``arg_constraints``."""

    arg_constraints = {"loc": torch.distributions.constraints.real_vector}

    def __init__(self, mean: torch.Tensor, covariance: torch.Tensor) -> None:
        self.loc, self._covar, self._islazy = mean, covariance, True
        super().__init__(mean.shape[:-1], mean.shape[-1:], validate_args=False)

    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    @property
    def variance(self) -> torch.Tensor:
        return self._covar.diagonal(dim1=-2, dim2=-1) if self._islazy else self._covar


class LazyGP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.mean_head, self.scale_head = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.features(x)
        return LazyCovarianceNormal(self.mean_head(h), torch.diag_embed(F.softplus(self.scale_head(h))))


def test_a_distribution_whose_state_is_not_its_parameters_is_refused_before_training(tmp_path) -> None:
    """gpytorch's SVGP (held-out check 7): the MultivariateNormal came back with its mean only, and ``.variance``,
    ``.stddev`` and the likelihood raised AttributeError, where the model gives them."""
    from fx_lightning.errors import FXLightningError

    torch.manual_seed(0)
    with pytest.raises(FXLightningError, match=r"(?s)stopped before the first optimizer step.*output is a "
                                               r"test_never_wrong.LazyCovarianceNormal, a distribution an artifact "
                                               r"cannot build again"):
        _fit_returning(tmp_path, LazyGP(), lambda d: (d.mean.pow(2) + d.variance).mean(), torch.randn(32, 2))


class TwiceCalledGP(nn.Module):
    """gpytorch's SVGP calls its kernel twice, on inputs of other shapes; the output is refused (see LazyGP)."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.Tanh()
        self.net = nn.Sequential(nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> Any:
        h = self.act(self.net[0](self.act(x)))  # act on 2, then on 8 features
        return LazyCovarianceNormal(self.net[1](h), torch.diag_embed(F.softplus(h[:, :3])))


def test_the_target_advice_sees_a_submodule_called_twice_and_names_an_index_that_works(tmp_path) -> None:
    """gpytorch (held-out check 7, rerun): the advice said "nothing to set" although the feature extractor returns
    tensors. Its forward hook returned the first output recorded, which replaced the output of the second call of a
    module called twice, and the run failed; and torchrl's advice ``target: actor.module.0.module`` was refused as
    not a dotted attribute path."""
    from fx_lightning import FXFuseCallback, load_fused
    from fx_lightning.errors import FXLightningError

    torch.manual_seed(0)
    with pytest.raises(FXLightningError, match=r"set target: model\.net\.0 \(") as raised:
        _fit_returning(tmp_path / "a", TwiceCalledGP(), lambda d: (d.mean.pow(2) + d.variance).mean(),
                       torch.randn(32, 2))
    target = re.search(r"set target: (\S+) \(", str(raised.value)).group(1)
    model = TwiceCalledGP()

    class Steps(H.CrossEntropySteps):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(batch[0]).mean.pow(2).mean()

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 2)), batch_size=8)
    cb = FXFuseCallback(target=target)
    H.make_trainer(tmp_path / "b", [cb], max_epochs=1).fit(Steps(), loader)
    x = torch.randn(5, 2)
    assert H.rel_err(load_fused(cb.export_dir)(x), H.fp64_copy(model.net[0])(x.double())) < 1e-5
