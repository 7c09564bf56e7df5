"""``report.html``: what an export's manifest holds, drawn for a person deciding whether to deploy it. One
self-contained file: inline CSS and SVG drawn here, no script, no font, no request (a test opens it in headless
Chromium and checks that nothing leaves the file).

Functional core: :func:`render_report` (a :class:`~fx_lightning.export.manifest.Manifest` -> the HTML text) and
:func:`sweep_svg` (one plot); the writer writes the page into the export's staging directory, so it is atomic with
the rest and listed in the manifest with its sha256 (``fx-lightning inspect DIR --html`` for an existing export).
Every figure shown carries ``data-key`` (what it is) and ``data-value`` (the manifest's number, unrounded), so a
test can read the page and compare it with the manifest.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from fx_lightning.export.manifest import Manifest, Sweep
from fx_lightning.parity.report import OutputError

__all__ = ["REPORT_NAME", "render_report", "sweep_svg", "sweep_series", "Series", "figures",
           "error_histogram_svg"]

REPORT_NAME = "report.html"

_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px;margin-bottom:4px} h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;margin:8px 0;font-size:13px} td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f4f4f4} .pass{color:#1a7f37;font-weight:600} .fail{color:#c62828;font-weight:600}
.cards{display:flex;gap:12px;flex-wrap:wrap} .card{border:1px solid #ccc;border-radius:6px;padding:10px 14px;min-width:220px}
.card .big{font-size:20px;font-weight:600} .muted{color:#666;font-size:12px} svg{background:#fff}
.plots{display:flex;gap:16px;flex-wrap:wrap}
"""


@dataclass(frozen=True)
class Series:
    """One line of a plot: its name and its (x, y) points; ``dashed``: drawn dashed (p99 beside p50)."""

    name: str
    points: Tuple[Tuple[float, float], ...]
    dashed: bool = False
    colour: int = 0  # an artifact keeps its colour across plots (its p50 and p99 too)


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e7):
        return f"{value:.2e}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:,.1f}"


def _figure(key: str, value: Optional[float], text: Optional[str] = None) -> str:
    """A figure in the page, with the manifest's value for a reader that compares (the tests)."""
    raw = "" if value is None else repr(float(value))
    return f'<span data-key="{_e(key)}" data-value="{raw}">{_e(text if text is not None else _num(value))}</span>'


def _verdict(passed: Optional[bool]) -> str:
    if passed is None:
        return '<span class="muted">not checked</span>'
    return '<span class="pass">passed</span>' if passed else '<span class="fail">FAILED</span>'


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], key: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table data-table="{_e(key)}"><tr>{head}</tr>{body}</table>'


# ------------------------------------------------------------------------------------------------- plots


def _ticks(low: float, high: float, log: bool) -> List[float]:
    if log:
        return [2.0 ** k for k in range(int(math.floor(math.log2(low))), int(math.ceil(math.log2(high))) + 1)]
    step = 10 ** math.floor(math.log10(max(high - low, 1e-12)))
    for factor in (1, 2, 5, 10):
        if (high - low) / (step * factor) <= 6:
            step *= factor
            break
    start = math.floor(low / step) * step
    return [start + i * step for i in range(int((high - start) / step) + 2) if start + i * step <= high + step]


