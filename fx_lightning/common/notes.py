"""Notes: what the pipeline tells the user besides its figures, as typed events (a kind and its facts).

A kind is declared once, where it is emitted, with the sentence that renders it::

    PARITY_DISABLED = NoteKind("parity_disabled", "parity check disabled (parity.enabled: false): ...")
    notes.append(PARITY_DISABLED())
    BATCHES_READ(count=3, source="validation")["count"]      # 3

Code and tests look at ``note.kind`` and the facts; only summaries and reports render them (``str(note)``).
Notes are frozen and hashable (the same note from several ranks is kept once) and pickle across processes.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Tuple, Union

from fx_lightning.common.json_views import json_safe

__all__ = ["Fact", "NoteKind", "Note", "unique_notes"]

Fact = Union[str, int, float, bool, None, Tuple[Union[str, int, float, bool, None], ...]]


def _frozen(value: object) -> Fact:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)  # type: ignore[misc]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


# Every kind declared in a loaded module, by name: a note read back from a manifest gets its declared kind.
_DECLARED: Dict[str, "NoteKind"] = {}


@dataclass(frozen=True)
class NoteKind:
    """One kind of note: its name (stable, recorded in manifests; what kinds compare by) and the sentence that
    renders it, a ``str.format`` template over its facts. Declaring two kinds of one name is an error."""

    name: str
    template: str = field(compare=False)
    declared: bool = field(default=True, compare=False, repr=False)  # False: rebuilt from a manifest's text

    def __post_init__(self) -> None:
        if not self.declared:
            return
        known = _DECLARED.setdefault(self.name, self)
        if known.template != self.template:
            raise ValueError(f"note kind {self.name!r} is declared twice, with different sentences")

    def __call__(self, **facts: object) -> "Note":
        missing = [f for _, f, _, _ in string.Formatter().parse(self.template) if f and f not in facts]
        if missing:
            raise TypeError(f"note {self.name!r} needs the facts {', '.join(missing)}")
        return Note(self, tuple((k, _frozen(v)) for k, v in facts.items()))


@dataclass(frozen=True)
class Note:
    kind: NoteKind
    facts: Tuple[Tuple[str, Fact], ...] = ()

    def __getitem__(self, name: str) -> Fact:
        for key, value in self.facts:
            if key == name:
                return value
        raise KeyError(f"note {self.kind.name!r} has no fact {name!r}; it has {', '.join(k for k, _ in self.facts)}")

    def __str__(self) -> str:
        return self.kind.template.format(**dict(self.facts))

    def to_dict(self) -> Mapping[str, object]:
        """JSON view: the kind, the facts (non-finite numbers as text: JSON has none) and the sentence."""
        return {"kind": self.kind.name, "facts": json_safe(dict(self.facts)), "text": str(self)}

    @classmethod
    def from_dict(cls, data: object) -> "Note":
        """A note read back from a manifest: its declared kind when the module declaring it is loaded (else a kind
        of that name rendering the recorded sentence); a plain string (format version 1) is a ``text`` note."""
        if isinstance(data, str):
            return TEXT(text=data)
        if not isinstance(data, Mapping):
            raise ValueError(f"a note is a string or an object with 'kind' and 'text', got {type(data).__name__}")
        text, name = str(data.get("text", "")), str(data.get("kind", "text"))
        facts = tuple((str(k), _frozen(v)) for k, v in dict(data.get("facts") or {}).items())
        kind = _DECLARED.get(name)
        if kind is None or _rendered(Note(kind, facts)) != text:  # unknown here, or its sentence changed since
            kind = NoteKind(name, text.replace("{", "{{").replace("}", "}}"), declared=False)
        return Note(kind, facts)


def _rendered(note: Note) -> str:
    """The note's sentence, or "" when its facts do not fit the kind's sentence (a NaN written as text)."""
    try:
        return str(note)
    except (KeyError, ValueError, TypeError, IndexError):
        return ""


# A note known only by its text (manifests of format version 1).
TEXT = NoteKind("text", "{text}")


def unique_notes(notes: Iterable[Note]) -> List[Note]:
    """``notes`` in order, each once."""
    return list(dict.fromkeys(notes))
