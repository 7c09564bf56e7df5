"""The export format record and what every writer is handed.

An export format is declared once, as a :class:`Format` in its own module under
``fx_lightning/formats/``: its name, where it lives in the export directory, how it is written,
loaded and described. The config schema (``export.formats``), the writer, ``load_fused``, the manifest
and the export's README are all derived from these records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.common.json_views import JsonObject, json_safe
from fx_lightning.common.batches import PlainOutputs, is_record_type
from fx_lightning.common.calls import Call
from fx_lightning.common.notes import Note
from fx_lightning.parity.report import ArtifactCheck, ParityReport
from fx_lightning.errors import ExportError, first_line
from fx_lightning.signature.program import ExportFailed, Program, export_program, nested_dynamic_shapes, signature_dims
from fx_lightning.common.rows import rows_of
from fx_lightning.signature.signature import DimKind, Signature

__all__ = ["FUSED_CLASS_NAME", "RUNTIME_DEFAULTS", "Format", "FormatEntry", "ExactReference", "WriteContext", "Writer",
           "Loader",
           "VariantMaker", "VariantRequest",
           "fields_from", "pickled_classes", "returns_named_tuple", "quietly", "numpy_inputs"]

Json = Mapping[str, Any]  # one JSON object as json.loads gives it


def fields_from(cls: type, data: Json) -> Dict[str, object]:
    """The keys of ``data`` that are fields of the dataclass ``cls`` (records read back from JSON)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class FormatEntry:
    """One artifact: where it is, how to load it, its files and how it was checked. ``format`` and ``variant``
    name a lossy variant's base format and variant (``aoti-int8``: ``aoti``, ``int8``), which is judged by its
    ``gate`` instead of a round trip. ``options``: what the format's own writer records for its loader."""

    path: str
    loader: str = ""
    files: List[str] = field(default_factory=list)
    device: str = ""  # where it runs; the writer may set it (ONNX, OpenVINO: cpu), else the export fills it in
    batch_sizes: Optional[List[int]] = None  # the batch sizes it is built for (None: any)
    weights_only: bool = True
    pickled_code: bool = False
    check: Optional[ArtifactCheck] = None  # loaded back at export and run against the fp64 reference
    format: Optional[str] = None
    variant: Optional[str] = None
    imports: List[str] = field(default_factory=list)
    gate: Optional[ParityReport] = None
    options: JsonObject = field(default_factory=dict)
    # The input shapes a static artifact is built for (None in a dimension: the sample axis, run as pieces); None:
    # it takes every size the signature says varies.
    built_shapes: Optional[List[List[Optional[int]]]] = None

    @property
    def format_name(self) -> str:
        """The :class:`~fx_lightning.formats.base.Format` that loads it."""
        return self.format or ""

    def to_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {"path": self.path, "loader": self.loader, "weights_only": self.weights_only,
                                  "pickled_code": self.pickled_code, **self.options, "files": list(self.files),
                                  "device": self.device}
        if self.batch_sizes is not None:
            out["batch_sizes"] = list(self.batch_sizes)
        if self.check is not None:
            out["check"] = self.check.to_dict()
        if self.variant is not None:
            out.update(format=self.format, variant=self.variant)
        if self.variant is not None or self.imports:
            out["imports"] = list(self.imports)
        if self.gate is not None:
            out["gate"] = self.gate.to_dict()
        if self.built_shapes is not None:
            out["built_shapes"] = [list(s) for s in self.built_shapes]
        return json_safe(out)

    @classmethod
    def from_dict(cls, name: str, data: Json) -> "FormatEntry":
        check, gate = data.get("check"), data.get("gate")
        common = {f.name for f in dataclasses.fields(cls)} - {"options"}  # the rest is the format's own
        return cls(
            path=str(data["path"]), loader=str(data.get("loader", "")), files=[str(f) for f in data.get("files", [])],
            device=str(data.get("device") or "cpu"), weights_only=bool(data.get("weights_only", True)),
            batch_sizes=[int(b) for b in data["batch_sizes"]] if data.get("batch_sizes") else None,
            pickled_code=bool(data.get("pickled_code", False)),
            check=ArtifactCheck.from_dict(check) if isinstance(check, Mapping) else None,
            format=str(data.get("format") or name), variant=data.get("variant"),
            imports=[str(i) for i in data.get("imports", [])],
            gate=ParityReport.from_dict(gate) if isinstance(gate, Mapping) else None,
            options={k: v for k, v in data.items() if k not in common},
            built_shapes=[[None if d is None else int(d) for d in s] for s in data["built_shapes"]]
            if isinstance(data.get("built_shapes"), list) else None,
        )


