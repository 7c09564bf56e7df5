"""fuse_conv_bn / fuse_linear_bn / fuse_bn_into_next: every case the reference fuser gets wrong or skips."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_helpers import (
    assert_exact,
    count_batchnorms,
    count_bn_modules,
    fingerprint,
    randomize_batchnorms,
    rel_err,
    reference_fp64,
)
from fx_lightning import fuse
from fx_lightning.capture.graph import CAPTURE_PREFERRED_EXPORT
from fx_lightning.passes.fold_math import bn_scale_shift, fold_bn_into_input, fold_bn_into_output

MODES = ["fx", "export"]


def check(model: nn.Module, inputs, *, bn_after: int, mode: str = "fx", tol: float = 1e-5, config=None):
    """Fuse with random BN statistics; assert exactness, the BatchNorms left, and an untouched input."""
    randomize_batchnorms(model)
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    before = fingerprint(model)
    cfg = {"trace": {"mode": mode}, **(config or {})}
    result = fuse(model, cfg, example_inputs=inputs)
    assert fingerprint(model) == before, "fuse() changed its input module"
    assert_exact(model, result.graph_module, inputs, tol)
    assert count_batchnorms(result.graph_module) == bn_after, str(result.report)
    assert result.report.after.batchnorms == bn_after
    return result


def seq(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers)


# ------------------------------------------------------------------------------------------ conv + BN


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("conv_bias", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_conv_bn_all_dims(mode, dims, conv_bias, affine):
    conv = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1]
    bn = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][dims - 1]
    model = seq(conv(3, 8, 3, padding=1, bias=conv_bias), bn(8, affine=affine), nn.ReLU())
    x = torch.randn(2, 3, *([6] * dims))
    result = check(model, x, bn_after=0, mode=mode)
    assert result.report.pass_report("fuse_conv_bn").changed


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv_transpose_bn_any_groups(mode, groups, dims):
    convt = [nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d][dims - 1]
    bn = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][dims - 1]
    model = seq(
        convt(4, 8, 3, stride=2, padding=1, output_padding=1, groups=groups, dilation=1), bn(8), nn.Tanh()
    )
    check(model, torch.randn(2, 4, *([5] * dims)), bn_after=0, mode=mode)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
def test_conv_padding_modes_dilation_stride_depthwise(padding_mode):
    model = seq(
        nn.Conv2d(6, 6, 3, stride=2, padding=2, dilation=2, groups=6, padding_mode=padding_mode, bias=False),
        nn.BatchNorm2d(6),
        nn.Conv2d(6, 12, 1, groups=3),
        nn.BatchNorm2d(12),
    )
    check(model, torch.randn(2, 6, 11, 11), bn_after=0)


def test_conv_transpose_dilated_grouped_with_bias():
    model = seq(nn.ConvTranspose2d(6, 9, (3, 2), stride=(2, 1), dilation=(1, 2), groups=3), nn.BatchNorm2d(9))
    check(model, torch.randn(3, 6, 4, 5), bn_after=0)


def test_sync_batchnorm_and_lightning_revert():
    """What DDP training hands on_fit_end: SyncBatchNorm reverted to _BatchNormXd."""
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    base = seq(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Identity())
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base))
    assert isinstance(synced[1], nn.SyncBatchNorm)
    check(synced, torch.randn(2, 3, 8, 8), bn_after=0)
    reverted = TorchSyncBatchNorm().revert(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base)))
    assert type(reverted[1]).__name__ == "_BatchNormXd"
    check(reverted, torch.randn(2, 3, 8, 8), bn_after=0)


class MyBN(nn.BatchNorm2d):
    """A subclass that keeps BatchNorm's forward (what many codebases do to change defaults)."""

    def __init__(self, n: int) -> None:
        super().__init__(n, eps=1e-3, momentum=0.01)


