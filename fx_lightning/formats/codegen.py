"""Code generation for the ``code`` export format: the fused GraphModule as readable Python.

Like ``GraphModule.to_folder``, but for serving: relative paths, torch.nn constructors written as their reprs
instead of pickles (a module without one is pickled and listed), weights loaded with ``weights_only=True``.
"""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.common.imports import import_object
from fx_lightning.errors import ExportError
from fx_lightning.formats.base import FUSED_CLASS_NAME
from fx_lightning.passes.graph_utils import owner_of

__all__ = ["generate_code"]


_CODE_HEADER = '''\
"""Fused model written by fx-lightning {version} (torch {torch_version}). Generated code: do not edit.

Load it without the training code:  from {package} import load; model = load()
"""
import os

import torch
from torch.nn import *  # noqa: F401,F403 - module constructors below are written as their reprs
{imports}

_HERE = os.path.dirname(os.path.abspath(__file__))


def _resolve(module: str, qualname: str):
    obj = __import__(module, fromlist=["_"])
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
{resolved}

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

'''

_CODE_FOOTER = '''

def load(map_location="cpu") -> {cls}:
    """Build the model, load ``weights.pt`` next to this file and return it in eval mode."""
    model = {cls}()
    state = torch.load(os.path.join(_HERE, "weights.pt"), map_location=map_location, weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()
'''


def generate_code(
    model: fx.GraphModule, folder: Path, package: str, version: str
) -> Tuple[str, Dict[str, torch.Tensor], List[str]]:
    """``GraphModule.to_folder`` done for serving: relative paths, constructors instead of pickles.

    Returns the source of ``module.py``, the state dict to save as ``weights.pt``, and the targets of the
    submodules that had to be pickled (no constructor repr), which are saved under ``folder/modules``."""
    called = [str(n.target) for n in model.graph.nodes if n.op == "call_module"]
    attrs = [str(n.target) for n in model.graph.nodes if n.op == "get_attr"]
    lines: List[str] = []
    pickled: List[str] = []
    built: List[str] = []
    for i, target in enumerate(dict.fromkeys(called)):
        sub = model.get_submodule(target)
        ctor = _constructor(sub)
        if ctor is None:
            blob = f"m{i}_{target.replace('.', '_')}"
            (folder / "modules").mkdir(exist_ok=True)
            torch.save(sub, folder / "modules" / f"{blob}.pt")
            lines.append(f"_module(self, {target!r}, _pickled({blob!r}))")
            pickled.append(target)
        else:
            lines.append(f"_module(self, {target!r}, {ctor})")
        built.append(target)
    inside = lambda name: any(name == b or name.startswith(b + ".") for b in built)  # noqa: E731
    non_persistent: Dict[str, torch.Tensor] = {}
    for target in dict.fromkeys(attrs):
        if inside(target):
            continue
        owner, name = owner_of(model, target)
        value = getattr(owner, name)
        if not isinstance(value, torch.Tensor):
            raise ExportError(f"get_attr {target!r} is a {type(value).__name__}, not a tensor; cannot write it as code.")
        if isinstance(value, nn.Parameter):
            kind = "parameter"
        elif name in owner._buffers and name not in owner._non_persistent_buffers_set:
            kind = "buffer"
        else:
            kind = "constant"  # a non-persistent buffer or plain tensor attribute: stored, not in state_dict
            non_persistent[target] = value.detach().cpu()
        lines.append(f"_tensor(self, {target!r}, {list(value.shape)}, {value.dtype}, {kind!r})")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    code = model.graph.python_code(root_module="self")
    imports, resolved = _global_imports(code.globals)
    init = ["def __init__(self):", "    super().__init__()"] + ["    " + ln for ln in lines]
    if non_persistent:
        init += [
            "    constants = torch.load(os.path.join(_HERE, 'constants.pt'), map_location='cpu', weights_only=True)",
            "    for path, value in constants.items():",
            "        owner, name = _owner(self, path)",
            "        getattr(owner, name).copy_(value)",
        ]
        torch.save(non_persistent, folder / "constants.pt")
    # torch.fx writes wrap("name") for each function kept whole above forward; it must run at a module's top level.
    source_lines = textwrap.dedent(code.src).strip("\n").splitlines()
    wraps = [line for line in source_lines if line.startswith("torch.fx._symbolic_trace.wrap(")]
    forward = "\n".join(line for line in source_lines if line not in wraps).strip("\n")
    resolved = resolved + wraps
    body = "\n".join(init) + "\n\n" + forward + "\n"
    source = (
        _CODE_HEADER.format(version=version, torch_version=torch.__version__, package=package,
                            imports="\n".join(imports),
                            resolved="".join(f"\n{line}" for line in resolved) + ("\n" if resolved else ""))
        + f"\nclass {FUSED_CLASS_NAME}(torch.nn.Module):\n"
        + textwrap.indent(body, "    ")
        + _CODE_FOOTER.format(cls=FUSED_CLASS_NAME)
    )
    compile(source, str(folder / "module.py"), "exec")  # fail here, with the path, not at load time
    return source, state, pickled


def _constructor(module: nn.Module) -> Optional[str]:
    """Python source that rebuilds ``module`` (weights aside), or None when its repr cannot do that."""
    cls = type(module)
    if not cls.__module__.startswith("torch.nn.modules") or module._modules:
        return None
    text = repr(module)
    if "\n" in text:
        return None
    namespace: Dict[str, object] = {}
    exec("from torch.nn import *\nimport torch", namespace)  # noqa: S102 - torch's own reprs only
    try:
        rebuilt = eval(text, namespace)  # noqa: S307
    except Exception:  # noqa: BLE001 - not every repr is a constructor call
        return None
    if type(rebuilt) is not cls or _public_state(rebuilt) != _public_state(module):
        return None
    mine = {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
    theirs = {k: (tuple(v.shape), v.dtype) for k, v in rebuilt.state_dict().items()}
    if set(mine) != set(theirs) or any(mine[k][0] != theirs[k][0] for k in mine):
        return None
    dtypes = {v[1] for v in mine.values()}
    if len(dtypes) > 1:
        return None
    # Build in the stored dtype so load_state_dict does not cast the weights.
    return text if dtypes <= {torch.get_default_dtype()} else f"{text}.to({next(iter(dtypes))})"


def _public_state(module: nn.Module) -> Dict[str, object]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}


def _global_imports(globals_: Dict[str, Any]) -> Tuple[List[str], List[str]]:
    from torch.fx.graph import _custom_builtins

    lines: List[str] = []
    for name, obj in sorted(globals_.items()):
        if name in _custom_builtins:
            if name != "torch":
                lines.append(_custom_builtins[name].import_str)
            continue
        if inspect.ismodule(obj):
            lines.append(f"import {obj.__name__} as {name}")
            continue
        if isinstance(obj, str):  # a string annotation (``from __future__ import annotations``)
            lines.append(f"{name} = {obj!r}")
            continue
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if module and qualname and "<" not in qualname:
            try:
                found = import_object(f"{module}:{qualname}")
            except (ImportError, AttributeError, ValueError):
                found = None
            if found is obj:
                lines.append(f"{name} = _resolve({module!r}, {qualname!r})")
                continue
        raise ExportError(f"the graph calls {obj!r} (as {name!r}), which cannot be imported by name.")
    # The imports go above, and the names found with _resolve below, its definition (a kept-whole function: the
    # module-level names the graph calls).
    plain = [ln for ln in lines if not ln.startswith(tuple(f"{n} = _resolve" for n in globals_))]
    return plain, [ln for ln in lines if ln not in plain]