def sweep_svg(title: str, x_label: str, y_label: str, series: Sequence[Series], key: str,
              width: int = 540, height: int = 300) -> str:
    """A line plot (x on a log2 axis: batch sizes) of ``series``, with axes, ticks and a legend, as inline SVG.
    Each point is a circle carrying ``data-series``, ``data-x`` and ``data-y``."""
    series = [Series(s.name, tuple(p for p in s.points if _finite(p[1]) and p[0] > 0), s.dashed, s.colour)
              for s in series]  # a point with no figure (a failed run's nan) is left out, not drawn at infinity
    points = [p for s in series for p in s.points]
    if not points:
        return f'<p class="muted" data-plot="{_e(key)}">{_e(title)}: nothing to draw</p>'
    left, right, top, bottom = 76, 170, 28, 44  # the legend on the right
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x_lo, x_hi = min(xs), max(max(xs), min(xs) * 2)
    y_ticks = _ticks(0.0, max(ys) * 1.05 or 1.0, log=False)
    y_hi = y_ticks[-1]
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + plot_w * (math.log2(x) - math.log2(x_lo)) / max(math.log2(x_hi) - math.log2(x_lo), 1e-9)

    def py(y: float) -> float:
        return top + plot_h * (1 - y / y_hi)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'data-plot="{_e(key)}" viewBox="0 0 {width} {height}"><title>{_e(title)}</title>',
           f'<text x="{left}" y="16" font-size="13" font-weight="600">{_e(title)}</text>',
           f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#444"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#444"/>']
    for t in _ticks(x_lo, x_hi, log=True):
        if x_lo <= t <= x_hi:
            out.append(f'<line x1="{px(t):.1f}" y1="{top + plot_h}" x2="{px(t):.1f}" y2="{top + plot_h + 4}" '
                       f'stroke="#444"/><text x="{px(t):.1f}" y="{top + plot_h + 16}" font-size="11" '
                       f'text-anchor="middle">{t:g}</text>')
    for t in y_ticks:
        out.append(f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + plot_w}" y2="{py(t):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{py(t) + 4:.1f}" font-size="11" text-anchor="end">{_num(t)}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" font-size="12" text-anchor="middle">'
               f'{_e(x_label)}</text><text x="14" y="{top + plot_h / 2}" font-size="12" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + plot_h / 2})">{_e(y_label)}</text>')
    for i, s in enumerate(series):
        colour = _COLOURS[s.colour % len(_COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} points="{path}"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}" data-series="{_e(s.name)}" '
                f'data-x="{x!r}" data-y="{y!r}"><title>{_e(s.name)}: batch {x:g}, {_num(y)}</title></circle>'
                for x, y in s.points]
        ly = top + 14 * i
        out.append(f'<line x1="{width - right + 10}" y1="{ly + 6}" x2="{width - right + 28}" y2="{ly + 6}" '
                   f'stroke="{colour}" stroke-width="2"{dash}/><text x="{width - right + 32}" y="{ly + 10}" '
                   f'font-size="11">{_e(s.name)}</text>')
    out.append("</svg>")
    return "".join(out)


def _sweep_name(sweep: Sweep) -> str:
    return sweep.artifact + (f" ({sweep.runtime})" if sweep.runtime else "")


def sweep_series(sweeps: Sequence[Sweep], traffic: str) -> Dict[str, List[Series]]:
    """The plots of one traffic: ``latency`` (p50 and, dashed, p99 per artifact) and ``throughput``."""
    chosen = [w for w in sweeps if w.traffic == traffic and w.points]
    colours = {name: i for i, name in enumerate(dict.fromkeys(_sweep_name(w) for w in sweeps))}
    latency = [Series(f"{_sweep_name(w)} {q}", tuple((p.batch_size, getattr(p, f"{q}_ms")) for p in w.points),
                      q == "p99", colours[_sweep_name(w)]) for w in chosen for q in ("p50", "p99")]
    throughput = [Series(_sweep_name(w), tuple((p.batch_size, p.throughput) for p in w.points), False,
                         colours[_sweep_name(w)]) for w in chosen]
    return {"latency": latency, "throughput": throughput}


# ----------------------------------------------------------------------------------------------- sections


def _card(label: str, big: str, more: str = "", attrs: str = "") -> str:
    """A decision: what it is (``label``), its verdict or figure (``big``, with ``attrs``) and ``more`` under it."""
    return f'<div class="card"><div class="muted">{label}</div><div class="big"{attrs}>{big}</div>{more}</div>'


