"""Why symbolic tracing failed, said as the user can act on it: the user's source line (the innermost frame outside
torch and this package), the module it was in, and the fixes that apply (:func:`explain_fx_failure`)."""

from __future__ import annotations

import os
import re
import traceback
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.errors import TraceError, first_line

if TYPE_CHECKING:
    from fx_lightning.capture.graph import FXLeafTracer

__all__ = ["explain_fx_failure", "class_path", "user_frame", "user_frames", "is_users_file", "is_tracer_code"]


# With the separator: a bare prefix would also match site-packages/torchvision, torchmetrics...
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # fx_lightning/, not capture/


def is_tracer_code(frame: Any) -> bool:
    """torch.fx's and this package's own frames (its patched calls, proxies): never what is kept whole."""
    filename = os.path.abspath(frame.f_code.co_filename)
    return filename.startswith((os.path.join(_TORCH_DIR, "fx") + os.sep, _PKG_DIR)) or "<" in filename


def user_frames(exc: BaseException) -> List[Any]:
    """The traceback's frames outside torch and this package (the user's code), outermost first."""
    return [frame for frame, _ in traceback.walk_tb(exc.__traceback__) if is_users_file(frame.f_code.co_filename)]


def is_users_file(filename: str) -> bool:
    """Code outside torch and this package, and not generated (``<string>``, ``<eval_with_key>``)."""
    return not (os.path.abspath(filename).startswith((_TORCH_DIR, _PKG_DIR)) or "<" in filename)


def explain_fx_failure(root: nn.Module, tracer: "FXLeafTracer", exc: BaseException) -> TraceError:
    stack = [(p, c) for p, c in (tracer.failed_in or []) if p]  # the root's own frame has no path
    if stack:
        path, cls = stack[-1]
        where = f"module '{path}' ({cls})"
    else:
        path, cls = "", type(root).__qualname__
        where = f"the root module ({cls})"
    frame = user_frame(exc)
    message = first_line(exc, with_type=True)
    lines = [f"torch.fx could not trace {where}: {message}"]
    if frame:
        lines.append(f"  at {frame}")
    lines.append("  Fixes that apply:")
    lines.append(
        "  - trace.mode: export (or auto, the default, with example inputs): torch.export follows code that "
        "depends on shapes, such as `if x.shape[0] > 1` or torch.zeros(x.shape[0], ...)"
    )
    if "control flow" in message or "iterate" in message or "bool" in message.lower():
        lines.append(
            "  - a Python branch on a traced value: on a shape, torch.export captures it (above); on tensor "
            "values, no tracer can, so move it into a leaf module or an autowrapped function; on a flag "
            "argument, pin it with trace.concrete_args"
        )
    if stack:  # a leaf at the root would keep the whole model opaque: nothing would be fused
        lines.append(
            f"  - keep that module opaque: trace.leaf_modules: ['{class_path(root, path)}'] (it stays unfused inside)"
        )
    lines.append(
        "  - move the offending code into a free function and list it in trace.autowrap_functions "
        "(['pkg.module:function'])"
    )
    return TraceError("\n".join(lines))


def class_path(root: nn.Module, path: str) -> str:
    try:
        mod = root.get_submodule(path)
    except AttributeError:
        return path
    return f"{type(mod).__module__}.{type(mod).__qualname__}"


def user_frame(exc: BaseException) -> Optional[str]:
    """The innermost traceback frame outside torch and this package: the user's source line."""
    found = [fs for fs in traceback.extract_tb(exc.__traceback__) if is_users_file(fs.filename)]
    if not found:
        return None
    return f"{found[-1].filename}:{found[-1].lineno} in {found[-1].name}: {(found[-1].line or '').strip()}"


def branch_sites(assertions: Sequence[fx.Node]) -> List[str]:
    """Where in the user's code each branch on tensor values is (``esm2.py:108: if not padding_mask.any():``), from
    the stack traces torch.export kept on the nodes reading the values; one entry per line."""
    from fx_lightning.signature.value_guards import value_reads

    sites: List[str] = []
    for node in assertions:
        trace = next((str(n.meta.get("stack_trace") or "") for n in value_reads(node) if n.meta.get("stack_trace")), "")
        frames = [m for m in re.finditer(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', trace)
                  if is_users_file(m.group(1))]
        site = f"{os.path.basename(frames[-1].group(1))}:{frames[-1].group(2)}: {frames[-1].group(3).strip()}" \
            if frames else f"an assertion of torch.export ({node.args[1] if len(node.args) > 1 else node.name})"
        if site not in sites:
            sites.append(site)
    return sites
