"""The models people train: a zoo of 51 small real models (timm, torchvision detection/segmentation/video/flow,
segmentation_models_pytorch, MONAI, Hugging Face transformers; tests/zoo_models.py), random weights and
randomised BatchNorm statistics, fused with the defaults and judged against an fp64 copy of the original.

For each: no wrong output (the fused error at most 1.5x the unfused fp32 model's own error against fp64, or
1e-5), the input module unchanged, and no BatchNorm left that sits where a fold applies (after a conv/linear
whose output nothing else reads, after a flatten of such a Linear, after a concat of such convs); every
BatchNorm left has a reason in the report.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any, Dict

import pytest
import torch
import torch.fx as fx
from torch import nn

from fusion_helpers import fingerprint, randomize_batchnorms, rel_err
from zoo_models import ZOO
from fx_lightning import fuse
from fx_lightning.capture.graph import CAPTURE_FELL_BACK
from fx_lightning.common.batches import flat_tensors
from fx_lightning.parity.compare import structure_mismatch
from fx_lightning.passes.bn_views import is_batchnorm_node

LIBRARY_MODULES = {"timm": "timm", "torchvision": "torchvision", "smp": "segmentation_models_pytorch",
                   "monai": "monai", "transformers": "transformers"}


def _build(name: str) -> Any:
    library, build = ZOO[name]
    if importlib.util.find_spec(LIBRARY_MODULES[library]) is None:
        pytest.skip(f"{LIBRARY_MODULES[library]} is not installed (pip install -e '.[dev]')")
    torch.set_num_threads(1)
    model, inputs = build()
    return randomize_batchnorms(model).eval(), inputs


def _errors(model: nn.Module, fused: nn.Module, inputs: tuple) -> Dict[str, float]:
    """Relative error of the fused and of the unfused fp32 model against fp64 (fp32 when fp64 cannot run); first of
    all, the fused model's outputs keep the model's structure (count, nesting, shapes, dtypes)."""
    with torch.no_grad():
        fused_out, model_out = fused(*inputs), model(*inputs)
        mismatch = structure_mismatch(fused_out, model_out)
        assert mismatch is None, f"the fused model's outputs have another structure: {mismatch}"
        out, base = flat_tensors(fused_out), flat_tensors(model_out)
        try:
            ref = flat_tensors(copy.deepcopy(model).double()(*(x.double() for x in inputs)))
        except RuntimeError:  # RAFT's grid sampling has no fp64 kernel here: compare with fp32
            ref = base
    pairs = [(o, b, r) for o, b, r in zip(out, base, ref) if r.is_floating_point()]
    assert len(out) == len(ref) and pairs
    return {"fused": max(rel_err(o, r) for o, _, r in pairs), "unfused": max(rel_err(b, r) for _, b, r in pairs)}


# ------------------------------------------------------------------ an oracle of what must have folded

_META = {"ndim", "shape", "size", "dim", "dtype", "device", "numel"}


def _reads_values(user: fx.Node, value: fx.Node) -> bool:
    """False for the uses that read only metadata: x.ndim / x.shape / x.size() / sym_size, reshape_as(x)."""
    if user.op == "call_function" and user.target is getattr:
        return user.args[1] not in _META
    if user.op == "call_method" and user.target in _META:
        return False
    name = getattr(user.target, "__name__", str(user.target))
    if "sym_size" in name or "sym_numel" in name:
        return False
    shape_donor = name.startswith(("reshape_as", "view_as", "expand_as"))
    return not (shape_donor and len(user.args) > 1 and user.args[1] is value and user.args[0] is not value)


def _single_reader(node: fx.Node) -> bool:
    return sum(1 for u in node.users if _reads_values(u, node)) == 1


def _is_layer(gm: fx.GraphModule, node: Any, kinds: tuple) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), kinds)
    names = ("conv", "convolution") if nn.Linear not in kinds else ("linear",)
    return node.op == "call_function" and any(getattr(node.target, "__name__", str(node.target)).startswith(n)
                                              for n in names)


CONVS = (nn.modules.conv._ConvNd,)


def must_have_folded(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Independent of the passes: a BatchNorm node sitting where an exact fold applies."""
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return False
    if _is_layer(gm, src, CONVS + (nn.Linear,)):
        return _single_reader(src) and "groups" not in str(src.kwargs)
    name = getattr(src.target, "__name__", str(src.target))
    if src.op in ("call_method", "call_function") and any(k in name for k in ("flatten", "reshape", "view")):
        inner = src.args[0]
        return _is_layer(gm, inner, (nn.Linear,)) and _single_reader(inner) and _single_reader(src)
    if src.op == "call_function" and name in ("cat", "cat.default", "concat") and isinstance(src.args[0], (list, tuple)):
        parts = src.args[0]
        return (_single_reader(src) and all(_is_layer(gm, p, CONVS) and _single_reader(p) for p in parts)
                and (src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)) in (1, -3, -4, -5))
    return False


# ------------------------------------------------------------------------------------------ the zoo


