"""``fx-lightning triton DIR OUT``: a Triton Inference Server model repository from an fx-lightning export.

Each artifact Triton can serve becomes one model, ``OUT/<name>_<entry>/``, with a ``config.pbtxt`` and the
artifact's files, copied byte for byte, in version ``1/``:

- ``onnx`` and its lossy variants (``onnx-int8``): the ONNX Runtime backend, ``1/model.onnx``;
- ``openvino`` and its variants (``openvino-int8``, ``openvino-bf16``): the OpenVINO backend, ``1/model.xml`` +
  ``1/model.bin`` (``openvino-bf16`` is the fp32 IR with the backend's ``HINT_BF16``).

- the export's selection (``OUT/<name>/``, the name ``fx-lightning serve`` gives the model) and each ``pt2`` and
  ``aoti`` artifact and variant: Triton's Python backend, through the export's own checked loader
  (:mod:`fx_lightning.serve.triton_python`; ``python=False`` leaves them out).

Triton's PyTorch backend is not used: it loads AOTInductor packages only as ``platform: "torch_aoti"``, a beta of
Triton 26.03 and later that serves batch size 1 only, and a package runs only under the torch version and CPU
instruction set it was built with, which the server's libtorch need not be; it does not load torch.export
programs at all. ``graph_module`` (a pickle) and ``code`` (Python source) are not written. Each artifact left out
is listed in :attr:`TritonRepository.skipped` with its reason.

The config is read off the artifact itself (``onnx.load``, ``openvino.Core().read_model``), not copied from the
manifest, and checked against the manifest before anything is written, so a config that names a tensor the model
does not have, or the wrong type, is refused here rather than by the server at load time. Every file is checked
against the manifest's sha256 first (:func:`~fx_lightning.export.manifest.verify_files`) and again once copied.
The config is written as protobuf text by hand: writing needs neither tritonclient nor protobuf.
"""

from __future__ import annotations


import dataclasses
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from fx_lightning.config import Strategy
from fx_lightning.common.dtypes import ONNX_TO_TORCH, OPENVINO_TO_TORCH, TORCH_TO_TRITON
from fx_lightning.errors import ConfigError, ExportError
from fx_lightning.formats import FORMATS
from fx_lightning.formats.base import FormatEntry
from fx_lightning.formats.onnx import ORT_OWN_THREADS
from fx_lightning.export.load.loader import runtime_for
from fx_lightning.export.write.atomic import replace_directories
from fx_lightning.export.files import sha256_file
from fx_lightning.export.manifest import MANIFEST_NAME, Manifest, read_manifest, verify_files
from fx_lightning.serve.triton_config import (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUE_DELAY_US, SkippedArtifact,
                                              TritonModel, TritonOptions, TritonRepository, config_text,
                                              contract_model, default_model_name, describe, readme_text,
                                              stated_leaf)
from fx_lightning.signature.conditions import condition_sizes, describe_condition
from fx_lightning.signature.signature import DimKind, LeafSpec
from fx_lightning.serve.artifact import artifact_for
from fx_lightning.serve.contract import Contract
from fx_lightning.serve.triton_python import (ENTRY_PARAMETER, MODEL_PY, STRATEGY_PARAMETER, python_copies,
                                              selection_options)

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MAX_QUEUE_DELAY_US",
    "VERSION",
    "TORCH_TO_TRITON",
    "TritonOptions",
    "TritonModel",
    "SkippedArtifact",
    "TritonRepository",
    "write_triton_repository",
    "plan_repository",
    "config_text",
    "readme_text",
    "triton_dtype",
    "onnx_tensors",
    "openvino_tensors",
    "describe",
]

log = logging.getLogger(__name__)

VERSION = "1"  # the model version directory every model's files go in


@dataclass(frozen=True)
class Backend:
    """A Triton backend fx-lightning writes for: its name, how its artifact's tensors are read, which files go
    in the version directory, and the folder of the export those files are relative to."""

    name: str
    read: Callable[[Path], Tuple[List[LeafSpec], List[LeafSpec]]]  # the artifact's tensors as it declares them
    model_file: str  # the file ``read`` takes, relative to the artifact's folder
    folder_is_path: bool  # True: the entry's path is the folder (openvino/); False: it is the file (model.onnx)


