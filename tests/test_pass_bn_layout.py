"""BatchNorms that fold through layout operations: transposes, unsqueeze/squeeze, reshapes, slices, chunks,
copying pads and concatenations, into the layer before them or into every layer after them; and the ones that do
not, each left with a reason that names what stands in the way (a nonlinearity, a residual add, a gate, pooling
statistics, zero padding, a channel mixed with another axis)."""

from __future__ import annotations

from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_helpers import assert_exact, count_batchnorms, fingerprint, randomize_batchnorms
from fx_lightning import fuse

MODES = ["fx", "export"]


def fused(model: nn.Module, x: Any, *, left: int, mode: str = "fx", tol: float = 1e-5) -> Any:
    """Fuse with random BatchNorm statistics; exact against fp64, the input untouched, ``left`` BatchNorms left
    (each with a reason)."""
    randomize_batchnorms(model).eval()
    inputs = x if isinstance(x, tuple) else (x,)
    before = fingerprint(model)
    result = fuse(model, {"trace": {"mode": mode}}, example_inputs=inputs)
    assert fingerprint(model) == before
    assert_exact(model, result.graph_module, inputs, tol)
    assert count_batchnorms(result.graph_module) == left, str(result.report)
    assert len(result.report.remaining_batchnorms) == left
    return result


def reasons(result: Any) -> List[str]:
    return [r.reason for r in result.report.remaining_batchnorms]


def changes(result: Any, name: str) -> List[Any]:
    return result.report.pass_report(name).changed


# ------------------------------------------------------------------------- into the layer before


class LinearTransposeBN(nn.Module):
    """Linear on (batch, length, features), then a BatchNorm1d over the features through transposes (PatchTST)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(6, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2))


@pytest.mark.parametrize("mode", MODES)
def test_linear_transpose_batchnorm_folds_into_the_linear(mode: str) -> None:
    result = fused(LinearTransposeBN(), torch.randn(3, 5, 6), left=0, mode=mode)
    (change,) = changes(result, "fuse_linear_bn")
    assert change.what == "folded through transpose" and change.kind == "linear"


class UnsqueezedBN2d(nn.Module):
    """A BatchNorm2d put on a sequence through unsqueeze/squeeze, between a Linear and a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.conv = nn.Linear(4, 6), nn.BatchNorm2d(6), nn.Conv1d(6, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.lin(x).permute(0, 2, 1).unsqueeze(-1))
        return self.conv(torch.relu(y.squeeze(-1)))


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm2d_through_unsqueeze_folds_into_the_linear(mode: str) -> None:
    fused(UnsqueezedBN2d(), torch.randn(2, 7, 4), left=0, mode=mode)


class ChompedConvBN(nn.Module):
    """TCN's causal conv: pad both sides, chomp the right end off (a slice), then the BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv1d(3, 5, 3, padding=4, dilation=2), nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)[:, :, :-4].contiguous()))


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_after_a_sliced_conv_folds_into_it(mode: str) -> None:
    fused(ChompedConvBN(), torch.randn(2, 3, 9), left=0, mode=mode)


class FlattenedTimeFeatures(nn.Module):
    """A Linear whose outputs are (time x feature), reshaped, then a BatchNorm1d over the flattened time x feature."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(5, 4 * 3), nn.BatchNorm1d(4 * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).reshape(x.shape[0], 4, 3)  # (batch, time, feature)
        return torch.sigmoid(self.bn(y.reshape(x.shape[0], -1)).reshape(-1, 4, 3))


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_over_flattened_time_and_features_folds_into_the_linear_that_made_them(mode: str) -> None:
    fused(FlattenedTimeFeatures(), torch.randn(3, 5), left=0, mode=mode)