# The name, among a Format's runtime_choices, of the runtime's own default settings (what a user gets from the
# runtime given no options, with the precision the artifact was checked at): raced beside the settings it was
# written with, so the pick is never slower than the runtime's defaults on the same file.
RUNTIME_DEFAULTS = "defaults"

# The class name of the plain fused GraphModule and of the generated code's module.
FUSED_CLASS_NAME = "FusedModule"


@dataclass
class ExactReference:
    """What the artifacts are judged against instead of an fp64 copy of the exported model itself (an fp64 copy
    of ``model`` is run on the example inputs), and how the round-trip check names it."""

    model: nn.Module
    against: str


@dataclass
class WriteContext:
    """What every writer gets: the fused model made plain, its example inputs, how it is called (the
    :class:`~fx_lightning.signature.signature.Signature`) and the export options."""

    model: fx.GraphModule  # plain GraphModule: default codegen, no export hooks, picklable
    # The example inputs as the artifacts take them (positional: one tensor per input leaf for a flat interface);
    # with a dynamic sample axis, at least 2 samples (export specialises 0 and 1).
    args: Tuple[Any, ...]
    signature: Signature  # the input and output leaves, with the dimensions the observed calls showed
    input_names: List[str]
    onnx_opset: Optional[int] = None
    # AOTInductor: one package per batch size listed (compiled for it), or one with a dynamic batch when empty.
    aoti_batch_sizes: List[int] = field(default_factory=list)
    notes: List[Note] = field(default_factory=list)
    # The torch.export program of ``export_model`` on ``args``, made once for every writer (fx_lightning.signature.program).
    program: Optional[Program] = None
    reference: Optional[ExactReference] = None  # None: artifacts are judged against an fp64 copy of ``model``
    dynamic_samples: bool = True  # export.dynamic_batch: the sample axis dynamic
    graph_fixed: bool = False  # the fused graph itself takes the example's sizes only (its capture was fixed)
    program_refused: Optional[str] = None  # why no torch.export program is made (the formats that need one fail)
    # The signature the torch.export program is made for, where it fixes sizes the export's signature lets vary
    # (sizes only shown to vary by experiment that torch.export could not keep dynamic); None: the same.
    program_signature: Optional[Signature] = None
    # Example inputs of other sizes along the dimensions that vary: every dynamic program must take them.
    check_args: List[Tuple[Any, ...]] = field(default_factory=list)

    @property
    def export_model(self) -> nn.Module:
        """What the torch.export-based writers trace: ``model``, or a wrapper returning its named-tuple outputs as
        plain tuples (same fields, same order) and dataclass outputs as dicts: a saved program cannot name a class
        it does not know, and the serving process has no training code."""
        return PlainOutputs(self.model) if returns_named_tuple(self.model) else self.model

    @property
    def exported_signature(self) -> Signature:
        """The signature the torch.export program (and every format made from it) is built for."""
        return self.program_signature or self.signature

    @property
    def dynamic(self) -> bool:
        """Whether the artifacts take other sizes than the example's (the program is dynamic)."""
        return self.program is not None and self.program.dynamic

    def takes_other_sizes(self, fmt: "Format") -> bool:
        """Whether ``fmt``'s artifact takes other sizes than the example's: its program's, or the fused graph's."""
        if fmt.from_program:
            return self.dynamic and self.static_batch is None
        return self.graph_takes_other_sizes

    @property
    def graph_takes_other_sizes(self) -> bool:
        """Whether the fused graph itself is right at other sizes than the example's: its capture was not fixed,
        and a proven sample axis also holds for fewer rows (else only padding to the size seen is exact)."""
        return not self.graph_fixed and not (self.signature.batched and not self.signature.sample.any_size)

    @property
    def leaf_dims(self) -> Optional[List[Any]]:
        """torch.export's dimensions per input leaf (None: static)."""
        if self.program is not None and not self.program.dynamic:
            return None
        dims = signature_dims(self.exported_signature, dynamic_samples=self.dynamic_samples)
        return dims if any(dims) else None

    @property
    def export_dynamic_shapes(self) -> Any:
        """``dynamic_shapes`` nested as ``export_model``'s forward takes them (for exporters that take them)."""
        dims = self.leaf_dims
        return None if dims is None else nested_dynamic_shapes(self.export_model, Call(self.args), dims)

    @property
    def sample_dynamic(self) -> bool:
        """Whether the sample axis is proven and dynamic in the artifacts (only where pieces of any size are exact:
        otherwise they are built for the size seen, and others padded to it)."""
        return self.signature.batched and self.dynamic_samples and self.signature.sample.any_size and self.dynamic

    @property
    def static_batch(self) -> Optional[int]:
        """The one number of samples every program-made artifact is built for (None: any, or no sample axis)."""
        if not self.signature.batched or self.sample_dynamic:
            return None
        return rows_of(self.args, self.signature.input_axes())

    def built_for(self, fmt: "Format") -> Tuple[Optional[List[int]], Optional[List[List[Optional[int]]]]]:
        """The batch sizes and input shapes ``fmt``'s artifact is built for (None: any)."""
        fixed_by_program = fmt.from_program and self.program_signature is not None
        if self.takes_other_sizes(fmt) and not fixed_by_program:
            return None, None
        batch = self.static_batch if fmt.from_program else (
            rows_of(self.args, self.signature.input_axes()) if self.signature.batched else None)
        return ([batch] if batch is not None else None), self.built_shapes()

    @property
    def device(self) -> torch.device:
        """Where the model and its example inputs are: the device the artifacts are built for."""
        return next((a.device for a in self.args if isinstance(a, torch.Tensor)), torch.device("cpu"))

    def built_shapes(self) -> Optional[List[List[Optional[int]]]]:
        """The input shapes the artifacts are built for (the sample axis left free: it is run as pieces), None when
        no input has a dimension."""
        if not any(isinstance(a, torch.Tensor) and a.dim() for a in self.args):
            return None
        signature = self.exported_signature
        axes = signature.input_axes() if signature.batched else [None] * len(signature.inputs)
        tensors = [a for a in self.args if isinstance(a, torch.Tensor)]
        varies = [[self.dynamic and d.kind is DimKind.variable for d in leaf.dims] for leaf in signature.inputs]
        return [[None if d == axis or (d < len(free) and free[d]) else int(size) for d, size in enumerate(t.shape)]
                for t, axis, free in zip(tensors, axes, varies)]

    def export(self, args: Optional[Tuple[Any, ...]] = None) -> "torch.export.ExportedProgram":
        """The program on ``args`` (another example: a static program for those sizes), else the context's own."""
        if args is None and self.program is not None:
            return self.program.program
        if self.program_refused is not None:
            raise ExportError(self.program_refused)
        try:
            made = export_program(self.export_model, Call(args if args is not None else self.args),
                                  self.leaf_dims if args is None else None, allow_static=True,
                                  check=[Call(a) for a in self.check_args] if args is None else ())
        except ExportFailed as exc:
            raise ExportError(f"torch.export failed: {first_line(exc.first, with_type=True)}"
                              + "".join(f"; tried {a}" for a in exc.attempts[1:])) from exc.first
        return made.program


