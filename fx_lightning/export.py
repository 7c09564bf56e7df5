"""Export: write a fused model in the configured formats plus ``manifest.json``, atomically; read it back.

Layout of an export directory::

    manifest.json          format version, versions, resolved config, fuse report, parity, inputs, files + sha256
    README.md              how to load each format without the training code
    model.pt2              pt2: torch.export ExportedProgram (torch.export.save; no pickled code)
    model.pt               graph_module: the fused GraphModule (torch.save; pickled code: weights_only=False)
    fused_module/          code: readable Python (module.py) + weights.pt, importable as a package
    model.onnx             onnx: ONNX with a dynamic batch axis (optional extra)

Everything is written into a temporary sibling directory, each format is loaded back from there and compared
with the fused model (batch sizes of the example and 1), and only then is the directory renamed into place.
A failure removes the temporary directory and raises :class:`~fx_lightning.errors.ExportError`; an existing
export is replaced only by a complete one. Under ``torch.distributed`` only rank zero writes (see
:func:`export_fused`'s ``barrier``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import math
import os
import platform
import shutil
import sys
import textwrap
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from fx_lightning.config import ExportFormat, FuseConfig, to_container
from fx_lightning.errors import ExportError

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "FORMAT_PREFERENCE",
    "export_fused",
    "load_fused",
    "read_manifest",
    "sha256_file",
    "OnnxRuntimeModule",
]

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# load_fused's order when no format is named: pt2 has no pickled code and is PyTorch's serving format.
FORMAT_PREFERENCE: Tuple[str, ...] = ("pt2", "graph_module", "code", "onnx")
# Where each format lives inside the export directory.
FORMAT_PATHS: Dict[str, str] = {
    "pt2": "model.pt2",
    "graph_module": "model.pt",
    "code": "fused_module",
    "onnx": "model.onnx",
}
CODE_MODULE = "fused_module"
CODE_CLASS = "FusedModule"
# Round-trip tolerance (max|loaded - fused| / max|fused|): the formats rerun the same arithmetic, so
# anything beyond float rounding means the artifact is not the model.
_ROUNDTRIP_RTOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}

PathLike = Union[str, "os.PathLike[str]"]


# ============================================================================================ public API


def export_fused(
    graph_module: nn.Module,
    directory: PathLike,
    *,
    example_inputs: tuple,
    config: FuseConfig,
    report: Any = None,
    parity: Optional[dict] = None,
    extra: Optional[dict] = None,
    barrier: bool = False,
) -> Path:
    """Write ``graph_module`` in ``config.export.formats`` plus ``manifest.json`` into ``directory``.

    ``graph_module`` is the fused model (``FuseResult.graph_module``: a symbolic-trace GraphModule or an
    unlifted ``torch.export`` module); ``example_inputs`` are forward's arguments (the batch dimension is
    dim 0 of every tensor). ``report`` (a FuseReport), ``parity`` (a dict with ``passed`` and ``metrics``) and
    ``extra`` go into the manifest as given (made JSON-safe). Honours ``export.overwrite`` and
    ``export.dynamic_batch``. Returns the directory's path.

    Atomic: the export appears complete or not at all, and an existing export is replaced only by a
    complete one. Raises :class:`ExportError` naming the cause.

    Under ``torch.distributed`` (world size > 1) only rank zero writes; other ranks return the path at once.
    ``barrier=True`` makes the call collective: every rank must call it, the others wait until rank zero has
    finished and raise :class:`ExportError` if it failed. (It is off by default because a caller that runs the
    export on rank zero only, as the callback does, would otherwise wait forever.)
    """
    final = Path(os.path.abspath(os.fspath(directory)))
    rank, world = _rank_and_world()
    if world <= 1 or (rank == 0 and not barrier):
        return _export_local(graph_module, final, example_inputs, config, report, parity, extra)
    if not barrier:
        return final  # not rank zero: rank zero writes
    import torch.distributed as dist

    message: Optional[str] = None
    if rank == 0:
        try:
            _export_local(graph_module, final, example_inputs, config, report, parity, extra)
        except Exception as exc:  # noqa: BLE001 - carried to the other ranks, then re-raised here
            message = f"{type(exc).__name__}: {exc}"
            dist.broadcast_object_list([message], src=0)
            raise
    box: List[Any] = [message]
    # The barrier: every rank leaves only once rank zero has finished (or failed), and learns which.
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ExportError(f"rank 0 failed to write the export {final}: {box[0]}")
    return final


def read_manifest(directory: PathLike) -> Dict[str, Any]:
    """The manifest of an export directory, checked for a supported ``format_version``."""
    root = Path(directory)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise ExportError(f"{root}: no such export directory.")
    if not path.is_file():
        raise ExportError(
            f"{path}: missing; {root} is not an fx-lightning export (or an incomplete one; exports are "
            "written atomically, so look for the error of the run that wrote it)."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path}: unreadable or corrupt manifest: {exc}") from None
    if not isinstance(manifest, dict):
        raise ExportError(f"{path}: corrupt manifest: expected a JSON object, got {type(manifest).__name__}.")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ExportError(
            f"{path}: unknown manifest format_version {version!r}; this fx_lightning "
            f"({_package_version()}) reads format_version {FORMAT_VERSION}. "
            + ("Upgrade fx-lightning to load it." if isinstance(version, int) and version > FORMAT_VERSION
               else "The file was not written by fx-lightning or is damaged.")
        )
    for key in ("formats", "files"):
        if not isinstance(manifest.get(key), dict):
            raise ExportError(f"{path}: corrupt manifest: '{key}' is missing or not an object.")
    return manifest


def load_fused(
    directory: PathLike,
    format: Optional[str] = None,
    *,
    verify: bool = True,
    map_location: Any = "cpu",
) -> nn.Module:
    """Load an export written by :func:`export_fused`, in eval mode.

    ``format``: one of ``pt2``, ``graph_module``, ``code``, ``onnx``; ``None`` picks the first available
    of pt2, graph_module, code, onnx. ``verify`` checks each file's size and sha256 against the manifest
    first. Raises :class:`ExportError` for a missing or corrupt file, an unknown manifest version or a
    format that is not in the export. Note: ``graph_module`` (and ``code`` when it holds pickled
    modules) unpickles code: load only exports you trust.
    """
    root = Path(directory)
    manifest = read_manifest(root)
    available = [f for f in FORMAT_PREFERENCE if f in manifest["formats"]]
    if format is None:
        if not available:
            raise ExportError(f"{root / MANIFEST_NAME}: lists no formats.")
        chosen = available[0]
    else:
        chosen = format.value if isinstance(format, ExportFormat) else str(format)
        if chosen not in FORMAT_PATHS:
            raise ExportError(
                f"unknown format {chosen!r}; allowed: {', '.join(FORMAT_PREFERENCE)}."
            )
        if chosen not in manifest["formats"]:
            raise ExportError(
                f"{root}: format {chosen!r} was not exported; available: {', '.join(available) or 'none'}."
            )
    entry = manifest["formats"][chosen]
    if verify:
        verify_files(root, manifest, chosen)
    try:
        module = _LOADERS[chosen](root, entry, map_location)
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - a file that passed (or skipped) verification still failed
        raise ExportError(
            f"{root / entry['path']}: could not load format {chosen!r}: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def verify_files(root: Path, manifest: Dict[str, Any], fmt: Optional[str] = None) -> None:
    """Check size and sha256 of the manifest's files (those of ``fmt`` only, when given)."""
    files: Dict[str, Any] = manifest["files"]
    names = sorted(files) if fmt is None else manifest["formats"][fmt].get("files", [])
    if not names:
        raise ExportError(f"{root / MANIFEST_NAME}: corrupt manifest: no files listed for format {fmt!r}.")
    for name in names:
        info = files.get(name)
        path = root / name
        if not isinstance(info, dict):
            raise ExportError(f"{root / MANIFEST_NAME}: corrupt manifest: no size/sha256 entry for {name!r}.")
        if not path.is_file():
            raise ExportError(f"{path}: missing file of format {fmt or 'export'!r} (listed in the manifest).")
        size = path.stat().st_size
        if size != info.get("size"):
            raise ExportError(
                f"{path}: corrupt file: size {size} bytes, the manifest says {info.get('size')} bytes."
            )
        digest = sha256_file(path)
        if digest != info.get("sha256"):
            raise ExportError(
                f"{path}: corrupt file: sha256 {digest[:16]}... does not match the manifest's "
                f"{str(info.get('sha256'))[:16]}...; re-export rather than load it."
            )


