"""A zoo of small time-series, speech and tabular models with BatchNorm, written from code as their libraries
build them (PatchTST, TSMixer, TCN, tsai's ResNet, speechbrain's ECAPA-TDNN and x-vector, torchaudio's Conformer
convolution module, fastai's TabularModel), random weights: nothing is downloaded and no library is needed.

``SEQUENCE_ZOO[name] = Entry(build, foldable)``: ``build()`` returns ``(model, example_inputs)``; ``foldable`` is
the number of BatchNorms an exact fold exists for, counted by hand from the architecture (each model's docstring
says which and why), independently of the passes: the test compares the engine's count with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

Builder = Callable[[], Tuple[nn.Module, Tuple[torch.Tensor, ...]]]


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ PatchTST (forecasting)


class Transpose(nn.Module):
    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(self.a, self.b)


def _batchnorm_over_features(d: int) -> nn.Module:
    """PatchTST's norm="BatchNorm": BatchNorm1d over d_model of (batch, patches, d_model), through transposes."""
    return nn.Sequential(Transpose(1, 2), nn.BatchNorm1d(d), Transpose(1, 2))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dk = heads, d // heads
        self.W_Q, self.W_K, self.W_V, self.to_out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.W_Q(x).view(b, -1, self.heads, self.dk).transpose(1, 2)
        k = self.W_K(x).view(b, -1, self.heads, self.dk).permute(0, 2, 3, 1)
        v = self.W_V(x).view(b, -1, self.heads, self.dk).transpose(1, 2)
        attn = torch.softmax(torch.matmul(q, k) * self.dk ** -0.5, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().view(b, -1, self.heads * self.dk)
        return self.to_out(out)


class TSTEncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, d_ff: int, pre_norm: bool) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.self_attn = Attention(d, heads)
        self.dropout_attn, self.dropout_ffn = nn.Dropout(0.1), nn.Dropout(0.1)
        self.norm_attn, self.norm_ffn = _batchnorm_over_features(d), _batchnorm_over_features(d)
        self.ff = nn.Sequential(nn.Linear(d, d_ff), nn.GELU(), nn.Dropout(0.1), nn.Linear(d_ff, d))

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            src = src + self.dropout_attn(self.self_attn(self.norm_attn(src)))
            return src + self.dropout_ffn(self.ff(self.norm_ffn(src)))
        src = self.norm_attn(src + self.dropout_attn(self.self_attn(src)))
        return self.norm_ffn(src + self.dropout_ffn(self.ff(src)))


class PatchTST(nn.Module):
    """PatchTST (Nie et al.), channel-independent, with its BatchNorm encoder and flatten head.

    Post-norm (the default): each BatchNorm follows a residual add; every one but the last also feeds the next
    residual add, so none of those folds; the last encoder layer's norm_ffn feeds only the head (permute, flatten,
    Linear over d_model x patches), where it folds: 1 of 4. Pre-norm: each BatchNorm's output feeds only linear
    layers (W_Q, W_K, W_V through the views, or ff's first Linear): all 4 fold.
    """

    def __init__(self, pre_norm: bool, n_vars: int = 3, seq_len: int = 32, patch_len: int = 8, stride: int = 8,
                 d: int = 16, heads: int = 2, layers: int = 2, pred_len: int = 6) -> None:
        super().__init__()
        self.patch_len, self.stride, self.n_vars = patch_len, stride, n_vars
        self.patches = (seq_len - patch_len) // stride + 1
        self.W_P = nn.Linear(patch_len, d)
        self.W_pos = nn.Parameter(torch.randn(self.patches, d) * 0.02)
        self.dropout = nn.Dropout(0.1)
        self.layers = nn.ModuleList(TSTEncoderLayer(d, heads, 2 * d, pre_norm) for _ in range(layers))
        self.head = nn.Sequential(nn.Flatten(start_dim=-2), nn.Linear(d * self.patches, pred_len), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq_len, n_vars)
        z = x.permute(0, 2, 1).unfold(-1, self.patch_len, self.stride)  # (batch, vars, patches, patch_len)
        z = self.W_P(z)
        u = self.dropout(z.reshape(-1, self.patches, z.shape[-1]) + self.W_pos)
        for layer in self.layers:
            u = layer(u)
        z = u.reshape(-1, self.n_vars, self.patches, u.shape[-1]).permute(0, 1, 3, 2)  # (batch, vars, d, patches)
        return self.head(z).permute(0, 2, 1)


