"""``fx-lightning inspect DIR``: an export's manifest as tables (or JSON), its files checked on request."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, List, Optional, Tuple

from fx_lightning.cli.common import fmt, shape_text, titled_table

__all__ = ["add_parser", "run", "roundtrip_text"]


def add_parser(sub: Any) -> None:
    inspect_ = sub.add_parser("inspect", help="print an export's manifest as tables")
    inspect_.add_argument("directory")
    inspect_.add_argument("--json", action="store_true", help="print the manifest JSON instead")
    inspect_.add_argument("--verify", action="store_true", help="also check every file's sha256")
    inspect_.add_argument("--html", nargs="?", const="", default=None, metavar="FILE",
                          help="write the export's report.html (default: DIR/report.html; the same file the export "
                               "wrote, for an export written before it had one) and print its path")


def run(args: argparse.Namespace, console: Any) -> int:
    """``fx-lightning inspect``: an export's manifest as tables."""
    import torch

    from fx_lightning.export import MANIFEST_NAME, read_manifest, verify_files
    from fx_lightning.export.check import read_check_file

    root = Path(args.directory)
    manifest = read_manifest(root)
    if args.verify:
        verify_files(root, manifest)
    if getattr(args, "html", None) is not None:
        print(_write_html(root, manifest, Path(args.html) if args.html else None))
        return 0
    if args.json:  # the file as written, checked readable above
        print(json.dumps(json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8")), indent=2))
        return 0
    for table in (_summary_table(root, manifest), _io_table(manifest), *_report_tables(manifest),
                  _formats_table(manifest)):
        console.print(table)
    console.print("round-trip checks (each format loaded back from the export and compared before it was kept):",
                  markup=False)
    inputs = [spec for spec in manifest.inputs if spec.get("kind") == "tensor"]
    reference = read_check_file(root)  # the example the checks ran on: its sizes where the manifest names a dim
    example = next((list(t.shape) for t in reference.batches[0] if isinstance(t, torch.Tensor)), None) \
        if reference is not None else None
    for name, entry in manifest.formats.items():
        console.print(f"  {roundtrip_text(name, entry.check, inputs, example)}", markup=False, soft_wrap=True)
    for name, reason in manifest.failed_formats.items():
        console.print(f"  {name}: NOT EXPORTED: {reason}", markup=False, soft_wrap=True)
    console.print(_files_table(manifest))
    if args.verify:
        console.print("all files match their sha256", markup=False)
    return 0


def _write_html(root: Path, manifest: Any, out: Optional[Path]) -> Path:
    """The export's report.html, rendered from its manifest as the export renders it (so for an export that has one
    the same bytes), into ``out`` or the export directory."""
    from fx_lightning.export.write.report_html import REPORT_NAME, render_report

    target = out if out is not None else root / REPORT_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(render_report(manifest, f"fx-lightning export: {root.resolve().name}"), encoding="utf-8")
    tmp.replace(target)
    return target


def _summary_table(root: Path, manifest: Any) -> Any:
    summary = titled_table(f"fx-lightning export: {root}", "key", "value", show_header=False)
    origin = manifest.provenance
    summary.add_row("format_version", str(manifest.format_version))
    summary.add_row("created", str(manifest.created_utc))
    summary.add_row("versions", ", ".join(f"{k} {v}" for k, v in manifest.versions.items()
                                          if v and k != "format_version"))
    summary.add_row("target", str((manifest.config or {}).get("target") or origin.target or "<default>"))
    for label, text in _weights_rows(origin):
        summary.add_row(label, text)
    parity = manifest.parity
    if parity is None:
        summary.add_row("parity", "not checked")
    else:
        verdict = "PASSED" if parity.passed else "FAILED"
        summary.add_row("parity", f"{verdict} ({parity.batches} batch(es) of {parity.source} data)")
        for key, value in parity.metrics.items():
            summary.add_row(f"  {key}", fmt(value))
        for failure in parity.failures:
            summary.add_row("  FAIL", str(failure))
    summary.add_row("dynamic batch", str(manifest.dynamic_batch))
    for form in [f for f in manifest.signature.forms if f.directory] if manifest.signature is not None else []:
        summary.add_row("call form", f"{form.label}: {root / form.directory}")
    return summary


def _weights_rows(origin: Any) -> List[Tuple[str, str]]:
    """Which weights were fused and the counters they were saved at; the trainer's own final counters apart."""
    rows = []
    weights = origin.weights
    if weights is not None:
        rows.append(("weights", str(weights.description or weights.source)))
        if weights.epoch is not None or weights.global_step is not None:
            rows.append(("weights saved at", f"epoch {weights.epoch}, global step {weights.global_step}"))
    if origin.trainer is not None:
        rows.append(("trainer at end of fit", f"epoch {origin.trainer.epoch}, global step {origin.trainer.global_step}"))
    for key in ("checkpoint", "lightning_module"):
        if getattr(origin, key) is not None:
            rows.append((key, str(getattr(origin, key))))
    return rows


def _io_table(manifest: Any) -> Any:
    table = titled_table("inputs and outputs", "", "name", "shape", "dtype")
    for kind, specs in (("input", manifest.inputs), ("output", manifest.outputs)):
        for spec in specs:
            table.add_row(kind, str(spec["name"]), shape_text(spec.get("shape", spec.get("value"))),
                          str(spec.get("dtype") or spec.get("kind")))
    return table


def _report_tables(manifest: Any) -> List[Any]:
    report = manifest.report
    if not report:
        return []
    passes = titled_table(f"fuse report (capture: {report.get('capture_mode')}, "
                          f"BatchNorms folded: {report.get('batchnorms_folded')})", "pass", "changed", "skipped")
    for p in report.get("passes", []):
        passes.add_row(str(p.get("name")), str(len(p.get("changed", []))), str(len(p.get("skipped", []))))
    stats = titled_table("graph", "", "nodes", "BatchNorms", "dropouts", "parameters")
    for label in ("before", "after"):
        s = report.get(label) or {}
        stats.add_row(label, str(s.get("nodes")), str(s.get("batchnorms")), str(s.get("dropouts")),
                      f"{s.get('parameters', 0):,}")
    return [passes, stats]


def _formats_table(manifest: Any) -> Any:
    table = titled_table("formats", "format", "path", "loader", "pickled code")
    for name, entry in manifest.formats.items():
        table.add_row(name, entry.path, entry.loader, "yes (weights_only=False)" if entry.pickled_code else "no")
    return table


def roundtrip_text(name: str, check: Optional[Any], inputs: List[Any], example: Optional[List[int]] = None) -> str:
    """The check of one format at export (an ArtifactCheck), in words: what was compared with what, on which
    batches. A lossy variant has none there: its gate judged it, and the selection's run on check.pt."""
    if check is None:
        return f"{name}: not checked at export: a variant is judged by its gate (and the selection's check)"
    if not check.passed:
        return f"{name}: failed its check: {check.reason or 'no reason recorded'}"
    shapes = []
    for size in check.batch_sizes:
        named = inputs[0].get("shape") or [] if inputs else []
        sizes = example if example is not None and len(example) == len(named) else named
        dims = [size if d == "batch" else s for d, s in zip(named, sizes)]
        shapes.append("x".join(str(d) for d in dims) if dims else f"batch {size}")
    return (f"{name}: loaded back and run on input {' and '.join(shapes)}: relative error {fmt(check.relative_error)} "
            f"against {check.against} (max|loaded - reference| / max|reference|); the fused model itself: "
            f"{fmt(check.fused_error)}, allowed: {fmt(check.tolerance)}")


def _files_table(manifest: Any) -> Any:
    table = titled_table("files", "file", "bytes", "sha256")
    for name, info in manifest.files.items():
        table.add_row(name, f"{info.size:,}", info.sha256[:16] + "...")
    return table
