"""Where a fused model came from: the target, the weights and the run that produced them, and what the
preflight proved before training. Recorded in the export's manifest (as ``extra``) by the callback and the CLI.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

from fx_lightning.common.json_views import json_safe

__all__ = ["WeightsInfo", "PreflightReport", "TrainerCounters", "Provenance"]


def _int_or_none(value: object) -> Optional[int]:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass
class WeightsInfo:
    """Which weights were fused: where they come from and the training counters they were saved at."""

    source: str  # last | best | checkpoint
    description: str
    epoch: Optional[int] = None
    global_step: Optional[int] = None
    checkpoint: Optional[str] = None

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> "WeightsInfo":
        checkpoint = data.get("checkpoint")
        return cls(str(data.get("source", "")), str(data.get("description", "")), _int_or_none(data.get("epoch")),
                   _int_or_none(data.get("global_step")), str(checkpoint) if checkpoint is not None else None)


@dataclass
class PreflightReport:
    """What the preflight proved before training (the pipeline steps it ran), and what it cost."""

    mode: str
    seconds: float = 0.0
    device: Optional[str] = None
    stages: List[str] = field(default_factory=list)
    unproven: Optional[str] = None  # what could not be proven before training, and why
    # What the end of fit will do other than asked (a format skipped, and why), as the rehearsal showed.
    predicted: List[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> "PreflightReport":
        device, unproven = data.get("device"), data.get("unproven")
        return cls(str(data.get("mode", "")), float(data.get("seconds") or 0.0),  # type: ignore[arg-type]
                   str(device) if device is not None else None, [str(s) for s in data.get("stages") or []],  # type: ignore[union-attr]
                   str(unproven) if unproven is not None else None,
                   [str(p) for p in data.get("predicted") or []])  # type: ignore[union-attr]

    def __str__(self) -> str:
        return (f"preflight ({self.mode}): {', '.join(self.stages) or 'nothing'} proven before training in "
                f"{self.seconds:.2f} s" + (f" on {self.device}" if self.device else "")
                + (f"; not proven: {self.unproven}" if self.unproven else "")
                + "".join(f"\n  the end of fit will: {p}" for p in self.predicted))


@dataclass
class TrainerCounters:
    """The trainer's epoch and step at the end of fit (the weights' own are in :class:`WeightsInfo`)."""

    epoch: Optional[int] = None
    global_step: Optional[int] = None


@dataclass
class Provenance:
    """Where a fused model came from. Every field is optional: ``fx_lightning.export.export_fused`` called by
    hand knows none of them. ``other``: keys a caller adds that this record does not know."""

    target: Optional[str] = None  # dotted path of the fused submodule; "" for the whole module
    lightning_module: Optional[str] = None  # its class, "package.module.Class"
    weights: Optional[WeightsInfo] = None
    trainer: Optional[TrainerCounters] = None
    world_size: Optional[int] = None
    checkpoint: Optional[str] = None
    model: Optional[str] = None  # the --model import path given to the CLI
    written_by: Optional[str] = None
    preflight: Optional[PreflightReport] = None
    other: Dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, object]:
        """The JSON view: set fields only, records as dicts (and ``other``'s keys at the top)."""
        out: Dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "other" and value is not None:
                out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        out.update(json_safe(self.other))
        return out

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, object]]) -> "Provenance":
        data = dict(data or {})
        weights, trainer, preflight = data.pop("weights", None), data.pop("trainer", None), data.pop("preflight", None)
        known = {f.name for f in dataclasses.fields(cls)} - {"weights", "trainer", "preflight", "other"}
        plain = {k: data.pop(k) for k in list(data) if k in known}
        return cls(
            **plain,  # type: ignore[arg-type]
            weights=WeightsInfo.from_dict(weights) if isinstance(weights, Mapping) else None,
            trainer=TrainerCounters(_int_or_none(trainer.get("epoch")), _int_or_none(trainer.get("global_step")))
            if isinstance(trainer, Mapping) else None,
            preflight=PreflightReport.from_dict(preflight) if isinstance(preflight, Mapping) else None,
            other=data,
        )