# ------------------------------------------------------------------------------ TSMixer (forecasting)


class TimeBatchNorm2d(nn.Module):
    """pytorch-tsmixer's BatchNorm over time x feature: (batch, time, feature) flattened to time*feature channels."""

    def __init__(self, time: int, features: int) -> None:
        super().__init__()
        self.time, self.features = time, features
        self.bn = nn.BatchNorm1d(time * features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x.reshape(x.shape[0], -1, 1))
        return y.reshape(x.shape[0], self.time, self.features)


class MixerLayer(nn.Module):
    def __init__(self, time: int, features: int, ff: int) -> None:
        super().__init__()
        self.time_fc, self.time_norm = nn.Linear(time, time), TimeBatchNorm2d(time, features)
        self.fc1, self.fc2 = nn.Linear(features, ff), nn.Linear(ff, features)
        self.feature_norm, self.dropout = TimeBatchNorm2d(time, features), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        res = self.dropout(torch.relu(self.time_fc(x.transpose(1, 2)))).transpose(1, 2)
        x = self.time_norm(x + res)
        res = self.dropout(self.fc2(self.dropout(torch.relu(self.fc1(x)))))
        return self.feature_norm(x + res)


class TSMixer(nn.Module):
    """TSMixer (Chen et al.) as pytorch-tsmixer writes it: post-norm mixer layers with a time x feature BatchNorm,
    and a flatten head.

    Each norm follows a residual add. time_norm feeds the feature MLP (a Linear over features, shared across time
    while the BatchNorm's channels are time x feature: mixed) and the residual add; feature_norm feeds the next
    layer's time mixing (a Linear over time, shared across features) and its residual add. The last feature_norm
    feeds only the head, a Linear over the flattened time x feature: it folds there. 1 of 4.
    """

    def __init__(self, time: int = 12, features: int = 4, ff: int = 8, layers: int = 2, horizon: int = 5) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(MixerLayer(time, features, ff) for _ in range(layers)))
        self.head = nn.Linear(time * features, horizon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, time, features)
        return self.head(self.layers(x).flatten(1))


# ----------------------------------------------------------------------------------- TCN (sequence)


class Chomp1d(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, :-self.size].contiguous()


