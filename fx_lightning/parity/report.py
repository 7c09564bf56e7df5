"""``ParityReport``: the gate's verdict on a fused model (or a lossy variant), its figures, failures and notes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Union

from fx_lightning.notes import Note

__all__ = ["ParityReport"]


def _finite_or_text(value: float) -> Union[float, str]:
    return float(value) if math.isfinite(value) else str(value)  # JSON has no NaN


@dataclass
class ParityReport:
    passed: bool
    metrics: Dict[str, float] = field(default_factory=dict)
    failures: List[Note] = field(default_factory=list)  # GATE_MISSED, OUTPUT_STRUCTURE, NO_BATCHES...
    batches: int = 0
    source: str = "val"  # val | train | example | given
    notes: List[Note] = field(default_factory=list)
    thresholds: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, object]:
        """JSON-safe view (non-finite floats become strings, since JSON has no NaN)."""
        return {"passed": self.passed, "metrics": {k: _finite_or_text(v) for k, v in self.metrics.items()},
                "failures": [f.to_dict() for f in self.failures], "batches": self.batches, "source": self.source,
                "notes": [n.to_dict() for n in self.notes],
                "thresholds": {k: _finite_or_text(v) for k, v in self.thresholds.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> "ParityReport":
        """Read back what :meth:`to_dict` wrote (failures and notes of format-version-1 manifests are strings)."""
        def floats(key: str) -> Dict[str, float]:
            return {str(k): float(v) for k, v in dict(data.get(key) or {}).items()}  # type: ignore[call-overload]

        return cls(bool(data.get("passed")), floats("metrics"), [Note.from_dict(f) for f in data.get("failures") or []],
                   int(data.get("batches") or 0), str(data.get("source", "val")),  # type: ignore[call-overload]
                   [Note.from_dict(n) for n in data.get("notes") or []], floats("thresholds"))

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [f"parity {verdict} on {self.batches} batch(es) of {self.source} data"]
        for key, value in self.metrics.items():
            lines.append(f"  {key:<28} {value:.6g}")
        for failure in self.failures:
            lines.append(f"  FAIL: {failure}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)
