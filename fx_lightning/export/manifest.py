"""``manifest.json``: what an export holds, as typed records, written and read, and its files checked against it.

:class:`Manifest` is the one place the JSON is written (:meth:`Manifest.to_dict`) and read
(:meth:`Manifest.from_dict`). Format version 2 writes notes and parity failures as objects (``kind``, ``facts``,
``text``); version 1 wrote them as strings and is still read. A newer version is refused with a message naming it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.metadata
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from fx_lightning.config.schema import ChannelOrder, InputDtype, Layout, PreprocessConfig
from fx_lightning.common.json_views import JsonObject, dtype_name, json_safe
from fx_lightning._version import __version__
from fx_lightning.errors import ExportError
from fx_lightning.export.files import FileInfo, sha256_file
from fx_lightning.formats.base import FormatEntry, WriteContext, fields_from
from fx_lightning.formats import FORMATS
from fx_lightning.common.notes import Note
from fx_lightning.parity.report import ArtifactCheck, ParityReport
from fx_lightning.common.provenance import Provenance
from fx_lightning.common.tolerance import DISCRETE_AGREEMENT
from fx_lightning.signature.signature import LeafSpec, SampleAxis, Signature

__all__ = [
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "MANIFEST_NAME",
    "VariantOutcome",
    "Timing",
    "SweepPoint",
    "Sweep",
    "TimingFailure",
    "BenchTable",
    "Selected",
    "Preprocess",
    "Manifest",
    "new_manifest",
    "write_manifest",
    "read_manifest",
    "verify_files",
    "legacy_signature",
    "is_tensor",
    "dist_version",
]

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"

Json = Mapping[str, Any]  # one JSON object as json.loads gives it


@dataclass
class VariantOutcome:
    """One artifact of a lossy variant (``aoti-int8``): its gate report when it ran, else the error, or why it was
    not made on this machine (``skipped``); ``kept`` when it passed and is in the export; ``notes`` on how it was
    made (layers kept in float)."""

    entry: str
    kept: bool
    gate: Optional[ParityReport] = None
    error: Optional[str] = None
    skipped: Optional[str] = None
    notes: List[Note] = field(default_factory=list)

    def to_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = (self.gate.to_dict() if self.gate is not None else
                                  {"passed": False, "failures": [] if self.skipped else [self.error or "not made"]})
        if self.skipped:
            out["skipped"] = self.skipped
        if self.notes:
            out["made_with"] = [n.to_dict() for n in self.notes]
        return out

    @classmethod
    def from_dict(cls, entry: str, data: Json) -> "VariantOutcome":
        report = ParityReport.from_dict(data)
        ran = "metrics" in data or "thresholds" in data
        skipped = data.get("skipped")
        return cls(entry, report.passed, report if ran else None,
                   None if ran or skipped else "; ".join(str(f) for f in report.failures),
                   str(skipped) if skipped else None, [Note.from_dict(n) for n in data.get("made_with") or []])


@dataclass
class Timing:
    artifact: str
    batch_size: int
    median_ms: float
    p90_ms: float
    rounds: int
    traffic: str = "idle"  # Traffic: each call after an idle gap, or right after the previous one
    runtime: str = ""  # the runtime settings it ran with (a name from its Format's runtime_choices; "": as written)
    process: str = "shared"  # "shared": timed beside the other artifacts in one process; "own": alone in one
    # Own: each process's median, one per fresh process it was timed in (median_ms is their median). Their spread
    # is the timing's noise: a process's thread placement and memory layout move its median more than its calls do.
    process_medians_ms: List[float] = field(default_factory=list)

    def spread(self) -> Optional[Tuple[float, float]]:
        """The lowest and highest of its processes' medians, or None when it was timed in fewer than two."""
        return (min(self.process_medians_ms), max(self.process_medians_ms)) if len(self.process_medians_ms) > 1 else None