class NotServable(Exception):
    """An entry this backend cannot serve (a data type it lacks): skipped, or refused when asked for by name."""


def write_triton_repository(export_dir: Any, out_dir: Any, **fields: Any) -> TritonRepository:
    """Write a Triton model repository in ``out_dir`` from the export in ``export_dir``; returns what was written.
    ``fields``: the :class:`TritonOptions` (what to write, how Triton is to run it).

    Raises :class:`ConfigError` for a bad option (naming it, the value and what is allowed) and
    :class:`ExportError` when the export is not one Triton can serve or a file does not match the manifest
    (nothing is written then)."""
    options = TritonOptions(**fields)
    options.check()
    root, out = Path(export_dir), Path(out_dir)
    manifest = read_manifest(root)
    models, skipped = plan_repository(root, manifest, out, options)
    _refuse_existing(models, options.overwrite)
    out.mkdir(parents=True, exist_ok=True)
    staged: List[Tuple[Path, Path]] = []
    try:  # every model assembled first, then all renamed into place: a failure leaves the repository as it was
        for model in models:
            staged.append((_stage_model(root, manifest, model), model.directory))
        replace_directories(staged)
    finally:
        for staging, _ in staged:
            shutil.rmtree(staging, ignore_errors=True)
    for model in models:
        log.info("triton: wrote %s (%s backend, max_batch_size %d)", model.directory, model.backend,
                 model.max_batch_size)
    for skip in skipped:
        log.info("triton: %s not written: %s", skip.entry, skip.reason)
    readme = out / "README.md"
    readme.write_text(readme_text(models, skipped, manifest), encoding="utf-8")
    return TritonRepository(out, models, skipped, readme)


def plan_repository(root: Path, manifest: Manifest, out: Path,
                    options: TritonOptions) -> Tuple[List[TritonModel], List[SkippedArtifact]]:
    """The models to write and the entries left out, decided from the verified artifacts; writes nothing."""
    chosen, skipped = _choose_entries(manifest, options.formats, options.python)
    base = options.name or default_model_name(root)
    models: List[TritonModel] = []
    if options.python and options.formats is None:
        try:
            models.append(_python_model(manifest, None, out / base, options))
        except NotServable as exc:
            skipped.append(SkippedArtifact("the selection (Python backend)", str(exc)))
    verified: Set[Tuple[str, ...]] = set()
    for entry_name in chosen:
        entry = manifest.formats[entry_name]
        if tuple(entry.files) not in verified:  # openvino-bf16 is openvino's files: hashed once
            verify_files(root, manifest, entry_name)  # before the artifact is read, let alone copied
            verified.add(tuple(entry.files))
        try:
            directory = out / f"{base}_{entry_name}"
            models.append(_plan_model(root, manifest, entry_name, entry, directory, options)
                          if _backend(entry_name, entry) is not None
                          else _python_model(manifest, entry_name, directory, options))
        except NotServable as exc:
            if options.formats is not None:  # asked for by name: refused, not skipped
                raise ExportError(f"{root}: {entry_name} cannot be served by Triton: {exc}.") from None
            skipped.append(SkippedArtifact(entry_name, str(exc)))
    if not models:
        # Re-exporting with onnx or openvino helps only an export without them: where they were refused (a scalar
        # output), the reasons say why, and the same formats would be refused again.
        native = any(_backend(name, entry) is not None for name, entry in manifest.formats.items())
        raise ExportError(
            f"{root}: nothing Triton can serve: "
            + "; ".join(f"{s.entry}: {s.reason}" for s in skipped)
            + ("." if native else
               ". Export with export.formats including onnx or openvino (e.g. export.formats=[pt2,onnx,openvino]).")
        )
    return models, skipped