def _decisions(manifest: Manifest) -> str:
    report = manifest.report or {}
    folded, left = report.get("batchnorms_folded"), (report.get("after") or {}).get("batchnorms")
    cards = [_card("BatchNorms folded / left", f'{_figure("batchnorms_folded", folded, str(folded))} / '
                                               f'{_figure("batchnorms_left", left, str(left))}')]
    parity = manifest.parity
    if parity is not None:
        worst = _figure("parity.relative_max_error", parity.metrics.get("relative_max_error"))
        cards.append(_card(f"parity on {parity.batches} batch(es) of {_e(parity.source)} data", _verdict(parity.passed),
                           f"<div>worst relative error {worst}</div>",
                           f' data-key="parity.passed" data-value="{parity.passed}"'))
    else:
        cards.append(_card("parity", "not checked"))
    selected = manifest.selected
    if selected is not None:
        eager = manifest.bench.median("eager", selected.batch_size, selected.traffic) if manifest.bench else None
        speed = f", {_figure('selected.speedup', eager / selected.median_ms)}x eager" if eager else ""
        cards.append(_card(f"served by load_fused (batch {selected.batch_size}, {_e(selected.traffic)})",
                           _e(selected.format), f'<div>{_figure("selected.median_ms", selected.median_ms)} ms median'
                                                f'{speed}</div>', ' data-key="selected.format"'))
    else:
        cards.append(_card("served", "not selected",
                           '<div class="muted">export.select: fastest times and picks one</div>'))
    return '<h2>Decisions</h2><div class="cards">' + "".join(cards) + "</div>"


def _graph(manifest: Manifest) -> str:
    report = manifest.report
    if not report:
        return "<h2>Graph</h2><p class='muted'>no fuse report in this manifest</p>"
    rows = []
    for label in ("before", "after"):
        s = report.get(label) or {}
        rows.append([label] + [_figure(f"graph.{label}.{k}", s.get(k), f"{s.get(k, 0):,}")
                               for k in ("nodes", "batchnorms", "dropouts", "parameters")])
    out = [f"<h2>Graph before and after the passes (capture: {_e(report.get('capture_mode'))})</h2>",
           _table(["", "nodes", "BatchNorms", "dropouts", "parameters"], rows, "graph")]
    folds, left = [], []
    for p in report.get("passes") or []:
        for change in p.get("changed") or []:
            details = ", ".join(f"{k}: {v}" for k, v in change.items() if k not in ("node", "what"))
            folds.append([_e(p.get("name")), _e(change.get("node")), _e(change.get("what")), _e(details)])
        for skip in p.get("skipped") or []:
            left.append([_e(p.get("name")), _e(skip.get("node")), _e(skip.get("reason"))])
    left += [["(still in the graph)", _e(r.get("node")), _e(r.get("reason"))]
             for r in report.get("remaining_batchnorms") or []]
    out.append(f"<h3>What the passes changed ({len(folds)})</h3>")
    out.append(_table(["pass", "node", "what", "details"], folds, "changed") if folds else "<p>nothing</p>")
    out.append(f"<h3>Left, each with its reason ({len(left)})</h3>")
    out.append(_table(["pass", "node", "reason"], left, "left") if left else "<p>nothing left</p>")
    return "".join(out)


def _parity(manifest: Manifest) -> str:
    parity = manifest.parity
    out = ["<h2>Parity</h2>"]
    if parity is None:
        return out[0] + "<p class='muted'>not checked (parity.enabled: false)</p>"
    rows = [[_e(k), _figure(f"parity.{k}", v), _num(parity.thresholds.get(k)) if k in parity.thresholds else ""]
            for k, v in parity.metrics.items()]
    out.append(_table(["figure (fused model against the original, on validation batches)", "value", "threshold"],
                      rows, "parity"))
    out += [f"<p class='fail'>{_e(f)}</p>" for f in parity.failures]
    if parity.outputs:
        out.append(_per_output(parity.outputs))
    errors = [(name, e.check.relative_error, e.check.tolerance) for name, e in manifest.formats.items()
              if e.check is not None and _finite(e.check.relative_error)]
    if errors:
        out.append("<h3>Relative error of each artifact against the fp64 reference (check.pt), and what it may be"
                   "</h3>" + _error_strip(errors, parity.metrics.get("relative_max_error")))
    return "".join(out)