class BNPlusOne(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1.0


def test_batchnorm_subclass_keeping_forward_is_folded():
    check(seq(nn.Conv2d(3, 5, 3), MyBN(5)), torch.randn(2, 3, 7, 7), bn_after=0)


class BNThenReLU(nn.BatchNorm2d):
    """Its own forward (as timm's BatchNormAct2d): F.batch_norm on its statistics, then an activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.ndim == 4, "expected 4-D input")  # a shape-only use of the conv's output
        return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                                   0.1, self.eps))


def test_batchnorm_subclass_with_a_traceable_forward_is_traced_through_and_folded():
    """fx follows its forward, so the F.batch_norm inside is folded and the ReLU stays."""
    result = check(seq(nn.Conv2d(3, 5, 3), BNThenReLU(5)), torch.randn(2, 3, 7, 7), bn_after=0)
    assert result.report.capture_mode == "fx"


def test_batchnorm_subclass_calling_torchs_forward_folds_through_export_in_auto_mode():
    """torch's BatchNorm.forward branches on the input's rank, which symbolic tracing cannot follow: auto mode
    captures with torch.export instead, and the BatchNorm folds (the +1 stays)."""
    result = check(seq(nn.Conv2d(3, 5, 3), BNPlusOne(5)), torch.randn(2, 3, 7, 7), bn_after=0, mode="auto")
    note = result.report.notes[0]
    assert result.report.capture_mode == "export" and note.kind == CAPTURE_PREFERRED_EXPORT
    assert "BNPlusOne" in note["modules"]  # type: ignore[operator]


@pytest.mark.parametrize("config", [{}, {"trace": {"leaf_modules": [f"{__name__}:BNThenReLU"]}}])
def test_batchnorm_subclass_kept_whole_in_fx_mode_is_left_with_reason(config):
    model = seq(nn.Conv2d(3, 5, 3), BNPlusOne(5) if not config else BNThenReLU(5))
    cfg = {"trace": {"mode": "fx", **config.get("trace", {})}}
    result = check(model, torch.randn(2, 3, 7, 7), bn_after=1, config=cfg)
    reasons = [s.reason for s in result.report.pass_report("fuse_conv_bn").skipped]
    assert any("overrides BatchNorm's forward" in r and "trace.mode: export" in r and "passes.batchnorm_forms" in r
               for r in reasons), reasons


def test_frozen_batchnorm2d():
    from torchvision.ops.misc import FrozenBatchNorm2d

    model = seq(nn.Conv2d(3, 6, 3, bias=False), FrozenBatchNorm2d(6), nn.ReLU())
    check(model, torch.randn(2, 3, 9, 9), bn_after=0)


class FunctionalBN(nn.Module):
    def __init__(self, affine: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("mean", torch.randn(4) * 0.5)
        self.register_buffer("var", torch.rand(4) + 0.5)
        self.gamma = nn.Parameter(torch.randn(4)) if affine else None
        self.beta = nn.Parameter(torch.randn(4)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return F.batch_norm(y, self.mean, self.var, self.gamma, self.beta, training=self.training, eps=1e-3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("affine", [True, False])
def test_functional_batch_norm_with_constant_statistics(mode, affine):
    check(FunctionalBN(affine), torch.randn(2, 3, 6, 6), bn_after=0, mode=mode)


class FunctionalConvBN(nn.Module):
    """F.conv2d with a parameter weight, then an nn.BatchNorm2d: the functional layer form."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 2, 3, 3) * 0.2)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(F.conv2d(x, self.w, None, 1, 1, 1, 2))


def test_functional_conv_then_batchnorm():
    check(FunctionalConvBN(), torch.randn(2, 4, 5, 5), bn_after=0)


def test_batchnorm_without_running_stats_is_left_with_reason():
    model = seq(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))
    x = torch.randn(4, 3, 6, 6)
    result = fuse(model, example_inputs=x)
    assert count_batchnorms(result.graph_module) == 1
    reasons = " ".join(s.reason for p in result.report.passes for s in p.skipped)
    assert "no running statistics" in reasons
    with torch.no_grad():
        assert rel_err(result.graph_module(x), model.eval()(x)) < 1e-6


# ----------------------------------------------------------------------------------------- Linear + BN