def _python_model(manifest: Manifest, entry: Optional[str], directory: Path, options: TritonOptions) -> TritonModel:
    """A Python-backend model of artifact ``entry`` (None: the export's selection; its max-throughput pick when the
    batching came from its sweep), stated from the export's contract exactly as ``fx-lightning serve`` states it
    (the record :func:`contract_model` makes for both)."""
    swept, note = options.with_recorded_batching(manifest, entry)
    # The selection's batch size from the sweep: it serves the sweep's max-throughput pick, as fx-lightning serve does.
    strategy = Strategy.max_throughput.value if entry is None and note and options.max_batch_size is None else None
    max_batch = swept.max_batch_size if swept.max_batch_size is not None else (
        DEFAULT_MAX_BATCH_SIZE if manifest.call_signature().batched else 0)
    preferred = _preferred(swept, max_batch) if max_batch else []
    try:  # what the contract cannot state: skipped like any other artifact Triton cannot take
        contract = Contract.of(manifest)
        chosen = entry or artifact_for(manifest, selection_options(entry, max_batch, strategy))[0]
        model = contract_model(directory.name, contract, chosen, "python", directory, max_batch_size=max_batch,
                               instances=swept.instances, dynamic_batching=swept.dynamic_batching,
                               preferred_batch_sizes=preferred, max_queue_delay_us=swept.queue_delay_us)
    except ValueError as exc:
        raise NotServable(f"the Python backend cannot serve this export: {exc}") from None
    except ExportError as exc:
        raise NotServable(str(exc)) from None
    model.files = ["model.py", f"export/{MANIFEST_NAME}"] + [f"export/{f}" for f in python_copies(manifest, entry)]
    if entry is not None:
        model.parameters[ENTRY_PARAMETER] = entry
    else:
        model.selection = True
        if strategy is not None:
            model.parameters[STRATEGY_PARAMETER] = strategy
        model.notes.append(f"serves the export's selection ({chosen} on this machine), picked again on the server's")
    if max_batch > 0 and not contract.batched:
        model.notes.append("max_batch_size 0 (dims are full shapes): the export has no sample axis on dim 0 of "
                           "every input and output")
    _refuse_scalars(model.inputs + model.outputs)
    if note and model.max_batch_size:
        model.notes.append(note)
    _attach_labels(model, manifest.labels)
    return model


def _refuse_conditions(where: str, signature: Any, entry: FormatEntry) -> None:
    """A condition on a size the config leaves free (a branch the model takes on it): Triton cannot check it, and
    the model would compute the captured side of the branch for every size."""
    if signature.value_guards:  # a guard program on values: no Triton backend runs it before the model
        raise ExportError(
            f"{where}: the artifact computes one way of the model's branch on tensor values "
            f"({'; '.join(signature.value_guards)}) and refuses calls taking the other by running its guard program "
            f"(value_guards.pt2) first, which a Triton model cannot: serve it with fx-lightning serve or load it "
            "with load_fused, which run it on every call")
    if entry.built_shapes:  # built for the example's sizes: every dim is fixed in the config
        return
    for condition in signature.conditions:
        if any(signature.inputs[leaf].dims[dim].kind is not DimKind.fixed for leaf, dim in condition_sizes(condition)):
            names = [leaf.name for leaf in signature.inputs]
            raise ExportError(
                f"{where}: the artifact takes only sizes where {describe_condition(condition, names)} (the model "
                "branches on that size; see the manifest's signature.conditions), which a Triton config cannot "
                "state: serve it with fx-lightning serve or load it with load_fused, which check it on every call")


def _refuse_scalars(tensors: Sequence[LeafSpec]) -> None:
    """Triton wants dims, and refuses an empty reshape where a model does not batch: a scalar (no axes, not even a
    batch one, so its model cannot batch) cannot be stated."""
    scalar = next((t.name for t in tensors if not t.dims), None)
    if scalar is not None:
        raise NotServable(f"{scalar!r} is a scalar (no axes), which a Triton model that does not batch cannot "
                          "state; return it with a batch axis")


