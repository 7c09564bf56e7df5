"""``aoti``: AOTInductor packages, the fused model compiled ahead of time to native code for its device.

One package with a dynamic batch (``export.aoti_batch_sizes: []``), or one per listed batch size (a package
compiled for a static batch is faster where measured: docs/performance.md). Built under
``torch.no_grad()`` with Inductor's freezing (weights folded into the code), which a package built with
gradients on silently skips. Building needs a C++ compiler; loading needs none, but a CPU package only runs
on CPUs with the instruction set it was built for (recorded in the manifest and checked when loading), and
with the torch version that built it.

In C++, ``torch::inductor::AOTIModelPackageLoader loader("aoti/batch_1.pt2"); loader.run(inputs);``.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
from torch import nn

from fx_lightning.errors import ExportError
from fx_lightning.formats.base import Format, FormatEntry, WriteContext, fields_from
from fx_lightning.formats.batching import BatchPieces
from fx_lightning.common.rows import with_rows

__all__ = ["FORMAT", "AotiModule", "BuiltFor"]

# CPU instruction-set levels as torch reports them (torch.backends.cpu.get_cpu_capability()), lowest first.
_ISA_ORDER = ("DEFAULT", "NO AVX", "AVX2", "AVX512", "AMX")


def _compiler() -> Optional[str]:
    """The C++ compiler Inductor would use: its configured one (or $CXX), else the usual names."""
    from torch._inductor import config

    configured = config.cpp.cxx[0] if isinstance(config.cpp.cxx, (tuple, list)) else config.cpp.cxx
    for name in (configured, os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(str(name)):
            return shutil.which(str(name))
    return None


def _compiler_version() -> str:
    cxx = _compiler()
    if not cxx:
        return "unknown"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx
    return out.splitlines()[0] if out else cxx


def _write(root: Path, ctx: WriteContext) -> FormatEntry:
    folder = root / FORMAT.path
    folder.mkdir()
    packages: Dict[str, str] = {}
    axes = ctx.signature.input_axes()
    for size in ctx.aoti_batch_sizes or [None]:
        name = "dynamic.pt2" if size is None else f"batch_{size}.pt2"
        program = ctx.export() if size is None else ctx.export(tuple(with_rows(ctx.args, axes, size)))
        with torch.no_grad():  # freezing needs it: with grad on, Inductor silently skips it (eager speed)
            torch._inductor.aoti_compile_and_package(program, package_path=str(folder / name),
                                                     inductor_configs={"freezing": True})
        packages["dynamic" if size is None else str(size)] = name
    device = ctx.device
    sizes = [int(k) for k in packages if k != "dynamic"] or None  # None: any
    batched = ctx.signature.batched
    return FormatEntry(FORMAT.path, "torch._inductor.aoti_load_package(path)", batch_sizes=sizes, options={
        "packages": packages,
        # Where the samples are, for running a batch as pieces of the compiled sizes (None: not split).
        "sample_axes": ctx.signature.input_axes() if batched else [None] * len(ctx.signature.inputs),
        "output_sample_axes": ctx.signature.output_axes() if batched else [None] * len(ctx.signature.outputs),
        "built_for": dataclasses.asdict(BuiltFor(
            str(device), platform.machine(), torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else None,
            list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
            _compiler_version(), torch.__version__)),
    })


@dataclass
class BuiltFor:
    """What an AOTInductor package is tied to (recorded in the manifest, checked when loading)."""

    device: Optional[str] = None
    machine: Optional[str] = None
    isa: Optional[str] = None  # torch.backends.cpu.get_cpu_capability() where it was built (CPU packages)
    cuda_capability: Optional[List[int]] = None
    compiler: Optional[str] = None
    torch: Optional[str] = None

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> "BuiltFor":
        return cls(**fields_from(cls, data))  # type: ignore[arg-type]


def _minor(version: Optional[str]) -> str:
    return str(version or "").split("+")[0].rsplit(".", 1)[0]


def _refusal(built: BuiltFor, device: torch.device) -> Optional[str]:
    """Why the packages cannot run here on ``device`` (None: they can)."""
    if _minor(torch.__version__) != _minor(built.torch):
        return f"built with torch {built.torch}, this process has torch {torch.__version__}"
    if built.machine not in (None, platform.machine()):
        return f"built for {built.machine}, this machine is {platform.machine()}"
    if torch.device(built.device or "cpu").type != device.type:
        return f"built for {built.device}; an AOTInductor package runs only on the device type it was built for"
    here = torch.backends.cpu.get_cpu_capability()
    if device.type == "cpu" and built.isa in _ISA_ORDER and here in _ISA_ORDER and \
            _ISA_ORDER.index(here) < _ISA_ORDER.index(built.isa):
        return f"built for CPUs with {built.isa}, this CPU has {here}"
    if device.type == "cuda" and built.cuda_capability not in (None, list(torch.cuda.get_device_capability(device))):
        return f"built for CUDA capability {built.cuda_capability}"
    return None


class AotiModule(BatchPieces):
    """AOTInductor packages behind the nn.Module interface: the package for the input's batch size, else the
    dynamic one, else the batch run as pieces of the compiled sizes (:class:`~fx_lightning.formats.batching.
    BatchPieces`): list the sizes a server sees in ``export.aoti_batch_sizes``."""

    def __init__(self, runners: Dict[str, Callable[..., Any]], axes: Optional[List[Optional[int]]] = None,
                 output_axes: Optional[List[Optional[int]]] = None) -> None:
        super().__init__(runners, axes, output_axes, what="AOTInductor package",
                         hint="add it to export.aoti_batch_sizes to serve it at full speed")


def _load(root: Path, entry: FormatEntry, device: torch.device) -> nn.Module:
    refusal = _refusal(BuiltFor.from_dict(entry.options.get("built_for") or {}), device)
    if refusal is not None:
        raise ExportError(f"format 'aoti' cannot run here: {refusal}. Load another format (pt2 runs anywhere torch "
                          "does) or rebuild the package on this machine.")
    folder = root / entry.path
    runners = {key: torch._inductor.aoti_load_package(str(folder / name)) for key, name in entry.options["packages"].items()}
    return AotiModule(runners, entry.options.get("sample_axes"), entry.options.get("output_sample_axes"))


FORMAT = Format(
    name="aoti",
    path="aoti",
    write=_write,
    load=_load,
    preference=50,
    unavailable=lambda: None if _compiler() else "a C++ compiler (g++ or clang++) to build AOTInductor packages",
    install_hint="install a C++ compiler (apt-get install g++)",
    readme=(
        "- `{path}/` (aoti): AOTInductor packages compiled for this machine's CPU or GPU: "
        "`torch._inductor.aoti_load_package('{path}/<package>.pt2')` in Python, "
        "`torch::inductor::AOTIModelPackageLoader` in C++. Needs the same torch version and instruction set."
    ),
    writes_variants=True,
    triton_backend="python",
    triton_refusal="python=False: AOTInductor packages are served by the Python-backend model only (Triton's "
                   "PyTorch backend loads them as platform \"torch_aoti\", a beta that serves batch size 1 only)",
)
