"""What ``export.preprocess`` and ``export.labels`` resolve to: the export's input contract.

The configured values, else what the training code shows (the validation transform's ``Normalize``, the
datamodule's ``classes``; found by :mod:`fx_lightning.callback.transforms`, handed in as :class:`Found`).
:func:`resolve_input_contract` decides before any work (an enabled prologue with nothing to take its mean and
std from is a ConfigError then, before training in the callback); :func:`labels_for_output` checks the labels
against the exported model's first output at export.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from fx_lightning.config import ExportConfig
from fx_lightning.errors import ConfigError
from fx_lightning.export.manifest import Preprocess
from fx_lightning.common.notes import Note, NoteKind

__all__ = ["FoundLabels", "Found", "InputContract", "resolve_input_contract", "labels_for_output",
           "preprocess_note",
           "PREPROCESS_PROPOSED", "PREPROCESS_COMPILED", "LABELS_FROM", "LABELS_IGNORED"]

PREPROCESS_PROPOSED = NoteKind("preprocess_proposed", "found Normalize(mean={mean}, std={std}) in {source}; set "
                                                      "export.preprocess.enabled: true to compile it into the export")
PREPROCESS_COMPILED = NoteKind("preprocess_compiled", "input normalisation compiled into the export (from {source}): "
                                                      "clients send raw {input_dtype} {layout} {channel_order}; "
                                                      "(x * {scale:.6g} - mean {mean}) / std {std}")
LABELS_FROM = NoteKind("labels_from", "labels: {count} class names of the first output's columns, from {source}")
LABELS_IGNORED = NoteKind("labels_ignored", "{source} has {count} class names but the first output has {width} "
                                            "columns: not recorded as the export's labels")


@dataclass(frozen=True)
class FoundLabels:
    names: Tuple[str, ...]
    source: str  # where they were found ("datamodule.classes")


@dataclass(frozen=True)
class Found:
    """What the training code shows: a normalisation (its ``source`` says where) and class names."""

    preprocess: Optional[Preprocess] = None
    labels: Optional[FoundLabels] = None


@dataclass
class InputContract:
    """The export's input contract: the prologue to compile (None: none), the class names and where they came from
    (``labels_configured``: from ``export.labels``, so a mismatch with the output is an error, not a note)."""

    preprocess: Optional[Preprocess] = None
    labels: List[str] = field(default_factory=list)
    labels_source: str = ""
    labels_configured: bool = False
    notes: List[Note] = field(default_factory=list)


def resolve_input_contract(export: ExportConfig, found: Optional[Found] = None,
                           searched: Optional[str] = None) -> InputContract:
    """``export.preprocess`` and ``export.labels`` with what was ``found`` in ``searched`` (None: nothing could be
    looked at, as without Lightning). Raises ConfigError when the prologue is enabled without mean/std and none
    was found."""
    found = found or Found()
    contract = InputContract()
    if not export.enabled:
        return contract  # nothing is exported: no contract, nothing to propose
    cfg = export.preprocess
    if cfg.enabled:
        contract.preprocess = _enabled_preprocess(export, found, searched)
    elif found.preprocess is not None:
        contract.notes.append(PREPROCESS_PROPOSED(mean=tuple(found.preprocess.mean), std=tuple(found.preprocess.std),
                                                  source=found.preprocess.source))
    if export.labels is not None:
        contract.labels, contract.labels_source, contract.labels_configured = list(export.labels), "export.labels", True
    elif found.labels is not None:
        contract.labels, contract.labels_source = list(found.labels.names), found.labels.source
    return contract


def _enabled_preprocess(export: ExportConfig, found: Found, searched: Optional[str]) -> Preprocess:
    cfg = export.preprocess
    if cfg.mean is not None and cfg.std is not None:
        return Preprocess.resolved(cfg, "config")
    if found.preprocess is None:
        where = (f"no Normalize(mean, std) was found in {searched}" if searched else
                 "there is no datamodule here to find them in")
        raise ConfigError(
            f"export.preprocess.enabled: true with mean: null and std: null, and {where}; set "
            "export.preprocess.mean and export.preprocess.std (one value per channel), or "
            "export.preprocess.enabled: false.")
    # The transform's own scale (ToTensor: 1/255; Normalize after a plain float conversion: 1) comes with it.
    return Preprocess.resolved(cfg, found.preprocess.source, mean=list(found.preprocess.mean),
                               std=list(found.preprocess.std), scale=float(found.preprocess.scale))


def labels_for_output(contract: InputContract, width: Optional[int]) -> Tuple[List[str], List[Note]]:
    """The labels to record for a first output ``width`` columns wide (None: not a 2-D output): configured ones
    that do not fit are a ConfigError, found ones are dropped with a note."""
    if not contract.labels:
        return [], []
    count = len(contract.labels)
    if width == count:
        return list(contract.labels), [LABELS_FROM(count=count, source=contract.labels_source)]
    if contract.labels_configured:
        raise ConfigError(f"export.labels: {count} class names {_shown(contract.labels)} but the exported model's "
                          f"first output has {width if width is not None else 'no class'} columns; give one name "
                          "per column, or null.",
                          # in place of the export step's "drop the failing format", which would not help
                          fix="give export.labels one name per column of the first output, or set it to null")
    return [], [LABELS_IGNORED(source=contract.labels_source, count=count, width=width)]


def preprocess_note(preprocess: Preprocess) -> Note:
    """Where the compiled prologue came from and what clients send (the summary shows it)."""
    return PREPROCESS_COMPILED(source=preprocess.source, **preprocess.client_input(), scale=preprocess.scale,
                               mean=tuple(preprocess.mean), std=tuple(preprocess.std))


def _shown(names: Sequence[str], most: int = 5) -> str:
    return repr(list(names[:most]))[:-1] + (", ...]" if len(names) > most else "]")