def _choose_entries(manifest: Manifest, wanted: Optional[Sequence[str]],
                    python: bool) -> Tuple[List[str], List[SkippedArtifact]]:
    """The entries to write (in manifest order) and those skipped with the reason; a named entry that is not in
    the export, or not servable, is refused."""
    backends = set(_BACKENDS) | ({"python"} if python else set())
    servable = [n for n, e in manifest.formats.items() if FORMATS[e.format_name or n].triton_backend in backends]
    if wanted is not None:
        for name in wanted:
            if name not in manifest.formats:
                raise ConfigError(f"triton formats: {name!r} is not in this export (it has "
                                  f"{', '.join(manifest.formats)}); allowed: {', '.join(servable) or 'none'}.")
            if name not in servable:
                raise ConfigError(f"triton formats: {name!r} cannot be served by Triton: {_skip_reason(manifest, name)}"
                                  f"; allowed: {', '.join(servable) or 'none in this export'}.")
        return [n for n in manifest.formats if n in wanted], []
    return servable, [SkippedArtifact(n, _skip_reason(manifest, n)) for n in manifest.formats if n not in servable]


def _skip_reason(manifest: Manifest, entry_name: str) -> str:
    fmt = FORMATS[manifest.formats[entry_name].format_name or entry_name]
    return fmt.triton_refusal or f"no Triton backend is written for format {fmt.name!r}"


def _plan_model(root: Path, manifest: Manifest, entry_name: str, entry: FormatEntry, directory: Path,
                options: TritonOptions) -> TritonModel:
    backend = _backend(entry_name, entry)
    assert backend is not None  # _choose_entries kept only what a backend serves
    # The artifact's folder in the export: its files are named relative to it in the version directory.
    folder = Path(entry.path) if backend.folder_is_path else Path(entry.path).parent
    model_file = root / folder / backend.model_file
    inputs, outputs = backend.read(model_file)
    where = f"{entry_name} ({model_file})"
    signature = manifest.call_signature()
    _refuse_conditions(where, signature, entry)
    _agree(where, "input", inputs, signature.inputs, entry, manifest.dynamic_batch)
    _agree(where, "output", outputs, signature.outputs, entry, manifest.dynamic_batch)
    swept, note = options.with_recorded_batching(manifest, entry_name)
    max_batch, why_not = _max_batch_size(manifest, entry, inputs + outputs, options.max_batch_size, entry_name,
                                         swept.max_batch_size or DEFAULT_MAX_BATCH_SIZE)
    options = swept if why_not is None else options
    batching = max_batch > 0
    _refuse_scalars(inputs + outputs)
    model = TritonModel(
        name=directory.name, entry=entry_name, backend=backend.name, directory=directory,
        files=[Path(f).relative_to(folder).as_posix() for f in entry.files], max_batch_size=max_batch,
        inputs=inputs, outputs=outputs,
        instances=options.instances, dynamic_batching=batching and options.dynamic_batching,
        preferred_batch_sizes=_preferred(options, max_batch) if batching and options.dynamic_batching else [],
        max_queue_delay_us=options.queue_delay_us,
        export_names={t.name: s.name for t, s in zip(inputs + outputs, signature.inputs + signature.outputs)
                      if t.name != s.name},
    )
    if note and why_not is None and batching:
        model.notes.append(note)
    left_out = [leaf.name for leaf in signature.inputs if leaf.optional]
    if left_out:  # the stand-in is made by fx-lightning's loader, which a native backend does not run
        model.notes.append(f"{', '.join(left_out)} required here (the artifact takes every input); the Python-backend "
                           "model and fx-lightning serve take requests that leave it out")
    if why_not:
        model.notes.append(f"max_batch_size 0 (dims are full shapes, Triton does not batch requests): {why_not}")
    # The runtime settings the selection recorded for the artifact (its runtime's own defaults when they won).
    runtime = runtime_for(manifest, entry_name, max_batch or 1, "back_to_back" if batching else None)
    entry = FORMATS[entry.format_name or entry_name].with_runtime(entry, runtime)
    model.parameters, notes = (_openvino_parameters(entry, batching) if backend.name == "openvino"
                               else _onnxruntime_parameters(entry))
    model.notes.extend(notes + ([f"runtime settings '{runtime}' (the selection's, recorded in the manifest)"]
                                if runtime else []))
    _attach_labels(model, manifest.labels)
    return model