@dataclass
class VariantRequest:
    """What a format needs to make a lossy variant from its own fp32 artifact: the variant's precision ("int8",
    "bf16"), the folder (relative to the export root) its files go in, and the calibration inputs (the target's
    inputs on a few data batches, as tuples of tensors)."""

    precision: str
    folder: str
    calibration: List[tuple] = field(default_factory=list)


# write(staging_dir, ctx) -> the format's manifest entry (the writer fills path, loader, trust and its options;
# files, device and the round-trip check are filled in by the export)
Writer = Callable[[Path, WriteContext], FormatEntry]
# load(export_dir, manifest_entry, device) -> an eval-mode module on that device
Loader = Callable[[Path, FormatEntry, torch.device], nn.Module]
# make(export_root, fp32_entry, request) -> the variant's entry (path and files relative to the root), made from
# the format's own fp32 artifact (OpenVINO int8 through NNCF, ONNX Runtime int8); None: not for this precision
VariantMaker = Callable[[Path, FormatEntry, VariantRequest], Optional[FormatEntry]]


@dataclass(frozen=True)
class Format:
    """One export format, declared once."""

    name: str
    path: str  # file or folder inside the export directory
    write: Writer
    load: Loader
    # How to load it without fx-lightning, for the export's README (a line or two of Markdown).
    readme: str
    # load_fused's default order when no format is named: lower first.
    preference: int
    # Modules needed to write it; checked before any work starts (pip extra named in install_hint).
    requires: Tuple[str, ...] = ()
    # What else writing it needs (a C++ compiler, say): None when available here, else what is missing.
    unavailable: Optional[Callable[[], Optional[str]]] = None
    # Modules needed to load and run it; without them the round-trip check is skipped and said so.
    runtime_requires: Tuple[str, ...] = ()
    install_hint: str = ""
    # Loading it unpickles Python objects (torch.load(weights_only=False)): only for trusted files.
    pickled_code: bool = False
    # Lossy variants it makes from its own fp32 artifact, by precision ("int8", "bf16"); the torch formats get
    # theirs from the variant's own model instead (fx_lightning.variants).
    variants: Mapping[str, VariantMaker] = field(default_factory=dict)
    # Runtime settings worth timing besides the ones it was written with (name -> options merged over the
    # entry's; a None value removes the key: the runtime's own default): the selection records which made it
    # fastest for each traffic. A runtime's own defaults are one of them, named RUNTIME_DEFAULTS.
    runtime_choices: Mapping[str, JsonObject] = field(default_factory=dict)
    # Written from the context's torch.export program (False: from the fused graph itself, which takes every size
    # its capture took, whether or not torch.export could make a dynamic program of it).
    from_program: bool = True
    # A lossy variant's own model (fx_lightning.variants) is written in it: it runs the model through Inductor (a
    # quantised graph run eagerly is slow).
    writes_variants: bool = False
    # The Triton backend that serves it ("onnxruntime", "openvino"; "python": the Python-backend model
    # fx-lightning writes, for formats no native backend serves whose loader runs no pickled code), else None and
    # why not in ``triton_refusal``.
    triton_backend: Optional[str] = None
    triton_refusal: str = ""

    def with_runtime(self, entry: FormatEntry, runtime: str) -> FormatEntry:
        """``entry`` as it loads with the runtime settings ``runtime`` ("": as written)."""
        if not runtime:
            return entry
        if runtime not in self.runtime_choices:
            raise KeyError(f"format {self.name!r} has no runtime settings {runtime!r}; it has "
                           f"{', '.join(self.runtime_choices) or 'none'}")
        return dataclasses.replace(entry, options=_merged(entry.options, self.runtime_choices[runtime]))

    def readme_text(self, options: Mapping[str, Any]) -> str:
        """The README lines for this format; ``{pickled_note}`` expands when the entry pickled modules."""
        note = "; modules listed under `pickled_modules` in the manifest are pickled" if options.get("pickled_modules") else ""
        return self.readme.format(path=self.path, pickled_note=note)


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> JsonObject:
    """``over`` merged into ``base``, nested mappings key by key; a None in ``over`` removes the key (what a runtime
    does when the setting is not given is its default)."""
    out = dict(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = (_merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
                        else value)
    return out


@contextlib.contextmanager
def quietly() -> Iterator[None]:
    """Third-party exporters and quantisers report their steps with print() and warnings: not the user's business."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def numpy_inputs(values: Sequence[Any]) -> List[Any]:
    """The tensors among ``values`` as contiguous CPU numpy arrays: what ONNX Runtime and OpenVINO take."""
    return [t.detach().cpu().contiguous().numpy() for t in values if isinstance(t, torch.Tensor)]


def returns_named_tuple(model: fx.GraphModule) -> bool:
    """Whether the graph's output holds a named tuple or a plain dataclass (built in the graph, or rebuilt from an
    export's spec)."""
    output = next(n for n in model.graph.nodes if n.op == "output")

    def holds(value: Any) -> bool:
        if is_record_type(type(value)):
            return True
        if isinstance(value, fx.Node):
            return value.op == "call_function" and is_record_type(value.target)
        if isinstance(value, (list, tuple)):
            return any(holds(v) for v in value)
        if isinstance(value, dict):
            return any(holds(v) for v in value.values())
        return False

    return holds(output.args)


def pickled_classes(model: nn.Module) -> List[str]:
    """Classes a pickle of ``model`` needs that are not torch's: the training code must be importable for them."""
    names = set()
    for m in model.modules():
        cls = type(m)
        if isinstance(m, fx.GraphModule) or cls.__module__.startswith("torch."):
            continue
        names.add(f"{cls.__module__}.{cls.__qualname__}")
    return sorted(names)