@dataclass
class TimingFailure:
    """An artifact that raised when timed at a batch size (and was not timed there again)."""

    artifact: str
    batch_size: int
    reason: str


@dataclass
class SweepPoint:
    """One batch size of a throughput sweep: the calls of its last stable windows (``stable``: the last
    ``STABLE_WINDOWS`` windows agreed within the sweep's tolerance; False: it ran out of windows first)."""

    batch_size: int
    p50_ms: float
    p99_ms: float
    throughput: float  # samples per second of run time
    calls: int
    stable: bool = True


@dataclass
class Sweep:
    """One artifact (with its runtime settings) timed at batch sizes 1, 2, 4... in one traffic until its
    throughput stopped growing; ``stop`` says why the sweep ended there."""

    artifact: str
    traffic: str
    points: List[SweepPoint]
    stop: str
    runtime: str = ""
    process: str = "shared"

    def best(self, latency_budget_ms: Optional[float] = None, tie: float = 0.05) -> Optional[SweepPoint]:
        """The smallest batch size whose throughput is within ``tie`` of the highest among the points whose p99 is
        within the budget (a larger batch for a few percent more samples/s only adds latency: the sweep's own
        stopping rule)."""
        within = [p for p in self.points if latency_budget_ms is None or p.p99_ms <= latency_budget_ms]
        if not within:
            return None
        top = max(p.throughput for p in within)
        return min((p for p in within if p.throughput * (1 + tie) >= top), key=lambda p: p.batch_size)

    @classmethod
    def from_dict(cls, data: Json) -> "Sweep":
        return cls(str(data["artifact"]), str(data["traffic"]),
                   [SweepPoint(**fields_from(SweepPoint, p)) for p in data.get("points") or []],  # type: ignore[arg-type]
                   str(data.get("stop", "")), str(data.get("runtime", "")), str(data.get("process", "shared")))


@dataclass
class BenchTable:
    """Timings of every artifact (and of the eager baselines given), each artifact's check, and what could not be
    timed."""

    threads: int
    isa: str
    machine: str
    torch: str
    timings: List[Timing] = field(default_factory=list)
    checks: Dict[str, ArtifactCheck] = field(default_factory=dict)
    failures: List[TimingFailure] = field(default_factory=list)
    sweeps: List[Sweep] = field(default_factory=list)  # the throughput sweep of the artifacts that could win it
    not_swept: Dict[str, str] = field(default_factory=dict)  # "artifact, traffic" -> why it was not swept
    cpu: str = ""  # the CPU that timed them (model and flags); "" in exports written before it was recorded
    # Candidates tied at a batch size and traffic, timed again together in more processes (their ``process_medians_ms``
    # those processes'): the timing that decided the tie (export/select/selection.py).
    tie_breaks: List[Timing] = field(default_factory=list)

    def median(self, artifact: str, batch_size: int, traffic: str = "idle", runtime: str = "") -> Optional[float]:
        return next((t.median_ms for t in self.timings if (t.artifact, t.batch_size, t.traffic, t.runtime)
                     == (artifact, batch_size, traffic, runtime)), None)

    def to_dict(self) -> Dict[str, object]:
        return {**dataclasses.asdict(self), "checks": {k: c.to_dict() for k, c in self.checks.items()}}

    @classmethod
    def from_dict(cls, data: Json) -> "BenchTable":
        return cls(int(data.get("threads", 0)), str(data.get("isa", "")), str(data.get("machine", "")),
                   str(data.get("torch", "")), [Timing(**fields_from(Timing, t)) for t in data.get("timings", [])],
                   {k: ArtifactCheck.from_dict(c) for k, c in (data.get("checks") or {}).items()},
                   [TimingFailure(**fields_from(TimingFailure, f)) for f in data.get("failures") or []],
                   [Sweep.from_dict(w) for w in data.get("sweeps") or []],
                   {str(k): str(v) for k, v in (data.get("not_swept") or {}).items()}, str(data.get("cpu", "")),
                   [Timing(**fields_from(Timing, t)) for t in data.get("tie_breaks") or []])


