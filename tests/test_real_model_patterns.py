"""Unit tests of what real models need, on hand-written modules: shape-only users, Linear -> flatten ->
BatchNorm1d, a concatenation of convs, BatchNorm forms with an epilogue (declared, frozen), deploy-form
re-parameterisation, a capture checked against the eager model, weight standardisation, and the messages."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_helpers import assert_exact, count_batchnorms, fingerprint, randomize_batchnorms
from fx_lightning import ConfigError, TraceError, fuse
from fx_lightning.capture.graph import CAPTURE_FELL_BACK
from fx_lightning.pipeline.engine import NO_EXAMPLE_INPUTS


def fused(model: nn.Module, x: torch.Tensor, config: Any = None, tol: float = 1e-5) -> Any:
    randomize_batchnorms(model).eval()
    before = fingerprint(model)
    result = fuse(model, config, example_inputs=x)
    assert fingerprint(model) == before
    assert_exact(model, result.graph_module, (x,), tol)
    return result


# ---------------------------------------------------------------------------------- shape-only users


class NdimChecked(nn.Module):
    """BatchNorm after a conv whose output is also read for its rank and shape (timm's BatchNormAct2d asserts)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        torch._assert(y.ndim == 4, "4-D")
        n, c = y.shape[0], y.size(1)
        return self.bn(y).reshape(n, c, -1).view_as(y)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_shape_only_users_do_not_block_a_fold(mode: str) -> None:
    result = fused(NdimChecked(), torch.randn(2, 3, 8, 8), {"trace": {"mode": mode}})
    assert count_batchnorms(result.graph_module) == 0


class ConvFeedsTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y.sum(dim=1, keepdim=True)  # a value user: folding would change it


def test_a_value_user_still_blocks_the_fold_with_its_reason() -> None:
    result = fused(ConvFeedsTwo(), torch.randn(2, 3, 8, 8))
    assert count_batchnorms(result.graph_module) == 1
    reasons = [s.reason for s in result.report.pass_report("fuse_conv_bn").skipped]
    assert any("also feeds sum" in r for r in reasons), reasons


# ------------------------------------------------------------------------ Linear -> flatten -> BN1d


class TokensBN(nn.Module):
    """BatchNorm over tokens flattened into the batch (LeViT's LinearNorm, Hugging Face's MLPLayerWithBN)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear, self.bn, self.how = nn.Linear(8, 12), nn.BatchNorm1d(12), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # [B, N, 12]
        flat = y.flatten(0, 1) if self.how == "flatten" else y.reshape(-1, y.shape[-1])
        return self.bn(flat).reshape_as(y)


@pytest.mark.parametrize("mode", ["fx", "export"])
@pytest.mark.parametrize("how", ["flatten", "reshape"])
def test_linear_flatten_batchnorm1d_folds_into_the_linear(mode: str, how: str) -> None:
    result = fused(TokensBN(how), torch.randn(3, 5, 8), {"trace": {"mode": mode}})
    assert count_batchnorms(result.graph_module) == 0
    change = result.report.pass_report("fuse_linear_bn").changed[0]
    assert change.what == f"folded through {how}" and change.kind == "linear"


class TokensBNWrongAxis(nn.Module):
    """The reshape moves the features off the BatchNorm's channel axis: not the same map, must stay."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.bn = nn.Linear(8, 5), nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # [B, 5, 5]
        return self.bn(y.transpose(1, 2).reshape(-1, 5))


def test_linear_then_a_reshape_that_moves_the_features_is_left() -> None:
    result = fused(TokensBNWrongAxis(), torch.randn(2, 5, 8))
    assert count_batchnorms(result.graph_module) == 1


# --------------------------------------------------------------------- concatenation of convs -> BN


class MixedConv(nn.Module):
    """mixnet's MixedConv2d: split the channels, a conv per group with its own kernel, concatenate, BatchNorm."""

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(2, 5, 5, padding=2, bias=False)
        self.bn, self.dim = nn.BatchNorm2d(8), dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xa, xb = torch.split(x, 2, dim=1)
        return F.relu(self.bn(torch.cat([self.a(xa), self.b(xb)], self.dim)))


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_batchnorm_after_a_concat_of_convs_folds_into_each(mode: str) -> None:
    result = fused(MixedConv(), torch.randn(2, 4, 9, 9), {"trace": {"mode": mode}})
    assert count_batchnorms(result.graph_module) == 0
    assert result.report.pass_report("fuse_conv_bn").changed[0].what == "folded into a concatenation"


def test_a_concat_along_another_axis_is_left() -> None:
    class AlongWidth(MixedConv):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Conv2d(2, 3, 3, padding=1)
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            xa, xb = torch.split(x, 2, dim=1)
            return self.bn(torch.cat([self.a(xa), self.b(xb)], 3))

    result = fused(AlongWidth(), torch.randn(2, 4, 9, 9))
    assert count_batchnorms(result.graph_module) == 1


# --------------------------------------------------------------------------- BatchNorm forms


class BNReLU(nn.BatchNorm2d):
    """A third-party "BatchNorm, then an activation" whose forward calls torch's BatchNorm (fx cannot follow it)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


class FrozenBNSiLU(nn.Module):
    """A frozen BatchNorm (statistics as buffers, x * scale + shift) with an epilogue."""

    def __init__(self, n: int) -> None:
        super().__init__()
        for name, value in (("weight", torch.ones(n)), ("bias", torch.zeros(n)), ("running_mean", torch.zeros(n)),
                            ("running_var", torch.ones(n))):
            self.register_buffer(name, value)
        self.eps, self.act = 1e-5, nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return self.act(x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1))


def _conv_then(norm: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 6, 3), norm)


def test_a_frozen_batchnorm_traced_into_arithmetic_is_reported_not_hidden() -> None:
    result = fused(_conv_then(FrozenBNSiLU(6)), torch.randn(2, 3, 8, 8), {"trace": {"mode": "fx"}})
    report = result.report
    assert report.before.batchnorms == 1 and report.after.batchnorms == 1  # not "0 -> 0"
    assert any("traced into plain arithmetic" in r.reason and "passes.batchnorm_forms" in r.reason
               for r in report.remaining_batchnorms), report.remaining_batchnorms


@pytest.mark.parametrize("cls", [BNReLU, FrozenBNSiLU])
def test_a_declared_form_folds_and_keeps_its_epilogue(cls: type) -> None:
    config = {"trace": {"mode": "fx"},
              "passes": {"batchnorm_forms": {"modules": [{"module": f"{__name__}:{cls.__name__}", "epilogue": ["act"]}]}}}
    result = fused(_conv_then(cls(6)), torch.randn(2, 3, 8, 8), config)
    assert result.report.before.batchnorms == 1 and result.report.after.batchnorms == 0
    assert result.report.pass_report("batchnorm_forms").changed[0].details["epilogue"] == ["act"]
    kinds = {type(m).__name__ for m in result.graph_module.modules()}
    assert {"ReLU", "SiLU"} & kinds  # the epilogue stays


def test_register_batchnorm_form_declares_it_for_every_fuse(monkeypatch: pytest.MonkeyPatch) -> None:
    from fx_lightning.passes import batchnorm_forms

    monkeypatch.setattr(batchnorm_forms, "_FORMS", list(batchnorm_forms._FORMS))
    batchnorm_forms.register_batchnorm_form(BNReLU, epilogue=["act"])
    result = fused(_conv_then(BNReLU(6)), torch.randn(2, 3, 8, 8), {"trace": {"mode": "fx"}})
    assert result.report.after.batchnorms == 0


def test_a_wrong_declaration_cannot_give_wrong_numbers() -> None:
    """Declared without its epilogue, the form would drop the activation: checked on the module's own input,
    the replacement is refused, and the result stays exact."""
    config = {"trace": {"mode": "fx"},
              "passes": {"batchnorm_forms": {"modules": [{"module": f"{__name__}:BNReLU", "epilogue": []}]}}}
    result = fused(_conv_then(BNReLU(6)), torch.randn(2, 3, 8, 8), config)  # asserts exactness
    skipped = result.report.pass_report("batchnorm_forms").skipped
    assert len(skipped) == 1 and "does not match its forward" in skipped[0].reason


def test_a_declaration_that_cannot_be_imported_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"passes.batchnorm_forms.modules\[0\].module: cannot import"):
        fuse(nn.Linear(2, 2), {"passes": {"batchnorm_forms": {"modules": [{"module": "nope.nothing:X"}]}}})


# ------------------------------------------------------------------------------- deploy forms


class RepBlock(nn.Module):
    """A RepVGG-style block: 3x3 conv+BN, 1x1 conv+BN and an identity BN in training, one 3x3 conv deployed."""

    def __init__(self, c: int, break_it: bool = False) -> None:
        super().__init__()
        self.c3, self.b3 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c1, self.b1 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.bid, self.deployed, self.break_it = nn.BatchNorm2d(c), None, break_it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deployed is not None:
            return self.deployed(x)
        return self.b3(self.c3(x)) + self.b1(self.c1(x)) + self.bid(x)

    def reparameterize(self) -> None:
        def folded(conv_w: torch.Tensor, bn: nn.BatchNorm2d) -> Any:
            std = (bn.running_var + bn.eps).sqrt()
            return conv_w * (bn.weight / std).reshape(-1, 1, 1, 1), bn.bias - bn.running_mean * bn.weight / std

        c = self.c3.out_channels
        w3, b3 = folded(self.c3.weight, self.b3)
        w1, b1 = folded(F.pad(self.c1.weight, [1, 1, 1, 1]), self.b1)
        eye = torch.zeros(c, c, 3, 3)
        eye[range(c), range(c), 1, 1] = 1.0
        wid, bid = folded(eye, self.bid)
        self.deployed = nn.Conv2d(c, c, 3, padding=1)
        self.deployed.weight.data, self.deployed.bias.data = w3 + w1 + wid, b3 + b1 + bid
        if self.break_it:
            self.deployed.bias.data += 1.0
        del self.c3, self.b3, self.c1, self.b1, self.bid


class RepNet(nn.Module):
    def __init__(self, break_second: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.Sequential(RepBlock(4), RepBlock(4, break_it=break_second))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x))


def test_deploy_forms_are_applied_to_the_copy_and_checked() -> None:
    model = RepNet()
    result = fused(model, torch.randn(2, 3, 8, 8))
    assert result.report.after.batchnorms == 0 and result.report.before.batchnorms == 6
    changed = result.report.pass_report("reparameterize").changed
    assert [c.node for c in changed] == ["blocks.0", "blocks.1"] and all(c.details["relative_change"] < 1e-5 for c in changed)
    convs = [m for m in result.graph_module.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 3  # the stem and one conv per block
    assert model.blocks[0].deployed is None  # the input module keeps its training form


def test_a_conversion_that_changes_outputs_is_put_back() -> None:
    result = fused(RepNet(break_second=True), torch.randn(2, 3, 8, 8))
    report = result.report.pass_report("reparameterize")
    assert [c.node for c in report.changed] == ["blocks.0"]
    assert report.skipped[0].node == "blocks.1" and "changed the module's output" in report.skipped[0].reason


def test_methods_that_need_arguments_are_not_conversions() -> None:
    class VAEHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.conv(x))

        def reparameterize(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:  # the VAE trick
            raise AssertionError("must not be called")

    model = nn.Sequential(VAEHead())
    result = fused(model, torch.randn(2, 3, 8, 8))
    assert result.report.pass_report("reparameterize").changed == [] and result.report.after.batchnorms == 0


# ------------------------------------------------------------------- a capture run before trusted


class TypeGatedSkip(nn.Module):
    """A skip connection added only when it "is a tensor": torch.jit.isinstance of a traced value is False, so
    symbolic tracing records the graph without it (MONAI's UpCat does this)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        if torch.jit.isinstance(x, torch.Tensor):
            y = y + x
        return y


def test_auto_falls_back_to_export_when_the_fx_graph_is_wrong() -> None:
    result = fused(TypeGatedSkip(), torch.randn(2, 3, 8, 8))
    assert result.report.capture_mode == "export"
    note = result.report.notes[0]
    assert note.kind == CAPTURE_FELL_BACK and note["what"] == "gave a graph that differs from the model"
    assert count_batchnorms(result.graph_module) == 0


def test_fx_mode_raises_saying_the_trace_is_unfaithful_and_where() -> None:
    model = randomize_batchnorms(TypeGatedSkip()).eval()
    with pytest.raises(TraceError) as info:
        fuse(model, {"trace": {"mode": "fx"}}, example_inputs=torch.randn(2, 3, 8, 8))
    message = str(info.value)
    assert "unfaithful" in message and "differs from the model by" in message
    assert "trace.mode: export" in message and "trace.leaf_modules" in message


def test_without_example_inputs_the_capture_is_not_run_and_the_report_says_so() -> None:
    result = fuse(randomize_batchnorms(TypeGatedSkip()).eval())
    assert result.report.capture_mode == "fx" and any(n.kind == NO_EXAMPLE_INPUTS for n in result.report.notes)


# -------------------------------------------------------------------------------- what is counted


class WeightStandardisedConv(nn.Conv2d):
    """NF-Net's ScaledStdConv2d: F.batch_norm on its own weight, with batch statistics: not a BatchNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0,
                         eps=1e-5).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


def test_weight_standardisation_is_not_counted_as_a_batchnorm() -> None:
    model = nn.Sequential(WeightStandardisedConv(3, 4, 3), nn.ReLU())
    result = fused(model, torch.randn(2, 3, 8, 8))
    assert result.report.before.batchnorms == 0 and result.report.remaining_batchnorms == []


def test_a_batch_of_one_exports_without_the_specialisation_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = randomize_batchnorms(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
    with caplog.at_level(logging.WARNING):  # torch.export logs it (logging, not warnings)
        result = fuse(model, {"trace": {"mode": "export"}}, example_inputs=torch.randn(1, 3, 8, 8))
    assert not [r for r in caplog.records if "specialized" in r.getMessage()]
    with torch.no_grad():  # still batch-generic
        assert result.graph_module(torch.randn(3, 3, 8, 8)).shape[0] == 3