class SharedWeightsOverTime(nn.Module):
    """TSMixer's time x feature BatchNorm after a Linear over features: each feature reaches one channel per time
    step, with its own scale, and the Linear shares its weights over time: no exact fold on either side."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.bn, self.mix = nn.Linear(2, 3), nn.BatchNorm1d(4 * 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.embed(x)  # (batch, time=4, feature=3)
        return self.mix(self.bn(y.reshape(y.shape[0], -1)).reshape(y.shape))


@pytest.mark.parametrize("mode", MODES)
def test_a_channel_mixed_with_time_by_a_reshape_is_left_with_that_reason(mode: str) -> None:
    result = fused(SharedWeightsOverTime(), torch.randn(3, 4, 2), left=1, mode=mode)
    (reason,) = reasons(result)
    assert "spread each output feature" in reason and "several BatchNorm channels" in reason, reason
    assert "each input feature of" in reason and "mixes several BatchNorm channels" in reason, reason


# -------------------------------------------------------------------------- into the layers after


class TDNN(nn.Module):
    """Speaker-model layers: Conv1d (padded by copying) -> ReLU -> BatchNorm1d -> Dropout1d(p=0) -> next Conv1d."""

    def __init__(self, padding_mode: str = "reflect", explicit_pad: bool = False) -> None:
        super().__init__()
        self.explicit_pad = explicit_pad
        pad = 0 if explicit_pad else 2
        self.conv1 = nn.Conv1d(4, 6, 5, padding=2, padding_mode="reflect")
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout1d(p=0.0)
        self.conv2 = nn.Conv1d(6, 8, 3, padding=pad, dilation=2, padding_mode=padding_mode)
        self.mode = padding_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.bn(torch.relu(self.conv1(x))))
        if self.explicit_pad:
            y = F.pad(y, (2, 2), mode=self.mode) if self.mode != "zeros" else F.pad(y, (2, 2))
        return self.conv2(y)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("padding_mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("explicit_pad", [False, True], ids=["conv_pads", "F.pad"])
def test_batchnorm_folds_into_the_next_conv_through_dropout_and_copying_padding(mode, padding_mode, explicit_pad):
    result = fused(TDNN(padding_mode, explicit_pad), torch.randn(2, 4, 16), left=0, mode=mode)
    assert changes(result, "fuse_bn_into_next")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("explicit_pad", [False, True], ids=["conv_pads", "F.pad"])
def test_zero_padding_after_a_batchnorm_is_left_with_that_reason(mode: str, explicit_pad: bool) -> None:
    result = fused(TDNN("zeros", explicit_pad), torch.randn(2, 4, 16), left=1, mode=mode)
    (reason,) = reasons(result)
    assert "relu" in reason and ("pads its input with zeros" in reason or "padding with a constant" in reason), reason


class PreNormAttention(nn.Module):
    """A BatchNorm over (batch, length, features) read by the query, key and value projections: three linear
    consumers, each takes the fold. The residual branch reads the un-normalised input."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(d)
        self.q, self.k, self.v, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(x.transpose(1, 2)).transpose(1, 2)
        attn = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / 8 ** 0.5, dim=-1)
        return x + self.out(attn @ self.v(h))


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_read_by_several_linear_layers_folds_into_each(mode: str) -> None:
    result = fused(PreNormAttention(), torch.randn(2, 5, 8), left=0, mode=mode)
    (change,) = changes(result, "fuse_bn_into_next")
    assert change.into is not None and change.into.count(",") == 2, change  # q, k and v


class PostNormAttention(PreNormAttention):
    """Post-norm: the BatchNorm follows the residual add, and feeds the next projections and the next residual."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn((x + self.out(x)).transpose(1, 2)).transpose(1, 2)
        return h + self.q(h)


@pytest.mark.parametrize("mode", MODES)
def test_a_residual_add_on_both_sides_is_named(mode: str) -> None:
    result = fused(PostNormAttention(), torch.randn(2, 5, 8), left=1, mode=mode)
    (reason,) = reasons(result)
    assert "a sum of branches" in reason and "a residual add beside another branch" in reason, reason


class ConcatIntoConv(nn.Module):
    """Res2Net's last split: a BatchNorm's output concatenated with other channels, then a 1x1 conv."""

    def __init__(self, kernel: int = 1, padding: int = 0) -> None:
        super().__init__()
        self.conv_a, self.bn = nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4)
        self.conv = nn.Conv1d(7, 5, kernel, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(torch.relu(self.conv_a(x)))
        return self.conv(torch.cat([x[:, :, 1:-1], y], dim=1))


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_folds_into_its_block_of_a_concatenation_read_by_a_conv(mode: str) -> None:
    fused(ConcatIntoConv(), torch.randn(2, 3, 9), left=0, mode=mode)


def test_a_concatenation_read_by_a_zero_padded_conv_is_left() -> None:
    result = fused(ConcatIntoConv(3, 1), torch.randn(2, 3, 9), left=1)
    assert "pads its input with zeros" in reasons(result)[0]


class ChunkedIntoConvs(nn.Module):
    """The BatchNorm's channels split in two halves, each read by its own conv (one of them reflect-padded)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(6)
        self.a, self.b = nn.Conv1d(3, 2, 1), nn.Conv1d(3, 2, 3, padding=1, padding_mode="reflect")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = torch.chunk(self.bn(torch.relu(x)), 2, dim=1)
        return self.a(first) * self.b(second)


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_folds_into_the_convs_of_its_chunks(mode: str) -> None:
    fused(ChunkedIntoConvs(), torch.randn(2, 6, 7), left=0, mode=mode)