def _agree(where: str, kind: str, found: List[LeafSpec], specs: List[LeafSpec], entry: FormatEntry,
           any_samples: bool) -> None:
    """The artifact's tensors are the manifest's: same count, the names the export recorded for it (ONNX records
    them; OpenVINO does not), and each tensor's data type and shape (a dynamic axis where the manifest names one,
    ``batch`` or a size that varies, unless the artifact is static: built for the example's sizes; its size
    elsewhere)."""
    names = [t.name for t in found]
    recorded = entry.options.get(f"{kind}_names")
    recorded = [str(n) for n in recorded] if isinstance(recorded, list) else None
    static = bool(entry.batch_sizes or entry.built_shapes)
    if len(found) != len(specs):
        raise ExportError(f"{where}: the artifact has {len(found)} {kind}s ({', '.join(names)}), the manifest "
                          f"{len(specs)} ({', '.join(s.name for s in specs)}); re-export it.")
    if recorded is not None and names != recorded:
        raise ExportError(f"{where}: the artifact's {kind} names are {names}, the manifest recorded {recorded}; "
                          "re-export it.")
    for tensor, spec in zip(found, specs):
        expected = triton_dtype(spec.dtype, f"manifest {kind} {spec.name!r}")
        if tensor.dtype != spec.dtype:
            raise ExportError(f"{where}: {kind} {tensor.name!r} is {TORCH_TO_TRITON[tensor.dtype]} in the artifact, "
                              f"the manifest says {spec.dtype} ({expected}); re-export it.")
        wants, gots = spec.sizes(any_samples), tensor.sizes()
        if len(wants) != len(gots) or any((want is None and not static and got is not None)
                                          or (want is not None and got is not None and got != want)
                                          for want, got in zip(wants, gots)):
            shown = ["any" if d is None else d for d in gots]
            raise ExportError(f"{where}: {kind} {tensor.name!r} has shape {shown} in the artifact, the manifest "
                              f"says {spec.written_shape(any_samples)}; re-export it.")


def triton_dtype(torch_dtype: Optional[str], what: str) -> str:
    """Triton's data type for a torch dtype name as a manifest records it (``float32`` -> ``TYPE_FP32``)."""
    if torch_dtype not in TORCH_TO_TRITON:
        raise ExportError(f"{what}: dtype {torch_dtype!r} has no Triton data type; allowed: "
                          f"{', '.join(TORCH_TO_TRITON)}.")
    return TORCH_TO_TRITON[str(torch_dtype)]


def _max_batch_size(manifest: Manifest, entry: FormatEntry, tensors: List[LeafSpec], requested: Optional[int],
                    entry_name: str, default: int = DEFAULT_MAX_BATCH_SIZE) -> Tuple[int, Optional[str]]:
    """max_batch_size for the artifact (``default`` when none is ``requested``), and why it is 0 when it must be:
    Triton batches only along a leading axis that every input and output has and that the artifact leaves
    dynamic."""
    why_not = _fixed_batch_reason(manifest, entry, tensors)
    if why_not is None:
        return (default if requested is None else requested), None
    if requested:
        raise ConfigError(f"triton max_batch_size: {requested}; {entry_name} cannot batch: {why_not}; allowed: 0 "
                          "(or unset). Re-export with export.dynamic_batch: true to let Triton batch it.")
    return 0, why_not


def _fixed_batch_reason(manifest: Manifest, entry: FormatEntry, tensors: List[LeafSpec]) -> Optional[str]:
    signature = manifest.call_signature()
    if not signature.batched:
        return f"the model has no sample axis ({signature.sample.how})"
    if any(a != 0 for a in signature.input_axes() + signature.output_axes()):
        return "the samples are not on the leading axis of every input and output"
    if not manifest.dynamic_batch:
        sizes = sorted({leaf.example_shape[0] for leaf in signature.inputs if leaf.dims})
        built = f" (batch size {', '.join(map(str, sizes))} only)" if sizes else ""
        return f"the export has a fixed batch (export.dynamic_batch: false){built}"
    if entry.batch_sizes is not None:
        return f"the artifact is built for batch size(s) {', '.join(map(str, entry.batch_sizes))} only"
    fixed = [t.name for t in tensors if not t.dims or t.sizes()[0] is not None]
    if fixed:
        return f"{', '.join(fixed)} has no dynamic leading (batch) axis in the artifact"
    return None


