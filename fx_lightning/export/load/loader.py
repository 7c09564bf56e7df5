"""``load_fused``: read back what :func:`~fx_lightning.export.write.writer.export_fused` wrote."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any, List, Optional

import torch
from torch import nn

from fx_lightning.common.imports import missing_modules
from fx_lightning.config import Strategy
from fx_lightning.errors import ExportError, first_line
from fx_lightning.formats.base import FormatEntry
from fx_lightning.formats.batching import with_pieces
from fx_lightning.export.load.forms import WithForms
from fx_lightning.export.load.interface import ArtifactInterface
from fx_lightning.formats import FORMATS
from fx_lightning.export.manifest import MANIFEST_NAME, Manifest, Selected, read_manifest, verify_files
from fx_lightning.signature.forms import CallForm
from fx_lightning.signature.signature import DimKind
from fx_lightning.signature.value_guards import GUARDS_FILE, load_guards

__all__ = ["load_fused", "load_artifact", "selection_for", "runtime_for", "preferred_format", "CompiledForServing"]


def load_fused(
    directory: Any,
    format: Optional[str] = None,
    *,
    verify: bool = True,
    device: Any = None,
    compile: bool = False,
    batch_size: Optional[int] = None,
    traffic: Optional[str] = None,
    strategy: Optional[str] = None,
) -> nn.Module:
    """Load an export written by :func:`export_fused`, in eval mode.

    ``format``: a format name (``pt2``, ``graph_module``, ``code``, ``onnx``, ``aoti``...) or a variant's entry
    (``openvino-int8``); ``None`` picks the artifact the export selected as the fastest that passed its check
    (``export.select: fastest`` or ``fx-lightning bench --select``), with the runtime settings that made it fastest,
    else the first available in order of preference (pt2 first, passing over one built for a single size of a
    dimension the signature shows to vary when another takes every size); a format named is loaded with the runtime
    settings the selection recorded for it (:func:`runtime_for`: ONNX Runtime's own defaults, say, when they
    won). ``batch_size`` and ``traffic`` (``idle``: requests after an idle gap; ``back_to_back``) pick the
    fastest the export recorded for the batch size (the nearest one timed) and traffic a server will run, instead
    of the default selection; ``strategy="max_throughput"`` the artifact with the most samples per second over
    the export's throughput sweep (its batch size is the pick's ``batch_size`` in ``manifest.json``'s
    ``selections``; ``fx-lightning serve`` batches to it).
    ``device``: where to load it (a torch device or its name); ``None``: the device the artifact was built for
    (the manifest records it) when this process has it, else the CPU. A format that cannot run on the device
    asked for raises an :class:`ExportError` saying so.
    ``verify`` checks each file's size and sha256 against the manifest first. Raises :class:`ExportError` for
    a missing or corrupt file, an unknown manifest version or a format that is not in the export. Note:
    ``graph_module`` (and ``code`` when it holds pickled modules) unpickles code: load only exports you trust.

    ``compile=True``: for a Python server, the loaded module wrapped in ``torch.compile`` (Inductor, freezing
    on) and run under ``torch.no_grad()``, which freezing needs; the first call compiles.
    """
    root = Path(directory)
    manifest = read_manifest(root)
    if format is None:
        pick = selection_for(manifest, batch_size, traffic, strategy)
        format, runtime = (pick.format, pick.runtime) if pick is not None else (None, "")
    else:
        runtime = runtime_for(manifest, str(getattr(format, "value", format)), batch_size, traffic, strategy)
    return load_artifact(root, manifest, format, verify=verify, device=device, compile=compile, runtime=runtime,
                         as_the_module=True)


def selection_for(manifest: Manifest, batch_size: Optional[int] = None, traffic: Optional[str] = None,
                  strategy: Optional[str] = None) -> Optional[Selected]:
    """The recorded selection for ``traffic`` and ``strategy`` (``min_latency``, the default: the fastest at the
    nearest batch size timed to ``batch_size``; ``max_throughput``: the most samples per second over the sweep,
    within the latency budget of the export's default selection when it had one); the default selection when
    none is given (None when the export recorded none)."""
    if batch_size is None and traffic is None and strategy is None or not manifest.selections:
        return manifest.selected
    default = manifest.selected
    wanted = Strategy(strategy or Strategy.min_latency.value).value
    wanted_traffic = traffic or (default.traffic if default is not None else "idle")
    of_strategy = [s for s in manifest.selections if s.strategy == wanted]
    matching = [s for s in of_strategy if s.traffic == wanted_traffic] or of_strategy
    if not matching:
        return None
    if wanted == Strategy.max_throughput.value:
        budget = default.latency_budget_ms if default is not None and default.strategy == wanted else None
        return next((s for s in matching if s.latency_budget_ms == budget), matching[0])
    wanted_batch = batch_size or (default.batch_size if default is not None else 1)
    return min(matching, key=lambda s: (abs(s.batch_size - wanted_batch), s.batch_size))


def runtime_for(manifest: Manifest, entry: str, batch_size: Optional[int] = None, traffic: Optional[str] = None,
                strategy: Optional[str] = None) -> str:
    """The runtime settings the export recorded for artifact ``entry``: those of the selection for ``batch_size``,
    ``traffic`` and ``strategy`` (:func:`selection_for`) when it picked ``entry``, else of the default selection,
    else of any selection of ``entry``; "" (as written) when none picked it (an export from before the
    selection recorded settings reads the same)."""
    picks = [selection_for(manifest, batch_size, traffic, strategy), manifest.selected, *manifest.selections]
    return next((p.runtime for p in picks if p is not None and p.format == entry), "")


def load_artifact(root: Path, manifest: Manifest, format: Optional[str] = None, *, verify: bool = True,
                  device: Any = None, compile: bool = False, runtime: str = "", as_the_module: bool = False
                  ) -> nn.Module:
    """:func:`load_fused` with the manifest given: an export whose manifest is not on disk yet (the selection
    times the artifacts of an export being written) loads the same way. ``runtime``: one of the format's
    ``runtime_choices`` ("": the settings it was written with)."""
    chosen = _choose(root, manifest, format)
    entry = manifest.formats[chosen]
    fmt = FORMATS[entry.format_name or chosen]  # a variant (aoti-int8) says which format it is
    try:
        entry = fmt.with_runtime(entry, runtime)
    except KeyError as exc:
        raise ExportError(str(exc.args[0])) from None
    if verify:
        verify_files(root, manifest, chosen)
    missing = missing_modules(fmt.runtime_requires)
    if missing:
        raise ExportError(f"format {chosen!r} needs {', '.join(missing)} to run: {fmt.install_hint}.")
    for name in entry.imports:  # modules that register a variant's ops (torchao for int8)
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ExportError(f"{chosen!r} needs {name} to load ({exc}): pip install {name}.") from None
    target = _device(device, entry)
    signature = manifest.call_signature()
    try:
        module = fmt.load(root, entry, target)
        module = with_pieces(module, entry.batch_sizes, signature, f"{chosen} artifact")
        if manifest.signature is not None:  # every call checked as the signature says, before a runtime sees it
            guards = None
            if signature.value_guards:  # the branches on values every observed call took one way
                if verify:
                    verify_files(root, manifest, names=[GUARDS_FILE])
                guards = load_guards(root)
            module = ArtifactInterface(module, signature, entry.built_shapes, what=f"the {chosen} artifact",
                                       as_the_module=as_the_module, guards=guards)
        module = CompiledForServing(module) if compile else module
        if as_the_module and signature.forms:  # called as the model: each call form by its own artifact
            module = _with_forms(module, root, signature.forms, entry.format_name or chosen, verify=verify,
                                 device=device, compile=compile)
        return module
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - a file that passed (or skipped) verification still failed
        raise ExportError(
            f"{root / entry.path}: could not load format {chosen!r}: {type(exc).__name__}: {exc}"
        ) from exc


def _with_forms(module: nn.Module, root: Path, forms: List[CallForm], kind: str, **load: Any) -> nn.Module:
    """``module`` with each exported call form's artifact, in the artifact's format ``kind`` where the form wrote
    it (else the form's own choice), loaded as :func:`load_fused` is given ``load``. A form that cannot be loaded is
    left out with a warning naming it: its calls are refused by name, the artifact's own are answered."""
    kept, loaded = [f for f in forms if not f.directory], []
    for form in (f for f in forms if f.directory):
        path = root / form.directory
        try:
            loaded.append(load_fused(path, kind if kind in read_manifest(path).formats else None, **load))
        except ExportError as exc:
            warnings.warn(f"call form {form.label} ({path}) could not be loaded, so its calls are refused by name: "
                          f"{first_line(exc)}", stacklevel=3)
            continue
        kept.append(form)
    return WithForms(module, kept, loaded)


class CompiledForServing(nn.Module):
    """``torch.compile`` (Inductor with freezing: weights folded into the generated code) for inference."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.compiled = torch.compile(module)
        self.eval()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch._inductor import config as inductor_config

        # Freezing is skipped with gradients on. It is set around the call (compiling happens in the first
        # call, and again for a new shape) rather than as torch.compile(options=...): with the options an
        # int8 (pt2e) graph fails to compile (onednn.qconv_prepack has no fake-tensor kernel; torch 2.14).
        with torch.no_grad(), inductor_config.patch(freezing=True):
            return self.compiled(*args, **kwargs)


def _device(device: Any, entry: FormatEntry) -> torch.device:
    """The device asked for, else the artifact's own when this process has it, else the CPU."""
    if device is not None:
        return torch.device(device)
    built = torch.device(entry.device or "cpu")
    cuda_here = torch.cuda.is_available() and (built.index or 0) < torch.cuda.device_count()
    return built if built.type == "cpu" or (built.type == "cuda" and cuda_here) else torch.device("cpu")


def fixes_varying_sizes(manifest: Manifest, name: str) -> bool:
    """Whether artifact ``name`` was built for one size of a dimension the signature says varies (torch.export
    could not keep it dynamic: it refuses the other sizes by name). The order of preference passes it over for
    an artifact that takes them (the fused graph's own formats), so the default pick serves every size proven."""
    built, signature = manifest.formats[name].built_shapes, manifest.signature
    if built is None or signature is None:
        return False
    return any(size is not None and dim.kind is DimKind.variable
               for shape, leaf in zip(built, manifest.call_signature().inputs) for size, dim in zip(shape, leaf.dims))


def preferred_format(manifest: Manifest) -> str:
    """The first format in order of preference that takes every size the signature proves (else the first)."""
    available = [name for name in FORMATS if name in manifest.formats]
    return next((name for name in available if not fixes_varying_sizes(manifest, name)), available[0])


def _choose(root: Path, manifest: Manifest, format: Optional[str]) -> str:
    available = [name for name in FORMATS if name in manifest.formats]
    variants = [name for name, entry in manifest.formats.items() if entry.variant]
    if format is None:
        selected = manifest.selected.format if manifest.selected is not None else None
        if selected in available + variants:
            return str(selected)
        if not available:
            raise ExportError(f"{root / MANIFEST_NAME}: lists no formats.")
        return preferred_format(manifest)
    chosen = str(getattr(format, "value", format))
    if chosen in variants:
        return chosen
    if chosen not in FORMATS:
        raise ExportError(f"unknown format {chosen!r}; allowed: {', '.join(FORMATS)}"
                          + (f", or the variants {', '.join(variants)}" if variants else "") + ".")
    if chosen not in manifest.formats:
        raise ExportError(f"{root}: format {chosen!r} was not exported; available: {', '.join(available) or 'none'}.")
    return chosen