def _per_output(outputs: Sequence[OutputError]) -> str:
    """Each output's relative error and its samples' quantiles (a table), and their distribution (a plot each)."""
    names = list(dict.fromkeys(q for o in outputs for q in o.quantiles))
    rows = [[_e(o.name), _e("x".join(map(str, o.shape)) or "-"), str(o.samples),
             _figure(f"parity.output.{o.name}.relative_max_error", o.relative_max_error)]
            + [_figure(f"parity.output.{o.name}.{q}", o.quantiles.get(q)) for q in names] for o in outputs]
    return ("<h3>Each output: its relative error and its samples' errors</h3><p class='muted'>a sample's error: its "
            "max|fused - reference| over the output's max|reference| on every batch (so the largest is the output's)"
            "</p>"
            + _table(["output", "shape (first batch)", "samples", "relative error"] + names, rows, "parity.outputs")
            + "<div class='plots'>" + "".join(error_histogram_svg(o) for o in outputs) + "</div>")


def error_histogram_svg(output: OutputError, width: int = 340, height: int = 150) -> str:
    """How ``output``'s samples' relative errors spread: a bar per log-spaced bin (a log axis: errors span decades),
    and one for the samples exactly equal to the reference. Each bar carries ``data-count``."""
    key = f"parity.output.{output.name}"
    bars = ([("0", output.zeros)] if output.zeros else []) + [
        (f"{_num(lo)} to {_num(hi)}", c) for lo, hi, c in zip(output.edges, output.edges[1:], output.counts)]
    if not bars:
        return f'<p class="muted" data-plot="{_e(key)}">{_e(output.name)}: no sample to draw</p>'
    left, right, top, bottom = 40, 10, 24, 34
    plot_w, plot_h = width - left - right, height - top - bottom
    step, peak = plot_w / len(bars), max(c for _, c in bars) or 1
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'data-plot="{_e(key)}" viewBox="0 0 {width} {height}"><title>{_e(output.name)}</title>',
           f'<text x="{left}" y="16" font-size="13" font-weight="600">{_e(output.name)}: samples by relative '
           f'error</text>',
           f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#444"/>',
           f'<text x="{left - 6}" y="{top + 10}" font-size="11" text-anchor="end">{peak}</text>']
    for i, (label, count) in enumerate(bars):
        h = plot_h * count / peak
        colour = "#2ca02c" if label == "0" else "#1f77b4"
        out.append(f'<rect x="{left + i * step + 1:.1f}" y="{top + plot_h - h:.1f}" width="{max(step - 2, 1):.1f}" '
                   f'height="{h:.1f}" fill="{colour}" data-count="{count}"><title>{_e(label)}: {count} sample(s)'
                   f'</title></rect>')
    ends = (output.edges[0], output.edges[-1]) if output.edges else None
    if ends is not None:  # the log axis' ends, under the first and the last bin
        first = left + (step if output.zeros else 0)
        out.append(f'<text x="{first:.1f}" y="{top + plot_h + 14}" font-size="11">{_num(ends[0])}</text>'
                   f'<text x="{left + plot_w:.1f}" y="{top + plot_h + 14}" font-size="11" text-anchor="end">'
                   f'{_num(ends[1])}</text>')
    if output.zeros:
        out.append(f'<text x="{left + step / 2:.1f}" y="{top + plot_h + 14}" font-size="11" '
                   f'text-anchor="middle">0</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 6}" font-size="11" text-anchor="middle">relative error '
               f'(log bins)</text></svg>')
    return "".join(out)


def _finite(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value)