def _preferred(options: TritonOptions, max_batch: int) -> List[int]:
    """The preferred batch sizes, checked against the model's ``max_batch`` (the sweep's, where it came from)."""
    dataclasses.replace(options, max_batch_size=max_batch).check()
    return sorted(set(options.preferred_batch_sizes or []))


def _openvino_parameters(entry: FormatEntry, batching: bool) -> Tuple[Dict[str, str], List[str]]:
    """The OpenVINO backend's parameters for the artifact, and what they mean for the user.

    The backend fixes the model's batch at max_batch_size (``ov::set_batch``) and refuses a batch of any other
    size unless ``ENABLE_BATCH_PADDING`` pads it, so a batching model gets padding. Of the export's compile
    config, the backend takes the performance hint and bf16 (``HINT_BF16``); it has no way to ask for f32, so on
    CPUs with AVX512-BF16 or AMX OpenVINO may run the fp32 IR in bf16."""
    config = entry.options.get("compile_config") or {}
    params: Dict[str, str] = {}
    notes = []
    hint = str(config.get("PERFORMANCE_HINT", "")).upper() if isinstance(config, Mapping) else ""
    if hint in ("LATENCY", "THROUGHPUT"):
        params["PERFORMANCE_HINT"] = hint
    if isinstance(config, Mapping) and str(config.get("INFERENCE_PRECISION_HINT", "")).lower() == "bf16":
        params["HINT_BF16"] = "YES"
    else:
        notes.append("OpenVINO's Triton backend cannot ask for f32 inference precision: on CPUs with AVX512-BF16 or "
                     "AMX, OpenVINO may run this fp32 model in bf16 (fx-lightning checked it in f32)")
    if batching:
        params["ENABLE_BATCH_PADDING"] = "YES"
        notes.append("ENABLE_BATCH_PADDING: OpenVINO's backend runs every batch padded to max_batch_size (it "
                     "refuses other sizes without it); a smaller --max-batch-size, or 0, wastes less on single "
                     "requests")
    return params, notes


def _onnxruntime_parameters(entry: FormatEntry) -> Tuple[Dict[str, str], List[str]]:
    """The ONNX Runtime backend's parameters for the artifact's recorded session options: its intra-op threads
    (0: ONNX Runtime's own count). The backend has no parameter for thread spinning: it spins, as ONNX Runtime does
    by default."""
    recorded = entry.options.get("session_options") or {}
    threads = recorded.get("intra_op_num_threads", ORT_OWN_THREADS) if isinstance(recorded, Mapping) else 0
    entries = recorded.get("config_entries") or {} if isinstance(recorded, Mapping) else {}
    spinning_off = str(entries.get("session.intra_op.allow_spinning", "1")) == "0"
    return {"intra_op_thread_count": str(threads)}, (
        ["ONNX Runtime's Triton backend cannot turn thread spinning off: its intra-op threads spin between "
         "requests (fx-lightning timed this artifact with spinning off)"] if spinning_off else [])


def _attach_labels(model: TritonModel, labels: Sequence[str]) -> None:
    """The export's class names as the first output's label file (Triton's classification extension), when
    they fit its last axis."""
    if not labels or not model.outputs:
        return
    columns = model.dims(model.outputs[0])[-1]
    if columns != len(labels):
        model.notes.append(f"labels not attached: {len(labels)} labels, output {model.outputs[0].name!r} has "
                           f"{columns} columns")
        return
    model.labels = list(labels)


# --- reading the artifacts ---------------------------------------------------------------------------------------


def onnx_tensors(path: Path) -> Tuple[List[LeafSpec], List[LeafSpec]]:
    """The graph's inputs (initializers excluded) and outputs as ONNX declares them."""
    try:
        import onnx
    except ImportError as exc:
        raise ExportError(f"reading {path} needs onnx: pip install 'fx-lightning[onnx]' ({exc})") from None
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}

    def one(value: Any) -> LeafSpec:
        if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
            raise ExportError(f"{path}: {value.name!r} is not a tensor of known rank; Triton needs one.")
        kind = onnx.TensorProto.DataType.Name(value.type.tensor_type.elem_type)
        if kind not in ONNX_TO_TORCH:
            raise NotServable(f"{value.name!r} has ONNX type {kind}, which Triton has no data type for")
        shape = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
        return stated_leaf(value.name, ONNX_TO_TORCH[kind], shape)

    return ([one(v) for v in graph.input if v.name not in initializers], [one(v) for v in graph.output])