@dataclass
class Selected:
    """An artifact picked by a strategy (``min_latency``: the fastest at ``batch_size`` under ``traffic`` whose
    check passed; ``max_throughput``: the most samples per second over its throughput sweep, at ``batch_size``,
    with a p99 within ``latency_budget_ms`` when one was given), and the runtime settings that made it so
    (``runtime``: a name from its Format's ``runtime_choices``; "": as written)."""

    format: str
    batch_size: int
    median_ms: float
    why: str
    traffic: str = "idle"
    runtime: str = ""
    # What ``runtime`` sets, merged over the entry's own options (for loaders without fx-lightning).
    runtime_options: JsonObject = field(default_factory=dict)
    strategy: str = "min_latency"
    throughput: Optional[float] = None  # samples per second at batch_size (max_throughput)
    p99_ms: Optional[float] = None  # (max_throughput)
    latency_budget_ms: Optional[float] = None


@dataclass
class Preprocess(PreprocessConfig):
    """``export.preprocess`` as an export resolved it, compiled into the graph as a prologue: ``mean`` and ``std``
    known, and ``source``: where they came from ("config", or the datamodule transform they were found in). The
    manifest writes it without ``enabled`` (a recorded prologue is on)."""

    enabled: bool = True
    source: str = "config"

    def __post_init__(self) -> None:
        # The names a manifest (or a client's code) gives become the config's members, so both compare alike.
        self.input_dtype = InputDtype(self.input_dtype)
        self.layout, self.channel_order = Layout(self.layout), ChannelOrder(self.channel_order)

    def client_input(self) -> Dict[str, str]:
        """What a client sends, by name (for notes and messages: a member formats as ``Layout.NCHW``)."""
        return {name: getattr(self, name).value for name in ("input_dtype", "layout", "channel_order")}

    def to_dict(self) -> JsonObject:
        return json_safe({k: v for k, v in dataclasses.asdict(self).items() if k != "enabled"})

    @classmethod
    def resolved(cls, config: PreprocessConfig, source: str, **found: object) -> "Preprocess":
        """``config`` with what was ``found`` in ``source`` (mean, std and scale) over its own values."""
        return cls(**{**dataclasses.asdict(config), **found, "enabled": True, "source": source})

    @classmethod
    def from_dict(cls, data: Json) -> "Preprocess":
        return cls(**fields_from(cls, data))  # type: ignore[arg-type]


