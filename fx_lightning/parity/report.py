"""``ParityReport``: the gate's verdict on a fused model (or a lossy variant), its figures, failures and notes;
``ArtifactCheck``: the verdict on one exported artifact run against the fp64 reference."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from fx_lightning.common.json_views import json_safe
from fx_lightning.common.notes import Note

__all__ = ["ParityReport", "ArtifactCheck", "OutputError"]


@dataclass
class OutputError:
    """One output of the target: its relative error (``max|fused - reference| / max|reference|`` over every batch)
    and the distribution of its samples' errors (each sample's ``max|fused - reference|`` over the same scale):
    ``quantiles`` (p50, p90, p99, max), a histogram with log-spaced ``edges`` (one more than ``counts``) and how
    many samples were exactly equal (``zeros``). ``shape``: the output's in the first batch compared."""

    name: str
    relative_max_error: float
    samples: int = 0
    quantiles: Dict[str, float] = field(default_factory=dict)
    shape: List[int] = field(default_factory=list)
    edges: List[float] = field(default_factory=list)
    counts: List[int] = field(default_factory=list)
    zeros: int = 0

    def to_dict(self) -> Dict[str, object]:
        return json_safe(asdict(self))  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "OutputError":
        return cls(str(data["name"]), float(data["relative_max_error"]), int(data.get("samples") or 0),
                   {str(k): float(v) for k, v in dict(data.get("quantiles") or {}).items()},
                   [int(s) for s in data.get("shape") or []], [float(e) for e in data.get("edges") or []],
                   [int(c) for c in data.get("counts") or []], int(data.get("zeros") or 0))


@dataclass
class ParityReport:
    passed: bool
    metrics: Dict[str, float] = field(default_factory=dict)
    failures: List[Note] = field(default_factory=list)  # GATE_MISSED, OUTPUT_STRUCTURE, NO_BATCHES...
    batches: int = 0
    source: str = "val"  # val | train | example | given
    notes: List[Note] = field(default_factory=list)
    thresholds: Dict[str, float] = field(default_factory=dict)
    outputs: List[OutputError] = field(default_factory=list)  # per output compared by value, in the target's order

    def to_dict(self) -> Dict[str, object]:
        """JSON-safe view (non-finite floats become strings, since JSON has no NaN)."""
        return {"passed": self.passed, "metrics": json_safe(self.metrics),
                "failures": [f.to_dict() for f in self.failures], "batches": self.batches, "source": self.source,
                "notes": [n.to_dict() for n in self.notes], "thresholds": json_safe(self.thresholds),
                "outputs": [o.to_dict() for o in self.outputs]}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> "ParityReport":
        """Read back what :meth:`to_dict` wrote (failures and notes of format-version-1 manifests are strings)."""
        def floats(key: str) -> Dict[str, float]:
            return {str(k): float(v) for k, v in dict(data.get(key) or {}).items()}  # type: ignore[call-overload]

        return cls(bool(data.get("passed")), floats("metrics"), [Note.from_dict(f) for f in data.get("failures") or []],
                   int(data.get("batches") or 0), str(data.get("source", "val")),  # type: ignore[call-overload]
                   [Note.from_dict(n) for n in data.get("notes") or []], floats("thresholds"),
                   [OutputError.from_dict(o) for o in data.get("outputs") or []])  # type: ignore[attr-defined]

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [f"parity {verdict} on {self.batches} batch(es) of {self.source} data"]
        lines += [f"  {key:<28} {value:.6g}" for key, value in self.metrics.items()]
        lines += [f"  FAIL: {failure}" for failure in self.failures]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


@dataclass
class ArtifactCheck:
    """One artifact judged against the fp64 reference outputs: at export (each format loaded back), by the selection
    and by a server (on ``check.pt``), all with :func:`fx_lightning.export.check.check_artifact`.

    ``passed``: it ran on every example with the reference's output structure and within ``tolerance`` (an exact
    artifact: a few times ``fused_error``, the fused model's own error against the reference); a lossy variant
    (``lossy``) also within its gate's agreement, and its gate passed. ``reason``: why not, in words.
    ``batch_sizes``: the sample counts it ran at (empty without a sample axis)."""

    passed: bool
    reason: Optional[str] = None
    relative_error: Optional[float] = None
    tolerance: Optional[float] = None
    fused_error: float = 0.0
    batch_sizes: List[int] = field(default_factory=list)
    against: str = "an fp64 copy of the fused model"
    lossy: bool = False

    def to_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {"passed": self.passed}
        for key in ("reason", "relative_error", "tolerance"):
            value = getattr(self, key)
            if value is not None:
                out[key] = json_safe(value)
        out.update(fused_error=self.fused_error, batch_sizes=list(self.batch_sizes), against=self.against)
        if self.lossy:
            out["lossy"] = True
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ArtifactCheck":
        """Read back :meth:`to_dict`, and the round-trip records of older manifests (``checked``, ``max_rel_err``,
        ``fused_rel_err``)."""
        def number(*keys: str) -> Optional[float]:
            value = next((data[k] for k in keys if data.get(k) is not None), None)
            return None if value is None else float(value)

        return cls(bool(data.get("passed", data.get("checked", False))),
                   None if data.get("reason") is None else str(data["reason"]),
                   number("relative_error", "max_rel_err"), number("tolerance"),
                   number("fused_error", "fused_rel_err") or 0.0,
                   [int(b) for b in data.get("batch_sizes") or []],
                   str(data.get("against") or "an fp64 copy of the fused model"), bool(data.get("lossy", False)))
