"""The raw-input prologue (``export.preprocess``): the input normalisation compiled into the exported graph, so a
client sends raw pixels (uint8) and no server re-implements the normalisation.

:class:`Prologue` computes ``(float(raw) [NHWC->NCHW] [BGR->RGB] * scale - mean[c]) / std[c]``;
:func:`with_prologue` splices it in front of the fused GraphModule as ONE graph, which every format then exports
(the writers trace the graph they are given). :func:`to_raw` is its inverse, turning the normalised example and
parity inputs back into the pixels a client would send; :class:`ThroughRaw` feeds a model or an artifact those
pixels, so that a model without the prologue and an artifact with it are judged on the same pixels.

The record is :class:`~fx_lightning.export.manifest.Preprocess` (what the manifest says to clients).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.common.batches import describe, model_device_dtype
from fx_lightning.errors import ConfigError
from fx_lightning.export.manifest import Preprocess

__all__ = ["Prologue", "with_prologue", "behind_prologue", "to_raw", "raw_args",
           "check_prologue_input", "ThroughRaw"]

# The prologue's buffers in the spliced graph (prefixed so they cannot shadow a model attribute).
_MEAN, _STD = "preprocess_mean", "preprocess_std"
_DTYPE_RANGE = {"uint8": (0.0, 255.0)}


class Prologue(nn.Module):
    """Raw input (``input_dtype``, ``layout``, ``channel_order``) -> the model's normalised NCHW RGB input, computed
    in float32 and given to the model in its own dtype (``dtype``: a half-precision model's)."""

    def __init__(self, preprocess: Preprocess, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        shape = (1, len(preprocess.mean), 1, 1)
        self.register_buffer(_MEAN, torch.tensor(preprocess.mean, dtype=torch.float32).reshape(shape))
        self.register_buffer(_STD, torch.tensor(preprocess.std, dtype=torch.float32).reshape(shape))
        self.scale = float(preprocess.scale)
        self.channels_last = preprocess.layout == "NHWC"
        self.bgr = preprocess.channel_order == "BGR"
        self.dtype = dtype

    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        x = raw.to(torch.float32)
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        if self.bgr:
            x = x.flip(1)
        x = (x * self.scale - getattr(self, _MEAN)) / getattr(self, _STD)
        return x if self.dtype == torch.float32 else x.to(self.dtype)


def with_prologue(model: fx.GraphModule, preprocess: Preprocess, dtype: torch.dtype = torch.float32) -> fx.GraphModule:
    """One GraphModule: the prologue's nodes, then ``model``'s graph reading their output where it read its input
    (``dtype``: the dtype ``model`` takes its input in). ``model`` (one placeholder: checked by
    :func:`check_prologue_input` on its inputs) is not changed; its weights are shared."""
    placeholders = [n for n in model.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ConfigError(f"export.preprocess: the prologue takes one image input; the fused model takes "
                          f"{len(placeholders)} ({', '.join(p.name for p in placeholders)}).")
    if any(hasattr(model, name) for name in (_MEAN, _STD)):
        raise ConfigError(f"export.preprocess: the model has an attribute named {_MEAN} or {_STD}, which the "
                          "prologue's buffers need.")
    device, _ = model_device_dtype(model)
    prologue = fx.symbolic_trace(Prologue(preprocess, dtype).to(device or "cpu"))
    graph = fx.Graph()
    raw = graph.placeholder(placeholders[0].name)  # the client's input keeps the model input's name
    prologue_input = next(n for n in prologue.graph.nodes if n.op == "placeholder")
    normalised = graph.graph_copy(prologue.graph, {prologue_input: raw})
    output = graph.graph_copy(model.graph, {placeholders[0]: normalised})
    graph.output(output)
    attrs: Dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            owner = prologue if node.target in (_MEAN, _STD) else model
            attrs[str(node.target)] = functools.reduce(getattr, str(node.target).split("."), owner)
    spliced = fx.GraphModule(attrs, graph, class_name=type(model).__name__)
    spliced.eval()
    return spliced


def check_prologue_input(args: Sequence[Any], preprocess: Preprocess) -> None:
    """The prologue fits a model whose input is one 4-D NCHW tensor with ``len(mean)`` channels (3 for BGR)."""
    channels = len(preprocess.mean)
    wanted = f"one 4-D NCHW image tensor with {channels} channel(s) (len(mean))"
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(args) != 1 or len(tensors) != 1 or tensors[0].dim() != 4:
        raise ConfigError(f"export.preprocess: the prologue needs {wanted}; the model's input is "
                          f"{describe(tuple(args))}. Set export.preprocess.enabled: false for this model.",
                          fix="set export.preprocess.enabled: false for this model")
    if tensors[0].shape[1] != channels:
        raise ConfigError(f"export.preprocess.mean: {channels} value(s) {list(preprocess.mean)} but the model's "
                          f"input {tuple(tensors[0].shape)} has {tensors[0].shape[1]} channels on axis 1; give one "
                          "mean and std per channel.",
                          # checked where parity runs: that step's advice (parity.input) would not help
                          fix="give export.preprocess.mean and std one value per channel of the input")
    if preprocess.channel_order == "BGR" and channels != 3:
        raise ConfigError(f"export.preprocess.channel_order: BGR needs 3 channels; the input has {channels}.")


def to_raw(x: torch.Tensor, preprocess: Preprocess) -> torch.Tensor:
    """The raw input a client sends for the normalised NCHW RGB ``x``: ``(x * std + mean) / scale`` in the client's
    channel order and layout; for uint8, rounded and clamped to 0..255 (exact for inputs that came from pixels)."""
    shape = (1, -1, 1, 1)
    mean = torch.tensor(preprocess.mean, dtype=torch.float64, device=x.device).reshape(shape)
    std = torch.tensor(preprocess.std, dtype=torch.float64, device=x.device).reshape(shape)
    raw = (x.detach().double() * std + mean) / preprocess.scale
    if preprocess.channel_order == "BGR":
        raw = raw.flip(1)
    if preprocess.layout == "NHWC":
        raw = raw.permute(0, 2, 3, 1)
    low_high = _DTYPE_RANGE.get(preprocess.input_dtype)
    if low_high is not None:
        raw = raw.round().clamp(*low_high)
    return raw.to(getattr(torch, preprocess.input_dtype)).contiguous()


def raw_args(args: Sequence[Any], preprocess: Preprocess) -> Tuple[Any, ...]:
    """``args`` (the model's one image input) as the raw input."""
    return tuple(to_raw(a, preprocess) if isinstance(a, torch.Tensor) else a for a in args)


def behind_prologue(module: nn.Module, preprocess: Optional[Preprocess]) -> nn.Module:
    """``module`` (eager, taking the normalised input) with the prologue in front: it takes the raw input (as it is
    without a prologue). The selection and ``fx-lightning bench`` time the unfused model so beside the artifacts."""
    if preprocess is None:
        return module
    device, dtype = model_device_dtype(module)
    return nn.Sequential(Prologue(preprocess, dtype or torch.float32).to(device or "cpu"), module).eval()


class ThroughRaw(nn.Module):
    """Normalised inputs (what parity batches hold) turned into the raw pixels a client would send, then ``module``,
    which takes raw inputs (an artifact, or a model :func:`behind_prologue`): a model and an artifact wrapped so are
    judged on the same pixels (uint8 rounding and clamping included)."""

    def __init__(self, module: nn.Module, preprocess: Preprocess) -> None:
        super().__init__()
        self.module = module
        self.preprocess = preprocess

    def forward(self, x: torch.Tensor) -> Any:
        return self.module(to_raw(x, self.preprocess))
