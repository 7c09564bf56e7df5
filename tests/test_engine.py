"""fuse(): the public contract, user passes, errors and the report."""

from __future__ import annotations

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


def test_register_pass_refuses_silent_overwrite():
    with pytest.raises(ValueError, match="already registered"):
        register_pass("fuse_conv_bn")(lambda gm, o, c: None)


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
