"""Fused model written by fx-lightning 0.1.0 (torch 2.14.1+cu130). Generated code: do not edit.

Load it without the training code:  from fused_module import load; model = load()
"""
import os

import torch
from torch.nn import *  # noqa: F401,F403 - module constructors below are written as their reprs
NoneType = type(None)
from torch import device
import torch.fx._pytree as fx_pytree
from math import inf
from math import nan
import torch.utils._pytree as pytree

_HERE = os.path.dirname(os.path.abspath(__file__))


def _resolve(module: str, qualname: str):
    obj = __import__(module, fromlist=["_"])
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _owner(root: torch.nn.Module, path: str):
    """The module that holds ``path`` (creating empty containers on the way) and the last name."""
    *parents, name = path.split(".")
    for part in parents:
        if part not in root._modules:
            root.add_module(part, torch.nn.Module())
        root = root._modules[part]
    return root, name


def _module(root, path, module):
    owner, name = _owner(root, path)
    owner.add_module(name, module)


def _tensor(root, path, shape, dtype, kind):
    owner, name = _owner(root, path)
    empty = torch.empty(shape, dtype=dtype)
    if kind == "parameter":
        owner.register_parameter(name, torch.nn.Parameter(empty, requires_grad=False))
    else:
        owner.register_buffer(name, empty, persistent=(kind == "buffer"))


def _pickled(name):
    # A module without a constructor repr: pickled, so it needs its class importable (weights_only=False).
    return torch.load(os.path.join(_HERE, "modules", name + ".pt"), map_location="cpu", weights_only=False)


class FusedModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        _module(self, '0', Conv2d(3, 4, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1)))
        _module(self, '2', ReLU())
        _module(self, '3', AdaptiveAvgPool2d(output_size=1))
        _module(self, '4', Flatten(start_dim=1, end_dim=-1))
        _module(self, '5', Linear(in_features=4, out_features=3, bias=True))

    def forward(self, input):
        input_1 = input
        _0 = getattr(self, "0")(input_1);  input_1 = None
        _2 = getattr(self, "2")(_0);  _0 = None
        _3 = getattr(self, "3")(_2);  _2 = None
        _4 = getattr(self, "4")(_3);  _3 = None
        _5 = getattr(self, "5")(_4);  _4 = None
        return _5


def load(map_location="cpu") -> FusedModule:
    """Build the model, load ``weights.pt`` next to this file and return it in eval mode."""
    model = FusedModule()
    state = torch.load(os.path.join(_HERE, "weights.pt"), map_location=map_location, weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()