def sha256_file(path: PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ============================================================================================= writing


@dataclass
class _WriteContext:
    """What every writer gets: the normalised model, inputs and options."""

    model: fx.GraphModule  # plain GraphModule: default codegen, no export hooks, picklable
    args: Tuple[Any, ...]  # the example inputs, batch >= 2 along dim 0 (export specialises 0 and 1)
    dynamic_shapes: Optional[Tuple[Any, ...]]
    input_names: List[str]
    config: FuseConfig
    notes: List[str] = field(default_factory=list)


def _export_local(
    graph_module: nn.Module,
    final: Path,
    example_inputs: Any,
    config: FuseConfig,
    report: Any,
    parity: Optional[dict],
    extra: Optional[dict],
) -> Path:
    if not isinstance(graph_module, nn.Module):
        raise ExportError(f"export_fused() takes the fused nn.Module, got {type(graph_module).__name__}.")
    if example_inputs is None:
        raise ExportError("export_fused() needs example_inputs: the formats are traced and checked with them.")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    ecfg = config.export
    formats = [f.value if isinstance(f, ExportFormat) else str(f) for f in ecfg.formats]
    if not formats:
        raise ExportError("export.formats is empty: nothing to write.")
    for fmt in formats:
        if fmt not in _WRITERS:
            raise ExportError(f"export.formats: unknown format {fmt!r}; allowed: {', '.join(_WRITERS)}.")
    if "onnx" in formats:
        _require_onnx()

    # Refuse before any work: an existing export with overwrite off, or a directory that is not ours.
    if final.exists() or final.is_symlink():
        if not final.is_dir() or final.is_symlink():
            raise ExportError(f"{final}: exists and is not a directory; choose another export.dir.")
        if not ecfg.overwrite:
            raise ExportError(f"{final}: already exists and export.overwrite is false; remove it or set it true.")
        if any(final.iterdir()) and not (final / MANIFEST_NAME).is_file():
            raise ExportError(
                f"{final}: exists and is not an fx-lightning export (no {MANIFEST_NAME}); refusing to replace it."
            )

    ctx = _make_context(graph_module, example_inputs, config)
    parent = final.parent
    created = _make_parents(parent)
    staging = parent / f".{final.name}.tmp-{uuid.uuid4().hex[:10]}"
    try:
        os.mkdir(staging)
    except OSError as exc:
        _remove_empty(created)
        raise ExportError(f"{parent}: cannot write the export there: {exc.strerror or exc}.") from exc
    try:
        _write_all(staging, ctx, formats, report, parity, extra)
        _replace(staging, final)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        if isinstance(exc, ExportError):
            raise ExportError(f"export to {final} failed: {exc}") from exc
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: cleaned up, pass them on
            raise
        raise ExportError(f"export to {final} failed: {type(exc).__name__}: {exc}") from exc
    return final


def _write_all(
    staging: Path,
    ctx: _WriteContext,
    formats: List[str],
    report: Any,
    parity: Optional[dict],
    extra: Optional[dict],
) -> Dict[str, Any]:
    entries: Dict[str, Dict[str, Any]] = {}
    for fmt in formats:
        before = set(_list_files(staging))
        try:
            entry = _WRITERS[fmt](staging, ctx)
        except ExportError as exc:
            raise ExportError(f"format {fmt!r}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - name the format and the cause
            raise ExportError(f"format {fmt!r}: writing failed: {type(exc).__name__}: {_first_line(exc)}") from exc
        entry["files"] = sorted(set(_list_files(staging)) - before)
        entries[fmt] = entry
    # Load every format back from the staging directory and compare it with the fused model.
    checks = _check_roundtrip(staging, ctx, entries)
    for fmt, check in checks.items():
        entries[fmt]["check"] = check
    (staging / "README.md").write_text(_readme(entries), encoding="utf-8")
    files = {name: {"size": (staging / name).stat().st_size, "sha256": sha256_file(staging / name)}
             for name in _list_files(staging)}
    manifest = {
        "format_version": FORMAT_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(formats),
        "config": to_container(ctx.config),
        "report": report.to_dict() if report is not None and hasattr(report, "to_dict") else report,
        "parity": parity,
        "inputs": _input_specs(ctx),
        "outputs": _output_specs(ctx),
        "dynamic_batch": ctx.dynamic_shapes is not None,
        "formats": entries,
        "files": files,
        "notes": ctx.notes,
        "extra": extra or {},
    }
    text = json.dumps(_json_safe(manifest), indent=2, allow_nan=False, sort_keys=False)
    (staging / MANIFEST_NAME).write_text(text + "\n", encoding="utf-8")
    return manifest


def _replace(staging: Path, final: Path) -> None:
    """Rename ``staging`` to ``final``; an existing ``final`` is moved aside first and restored on failure."""
    if not final.exists():
        os.rename(staging, final)
        return
    old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:10]}"
    os.rename(final, old)
    try:
        os.rename(staging, final)
    except BaseException:
        os.rename(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _make_parents(parent: Path) -> List[Path]:
    """Create ``parent`` and missing ancestors; return those created (deepest last) for clean-up."""
    missing: List[Path] = []
    p = parent
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    if p.exists() and not p.is_dir():
        raise ExportError(f"{parent}: cannot create the export directory: {p} is a file, not a directory.")
    created: List[Path] = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue
        except OSError as exc:
            _remove_empty(created)
            raise ExportError(f"{parent}: cannot create the export directory: {exc.strerror or exc}.") from exc
        created.append(d)
    return created


def _remove_empty(created: List[Path]) -> None:
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            break


def _list_files(root: Path) -> List[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()
                  and "__pycache__" not in p.parts)


# --------------------------------------------------------------------------------------- normalising


def _make_context(graph_module: nn.Module, example_inputs: Tuple[Any, ...], config: FuseConfig) -> _WriteContext:
    plain = plain_graph_module(graph_module)
    notes: List[str] = []
    args = _batch_at_least_two(example_inputs)
    dynamic = None
    if config.export.dynamic_batch:
        sizes = {a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0}
        if sizes:
            # One named Dim shared by all inputs when they agree (min 1: batch 1 must load too).
            shared = torch.export.Dim("batch", min=1) if len(sizes) == 1 else None
            dims = []
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.dim() > 0:
                    dims.append({0: shared if shared is not None else torch.export.Dim(f"batch_{i}", min=1)})
                else:
                    dims.append(None)
            dynamic = tuple(dims)
        else:
            notes.append("export.dynamic_batch: no tensor input has a batch dimension; exported static shapes")
    names = [n.name for n in plain.graph.nodes if n.op == "placeholder"]
    return _WriteContext(plain, args, dynamic, names, config, notes)


def plain_graph_module(module: nn.Module) -> fx.GraphModule:
    """A picklable copy of a fused GraphModule with the default code generator.

    An unlifted ``torch.export`` module (capture mode ``export``) flattens its inputs with a pytree codegen,
    checks them with a ``_guards_fn`` submodule and forward pre-hooks, and refuses ``eval()``: none of that
    pickles or re-exports cleanly. The copy takes the flat tensors as arguments and rebuilds the output
    structure in the graph itself. The weights are shared with ``module``, which is not changed.
    """
    if not isinstance(module, fx.GraphModule):
        raise ExportError(
            f"expected the fused torch.fx.GraphModule (FuseResult.graph_module), got {type(module).__name__}."
        )
    old = module.graph
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(old, env)
    for node in list(graph.nodes):
        # The export guard module only re-checks input shapes; the plain model has no use for it.
        if node.op == "call_module" and str(node.target).split(".")[-1] == "_guards_fn" and not node.users:
            graph.erase_node(node)
    codegen = old._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is not None:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if info.in_spec is not None:
            args_kwargs = pytree.tree_unflatten(placeholders, info.in_spec)
            flat_ok = (
                isinstance(args_kwargs, tuple) and len(args_kwargs) == 2 and not args_kwargs[1]
                and list(args_kwargs[0]) == placeholders
            )
            if not flat_ok:
                raise ExportError(
                    "the fused model takes nested or keyword inputs; exports support positional tensor "
                    "arguments (wrap the model so forward takes tensors)."
                )
        if info.out_spec is not None:
            flat = list(out) if isinstance(out, (tuple, list)) else [out]
            out = pytree.tree_unflatten(flat, info.out_spec)
    graph.output(out)
    for node in reversed(list(graph.nodes)):
        # Unused attribute reads (export lists every buffer, num_batches_tracked included): pure, drop them.
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    plain = fx.GraphModule(module, graph, class_name=CODE_CLASS)
    plain.eval()
    return plain


def _batch_at_least_two(args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """torch.export specialises a dimension of size 0 or 1: trace with a batch of at least 2."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] < 2:
            if a.shape[0] == 0:
                raise ExportError("example_inputs: a tensor has batch size 0; give at least one sample.")
            a = torch.cat([a, a], dim=0)
        out.append(a)
    return tuple(out)


def _first_rows(args: Tuple[Any, ...], n: int) -> Tuple[Any, ...]:
    return tuple(a[:n] if isinstance(a, torch.Tensor) and a.dim() > 0 else a for a in args)


# ------------------------------------------------------------------------------------------- writers


def _write_graph_module(root: Path, ctx: _WriteContext) -> Dict[str, Any]:
    path = root / FORMAT_PATHS["graph_module"]
    torch.save(ctx.model, path)
    foreign = _foreign_classes(ctx.model)
    return {
        "path": FORMAT_PATHS["graph_module"],
        "loader": "torch.load(path, weights_only=False)",
        "weights_only": False,
        "pickled_code": True,
        "warning": "pickled Python objects: torch.load(..., weights_only=False) runs code; load only trusted files",
        "requires_classes": foreign,
    }


def _write_pt2(root: Path, ctx: _WriteContext) -> Dict[str, Any]:
    path = root / FORMAT_PATHS["pt2"]
    program = _torch_export(ctx)
    torch.export.save(program, path)
    return {
        "path": FORMAT_PATHS["pt2"],
        "loader": "torch.export.load(path).module()",
        "weights_only": True,
        "pickled_code": False,
        "range_constraints": {str(k): str(v) for k, v in program.range_constraints.items()},
    }


def _torch_export(ctx: _WriteContext) -> "torch.export.ExportedProgram":
    try:
        return torch.export.export(ctx.model, ctx.args, strict=False, dynamic_shapes=ctx.dynamic_shapes)
    except Exception as exc:  # noqa: BLE001
        hint = ""
        if ctx.dynamic_shapes is not None and ("Constraint" in type(exc).__name__ or "specializ" in str(exc)
                                               or "batch" in str(exc)):
            hint = (" The model fixes its batch size (e.g. a reshape to a constant); "
                    "set export.dynamic_batch: false, or make the reshape use x.shape[0] / -1.")
        raise ExportError(f"torch.export failed: {type(exc).__name__}: {_first_line(exc)}.{hint}") from exc


def _write_onnx(root: Path, ctx: _WriteContext) -> Dict[str, Any]:
    _require_onnx()
    path = root / FORMAT_PATHS["onnx"]
    input_names = [n for n, a in zip(ctx.input_names, ctx.args) if isinstance(a, torch.Tensor)]
    output_names = [f"output_{i}" for i in range(len(_flat_outputs(ctx.model, ctx.args)))]
    opset = ctx.config.export.onnx_opset
    exporter = "dynamo"
    fallback_reason = None
    try:
        _onnx_dynamo(ctx, path, input_names, output_names, opset)
    except Exception as exc:  # noqa: BLE001 - the TorchScript exporter handles some graphs dynamo cannot
        fallback_reason = f"{type(exc).__name__}: {_first_line(exc)}"
        for leftover in root.glob(FORMAT_PATHS["onnx"] + "*"):
            leftover.unlink()
        exporter = "torchscript"
        try:
            _onnx_torchscript(ctx, path, input_names, output_names, opset)
        except Exception as exc2:  # noqa: BLE001
            raise ExportError(
                f"torch.onnx.export failed with both exporters: dynamo: {fallback_reason}; "
                f"torchscript: {type(exc2).__name__}: {_first_line(exc2)}"
            ) from exc2
    import onnx

    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    entry = {
        "path": FORMAT_PATHS["onnx"],
        "loader": "onnxruntime.InferenceSession(path)",
        "weights_only": True,
        "pickled_code": False,
        "exporter": exporter,
        "opset": max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=None),
        "input_names": [i.name for i in model.graph.input],
        "output_names": [o.name for o in model.graph.output],
    }
    if fallback_reason:
        entry["dynamo_failure"] = fallback_reason
    return entry


def _onnx_dynamo(ctx: _WriteContext, path: Path, input_names: List[str], output_names: List[str],
                 opset: Optional[int]) -> None:
    kwargs: Dict[str, Any] = dict(dynamo=True, input_names=input_names, output_names=output_names,
                                  dynamic_shapes=ctx.dynamic_shapes, verbose=False)
    if opset is not None:
        kwargs["opset_version"] = int(opset)
    # The dynamo exporter reports its steps with print(); keep them out of the user's logs.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(ctx.model, ctx.args, **kwargs)
        if program is None:
            raise ExportError("torch.onnx.export returned no program.")
        program.save(str(path))


def _onnx_torchscript(ctx: _WriteContext, path: Path, input_names: List[str], output_names: List[str],
                      opset: Optional[int]) -> None:
    dynamic_axes = None
    if ctx.dynamic_shapes is not None:
        dynamic_axes = {n: {0: "batch"} for n in input_names}
        dynamic_axes.update({n: {0: "batch"} for n in output_names})
    kwargs: Dict[str, Any] = dict(dynamo=False, input_names=input_names, output_names=output_names,
                                  dynamic_axes=dynamic_axes)
    if opset is not None:
        kwargs["opset_version"] = int(opset)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(ctx.model, ctx.args, str(path), **kwargs)


def _require_onnx() -> None:
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(
            f"export.formats has 'onnx' but {', '.join(missing)} is not installed: "
            "pip install 'fx-lightning[onnx]' (onnx, onnxscript, onnxruntime), or drop onnx from export.formats."
        )


def _write_code(root: Path, ctx: _WriteContext) -> Dict[str, Any]:
    folder = root / CODE_MODULE
    folder.mkdir()
    source, weights, pickled = _generate_code(ctx.model, folder)
    torch.save(weights, folder / "weights.pt")
    (folder / "module.py").write_text(source, encoding="utf-8")
    (folder / "__init__.py").write_text(
        f'"""Fused model written by fx-lightning: ``from {CODE_MODULE} import {CODE_CLASS}, load``."""\n'
        f"from .module import {CODE_CLASS}, load\n\n__all__ = [\"{CODE_CLASS}\", \"load\"]\n",
        encoding="utf-8",
    )
    return {
        "path": CODE_MODULE,
        "loader": f"sys.path.insert(0, export_dir); from {CODE_MODULE} import load; model = load()",
        "weights_only": not pickled,
        "pickled_code": bool(pickled),
        "pickled_modules": pickled,
        "requires_classes": _foreign_classes(ctx.model) if pickled else [],
    }


_WRITERS: Dict[str, Callable[[Path, _WriteContext], Dict[str, Any]]] = {
    "graph_module": _write_graph_module,
    "code": _write_code,
    "pt2": _write_pt2,
    "onnx": _write_onnx,
}


# ------------------------------------------------------------------------------------ code generation

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


def _generate_code(model: fx.GraphModule, folder: Path) -> Tuple[str, Dict[str, torch.Tensor], List[str]]:
    """``GraphModule.to_folder`` done for serving: relative paths, constructors instead of pickles."""
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
        owner_path, _, name = target.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
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
    imports = _global_imports(code.globals)
    init = ["def __init__(self):", "    super().__init__()"] + ["    " + ln for ln in lines]
    if non_persistent:
        init += [
            "    constants = torch.load(os.path.join(_HERE, 'constants.pt'), map_location='cpu', weights_only=True)",
            "    for path, value in constants.items():",
            "        owner, name = _owner(self, path)",
            "        getattr(owner, name).copy_(value)",
        ]
        torch.save(non_persistent, folder / "constants.pt")
    body = "\n".join(init) + "\n\n" + textwrap.dedent(code.src).strip("\n") + "\n"
    source = (
        _CODE_HEADER.format(version=_package_version(), torch_version=torch.__version__, package=CODE_MODULE,
                            imports="\n".join(imports))
        + f"\nclass {CODE_CLASS}(torch.nn.Module):\n"
        + textwrap.indent(body, "    ")
        + _CODE_FOOTER.format(cls=CODE_CLASS)
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
    namespace: Dict[str, Any] = {}
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
    if dtypes and dtypes != {torch.get_default_dtype()}:
        # Build in the stored dtype so load_state_dict does not cast the weights.
        (dtype,) = dtypes if len(dtypes) == 1 else (None,)
        if dtype is None:
            return None
        return f"{text}.to({dtype})"
    return text


def _public_state(module: nn.Module) -> Dict[str, Any]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}


def _global_imports(globals_: Dict[str, Any]) -> List[str]:
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
                found = importlib.import_module(module)
                for part in qualname.split("."):
                    found = getattr(found, part)
            except (ImportError, AttributeError):
                found = None
            if found is obj:
                lines.append(f"{name} = _resolve({module!r}, {qualname!r})")
                continue
        raise ExportError(f"the graph calls {obj!r} (as {name!r}), which cannot be imported by name.")
    # _resolve is defined after the imports block: the resolved names go after it.
    plain = [ln for ln in lines if not ln.startswith(tuple(f"{n} = _resolve" for n in globals_))]
    resolved = [ln for ln in lines if ln not in plain]
    return plain + ([""] if resolved else []) + resolved


def _foreign_classes(model: nn.Module) -> List[str]:
    """Classes the pickle needs that are not torch's: the training code must be importable for them."""
    names = set()
    for m in model.modules():
        cls = type(m)
        if isinstance(m, fx.GraphModule) or cls.__module__.startswith("torch."):
            continue
        names.add(f"{cls.__module__}.{cls.__qualname__}")
    return sorted(names)


# ============================================================================================= loading


def _load_pt2(root: Path, entry: Dict[str, Any], map_location: Any) -> nn.Module:
    program = torch.export.load(str(root / entry["path"]))
    module = program.module()
    _allow_eval(module)
    if map_location is not None and str(map_location) != "cpu":
        module = module.to(map_location)
    return module


def _allow_eval(module: nn.Module) -> None:
    """``ExportedProgram.module()`` raises on ``eval()``; it is already an inference graph, so make
    ``eval()`` a no-op (serving code calls it out of habit) and keep ``train()`` an error."""
    import types

    for m in module.modules():
        m.training = False  # the flags only; the graph was exported in eval mode

    def _eval(self: nn.Module) -> nn.Module:
        return self

    def _train(self: nn.Module, mode: bool = True) -> nn.Module:
        if mode:
            raise NotImplementedError("a loaded pt2 export is an inference graph; train() is not supported.")
        return self

    module.eval = types.MethodType(_eval, module)  # type: ignore[method-assign]
    module.train = types.MethodType(_train, module)  # type: ignore[method-assign]


def _load_graph_module(root: Path, entry: Dict[str, Any], map_location: Any) -> nn.Module:
    # weights_only=False is required: a GraphModule pickle carries its generated code (see the manifest).
    module = torch.load(str(root / entry["path"]), map_location=map_location, weights_only=False)
    if not isinstance(module, nn.Module):
        raise ExportError(f"{root / entry['path']}: holds a {type(module).__name__}, not a module.")
    return module.eval()


def _load_code(root: Path, entry: Dict[str, Any], map_location: Any) -> nn.Module:
    folder = root / entry["path"]
    init = folder / "__init__.py"
    # A unique module name: two exports loaded in one process must not share sys.modules entries.
    name = f"_fx_fused_{uuid.uuid4().hex[:12]}"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
    if spec is None or spec.loader is None:
        raise ExportError(f"{init}: cannot import the generated package.")
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    try:
        spec.loader.exec_module(package)
        return package.load(map_location=map_location)
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


class OnnxRuntimeModule(nn.Module):
    """An onnxruntime session behind the nn.Module interface: tensors in, tensors out (CPU)."""

    def __init__(self, path: PathLike, providers: Optional[Sequence[str]] = None) -> None:
        super().__init__()
        import onnxruntime as ort

        self.path = str(path)
        self.session = ort.InferenceSession(self.path, providers=list(providers or ["CPUExecutionProvider"]))
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.eval()

    def forward(self, *args: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) != len(self.input_names):
            raise ValueError(f"the ONNX model takes {len(self.input_names)} tensor inputs "
                             f"({', '.join(self.input_names)}), got {len(tensors)}.")
        feed = {n: t.detach().cpu().contiguous().numpy() for n, t in zip(self.input_names, tensors)}
        outs = [torch.from_numpy(o) for o in self.session.run(None, feed)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError("OnnxRuntimeModule wraps an onnxruntime session and cannot be pickled; load it again.")


def _load_onnx(root: Path, entry: Dict[str, Any], map_location: Any) -> nn.Module:
    if importlib.util.find_spec("onnxruntime") is None:
        raise ExportError("format 'onnx' needs onnxruntime to run: pip install 'fx-lightning[onnx]'.")
    return OnnxRuntimeModule(root / entry["path"])


_LOADERS: Dict[str, Callable[[Path, Dict[str, Any], Any], nn.Module]] = {
    "pt2": _load_pt2,
    "graph_module": _load_graph_module,
    "code": _load_code,
    "onnx": _load_onnx,
}


# ============================================================================================ checking


def _flat_outputs(model: nn.Module, args: Tuple[Any, ...]) -> List[torch.Tensor]:
    with torch.no_grad():
        out = model(*args)
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _check_roundtrip(staging: Path, ctx: _WriteContext, entries: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Load every format back and compare it with the fused model on the example and on batch 1."""
    batches = [ctx.args]
    if ctx.dynamic_shapes is not None:
        batches.append(_first_rows(ctx.args, 1))
    expected = [_flat_outputs(ctx.model, b) for b in batches]
    checks: Dict[str, Any] = {}
    # Load onto the model's device so a GPU model is checked where it runs (onnxruntime runs on CPU).
    device = next((a.device for a in ctx.args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    for fmt, entry in entries.items():
        if fmt == "onnx" and importlib.util.find_spec("onnxruntime") is None:
            checks[fmt] = {"checked": False, "reason": "onnxruntime is not installed"}
            continue
        try:
            loaded = _LOADERS[fmt](staging, entry, device)
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"format {fmt!r}: written but cannot be loaded back: {type(exc).__name__}: "
                              f"{_first_line(exc)}") from exc
        worst = 0.0
        sizes = []
        for batch, want in zip(batches, expected):
            try:
                got = _flat_outputs(loaded, batch)
            except Exception as exc:  # noqa: BLE001
                raise ExportError(f"format {fmt!r}: the loaded model fails on batch size {_batch_size(batch)}: "
                                  f"{type(exc).__name__}: {_first_line(exc)}") from exc
            if len(got) != len(want):
                raise ExportError(f"format {fmt!r}: the loaded model returns {len(got)} tensors, "
                                  f"the fused model {len(want)}.")
            for g, w in zip(got, want):
                if tuple(g.shape) != tuple(w.shape):
                    raise ExportError(f"format {fmt!r}: output shape {tuple(g.shape)} != {tuple(w.shape)} "
                                      f"on batch size {_batch_size(batch)}.")
                err = _rel_err(g, w)
                tol = _ROUNDTRIP_RTOL.get(w.dtype, 1e-5) if w.is_floating_point() else 0.0
                if not err <= tol:
                    raise ExportError(f"format {fmt!r}: the loaded model disagrees with the fused model on batch "
                                      f"size {_batch_size(batch)}: relative error {err:.3e} > {tol:.0e}.")
                worst = max(worst, err)
            sizes.append(_batch_size(batch))
        checks[fmt] = {"checked": True, "batch_sizes": sizes, "max_rel_err": worst}
        del loaded
    return checks


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    if w.numel() == 0:
        return 0.0
    return ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()


def _batch_size(args: Tuple[Any, ...]) -> Optional[int]:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return int(a.shape[0])
    return None


# ============================================================================================ manifest


def _input_specs(ctx: _WriteContext) -> List[Dict[str, Any]]:
    specs = []
    for i, (name, a) in enumerate(zip(ctx.input_names, ctx.args)):
        if isinstance(a, torch.Tensor):
            dyn = ctx.dynamic_shapes is not None and ctx.dynamic_shapes[i] is not None
            shape: List[Any] = list(a.shape)
            if dyn:
                shape[0] = "batch"
            specs.append({"name": name, "kind": "tensor", "shape": shape, "dtype": _dtype(a.dtype),
                          "example_shape": list(a.shape), "device": str(a.device)})
        else:
            specs.append({"name": name, "kind": type(a).__name__, "value": repr(a)[:200]})
    return specs


def _output_specs(ctx: _WriteContext) -> List[Dict[str, Any]]:
    outs = _flat_outputs(ctx.model, ctx.args)
    dyn = ctx.dynamic_shapes is not None
    batch = _batch_size(ctx.args)
    specs = []
    for i, t in enumerate(outs):
        shape: List[Any] = list(t.shape)
        if dyn and shape and shape[0] == batch:
            shape[0] = "batch"
        specs.append({"name": f"output_{i}", "shape": shape, "dtype": _dtype(t.dtype)})
    return specs


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _versions(formats: List[str]) -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {
        "format_version": str(FORMAT_VERSION),
        "fx_lightning": _package_version(),
        "torch": torch.__version__,
        "lightning": _dist_version("lightning"),
        "python": platform.python_version(),
    }
    if "onnx" in formats:
        for name in ("onnx", "onnxscript", "onnxruntime"):
            out[name] = _dist_version(name)
    return out


def _package_version() -> str:
    try:
        from fx_lightning import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _json_safe(value: Any) -> Any:
    """Plain JSON types only: tensors and numpy scalars become numbers, non-finite floats strings."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, torch.Tensor):
        return _json_safe(value.detach().cpu().tolist())
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return _json_safe(value.item())
        except (TypeError, ValueError):
            pass
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return _json_safe(value.to_dict())
    if hasattr(value, "value") and isinstance(getattr(value, "value"), (str, int)):  # enums
        return value.value
    if isinstance(value, torch.dtype):
        return _dtype(value)
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _readme(entries: Dict[str, Dict[str, Any]]) -> str:
    lines = [
        "# Fused model exported by fx-lightning",
        "",
        "`manifest.json` lists the formats, the inputs (dim 0 is the batch, any size when `dynamic_batch`),",
        "the fuse report, the parity verdict and each file's sha256. With fx-lightning installed:",
        "",
        "    from fx_lightning import load_fused",
        "    model = load_fused('this/directory')          # pt2 first; checks sha256",
        "",
        "Without it, with torch only:",
        "",
    ]
    if "pt2" in entries:
        lines += ["- `model.pt2` (pt2, recommended): `torch.export.load('model.pt2').module()`. No pickled code.",
                  "  Already an inference graph: `.eval()` on it raises in plain torch; just call it."]
    if "graph_module" in entries:
        lines += ["- `model.pt` (graph_module): `torch.load('model.pt', weights_only=False).eval()`.",
                  "  **This is pickled code** (weights_only=False runs it): load only files you trust."]
    if "code" in entries:
        lines += [f"- `{CODE_MODULE}/` (code): readable Python; `sys.path.insert(0, '.')`, then",
                  f"  `from {CODE_MODULE} import load; model = load()`. Weights load with weights_only=True"
                  + ("; modules listed under `pickled_modules` in the manifest are pickled." if
                     entries["code"].get("pickled_modules") else ".")]
    if "onnx" in entries:
        lines += ["- `model.onnx` (onnx): `onnxruntime.InferenceSession('model.onnx')`; dynamic batch axis."]
    return "\n".join(lines) + "\n"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _rank_and_world() -> Tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
