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
from dataclasses import dataclass
from typing import Iterable, List, Mapping, Tuple, Union

__all__ = ["Fact", "NoteKind", "Note", "unique_notes"]

Fact = Union[str, int, float, bool, None, Tuple[Union[str, int, float, bool, None], ...]]


def _frozen(value: object) -> Fact:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)  # type: ignore[misc]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


@dataclass(frozen=True)
class NoteKind:
    """One kind of note: its name (stable, recorded in manifests) and the sentence that renders it, a
    ``str.format`` template over its facts."""

    name: str
    template: str

    def fields(self) -> List[str]:
        return [f for _, f, _, _ in string.Formatter().parse(self.template) if f]

    def __call__(self, **facts: object) -> "Note":
        missing = [f for f in self.fields() if f not in facts]
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

    def facts_dict(self) -> Mapping[str, Fact]:
        return dict(self.facts)

    def __str__(self) -> str:
        return self.kind.template.format(**self.facts_dict())

    def to_dict(self) -> Mapping[str, object]:
        """JSON view: the kind, the facts and the sentence."""
        return {"kind": self.kind.name, "facts": {k: list(v) if isinstance(v, tuple) else v for k, v in self.facts},
                "text": str(self)}

    @classmethod
    def from_dict(cls, data: object) -> "Note":
        """A note read back from a manifest; a plain string (manifests of format version 1) is a ``text`` note."""
        if isinstance(data, str):
            return TEXT(text=data)
        if not isinstance(data, Mapping):
            raise ValueError(f"a note is a string or an object with 'kind' and 'text', got {type(data).__name__}")
        text = str(data.get("text", ""))
        kind = NoteKind(str(data.get("kind", "text")), text.replace("{", "{{").replace("}", "}}"))
        facts = data.get("facts") or {}
        return Note(kind, tuple((str(k), _frozen(v)) for k, v in dict(facts).items()))


# A note known only by its text (manifests of format version 1).
TEXT = NoteKind("text", "{text}")


def unique_notes(notes: Iterable[Note]) -> List[Note]:
    """``notes`` in order, each once."""
    return list(dict.fromkeys(notes))