@dataclass
class Manifest:
    """Everything an export records. ``config`` is the resolved FuseConfig and ``report`` the FuseReport, both as
    their JSON views; ``provenance`` is written under the key ``extra``."""

    formats: Dict[str, FormatEntry]
    files: Dict[str, FileInfo] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION  # the version it was read from; to_dict always writes FORMAT_VERSION
    created_utc: str = ""
    versions: Dict[str, Optional[str]] = field(default_factory=dict)
    config: Optional[JsonObject] = None
    report: Optional[JsonObject] = None
    parity: Optional[ParityReport] = None
    # The arguments and outputs as written for readers without fx-lightning: the signature's leaves (name, dtype,
    # ``LeafSpec.written_shape``), and each argument's kind (an argument that is not a tensor: its type and value)
    # and device. fx-lightning reads the signature; these only where it says nothing (before version 3).
    inputs: List[JsonObject] = field(default_factory=list)
    outputs: List[JsonObject] = field(default_factory=list)
    dynamic_batch: bool = False
    notes: List[Note] = field(default_factory=list)
    provenance: Provenance = field(default_factory=Provenance)
    failed_formats: Dict[str, str] = field(default_factory=dict)
    check_file: Optional[str] = None  # check.pt: example inputs and fp64 outputs any process checks artifacts with
    variants: Dict[str, List[VariantOutcome]] = field(default_factory=dict)
    bench: Optional[BenchTable] = None
    selected: Optional[Selected] = None  # what load_fused(dir) loads
    selections: List[Selected] = field(default_factory=list)  # the fastest per batch size timed and traffic
    # The input contract's optional parts: the raw-input prologue in the graph, and the class names of the first
    # output's columns (``export.labels``, or the datamodule's ``classes``).
    preprocess: Optional[Preprocess] = None
    labels: List[str] = field(default_factory=list)
    # How the artifacts are called (version 3): every input and output leaf with its dimensions, and whether a
    # sample axis is proven. Read from an older manifest, it is what that manifest implied (dim 0 the batch).
    signature: Optional[Signature] = None

    def call_signature(self) -> Signature:
        """The signature, or for a manifest written before version 3 what it implied: dim 0 of every input and output
        the sample axis when it recorded a dynamic batch."""
        if self.signature is not None:
            return self.signature
        return legacy_signature([s for s in self.inputs if is_tensor(s)], self.outputs, self.dynamic_batch)

    @property
    def min_discrete_agreement(self) -> float:
        """``parity.min_discrete_agreement`` of the export's config: what a discrete output of any artifact must
        agree on, wherever it is checked (the default for an export that did not record it)."""
        parity = (self.config or {}).get("parity") or {}
        return float(parity.get("min_discrete_agreement", DISCRETE_AGREEMENT))

    def to_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {
            "format_version": FORMAT_VERSION, "created_utc": self.created_utc, "versions": self.versions,
            "config": self.config, "report": self.report,
            "parity": self.parity.to_dict() if self.parity is not None else None,
            "inputs": list(self.inputs), "outputs": list(self.outputs),
            "dynamic_batch": self.dynamic_batch, "formats": {k: e.to_dict() for k, e in self.formats.items()},
            "files": {k: dataclasses.asdict(v) for k, v in self.files.items()},
            "notes": [n.to_dict() for n in self.notes], "extra": self.provenance.to_dict(),
            "failed_formats": self.failed_formats,
            "check": {"path": self.check_file} if self.check_file is not None else None,
        }
        if self.variants:
            out["variants"] = {v: {o.entry: o.to_dict() for o in outs} for v, outs in self.variants.items()}
        if self.bench is not None or self.selected is not None:
            out["bench"] = self.bench.to_dict() if self.bench is not None else None
            out["selected"] = dataclasses.asdict(self.selected) if self.selected is not None else None
            out["selections"] = [dataclasses.asdict(s) for s in self.selections]
        if self.preprocess is not None:
            out["preprocess"] = self.preprocess.to_dict()
        if self.labels:
            out["labels"] = list(self.labels)
        if self.signature is not None:
            out["signature"] = self.signature.to_dict()
        return json_safe(out)

    @classmethod
    def from_dict(cls, data: Json) -> "Manifest":
        """Read a manifest of any version in :data:`READABLE_VERSIONS` (raises ValueError, KeyError or TypeError
        on a malformed one; :func:`read_manifest` turns those into an ExportError naming the file)."""
        parity, check, bench, selected = (data.get(k) for k in ("parity", "check", "bench", "selected"))
        return cls(
            formats={str(k): FormatEntry.from_dict(str(k), v) for k, v in data["formats"].items()},
            files={str(k): FileInfo(int(v["size"]), str(v["sha256"])) for k, v in data["files"].items()},
            format_version=int(data["format_version"]), created_utc=str(data.get("created_utc", "")),
            versions=dict(data.get("versions") or {}), config=data.get("config"), report=data.get("report"),
            parity=ParityReport.from_dict(parity) if isinstance(parity, Mapping) else None,
            inputs=[dict(s) for s in data.get("inputs") or []], outputs=[dict(s) for s in data.get("outputs") or []],
            dynamic_batch=bool(data.get("dynamic_batch", False)),
            notes=[Note.from_dict(n) for n in data.get("notes") or []],
            provenance=Provenance.from_dict(data.get("extra")),
            failed_formats={str(k): str(v) for k, v in (data.get("failed_formats") or {}).items()},
            check_file=str(check["path"]) if isinstance(check, Mapping) and check.get("path") else None,
            variants={str(v): [VariantOutcome.from_dict(str(e), r) for e, r in outs.items()]
                      for v, outs in (data.get("variants") or {}).items()},
            bench=BenchTable.from_dict(bench) if isinstance(bench, Mapping) else None,
            selected=Selected(**fields_from(Selected, selected)) if isinstance(selected, Mapping) else None,  # type: ignore[arg-type]
            selections=[Selected(**fields_from(Selected, s)) for s in data.get("selections") or []],  # type: ignore[arg-type]
            preprocess=Preprocess.from_dict(data["preprocess"]) if isinstance(data.get("preprocess"), Mapping) else None,
            labels=[str(label) for label in data.get("labels") or []],
            signature=Signature.from_dict(data["signature"]) if isinstance(data.get("signature"), Mapping) else None,
        )


