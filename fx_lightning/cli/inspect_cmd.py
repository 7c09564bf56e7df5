"""``fx-lightning inspect DIR``: an export's manifest as tables (or JSON), its files checked on request."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

from fx_lightning.cli.common import fmt, shape_text

__all__ = ["run", "roundtrip_text"]


def run(args: argparse.Namespace, console: Any) -> int:
    """``fx-lightning inspect``: an export's manifest as tables."""
    from fx_lightning.export import read_manifest, verify_files

    root = Path(args.directory)
    manifest = read_manifest(root)
    if args.verify:
        verify_files(root, manifest)
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    for table in (_summary_table(root, manifest), _io_table(manifest), *_report_tables(manifest),
                  _formats_table(manifest)):
        console.print(table)
    console.print("round-trip checks (each format loaded back from the export and compared before it was kept):",
                  markup=False)
    inputs = [spec for spec in manifest.get("inputs") or [] if spec.get("kind", "tensor") == "tensor"]
    for name, entry in manifest["formats"].items():
        console.print(f"  {roundtrip_text(name, entry.get('check') or {}, inputs)}", markup=False, soft_wrap=True)
    for name, reason in (manifest.get("failed_formats") or {}).items():
        console.print(f"  {name}: NOT EXPORTED: {reason}", markup=False, soft_wrap=True)
    console.print(_files_table(manifest))
    if args.verify:
        console.print("all files match their sha256", markup=False)
    return 0


def _table(title: str, *columns: str, **kwargs: Any) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", **kwargs)
    for col in columns:
        table.add_column(col)
    return table


def _summary_table(root: Path, manifest: Dict[str, Any]) -> Any:
    summary = _table(f"fx-lightning export: {root}", "key", "value", show_header=False)
    versions = manifest.get("versions", {})
    extra = manifest.get("extra") or {}
    summary.add_row("format_version", str(manifest.get("format_version")))
    summary.add_row("created", str(manifest.get("created_utc")))
    summary.add_row("versions", ", ".join(f"{k} {v}" for k, v in versions.items() if v and k != "format_version"))
    config = manifest.get("config") or {}
    summary.add_row("target", str(config.get("target") or extra.get("target") or "<default>"))
    for label, text in _weights_rows(extra):
        summary.add_row(label, text)
    parity = manifest.get("parity")
    if parity is None:
        summary.add_row("parity", "not checked")
    else:
        verdict = "PASSED" if parity.get("passed") else "FAILED"
        summary.add_row("parity", f"{verdict} ({parity.get('batches', '?')} batch(es) of {parity.get('source', '?')} data)")
        for key, value in (parity.get("metrics") or {}).items():
            summary.add_row(f"  {key}", fmt(value))
        for failure in parity.get("failures") or []:
            summary.add_row("  FAIL", str(failure))
    summary.add_row("dynamic batch", str(manifest.get("dynamic_batch")))
    return summary


def _weights_rows(extra: Dict[str, Any]) -> List[Tuple[str, str]]:
    """Which weights were fused and the counters they were saved at; the trainer's own final counters apart."""
    rows = []
    weights = extra.get("weights")
    if isinstance(weights, dict):
        rows.append(("weights", str(weights.get("description") or weights.get("source"))))
        if weights.get("epoch") is not None or weights.get("global_step") is not None:
            rows.append(("weights saved at", f"epoch {weights.get('epoch')}, global step {weights.get('global_step')}"))
    trainer = extra.get("trainer")
    if isinstance(trainer, dict):
        rows.append(("trainer at end of fit", f"epoch {trainer.get('epoch')}, global step {trainer.get('global_step')}"))
    for key in ("checkpoint", "lightning_module"):
        if extra.get(key) is not None:
            rows.append((key, str(extra[key])))
    return rows


def _io_table(manifest: Dict[str, Any]) -> Any:
    table = _table("inputs and outputs", "", "name", "shape", "dtype")
    for kind in ("inputs", "outputs"):
        for spec in manifest.get(kind) or []:
            table.add_row(kind[:-1], str(spec.get("name")), shape_text(spec.get("shape", spec.get("value"))),
                          str(spec.get("dtype", spec.get("kind", ""))))
    return table


def _report_tables(manifest: Dict[str, Any]) -> List[Any]:
    report = manifest.get("report")
    if not report:
        return []
    passes = _table(f"fuse report (capture: {report.get('capture_mode')}, "
                    f"BatchNorms folded: {report.get('batchnorms_folded')})", "pass", "changed", "skipped")
    for p in report.get("passes", []):
        passes.add_row(str(p.get("name")), str(len(p.get("changed", []))), str(len(p.get("skipped", []))))
    stats = _table("graph", "", "nodes", "BatchNorms", "dropouts", "parameters")
    for label in ("before", "after"):
        s = report.get(label) or {}
        stats.add_row(label, str(s.get("nodes")), str(s.get("batchnorms")), str(s.get("dropouts")),
                      f"{s.get('parameters', 0):,}")
    return [passes, stats]


def _formats_table(manifest: Dict[str, Any]) -> Any:
    table = _table("formats", "format", "path", "loader", "pickled code")
    for name, entry in manifest["formats"].items():
        table.add_row(name, str(entry.get("path")), str(entry.get("loader")),
                      "yes (weights_only=False)" if entry.get("pickled_code") else "no")
    return table


def roundtrip_text(name: str, check: Dict[str, Any], inputs: List[Dict[str, Any]]) -> str:
    """The round-trip check of one format, in words: what was compared with what, on which batches."""
    if not check.get("checked"):
        return f"{name}: not checked: {check.get('reason', 'no check recorded')}"
    shapes = []
    for size in check.get("batch_sizes") or []:
        dims = [size if d == "batch" else d for d in (inputs[0].get("shape") or [])] if inputs else []
        shapes.append("x".join(str(d) for d in dims) if dims else f"batch {size}")
    against = check.get("against", "the fused model")
    text = (f"{name}: loaded back and run on input {' and '.join(shapes)}: relative error "
            f"{fmt(check.get('max_rel_err'))} against {against} (max|loaded - reference| / max|reference|)")
    if check.get("fused_rel_err") is not None:
        text += f"; the fused model itself: {fmt(check['fused_rel_err'])}, allowed: {fmt(check.get('tolerance'))}"
    return text


def _files_table(manifest: Dict[str, Any]) -> Any:
    table = _table("files", "file", "bytes", "sha256")
    for name, info in manifest["files"].items():
        table.add_row(name, f"{info.get('size', 0):,}", str(info.get("sha256", ""))[:16] + "...")
    return table
