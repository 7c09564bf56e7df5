"""fuse(): the public contract, user passes, errors and the report."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from fusion_helpers import assert_exact, fingerprint, randomize_batchnorms, rel_err
from fx_lightning import ConfigError, FuseConfig, PassError, fuse, register_pass
from fx_lightning.passes import registered_passes


def small() -> nn.Module:
    return randomize_batchnorms(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4), nn.BatchNorm1d(4),
    ))


def test_fuse_accepts_dataclass_dict_and_dictconfig():
    from omegaconf import OmegaConf

    x = torch.randn(2, 3, 6, 6)
    for cfg in (None, FuseConfig(), {"passes": {"remove_dropout": {"enabled": True}}},
                OmegaConf.create({"trace": {"mode": "fx"}})):
        result = fuse(small(), cfg, example_inputs=x)
        assert result.report.after.batchnorms == 0
        assert result.report.after.dropouts == 0


def test_input_module_is_never_changed():
    model = small().train()
    model[0].weight.requires_grad_(True)
    before = fingerprint(model)
    fuse(model, example_inputs=torch.randn(2, 3, 6, 6))
    assert fingerprint(model) == before


def test_report_is_json_safe_and_readable():
    result = fuse(small(), example_inputs=torch.randn(2, 3, 6, 6))
    data = json.loads(json.dumps(result.report.to_dict()))
    assert data["before"]["batchnorms"] == 2 and data["after"]["batchnorms"] == 0
    assert data["batchnorms_folded"] == 2
    from fx_lightning.passes import builtin_passes

    order = [spec.name for spec in builtin_passes()]
    assert [p["name"] for p in data["passes"]][:5] == order[:5]
    assert order[:5] == ["reparameterize", "batchnorm_forms", "remove_dropout", "remove_identity", "fuse_conv_bn"]
    text = str(result.report)
    assert "fuse_conv_bn" in text and "BatchNorms" in text and "before" in text


@register_pass("test_scale_output", options=None, preserves_computation=False)
def _scale_output(gm, options, ctx):
    from sample_passes import double_output

    return double_output(gm, options, ctx)


def test_registered_user_pass_runs_with_options():
    assert "test_scale_output" in registered_passes()
    model = small()
    x = torch.randn(2, 3, 6, 6)
    result = fuse(model, {"passes": {"extra": [{"name": "test_scale_output", "options": {"factor": 3.0}}]}},
                  example_inputs=x)
    spec = result.report.pass_report("test_scale_output")
    assert spec.preserves_computation is False and spec.changed
    with torch.no_grad():
        assert rel_err(result.graph_module(x), 3.0 * model.eval()(x)) < 1e-5


def test_user_pass_by_import_path():
    model = small()
    x = torch.randn(2, 3, 6, 6)
    result = fuse(model, {"passes": {"extra": ["sample_passes:double_output"]}}, example_inputs=x)
    with torch.no_grad():
        assert rel_err(result.graph_module(x), 2.0 * model.eval()(x)) < 1e-5


def test_a_torch_fx_pass_base_registered_as_a_user_pass_runs_with_its_options():
    """torch.fx's own pass interface (``PassBase.call(gm) -> PassResult(graph_module, modified)``): before, a
    registered subclass was called as ``fn(gm, options, ctx)`` and failed in its constructor."""
    from sample_passes import ScaleOutputFxPass

    register_pass("test_fx_scale", preserves_computation=False, replace=True)(ScaleOutputFxPass)
    model, x = small(), torch.randn(2, 3, 6, 6)
    result = fuse(model, {"passes": {"extra": [{"name": "test_fx_scale", "options": {"factor": 3.0}}]}},
                  example_inputs=x)
    report = result.report.pass_report("test_fx_scale")
    assert [c.what for c in report.changed] == ["modified by the torch.fx pass ScaleOutputFxPass"]
    with torch.no_grad():
        assert rel_err(result.graph_module(x), 3.0 * model.eval().double()(x.double())) < 1e-5


def test_a_torch_fx_pass_returning_a_new_graph_module_by_import_path():
    model, x = small(), torch.randn(2, 3, 6, 6)
    result = fuse(model, {"passes": {"extra": ["sample_passes:RebuildWithOffsetFxPass"]}}, example_inputs=x)
    assert result.report.pass_report("sample_passes:RebuildWithOffsetFxPass").changed
    with torch.no_grad():
        assert rel_err(result.graph_module(x), model.eval().double()(x.double()) + 0.5) < 1e-5


def test_a_torch_fx_pass_s_new_buffers_stay_buffers_and_follow_dtype_moves():
    """Before: a new GraphModule's buffer was set as a plain attribute: missing from state_dict() and left in fp32 by
    ``.double()`` (the bf16 variant's ``.to(bfloat16)`` likewise)."""
    model, x = small(), torch.randn(2, 3, 6, 6)
    result = fuse(model, {"passes": {"extra": ["sample_passes:ReplaceSubmoduleByTensorFxPass"]}}, example_inputs=x)
    gm = result.graph_module
    assert "shift" in dict(gm.named_buffers()) and "shift" in gm.state_dict()
    doubled = copy.deepcopy(gm).double()
    assert doubled.shift.dtype == torch.float64
    with torch.no_grad():
        assert rel_err(doubled(x.double()), model.eval().double()(x.double()) + 0.25) < 1e-5  # folded in fp32


def test_the_same_torch_fx_pass_registered_twice_is_one_pass_and_an_instance_refuses_options():
    from sample_passes import ScaleOutputFxPass

    register_pass("test_fx_twice", preserves_computation=False)(ScaleOutputFxPass)
    register_pass("test_fx_twice", preserves_computation=False)(ScaleOutputFxPass)  # a module imported again
    register_pass("test_fx_instance", preserves_computation=False, replace=True)(ScaleOutputFxPass(factor=5.0))
    with pytest.raises(PassError, match="registered as an instance: it takes no options"):
        fuse(small(), {"passes": {"extra": [{"name": "test_fx_instance", "options": {"factor": 3.0}}]}},
             example_inputs=torch.randn(2, 3, 6, 6))


def test_register_pass_refuses_silent_overwrite():
    with pytest.raises(ValueError, match="is a built-in pass"):  # not "pass replace=True": that is refused too
        register_pass("fuse_conv_bn")(lambda gm, o, c: None)
    with pytest.raises(ValueError, match="is a built-in pass"):
        register_pass("fuse_conv_bn", replace=True)(lambda gm, o, c: None)


def test_pass_that_raises_is_named():
    with pytest.raises(PassError, match=r"sample_passes:raises.*boom"):
        fuse(small(), {"passes": {"extra": ["sample_passes:raises"]}})


def test_pass_that_breaks_the_graph_is_named():
    with pytest.raises(PassError, match=r"sample_passes:breaks_graph.*does not lint"):
        fuse(small(), {"passes": {"extra": ["sample_passes:breaks_graph"]}})


@pytest.mark.parametrize("name", ["no_such_pass", "sample_passes:missing", "sample_passes:NOT_CALLABLE"])
def test_unknown_pass_is_a_config_error(name):
    with pytest.raises(ConfigError, match=r"passes.extra\[0\].name"):
        fuse(small(), {"passes": {"extra": [name]}})


def test_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fuse(lambda x: x)  # type: ignore[arg-type]


def test_every_builtin_can_be_disabled_and_result_stays_exact():
    from fx_lightning.passes import builtin_passes

    cfg = {"passes": {spec.name: {"enabled": False} for spec in builtin_passes()}}
    model = small()
    x = torch.randn(2, 3, 6, 6)
    result = fuse(model, cfg, example_inputs=x)
    assert result.report.passes == [] and result.report.after.batchnorms == 2
    assert_exact(model, result.graph_module, (x,))


# ------------------------------------------------------------------------------------ the pass records


def test_change_and_skip_are_typed_and_keep_their_json_shape():
    from fx_lightning.passes import Change, PassResult, Skip

    result = PassResult()
    result.change("bn1", "folded", into="conv1 (Conv2d 'conv1')", kind="conv")
    result.change("blocks.0", "reparameterized", module="RepBlock", method="fuse", relative_change=1e-7)
    result.skip("bn2", "in training mode", into="conv2 (Conv2d 'conv2')")
    folded, rep = result.changed
    assert isinstance(folded, Change) and isinstance(result.skipped[0], Skip)
    assert (folded.node, folded.what, folded.into, folded.kind, folded.module) == (
        "bn1", "folded", "conv1 (Conv2d 'conv1')", "conv", None)
    assert rep.module == "RepBlock" and dict(rep.details) == {"method": "fuse", "relative_change": 1e-7}
    # Flat, None-valued typed facts left out, in the order the pass gave them (the manifests' shape).
    assert list(folded.to_dict().items()) == [("node", "bn1"), ("what", "folded"),
                                              ("into", "conv1 (Conv2d 'conv1')"), ("kind", "conv")]
    assert list(rep.to_dict()) == ["node", "what", "module", "method", "relative_change"]
    assert result.skipped[0].to_dict() == {"node": "bn2", "reason": "in training mode",
                                           "into": "conv2 (Conv2d 'conv2')"}


def test_a_user_pass_keeps_any_fact_exactly_as_given():
    from fx_lightning.passes import PassResult

    result = PassResult()
    result.change("n", "did", kind=3, into=None, extra=[1, 2])  # not strings: kept as given, in details
    change = result.changed[0]
    assert change.kind is None and change.into is None
    assert change.to_dict() == {"node": "n", "what": "did", "kind": 3, "into": None, "extra": [1, 2]}


def test_a_record_refuses_details_that_repeat_a_field():
    from fx_lightning.passes import Change, Skip

    with pytest.raises(ValueError, match="into"):
        Change("n", "did", into="a", details={"into": "b"})
    with pytest.raises(ValueError, match="reason"):
        Skip("n", "why", details={"reason": "other"})


def test_reading_a_record_like_a_dict_still_works_but_is_deprecated():
    from fx_lightning.passes import Skip

    skip = Skip.of("bn", "why", op="x")
    with pytest.warns(DeprecationWarning, match=r"read \.reason"):
        assert skip["reason"] == "why"
    with pytest.warns(DeprecationWarning, match=r"read \.details\['op'\]"):
        assert skip["op"] == "x"


def test_report_records_are_typed_and_its_json_keeps_them_flat():
    from fx_lightning.passes import Change, RemainingBatchNorm

    model = randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4)))
    result = fuse(model, example_inputs=torch.randn(2, 3, 6, 6))
    report = result.report
    assert all(isinstance(c, Change) for p in report.passes for c in p.changed)
    (left,) = report.remaining_batchnorms  # after a ReLU, before the output: nothing to fold into
    assert isinstance(left, RemainingBatchNorm) and "the model's output" in left.reason
    data = json.loads(json.dumps(report.to_dict()))
    assert data["remaining_batchnorms"] == [{"node": left.node, "reason": left.reason}]
    for p in data["passes"]:  # every record one flat object, as manifests have always held them
        assert all(set(c) >= {"node", "what"} and "details" not in c for c in p["changed"])
        assert all(set(s) >= {"node", "reason"} and "details" not in s for s in p["skipped"])