class TemporalBlock(nn.Module):
    def __init__(self, n_in: int, n_out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        pad = (kernel - 1) * dilation
        self.net = nn.Sequential(
            nn.Conv1d(n_in, n_out, kernel, padding=pad, dilation=dilation), Chomp1d(pad), nn.BatchNorm1d(n_out),
            nn.ReLU(), nn.Dropout(0.2),
            nn.Conv1d(n_out, n_out, kernel, padding=pad, dilation=dilation), Chomp1d(pad), nn.BatchNorm1d(n_out),
            nn.ReLU(), nn.Dropout(0.2))
        self.downsample = nn.Conv1d(n_in, n_out, 1) if n_in != n_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        res = x if self.downsample is None else self.downsample(x)
        return torch.relu(self.net(x) + res)


class TCN(nn.Module):
    """Bai et al.'s temporal convolutional network (causal convs, padded then chomped: a slice before each
    BatchNorm). Every BatchNorm follows its conv through the chomp: 6 of 6."""

    def __init__(self, n_in: int = 3, channels: Tuple[int, ...] = (8, 8, 6), classes: int = 4) -> None:
        super().__init__()
        sizes = (n_in,) + channels
        self.blocks = nn.Sequential(*(TemporalBlock(sizes[i], sizes[i + 1], 3, 2 ** i) for i in range(len(channels))))
        self.linear = nn.Linear(channels[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, channels, time)
        return self.linear(self.blocks(x)[:, :, -1])


# ---------------------------------------------------------------------------- ResNet (tsai, 1-d)


def _conv_block(n_in: int, n_out: int, kernel: int, act: bool = True) -> nn.Sequential:
    layers: List[nn.Module] = [nn.Conv1d(n_in, n_out, kernel, padding="same", bias=False), nn.BatchNorm1d(n_out)]
    return nn.Sequential(*layers, *([nn.ReLU()] if act else []))


class ResBlock1d(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.convblock1, self.convblock2 = _conv_block(n_in, n_out, 7), _conv_block(n_out, n_out, 5)
        self.convblock3 = _conv_block(n_out, n_out, 3, act=False)
        self.shortcut = nn.BatchNorm1d(n_in) if n_in == n_out else _conv_block(n_in, n_out, 1, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.convblock3(self.convblock2(self.convblock1(x))) + self.shortcut(x))


class ResNet1d(nn.Module):
    """tsai's ResNet for time-series classification (Wang et al.): conv -> BatchNorm everywhere (7 fold into their
    conv), and a BatchNorm shortcut on the second block, which reads the previous block's ReLU and feeds the
    residual add: no exact fold. 7 of 8."""

    def __init__(self, c_in: int = 3, nf: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.resblock1, self.resblock2 = ResBlock1d(c_in, nf), ResBlock1d(nf, nf)
        self.fc = nn.Linear(nf, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.resblock2(self.resblock1(x)).mean(dim=-1))


# ----------------------------------------------------------------- ECAPA-TDNN and x-vector (speaker)


class SameConv1d(nn.Module):
    """speechbrain's Conv1d: "same" padding by reflection (F.pad), then an unpadded conv."""

    def __init__(self, n_in: int, n_out: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(n_in, n_out, kernel, dilation=dilation, groups=groups)
        self.pad = dilation * (kernel - 1) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.pad, self.pad), mode="reflect"))


class TDNNBlock(nn.Module):
    def __init__(self, n_in: int, n_out: int, kernel: int, dilation: int = 1) -> None:
        super().__init__()
        self.conv, self.activation = SameConv1d(n_in, n_out, kernel, dilation), nn.ReLU()
        self.norm, self.dropout = nn.BatchNorm1d(n_out), nn.Dropout1d(p=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.norm(self.activation(self.conv(x))))


class Res2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TDNNBlock(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = []
        for i, x_i in enumerate(torch.chunk(x, self.scale, dim=1)):
            y_i = x_i if i == 0 else self.blocks[i - 1](x_i if i == 1 else x_i + y_i)
            y.append(y_i)
        return torch.cat(y, dim=1)


class SEBlock(nn.Module):
    def __init__(self, channels: int, se: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = SameConv1d(channels, se, 1), SameConv1d(se, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.conv2(torch.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return s * x


class SERes2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1, self.tdnn2 = TDNNBlock(channels, channels, 1), TDNNBlock(channels, channels, 1)
        self.res2net_block = Res2NetBlock(channels, scale, kernel, dilation)
        self.se_block = SEBlock(channels, channels // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


class AttentiveStatisticsPooling(nn.Module):
    def __init__(self, channels: int, attention: int) -> None:
        super().__init__()
        self.tdnn = TDNNBlock(channels * 3, attention, 1)
        self.conv = SameConv1d(attention, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        mean, std = x.mean(dim=2, keepdim=True), x.std(dim=2, keepdim=True)
        context = torch.cat([x, mean.repeat(1, 1, length), std.repeat(1, 1, length)], dim=1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean = (attn * x).sum(dim=2)
        std = torch.sqrt(((x - mean.unsqueeze(2)).pow(2) * attn).sum(dim=2).clamp(1e-12))
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class ECAPATDNN(nn.Module):
    """speechbrain's ECAPA-TDNN (Desplanques et al.), small: 19 BatchNorms.

    Foldable, 4: in each SE-Res2Net block, the last Res2Net split's BatchNorm reaches only tdnn2's 1x1 conv
    through the concatenation (3); asp_bn reaches only the final 1x1 conv (1). Not: blocks[0] and each tdnn1
    feed a residual add (the skip, or the next split's x_i + y_i); the other splits feed the next split's add;
    tdnn2 feeds the SE gate's multiply; mfa feeds the attentive pooling's statistics and multiply; the pooling's
    tdnn feeds a tanh.
    """

    def __init__(self, n_mels: int = 16, channels: int = 32, scale: int = 4, lin: int = 12,
                 attention: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TDNNBlock(n_mels, channels, 5)] + [
            SERes2NetBlock(channels, scale, 3, d) for d in (2, 3, 4)])
        self.mfa = TDNNBlock(channels * 3, channels * 3, 1)
        self.asp = AttentiveStatisticsPooling(channels * 3, attention)
        self.asp_bn = nn.BatchNorm1d(channels * 6)
        self.fc = SameConv1d(channels * 6, lin, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, time, n_mels)
        x = x.transpose(1, 2)
        xl = []
        for layer in self.blocks:
            x = layer(x)
            xl.append(x)
        x = self.mfa(torch.cat(xl[1:], dim=1))
        return self.fc(self.asp_bn(self.asp(x))).transpose(1, 2)


class XVector(nn.Module):
    """speechbrain's x-vector TDNN: Conv1d (reflect "same" padding) -> LeakyReLU -> BatchNorm1d frame layers,
    statistics pooling, and an embedding MLP with a BatchNorm on (batch, 1, features) through transposes.

    Foldable, 5: the first four frame-level BatchNorms reach only the next conv through its reflect padding; the
    segment-level one reaches only the last Linear. Not: the fifth frame-level one feeds the mean and standard
    deviation of the statistics pooling. 5 of 6.
    """

    def __init__(self, n_mels: int = 12, channels: Tuple[int, ...] = (16, 16, 16, 16, 24), lin: int = 10) -> None:
        super().__init__()
        layers: List[nn.Module] = []
        n_in = n_mels
        for n_out, kernel, dilation in zip(channels, (5, 3, 3, 1, 1), (1, 2, 3, 1, 1)):
            layers += [SameConv1d(n_in, n_out, kernel, dilation), nn.LeakyReLU(), nn.BatchNorm1d(n_out)]
            n_in = n_out
        self.blocks = nn.Sequential(*layers)
        self.segment = nn.Linear(2 * channels[-1], lin)
        self.segment_norm = nn.BatchNorm1d(lin)
        self.embedding = nn.Linear(lin, lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, time, n_mels)
        h = self.blocks(x.transpose(1, 2))
        stats = torch.cat([h.mean(dim=2), h.std(dim=2)], dim=1).unsqueeze(1)  # (batch, 1, 2C)
        s = F.leaky_relu(self.segment(stats))
        return self.embedding(self.segment_norm(s.transpose(1, 2)).transpose(1, 2))


# ------------------------------------------------------------------------ Conformer (speech, text)


class ConvolutionModule(nn.Module):
    """torchaudio's Conformer convolution module: pointwise conv, GLU, depthwise conv, BatchNorm, SiLU,
    pointwise conv, on (batch, time, d) through transposes."""

    def __init__(self, d: int, kernel: int) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(d)
        self.sequential = nn.Sequential(
            nn.Conv1d(d, 2 * d, 1), nn.GLU(dim=1), nn.Conv1d(d, d, kernel, padding=(kernel - 1) // 2, groups=d),
            nn.BatchNorm1d(d), nn.SiLU(), nn.Conv1d(d, d, 1), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sequential(self.layer_norm(x).transpose(1, 2)).transpose(1, 2)


class ConformerLayer(nn.Module):
    def __init__(self, d: int, heads: int, kernel: int) -> None:
        super().__init__()
        self.ffn1, self.ffn2 = (nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.SiLU(), nn.Dropout(0.1),
                                              nn.Linear(2 * d, d)) for _ in range(2))
        self.attn_norm, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.conv_module, self.final_norm = ConvolutionModule(d, kernel), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.ffn1(x)
        x = x + self.attn(self.attn_norm(x))
        x = x + self.conv_module(x)
        return self.final_norm(x + 0.5 * self.ffn2(x))


class Conformer(nn.Module):
    """Two Conformer layers (Gulati et al.): each BatchNorm follows the depthwise conv directly. 2 of 2."""

    def __init__(self, n_in: int = 10, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.input_linear = nn.Linear(n_in, d)
        self.layers = nn.Sequential(*(ConformerLayer(d, 2, 7) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.input_linear(x))


# -------------------------------------------------------------------------------------- tabular


class TabularModel(nn.Module):
    """fastai's TabularModel: categorical embeddings concatenated with the BatchNorm'd continuous columns, then
    Linear -> ReLU -> BatchNorm1d -> Dropout blocks (BatchNorm after the activation), and bn_final.

    Foldable, 4 of 4: bn_cont reaches only the first Linear, through the concatenation (its block of inputs); each
    block's BatchNorm reaches only the next Linear through the dropout; bn_final follows the last Linear.
    """

    def __init__(self, cardinalities: Tuple[int, ...] = (5, 7), n_cont: int = 4, sizes: Tuple[int, ...] = (16, 8),
                 out: int = 3) -> None:
        super().__init__()
        self.embeds = nn.ModuleList(nn.Embedding(n, 3) for n in cardinalities)
        self.emb_drop, self.bn_cont = nn.Dropout(0.1), nn.BatchNorm1d(n_cont)
        widths = (3 * len(cardinalities) + n_cont,) + sizes
        blocks: List[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU(), nn.BatchNorm1d(b), nn.Dropout(0.1)]
        self.layers = nn.Sequential(*blocks, nn.Linear(widths[-1], out), nn.BatchNorm1d(out))

    def forward(self, x_cat: torch.Tensor, x_cont: torch.Tensor) -> torch.Tensor:
        x = self.emb_drop(torch.cat([e(x_cat[:, i]) for i, e in enumerate(self.embeds)], 1))
        return self.layers(torch.cat([x, self.bn_cont(x_cont)], 1))


# ----------------------------------------------------------------------------------------- zoo


@dataclass(frozen=True)
class Entry:
    build: Builder
    foldable: int  # counted by hand: see each model's docstring


def _built(make: Callable[[], nn.Module], *inputs: Callable[[], torch.Tensor]) -> Builder:
    def build() -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
        torch.manual_seed(0)
        return make(), tuple(i() for i in inputs)

    return build


SEQUENCE_ZOO: Dict[str, Entry] = {
    "patchtst_postnorm": Entry(_built(lambda: PatchTST(pre_norm=False), lambda: _x(2, 32, 3)), 1),
    "patchtst_prenorm": Entry(_built(lambda: PatchTST(pre_norm=True), lambda: _x(2, 32, 3)), 4),
    "tsmixer": Entry(_built(TSMixer, lambda: _x(3, 12, 4)), 1),
    "tcn": Entry(_built(TCN, lambda: _x(2, 3, 20)), 6),
    "resnet1d": Entry(_built(ResNet1d, lambda: _x(2, 3, 24)), 7),
    "ecapa_tdnn": Entry(_built(ECAPATDNN, lambda: _x(2, 40, 16)), 4),
    "xvector": Entry(_built(XVector, lambda: _x(2, 30, 12)), 5),
    "conformer": Entry(_built(Conformer, lambda: _x(2, 9, 10)), 2),
    "tabular": Entry(_built(TabularModel, lambda: torch.stack([torch.arange(6) % 5, torch.arange(6) % 7], 1),
                            lambda: _x(6, 4)), 4),
}