def new_manifest(ctx: WriteContext, entries: Dict[str, FormatEntry], *, config: Optional[JsonObject],
                 report: Optional[JsonObject], parity: Optional[ParityReport], provenance: Provenance) -> Manifest:
    """The manifest of a fresh export: versions, inputs and outputs, formats, and what the caller knows."""
    return Manifest(
        formats=entries, created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        versions=_versions(entries), config=config, report=report, parity=parity, inputs=_input_views(ctx),
        outputs=[{"name": leaf.name, "shape": leaf.written_shape(ctx.sample_dynamic), "dtype": leaf.dtype}
                 for leaf in ctx.signature.outputs], dynamic_batch=ctx.sample_dynamic,
        notes=list(ctx.notes), provenance=provenance, signature=ctx.signature,
    )


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Write (or rewrite, in a finished export) the manifest atomically: a reader sees the old one or the new one."""
    staging = Path(root) / f".{MANIFEST_NAME}.tmp"
    staging.write_text(json.dumps(manifest.to_dict(), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(staging, Path(root) / MANIFEST_NAME)


def read_manifest(directory: Any) -> Manifest:
    """The manifest of an export directory, checked for a readable ``format_version``."""
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
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path}: unreadable or corrupt manifest: {exc}") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path}: corrupt manifest: expected a JSON object, got {type(data).__name__}.")
    version = data.get("format_version")
    if version not in READABLE_VERSIONS:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
        raise ExportError(
            f"{path}: manifest format_version {version!r} is "
            + (f"newer than this fx-lightning ({__version__}) reads (versions {', '.join(map(str, READABLE_VERSIONS))})"
               "; upgrade fx-lightning to load it." if newer else
               f"unknown; this fx-lightning ({__version__}) reads versions {', '.join(map(str, READABLE_VERSIONS))}. "
               "The file was not written by fx-lightning or is damaged.")
        )
    for key in ("formats", "files"):
        if not isinstance(data.get(key), dict):
            raise ExportError(f"{path}: corrupt manifest: '{key}' is missing or not an object.")
    try:
        manifest = Manifest.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ExportError(f"{path}: corrupt manifest: {type(exc).__name__}: {exc}") from None
    _refuse_disagreeing_views(manifest, path)
    return manifest


def _refuse_disagreeing_views(manifest: Manifest, path: Path) -> None:
    """``inputs`` (for readers without fx-lightning) and ``signature`` (what fx-lightning reads) state the same
    tensors: where an edit made them differ, one of them is wrong, and a server would trust the other."""
    if manifest.signature is None:
        return
    views = [v.get("dtype") for v in manifest.inputs if is_tensor(v)]
    leaves = [leaf.dtype for leaf in manifest.signature.inputs]
    if len(views) == len(leaves) and views != leaves:  # (a nested argument is one view and several leaves)
        raise ExportError(f"{path}: corrupt manifest: the dtypes of its inputs ({', '.join(map(str, views))}) and of "
                          f"its signature's inputs ({', '.join(leaves)}) disagree")


def verify_files(root: Path, manifest: Manifest, fmt: Optional[str] = None, *,
                 names: Optional[Sequence[str]] = None) -> None:
    """Check size and sha256 of the manifest's files (those of ``fmt`` only, or ``names``, when given)."""
    names = list(names) if names is not None else sorted(manifest.files) if fmt is None else manifest.formats[fmt].files
    if not names:
        raise ExportError(f"{root / MANIFEST_NAME}: corrupt manifest: no files listed for format {fmt!r}.")
    for name in names:
        info = manifest.files.get(name)
        path = root / name
        if info is None:
            raise ExportError(f"{root / MANIFEST_NAME}: corrupt manifest: no size/sha256 entry for {name!r}.")
        if not path.is_file():
            raise ExportError(f"{path}: missing file of format {fmt or 'export'!r} (listed in the manifest).")
        size = path.stat().st_size
        if size != info.size:
            raise ExportError(f"{path}: corrupt file: size {size} bytes, the manifest says {info.size} bytes.")
        digest = sha256_file(path)
        if digest != info.sha256:
            raise ExportError(
                f"{path}: corrupt file: sha256 {digest[:16]}... does not match the manifest's "
                f"{info.sha256[:16]}...; re-export rather than load it."
            )