def _error_strip(errors: Sequence[Tuple[str, float, Optional[float]]], fused: Optional[float]) -> str:
    """The relative errors on a log axis: each artifact's (dot) and its tolerance (tick), the fused model's (line)."""
    fused = fused if _finite(fused) else None
    values = [v for _, e, t in errors for v in (e, t) if _finite(v) and v > 0] + ([fused] if fused else [])
    lo = math.floor(math.log10(max(min(values, default=1e-9), 1e-16)))
    hi = max(math.ceil(math.log10(max(values, default=1.0))), lo + 1)
    width, left, row = 640, 150, 22
    height = row * len(errors) + 40

    def px(v: float) -> float:
        return left + (width - left - 20) * (math.log10(max(v, 10.0 ** lo)) - lo) / (hi - lo)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" data-plot="errors">']
    for k in range(lo, hi + 1):
        out.append(f'<line x1="{px(10.0 ** k):.1f}" y1="10" x2="{px(10.0 ** k):.1f}" y2="{height - 24}" '
                   f'stroke="#eee"/><text x="{px(10.0 ** k):.1f}" y="{height - 10}" font-size="11" '
                   f'text-anchor="middle">1e{k}</text>')
    if fused:
        out.append(f'<line x1="{px(fused):.1f}" y1="10" x2="{px(fused):.1f}" y2="{height - 24}" stroke="#999" '
                   f'stroke-dasharray="4 3"><title>parity: fused model {_num(fused)}</title></line>')
    for i, (name, error, tolerance) in enumerate(errors):
        y = 20 + row * i
        out.append(f'<text x="{left - 8}" y="{y + 4}" font-size="11" text-anchor="end">{_e(name)}</text>')
        if _finite(tolerance) and tolerance:
            out.append(f'<line x1="{px(tolerance):.1f}" y1="{y - 7}" x2="{px(tolerance):.1f}" y2="{y + 7}" '
                       f'stroke="#c62828" stroke-width="2"><title>allowed {_num(tolerance)}</title></line>')
        out.append(f'<circle cx="{px(error):.1f}" cy="{y}" r="4" fill="#1f77b4" data-series="{_e(name)}" '
                   f'data-y="{error!r}"><title>{_e(name)}: {_num(error)}</title></circle>')
    return "".join(out) + "</svg>"


def _artifacts(manifest: Manifest) -> str:
    bench = manifest.bench
    rows = []
    baselines = dict.fromkeys(t.artifact for t in (bench.timings if bench else []) if t.artifact not in manifest.formats)
    for name in baselines:  # the unfused model, timed beside the artifacts: what the speed-ups are against
        rows.append([f"{_e(name)} <span class='muted'>(the unfused model)</span>", "-", "-", "-",
                     _timings(manifest, name)])
    for name, entry in manifest.formats.items():
        size = sum(manifest.files[f].size for f in entry.files if f in manifest.files)
        check = entry.check if entry.check is not None else (bench.checks.get(name) if bench else None)
        check_text = (f"{_verdict(check.passed)} (rel. error {_figure(f'check.{name}', check.relative_error)}"
                      f", allowed {_num(check.tolerance)})" if check is not None else _verdict(None))
        gate = entry.gate
        gate_text = (f"{_verdict(gate.passed)} " + ", ".join(f"{k} {_num(v)}" for k, v in gate.metrics.items()
                                                            if k in ("top1_agreement", "cosine_similarity_min",
                                                                     "accuracy_drop"))) if gate else "-"
        rows.append([_e(name), f"{size / 1e6:.2f} MB", check_text, gate_text, _timings(manifest, name)])
    out = ["<h2>Artifacts: each with its check, its gate and its timings</h2>",
           _table(["artifact", "size", "check (round trip)", "gate (lossy variants)", "median latency"], rows,
                  "artifacts")]
    dropped = [[_e(o.entry), _e(o.skipped or o.error or ("missed its gate: " + "; ".join(
        str(f) for f in (o.gate.failures if o.gate else []))))] for outs in manifest.variants.values() for o in outs
               if not o.kept]
    dropped += [[_e(n), _e(r)] for n, r in manifest.failed_formats.items()]
    if dropped:
        out.append("<h3>Not in the export</h3>" + _table(["artifact", "why"], dropped, "dropped"))
    return "".join(out)


