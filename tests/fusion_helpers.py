"""Helpers for the engine tests: non-trivial BatchNorm statistics, fp64 references, state fingerprints."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.passes.batchnorm import is_batchnorm_node
from fx_lightning.passes.graph_utils import is_batchnorm_like, looks_like_batchnorm


def randomize_batchnorms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm-like module non-trivial statistics and affine parameters.

    A fresh BatchNorm is the identity map (mean 0, var 1, gamma 1, beta 0): folding it can be wrong
    and still look exact, so every test uses random statistics.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():  # frozen forms (statistics as buffers, e.g. timm's FrozenBatchNormAct2d) too
            if not (is_batchnorm_like(m) or looks_like_batchnorm(m)):
                continue
            if getattr(m, "running_mean", None) is not None:
                n = m.running_mean.numel()
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(n, generator=g) * 1.5 + 0.25)
            if isinstance(getattr(m, "weight", None), torch.Tensor):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3 + 1.0)
            if isinstance(getattr(m, "bias", None), torch.Tensor):
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.3)
    return model


def _to64(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    if isinstance(x, (tuple, list)):
        return type(x)(_to64(v) for v in x)
    return x


def reference_fp64(model: nn.Module, inputs: Any) -> Any:
    """The original model in eval mode, computed in float64 (``inputs``: a tensor or a tuple of args)."""
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    ref = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        return ref(*_to64(inputs))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref|: relative to the reference's scale, not elementwise."""
    out, ref = out.detach().double(), ref.detach().double()
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def assert_exact(model: nn.Module, fused: nn.Module, inputs: Sequence[Any], tol: float = 1e-5) -> float:
    ref = reference_fp64(model, inputs)
    with torch.no_grad():
        out = fused(*inputs)
    if isinstance(ref, (tuple, list)):
        errs = [rel_err(o, r) for o, r in zip(out, ref)]
        err = max(errs)
    else:
        err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"
    return err


def fingerprint(model: nn.Module) -> Tuple[str, Tuple[Tuple[str, bool], ...], Tuple[str, ...]]:
    """Hash of every parameter and buffer (bytes, dtype, shape, requires_grad), every module's training
    flag, and any instance-level attribute that shadows a method (a replaced ``forward``)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict(keep_vars=True).items()):
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(str(t.requires_grad).encode())
        if t.numel():
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    flags = tuple((n, m.training) for n, m in model.named_modules())
    shadowed = tuple(sorted(f"{n}.{k}" for n, m in model.named_modules() for k in m.__dict__
                            if k in ("forward", "__call__", "eval", "train")))
    return h.hexdigest(), flags, shadowed


def file_hashes(directory: Path) -> Dict[str, str]:
    """sha256 of every file under ``directory`` (relative posix path -> digest)."""
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def count_batchnorms(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if is_batchnorm_node(gm, n))


def count_bn_modules(module: nn.Module) -> int:
    return sum(1 for m in module.modules() if is_batchnorm_like(m))


def dropout_nodes(gm: fx.GraphModule) -> int:
    from fx_lightning.capture.fuse_report import graph_stats

    return graph_stats(gm).dropouts


def stats(gm: fx.GraphModule) -> Dict[str, int]:
    from fx_lightning.capture.fuse_report import graph_stats

    s = graph_stats(gm)
    return {"nodes": s.nodes, "batchnorms": s.batchnorms, "dropouts": s.dropouts, "parameters": s.parameters}


def foldable_after_conv(model: nn.Module) -> set:
    """Names of BN nodes that directly follow a conv whose output has exactly one user (independent of
    the passes: computed on a fresh capture of the model)."""
    from fx_lightning.capture.graph import capture
    from fx_lightning.config import TraceConfig
    from fx_lightning.passes.bn_views import Layer, match_layer

    gm = capture(model, TraceConfig(mode="fx")).graph_module
    found = set()
    for node in gm.graph.nodes:
        if is_batchnorm_node(gm, node):
            producer = node.args[0]
            layer = match_layer(gm, producer)
            if isinstance(layer, Layer) and layer.kind != "linear" and len(producer.users) == 1:
                found.add(node.name)
    return found


def real_cpu_has(flag: str) -> bool:
    """Whether this machine's own CPU (not the one the tests fake) has ``flag``: what a runtime's kernels use."""
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
