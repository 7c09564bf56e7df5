"""The export's ``README.md``: how to load each written artifact, with and without fx-lightning."""

from __future__ import annotations

from typing import Dict

from fx_lightning.formats import FORMATS
from fx_lightning.formats.base import FormatEntry

__all__ = ["readme_text"]


def readme_text(entries: Dict[str, FormatEntry]) -> str:
    lines = [
        "# Fused model exported by fx-lightning",
        "",
        "`manifest.json` lists the formats, the inputs (`batch`: the sample axis, any size when `dynamic_batch`;",
        "a name: a size that varies; `signature` says how each was observed),",
        "the fuse report, the parity verdict and each file's sha256. With fx-lightning installed:",
        "",
        "    from fx_lightning import load_fused",
        "    model = load_fused('this/directory')          # checks sha256",
        "",
        "Without it, with torch only:",
        "",
    ]
    for name, entry in entries.items():
        if entry.variant is None:
            lines.append(FORMATS[entry.format_name or name].readme_text(entry.options))
            continue
        metrics = entry.gate.metrics if entry.gate is not None else {}
        figures = ", ".join(f"{label} {metrics[key]:.4g}" for key, label in (
            ("top1_agreement", "top-1 agreement with fp32"), ("accuracy_drop", "accuracy drop")) if key in metrics)
        lines.append(f"- `{entry.path}` ({name}): the {entry.variant} variant, loaded as `{entry.format_name}` is "
                     f"(lossy: it passed its accuracy gate{': ' + figures if figures else ''}).")
    return "\n".join(lines) + "\n"