@pytest.mark.parametrize("mode", MODES)
def test_linear_bn1d_on_2d_input_is_folded(mode):
    model = seq(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 5, bias=False), nn.BatchNorm1d(5))
    check(model, torch.randn(4, 7), bn_after=0, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_linear_bn1d_on_3d_input_equal_sizes_is_not_folded(mode):
    """(N, L, C) with L == C: BatchNorm1d normalises L, not the Linear's C. torch.fx's fuse gets this wrong."""
    model = seq(nn.Linear(6, 6), nn.BatchNorm1d(6))
    result = check(model, torch.randn(3, 6, 6), bn_after=1, mode=mode)
    reasons = [s.reason for s in result.report.pass_report("fuse_linear_bn").skipped]
    assert any("rank-3" in r for r in reasons), reasons


def test_linear_bn1d_on_3d_input_unequal_sizes_is_not_folded():
    model = seq(nn.Linear(6, 4), nn.BatchNorm1d(5))  # BN over L=5, the Linear's outputs are 4
    check(model, torch.randn(3, 5, 6), bn_after=1)


def test_linear_bn_without_shapes_is_left_with_reason():
    model = randomize_batchnorms(seq(nn.Linear(6, 6), nn.BatchNorm1d(6)))
    result = fuse(model)  # no example inputs: rank unknown
    assert count_batchnorms(result.graph_module) == 1
    assert "example_inputs" in result.report.pass_report("fuse_linear_bn").skipped[0].reason
    x = torch.randn(3, 6)
    assert rel_err(result.graph_module(x), reference_fp64(model, (x,))) < 1e-5


# ------------------------------------------------------------------------------- sharing and multi-use


class ReusedConv(nn.Module):
    """One conv called at two places, each followed by its own BatchNorm (torch.fx's fuse corrupts this)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.bn1(self.conv(x))
        b = self.bn2(self.conv(torch.relu(a)))
        return a + b


@pytest.mark.parametrize("mode", MODES)
def test_conv_reused_at_two_sites_gets_a_fused_copy_per_site(mode):
    result = check(ReusedConv(), torch.randn(2, 4, 6, 6), bn_after=0, mode=mode)
    assert len(result.report.pass_report("fuse_conv_bn").changed) == 2


class ReusedConvOneBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)) + self.conv(x * 2)  # second site has no BN and must stay unchanged


def test_reused_conv_second_site_without_bn_is_untouched():
    result = check(ReusedConvOneBN(), torch.randn(2, 4, 5, 5), bn_after=0)
    assert hasattr(result.graph_module, "conv"), "the unfused conv must remain for the other site"


def test_reused_conv_with_copy_disabled_is_skipped():
    result = check(
        ReusedConv(), torch.randn(2, 4, 6, 6), bn_after=2,
        config={"passes": {"fuse_conv_bn": {"copy_shared_modules": False}}},
    )
    reasons = [s.reason for s in result.report.pass_report("fuse_conv_bn").skipped]
    assert any("called at 2 sites" in r for r in reasons), reasons


class BranchingConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) * y.sigmoid()  # conv output has two users


@pytest.mark.parametrize("mode", MODES)
def test_conv_output_with_two_users_is_skipped_with_reason(mode):
    result = check(BranchingConv(), torch.randn(2, 3, 6, 6), bn_after=1, mode=mode)
    reasons = [s.reason for s in result.report.pass_report("fuse_conv_bn").skipped]
    assert any("also feeds" in r for r in reasons), reasons


class TiedWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 3, 3, padding=1)
        self.b = nn.Conv2d(3, 3, 3, padding=1)
        self.b.weight = self.a.weight  # tied
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.a(x)) + self.b(x)


def test_tied_weights_are_not_corrupted():
    check(TiedWeights(), torch.randn(2, 3, 5, 5), bn_after=0)


class SharedBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 1)
        self.c2 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.c1(x)) - self.bn(self.c2(x))


def test_one_batchnorm_called_after_two_convs():
    check(SharedBN(), torch.randn(2, 3, 5, 5), bn_after=0)


def test_channel_mismatch_is_skipped_not_crashed():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(2, 4, 1)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):  # (N, 2, 4) -> conv -> (N, 4, 4) -> transpose -> BN over the conv's length
            return self.bn(self.conv(x).transpose(1, 2))

    check(M(), torch.randn(3, 2, 4), bn_after=1)


# ------------------------------------------------------------------------------ BN before the next layer


@pytest.mark.parametrize("mode", MODES)
def test_bn_before_linear_is_folded_forward(mode):
    model = seq(nn.Linear(5, 6), nn.ReLU(), nn.BatchNorm1d(6), nn.Linear(6, 3))
    result = check(model, torch.randn(4, 5), bn_after=0, mode=mode)
    assert result.report.pass_report("fuse_bn_into_next").changed


@pytest.mark.parametrize("groups", [1, 2])
def test_bn_before_unpadded_conv_is_folded_forward(groups):
    model = seq(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3, groups=groups))
    check(model, torch.randn(2, 3, 9, 9), bn_after=0)


def test_bn_before_padded_conv_is_left_with_reason():
    model = seq(nn.ReLU(), nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3, padding=1))
    result = check(model, torch.randn(2, 4, 6, 6), bn_after=1)
    reasons = [s.reason for s in result.report.pass_report("fuse_bn_into_next").skipped]
    assert any("pads its input" in r for r in reasons), reasons


def test_bn_that_is_first_layer_folds_into_conv():
    check(seq(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 2)), torch.randn(2, 3, 5, 5), bn_after=0)


def test_remaining_batchnorm_is_explained():
    model = seq(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.BatchNorm2d(4), nn.ReLU())
    result = check(model, torch.randn(2, 3, 6, 6), bn_after=1)
    assert len(result.report.remaining_batchnorms) == 1
    assert "relu" in result.report.remaining_batchnorms[0].reason.lower()


# --------------------------------------------------------------------------------- dtypes and the math


def test_bf16_model_error_no_worse_than_unfused_bf16():
    model = seq(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.BatchNorm2d(16))
    randomize_batchnorms(model)
    x = torch.randn(2, 3, 12, 12)
    ref = reference_fp64(model, (x,))
    low = copy.deepcopy(model).to(torch.bfloat16).eval()
    with torch.no_grad():
        unfused_err = rel_err(low(x.bfloat16()), ref)
        fused = fuse(low).graph_module
        fused_out = fused(x.bfloat16())
    assert fused_out.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in fused.parameters())
    assert count_batchnorms(fused) == 0
    assert rel_err(fused_out, ref) <= 1.5 * unfused_err, (rel_err(fused_out, ref), unfused_err)


def test_float64_model_stays_float64_and_exact():
    model = seq(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).double()
    randomize_batchnorms(model)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    fused = fuse(model).graph_module
    assert next(fused.parameters()).dtype == torch.float64
    assert rel_err(fused(x), model.eval()(x)) < 1e-12


def test_fold_dtype_float32_is_less_exact_than_float64_but_within_tolerance():
    model = randomize_batchnorms(seq(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)))
    x = torch.randn(2, 8, 6, 6)
    r32 = fuse(model, {"passes": {"fuse_conv_bn": {"fold_dtype": "float32"}}}).graph_module
    assert_exact(model, r32, (x,), tol=1e-5)


def test_math_against_definition():
    """The fold functions against BatchNorm's definition, independent of any graph."""
    torch.manual_seed(1)
    rm, rv, w, b = torch.randn(6), torch.rand(6) + 0.1, torch.randn(6), torch.randn(6)
    scale, shift = bn_scale_shift(rm, rv, w, b, 1e-3)
    x = torch.randn(10, 6, dtype=torch.float64)
    expect = (x - rm.double()) / torch.sqrt(rv.double() + 1e-3) * w.double() + b.double()
    assert torch.allclose(x * scale + shift, expect, rtol=1e-12, atol=1e-12)
    # grouped transpose conv: compare against conv_transpose then affine
    wt, bt = torch.randn(4, 3, 2, 2).double(), torch.randn(6).double()
    nw, nb = fold_bn_into_output(wt, bt, scale, shift, transposed=True, groups=2)
    inp = torch.randn(1, 4, 3, 3, dtype=torch.float64)
    y = F.conv_transpose2d(inp, wt, bt, groups=2) * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)
    assert torch.allclose(F.conv_transpose2d(inp, nw, nb, groups=2), y, rtol=1e-10, atol=1e-10)
    # BN before a grouped conv
    wc, bc = torch.randn(4, 3, 2, 2).double(), torch.randn(4).double()
    nw, nb = fold_bn_into_input(wc, bc, scale, shift, groups=2)
    inp = torch.randn(1, 6, 4, 4, dtype=torch.float64)
    y = F.conv2d(inp * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1), wc, bc, groups=2)
    assert torch.allclose(F.conv2d(inp, nw, nb, groups=2), y, rtol=1e-10, atol=1e-10)