class FlattenHead(nn.Module):
    """The last BatchNorm of an encoder on (batch*vars, patches, d) read by a head that flattens d x patches."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.head = nn.BatchNorm1d(4), nn.Linear(4 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch * vars, patches=5, d=4)
        h = self.bn(torch.relu(x).transpose(1, 2)).transpose(1, 2)
        h = h.reshape(-1, 2, 5, 4).permute(0, 1, 3, 2)  # (batch, vars, d, patches)
        return self.head(h.flatten(start_dim=-2))


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_folds_into_a_head_over_the_flattened_channels_and_positions(mode: str) -> None:
    fused(FlattenHead(), torch.randn(6, 5, 4), left=0, mode=mode)


class LinearOverTime(nn.Module):
    """BatchNorm1d over channels, then a Linear over the time axis: it shares its weights across channels."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.lin = nn.BatchNorm1d(4), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.bn(torch.relu(x)))


def test_a_linear_over_another_axis_is_left_with_that_reason() -> None:
    result = fused(LinearOverTime(), torch.randn(3, 4, 6), left=1)
    assert "mixes several BatchNorm channels" in reasons(result)[0]


class Blocked(nn.Module):
    """BatchNorms whose outputs reach a gate, pooling statistics, a transposed conv and the model's output."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1, self.bn2, self.bn3, self.bn4 = (nn.BatchNorm1d(4) for _ in range(4))
        self.gate, self.up = nn.Conv1d(4, 4, 1), nn.ConvTranspose1d(4, 4, 2, stride=2)

    def forward(self, x: torch.Tensor) -> Any:
        a = self.bn1(torch.relu(x))
        gated = a * torch.sigmoid(self.gate(a))
        b = self.bn2(torch.relu(gated))
        stats = torch.cat([b.mean(dim=-1), b.std(dim=-1)], dim=1)
        c = self.bn3(torch.tanh(x))
        return stats, self.up(c), self.bn4(torch.relu(x))


@pytest.mark.parametrize("mode", MODES)
def test_each_batchnorm_left_names_what_blocks_it(mode: str) -> None:
    result = fused(Blocked(), torch.randn(3, 4, 6), left=4, mode=mode)
    by_node = sorted(reasons(result))
    text = "\n".join(by_node)
    assert all(r.startswith("no exact fold: before it, ") and "is not linear" in r.split("; after it")[0]
               for r in by_node), text
    assert "a product with another value" in text  # the gate
    assert "statistics that are not linear" in text  # the std of the pooling
    assert "ConvTranspose" in text
    assert "the model's output" in text


class SharedLinearTwice(nn.Module):
    """One Linear module called on the BatchNorm's output and on the raw input: the BatchNorm's site gets a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.lin = nn.BatchNorm1d(5), nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(torch.relu(x).transpose(1, 2)).transpose(1, 2)
        return self.lin(h) + self.lin(x)


@pytest.mark.parametrize("mode", MODES)
def test_a_shared_linear_gets_a_folded_copy_for_the_batchnorms_site(mode: str) -> None:
    fused(SharedLinearTwice(), torch.randn(2, 3, 5), left=0, mode=mode)


def test_grouped_conv_through_a_transpose() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.conv = nn.BatchNorm1d(6), nn.Conv1d(6, 4, 3, groups=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, length, 6)
            return self.conv(self.bn(torch.relu(x).transpose(1, 2)))

    fused(M(), torch.randn(2, 7, 6), left=0)


class PooledHead(nn.Module):
    """BatchNorm -> global average over time -> Linear: an average of one channel keeps its affine map."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.bn, self.head, self.how = nn.BatchNorm1d(5), nn.Linear(5, 3), how
        self.pool = nn.AdaptiveAvgPool1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(torch.relu(x))
        pooled = y.mean(dim=-1) if self.how == "mean" else self.pool(y).flatten(1)
        return self.head(pooled)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["mean", "adaptive_avg_pool"])
def test_batchnorm_folds_through_a_global_average_into_the_head(mode: str, how: str) -> None:
    fused(PooledHead(how), torch.randn(3, 5, 7), left=0, mode=mode)


class MeanOverChannels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn, self.head = nn.BatchNorm1d(5), nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(torch.relu(x)).mean(dim=1))


def test_an_average_over_the_channels_is_left_with_that_reason() -> None:
    result = fused(MeanOverChannels(), torch.randn(3, 5, 7), left=1)
    assert "averages values of several channels together" in reasons(result)[0]


def test_without_example_inputs_a_fold_through_a_reshape_is_left_with_what_to_do() -> None:
    """Symbolic tracing alone gives no shapes: the reshape cannot be followed, and the reason says so."""
    model = randomize_batchnorms(FlattenedTimeFeatures()).eval()
    result = fuse(model, {"trace": {"mode": "fx"}})
    assert count_batchnorms(result.graph_module) == 1
    (left,) = result.report.remaining_batchnorms
    assert "pass example_inputs" in left.reason, left.reason
    assert_exact(model, result.graph_module, (torch.randn(3, 5),))