def _timings(manifest: Manifest, name: str) -> str:
    timings = [t for t in (manifest.bench.timings if manifest.bench else []) if t.artifact == name]
    return "<br>".join(
        f"batch {t.batch_size}, {_e(t.traffic)}{f' ({_e(t.runtime)})' if t.runtime else ''}: "
        f"{_figure(f'timing.{name}.{t.batch_size}.{t.traffic}.{t.runtime}', t.median_ms)} ms"
        for t in sorted(timings, key=lambda t: (t.batch_size, t.traffic, t.runtime))) or "-"


def _sweeps(manifest: Manifest) -> str:
    bench = manifest.bench
    out = ["<h2>Batch-size sweep: latency and throughput against batch size</h2>"]
    if bench is None or not bench.sweeps:
        return out[0] + "<p class='muted'>no sweep in this export (export.select: fastest runs one)</p>"
    for traffic in dict.fromkeys(w.traffic for w in bench.sweeps):
        plots = sweep_series(bench.sweeps, traffic)
        out.append(f"<h3>{_e(traffic)} traffic</h3><div class='plots'>"
                   + sweep_svg(f"latency ({traffic})", "batch size", "ms per call (p50, p99 dashed)",
                               plots["latency"], f"latency.{traffic}")
                   + sweep_svg(f"throughput ({traffic})", "batch size", "samples/s", plots["throughput"],
                               f"throughput.{traffic}") + "</div>")
    stops = [[_e(_sweep_name(w)), _e(w.traffic), _e(w.stop)] for w in bench.sweeps]
    return "".join(out) + "<h3>Why each sweep stopped</h3>" + _table(["artifact", "traffic", "stopped"], stops, "stops")


def _machine(manifest: Manifest) -> str:
    bench = manifest.bench
    rows = []
    if bench is not None:
        rows += [["CPU", _e(bench.cpu or bench.machine)], ["instruction set (torch)", _e(bench.isa)],
                 ["threads", str(bench.threads)]]
    rows += [[_e(k), _e(v)] for k, v in manifest.versions.items() if v]
    return "<h2>CPU and versions</h2>" + _table(["", ""], rows, "machine")


def render_report(manifest: Manifest, title: str = "fx-lightning export") -> str:
    """The whole page for ``manifest``: the decisions first (folded/left, parity, what is served and how fast),
    then the graph, parity, every artifact, the sweep's plots, the CPU and versions."""
    notes = "".join(f"<li>{_e(n)}</li>" for n in manifest.notes)
    body = [f"<h1>{_e(title)}</h1><p class='muted'>created {_e(manifest.created_utc)} (UTC); manifest format "
            f"{manifest.format_version}</p>", _decisions(manifest), _graph(manifest), _parity(manifest),
            _artifacts(manifest), _sweeps(manifest), _machine(manifest)]
    if notes:
        body.append(f"<h2>Notes</h2><ul>{notes}</ul>")
    # The CSP forbids any request (fonts, images, scripts): the file must stand alone.
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'\">"
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>" + "".join(body) + "</body></html>\n")


def figures(manifest: Manifest) -> Mapping[str, float]:
    """The figures the page shows as numbers, by their ``data-key`` (what the tests compare the page with)."""
    report = manifest.report or {}
    out: Dict[str, float] = {}
    if report:
        out["batchnorms_folded"] = float(report.get("batchnorms_folded", 0))
        out["batchnorms_left"] = float((report.get("after") or {}).get("batchnorms", 0))
    if manifest.parity is not None:
        out.update({f"parity.{k}": float(v) for k, v in manifest.parity.metrics.items()})
        for o in manifest.parity.outputs:
            out[f"parity.output.{o.name}.relative_max_error"] = o.relative_max_error
            out.update({f"parity.output.{o.name}.{q}": v for q, v in o.quantiles.items()})
    if manifest.selected is not None:
        out["selected.median_ms"] = manifest.selected.median_ms
    for t in manifest.bench.timings if manifest.bench else []:
        out[f"timing.{t.artifact}.{t.batch_size}.{t.traffic}.{t.runtime}"] = t.median_ms
    return out