def test_fused_modules_are_plain_and_frozen():
    model = seq(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    fused = check(model, torch.randn(2, 3, 5, 5), bn_after=0).graph_module
    assert count_bn_modules(fused) == 0, "unused BatchNorm modules must be dropped from the GraphModule"
    assert not any(p.requires_grad for p in fused.parameters())
    assert not fused.training


# ------------------------------------------------------------------------------------------ the matchers


def test_matchers_return_the_view_a_typed_refusal_or_none():
    from fx_lightning.capture.graph import capture
    from fx_lightning.config import TraceConfig
    from fx_lightning.passes.bn_views import BatchNorm, Layer, Refused, match_bn, match_layer

    hooked = nn.Conv2d(4, 4, 1)
    hooked.register_forward_hook(lambda m, i, o: None)
    model = seq(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), hooked, nn.BatchNorm2d(4, track_running_stats=False),
                nn.ReLU())
    gm = capture(model, TraceConfig(mode="fx")).graph_module
    nodes = {n.name: n for n in gm.graph.nodes}
    assert isinstance(match_layer(gm, nodes["_0"]), Layer) and isinstance(match_bn(gm, nodes["_1"]), BatchNorm)
    refused = match_layer(gm, nodes["_2"])
    assert isinstance(refused, Refused) and refused.reason == "Conv2d has forward hooks"
    no_stats = match_bn(gm, nodes["_3"])
    assert isinstance(no_stats, Refused) and "no running statistics" in no_stats.reason
    assert match_layer(gm, nodes["_4"]) is None and match_bn(gm, nodes["_4"]) is None  # a ReLU: neither kind