def openvino_tensors(xml: Path) -> Tuple[List[LeafSpec], List[LeafSpec]]:
    """The IR's inputs and outputs by the names the Triton backend looks them up by (``get_any_name``)."""
    try:
        import openvino as ov
    except ImportError as exc:
        raise ExportError(f"reading {xml} needs openvino: pip install 'fx-lightning[openvino]' ({exc})") from None
    model = ov.Core().read_model(str(xml))

    def one(port: Any) -> LeafSpec:
        try:
            name = port.get_any_name()
        except RuntimeError:
            raise ExportError(f"{xml}: a tensor has no name, which Triton needs to address it.") from None
        kind = port.get_element_type().get_type_name()
        if kind not in OPENVINO_TO_TORCH:
            raise NotServable(f"{name!r} has OpenVINO type {kind}, which Triton's OpenVINO backend does not take "
                              f"(it takes {', '.join(OPENVINO_TO_TORCH)})")
        shape = port.get_partial_shape()
        if shape.rank.is_dynamic:
            raise ExportError(f"{xml}: {name!r} has a dynamic rank; Triton needs a fixed one.")
        return stated_leaf(name, OPENVINO_TO_TORCH[kind], [d.get_length() if d.is_static else None for d in shape])

    return [one(p) for p in model.inputs], [one(p) for p in model.outputs]


# How each Triton backend a Format names (``Format.triton_backend``) reads that format's artifact.
_BACKENDS: Dict[str, Backend] = {
    "onnxruntime": Backend("onnxruntime", onnx_tensors, "model.onnx", folder_is_path=False),
    "openvino": Backend("openvino", openvino_tensors, "model.xml", folder_is_path=True),
}


def _backend(entry_name: str, entry: FormatEntry) -> Optional[Backend]:
    """The Triton backend that serves the entry's format itself (None: the Python-backend model, or nothing)."""
    return _BACKENDS.get(FORMATS[entry.format_name or entry_name].triton_backend or "")


# --- writing -----------------------------------------------------------------------------------------------------


def _refuse_existing(models: List[TritonModel], overwrite: bool) -> None:
    existing = [str(m.directory) for m in models if m.directory.exists()]
    if existing and not overwrite:
        raise ExportError(f"{', '.join(existing)} already exist(s); pass overwrite=True (--overwrite) to replace "
                          "them, or choose another name or directory.")


def _stage_model(root: Path, manifest: Manifest, model: TritonModel) -> Path:
    """The model's directory, assembled beside its final place (renamed into it by the caller, with the others):
    Triton polling the repository never sees half a model. Removed again when assembling it fails."""
    parent = model.directory.parent
    staging = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=parent))
    try:
        version = staging / VERSION
        if model.backend == "python":
            copies = python_copies(manifest, model.parameters.get(ENTRY_PARAMETER))
            pairs = [(name, f"export/{name}") for name in copies]
            (version / "export").mkdir(parents=True)
            shutil.copyfile(root / MANIFEST_NAME, version / "export" / MANIFEST_NAME)
            (version / "model.py").write_text(MODEL_PY, encoding="utf-8")
        else:
            pairs = list(zip(manifest.formats[model.entry].files, model.files))
        for export_name, name in pairs:
            _copy_checked(root / export_name, version / name, manifest.files[export_name].sha256)
        if model.labels:
            (staging / "labels.txt").write_text("\n".join(model.labels) + "\n", encoding="utf-8")
        (staging / "config.pbtxt").write_text(config_text(model), encoding="utf-8")
        return staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _copy_checked(source: Path, target: Path, sha256: str) -> None:
    """Copy one file of the export and check the copy's sha256 against the manifest's: the file was verified
    before it was read, and this catches one changed since."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    got = sha256_file(target)
    if got != sha256:
        raise ExportError(f"{target}: the copy of {source} has sha256 {got[:16]}..., the manifest says "
                          f"{sha256[:16]}...; the export changed while it was copied.")
