"""Typed notes: a kind declared once with its sentence, facts checked, JSON that reads back as the same kind."""

from __future__ import annotations

import json

import pytest

from fx_lightning.common.notes import TEXT, Note, NoteKind, unique_notes
from fx_lightning.pipeline.export_step import FORMAT_NOT_EXPORTED
from fx_lightning.pipeline.steps import PARITY_DISABLED


def test_a_note_is_its_kind_and_facts_and_renders_only_when_asked() -> None:
    note = FORMAT_NOT_EXPORTED(format="onnx", reason="onnxscript is not installed")
    assert note.kind == FORMAT_NOT_EXPORTED and note["format"] == "onnx"
    assert str(note) == "format onnx not exported (onnxscript is not installed)"
    with pytest.raises(KeyError, match="has no fact 'size'"):
        note["size"]


def test_a_kind_refuses_missing_facts_and_a_second_declaration() -> None:
    with pytest.raises(TypeError, match="needs the facts reason"):
        FORMAT_NOT_EXPORTED(format="onnx")
    with pytest.raises(ValueError, match="declared twice"):
        NoteKind(FORMAT_NOT_EXPORTED.name, "another sentence")
    assert NoteKind(PARITY_DISABLED.name, PARITY_DISABLED.template) == PARITY_DISABLED  # the same declaration


def test_json_round_trip_gives_the_declared_kind_back() -> None:
    note = FORMAT_NOT_EXPORTED(format="aoti", reason="no C++ compiler")
    back = Note.from_dict(json.loads(json.dumps(note.to_dict(), allow_nan=False)))
    assert back == note and back.kind == FORMAT_NOT_EXPORTED


def test_non_finite_facts_are_json_safe_and_unknown_kinds_keep_their_text() -> None:
    kind = NoteKind("test_ratio", "ratio {ratio:.2f}")
    data = json.loads(json.dumps(kind(ratio=float("inf")).to_dict(), allow_nan=False))
    assert data["facts"]["ratio"] == "inf" and data["text"] == "ratio inf"
    back = Note.from_dict(data)  # "inf" as text no longer fits "{ratio:.2f}": kept as the sentence written
    assert str(back) == "ratio inf" and back.kind.name == "test_ratio"
    unknown = Note.from_dict({"kind": "from_a_newer_version", "facts": {"n": 3}, "text": "three {braces}"})
    assert str(unknown) == "three {braces}" and unknown["n"] == 3


def test_format_version_1_strings_are_text_notes_and_notes_dedupe() -> None:
    old = Note.from_dict("parity read 2 batch(es) of validation data")
    assert old.kind == TEXT and str(old) == "parity read 2 batch(es) of validation data"
    a, b = PARITY_DISABLED(), FORMAT_NOT_EXPORTED(format="onnx", reason="x")
    assert unique_notes([a, b, PARITY_DISABLED(), b]) == [a, b]