@pytest.mark.parametrize("name", sorted(ZOO))
def test_real_model_fuses_exactly_and_folds_what_it_can(name: str) -> None:
    model, inputs = _build(name)
    before = fingerprint(model)
    result = fuse(model, example_inputs=inputs)
    assert fingerprint(model) == before, "fuse() changed its input module"
    errors = _errors(model, result.graph_module, inputs)
    assert errors["fused"] <= max(1.5 * errors["unfused"], 1e-5), (errors, str(result.report))

    gm, report = result.graph_module, result.report
    left = [n for n in gm.graph.nodes if is_batchnorm_node(gm, n)]
    missed = [n.name for n in left if must_have_folded(gm, n)]
    assert not missed, f"BatchNorms left where a fold applies: {missed}\n{report}"
    assert report.after.batchnorms == len(left) + len([r for r in report.remaining_batchnorms
                                                       if "traced into plain arithmetic" in r.reason])
    assert len(report.remaining_batchnorms) == report.after.batchnorms  # a reason for every one left
    assert all(r.reason for r in report.remaining_batchnorms)


def _deploy_blocks(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if type(m).__name__ in ("RepVggBlock", "MobileOneBlock"))


@pytest.mark.parametrize("name", ["timm/repvgg_a0", "timm/mobileone_s0"])
def test_reparameterisable_models_come_out_with_one_conv_per_block(name: str) -> None:
    model, inputs = _build(name)
    result = fuse(model, example_inputs=inputs)
    gm = result.graph_module
    convs = sum(1 for n in gm.graph.nodes if _is_layer(gm, n, CONVS))
    blocks = _deploy_blocks(model)
    assert blocks > 10 and convs == blocks, (convs, blocks)
    assert result.report.after.batchnorms == 0
    changed = result.report.pass_report("reparameterize").changed
    assert len(changed) == blocks and all(c.details["relative_change"] <= 1e-4 for c in changed)


def test_the_zoo_has_what_the_issue_asks_for() -> None:
    """At least 25 models, at least 10 of them timm models built on BatchNormAct2d (checked by class)."""
    pytest.importorskip("timm")
    assert len(ZOO) >= 25
    act = 0
    for name, (library, build) in ZOO.items():
        if library == "timm":
            model, _ = build()
            act += any(type(m).__name__ in ("BatchNormAct2d", "SyncBatchNormAct", "FrozenBatchNormAct2d")
                       for m in model.modules())
    assert act >= 10, act


def test_a_wrong_symbolic_trace_falls_back_to_export_or_raises_in_fx_mode() -> None:
    """MONAI's BasicUNet branches on torch.jit.isinstance, which symbolic tracing records wrongly (the skip
    connection's cat disappears): auto mode notices on the example inputs and captures with torch.export."""
    from fx_lightning import TraceError

    model, inputs = _build("monai/BasicUNet-2d")
    result = fuse(model, example_inputs=inputs)
    note = result.report.notes[0]
    assert result.report.capture_mode == "export" and note.kind == CAPTURE_FELL_BACK
    assert note["what"] == "gave a graph that differs from the model"
    with pytest.raises(TraceError, match="unfaithful") as info:
        fuse(model, {"trace": {"mode": "fx"}}, example_inputs=inputs)
    assert "first difference at" in str(info.value) and "trace.mode: export" in str(info.value)


def test_callback_end_to_end_with_a_timm_backbone(tmp_path) -> None:
    """A LightningModule whose backbone is timm's mobilenetv3 (BatchNormAct2d throughout): the callback folds
    every BatchNorm, passes parity on the validation batches and exports a model that loads without timm."""
    timm = pytest.importorskip("timm")
    import lightning_helpers as H
    from fx_lightning import FXFuseCallback, load_fused

    torch.manual_seed(0)
    backbone = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=0)
    assert sum(type(m).__name__ == "BatchNormAct2d" for m in backbone.modules()) >= 30
    with torch.no_grad():
        width = backbone.eval()(torch.randn(2, 3, 8, 8)).shape[1]
    model = H.LitClassifier(backbone=backbone.train(), width=width)
    fuse_cb = FXFuseCallback(export={"formats": ["pt2", "graph_module"]})
    trainer = H.make_trainer(tmp_path, [fuse_cb], max_epochs=1, limit_train_batches=2)
    train, val = H.loaders()
    trainer.fit(model, train, val)
    report = fuse_cb.result.report  # type: ignore[union-attr]
    assert report.before.batchnorms >= 30 and report.after.batchnorms == 0, str(report)
    assert report.pass_report("batchnorm_forms").changed  # the BatchNormAct2d layers, made plain
    assert fuse_cb.parity_report is not None and fuse_cb.parity_report.passed
    x = torch.randn(3, 3, 8, 8)
    ref = H.fp64_copy(model.backbone)(x.double())
    with torch.no_grad():
        assert H.rel_err(load_fused(fuse_cb.export_dir)(x), ref) <= 1e-5


def test_a_trace_error_points_at_the_model_librarys_line() -> None:
    """Frames under site-packages/torchvision are the model's code, not torch's: the error names raft.py."""
    from fx_lightning import TraceError

    model, inputs = _build("torchvision/raft_large")
    with pytest.raises(TraceError) as info:
        fuse(model, {"trace": {"mode": "fx"}}, example_inputs=inputs)
    assert "torchvision/models/optical_flow/raft.py:" in str(info.value).replace("\\", "/")


def test_the_report_groups_one_reason_given_for_many_batchnorms() -> None:
    model, inputs = _build("timm/densenet121")
    text = " ".join(str(fuse(model, example_inputs=inputs).report).split())  # the console wraps long lines
    reason = ("62 x no exact fold: before it, its input is <cat>, a concatenation of values that are not all conv "
              "outputs; after it, it reaches a nonlinearity (<ReLU>)")
    assert reason in text
    # One line where fuse_bn_into_next left them, one among the BatchNorms still in the graph: not 62 each.
    assert text.count("a concatenation of values that are not all conv outputs") == 2