def _input_views(ctx: WriteContext) -> List[JsonObject]:
    """Each argument as the manifest writes it: a tensor as its leaf's view with its kind, example shape and device;
    another argument by its type and value."""
    views: List[JsonObject] = []
    leaves = iter(ctx.signature.inputs)
    for name, a in zip(ctx.input_names, ctx.args):
        if not isinstance(a, torch.Tensor):
            views.append({"name": name, "kind": type(a).__name__, "value": repr(a)[:200]})
            continue
        shape = next(leaves).written_shape(ctx.sample_dynamic)
        views.append({"name": name, "kind": "tensor", "shape": shape, "dtype": dtype_name(a.dtype),
                      "example_shape": list(a.shape), "device": str(a.device)})
    return views


def is_tensor(view: Json) -> bool:
    """Whether an argument of a manifest's ``inputs`` is a tensor (version 1 recorded no ``kind``: a dtype says so)."""
    return view.get("kind") == "tensor" or (view.get("kind") is None and view.get("dtype") is not None)


def legacy_signature(inputs: Sequence[Json], outputs: Sequence[Json], dynamic_batch: bool) -> Signature:
    """What a manifest written before signatures implied from its tensors' records: dim 0 of every input and output
    is the batch (fixed to the example's size when it recorded no dynamic batch: its artifacts ran other sizes as
    pieces)."""
    def leaf(view: Json) -> LeafSpec:
        shape = list(view.get("shape") or [])
        example = view.get("example_shape") or [d if isinstance(d, int) else 1 for d in shape]
        return LeafSpec.from_dict({"name": view["name"], "dtype": view.get("dtype") or "float32",
                                   "example_shape": example, "shape": ["batch", *shape[1:]] if shape else []})

    sample = SampleAxis(True, "dim 0 of every input and output, as manifests before version 3 had it", dynamic_batch)
    return Signature([leaf(s) for s in inputs], [leaf(s) for s in outputs], sample)


def _versions(entries: Mapping[str, FormatEntry]) -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {
        "format_version": str(FORMAT_VERSION),
        "fx_lightning": __version__,
        "torch": torch.__version__,
        "lightning": dist_version("lightning"),
        "python": platform.python_version(),
    }
    for name, entry in entries.items():
        fmt = FORMATS[entry.format_name or name]
        for module in (*fmt.requires, *fmt.runtime_requires):
            out[module] = dist_version(module)
    return out


def dist_version(name: str) -> Optional[str]:
    """The installed version of the distribution ``name`` (None: not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
