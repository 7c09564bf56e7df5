"""Real models, fx-lightning against torch.fx's ``fuse``: the zoo of tests/zoo_models.py (51 small models from
timm, torchvision, segmentation_models_pytorch, MONAI and transformers; random weights, randomised BatchNorm
statistics), each fused by both with their defaults, judged against an fp64 copy of the original.

    python benchmarks/real_models.py            # writes benchmarks/results/real_models.md and .json

Per model: BatchNorms before (module calls and batch_norm calls in the captured graph, BatchNorm-like
modules traced into arithmetic included), left after, why they were left (fx-lightning's report, grouped),
and the relative error max|fused - ref| / max|ref| beside the unfused fp32 model's own error. torch.fx's
``fuse`` is counted on its own graph the same way; "crash" is when it raises, "WRONG" when its output is
more than 1e-3 (relative) away from the reference, or raises when called.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch.fx.experimental.optimization import fuse as torch_fx_fuse

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))
from fusion_helpers import randomize_batchnorms  # noqa: E402
from zoo_models import ZOO  # noqa: E402

import fx_lightning  # noqa: E402
from fx_lightning.common.batches import flat_tensors  # noqa: E402
from fx_lightning.passes.bn_views import is_batchnorm_node  # noqa: E402
from fx_lightning.capture.fuse_report import reason_kind  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _error(out: Any, ref: Any) -> float:
    pairs = [(o, r) for o, r in zip(flat_tensors(out), flat_tensors(ref)) if r.is_floating_point()]
    return max(float((o.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30)) for o, r in pairs)


def _bn_nodes(gm: Any) -> int:
    return sum(1 for n in gm.graph.nodes if is_batchnorm_node(gm, n))


def one(name: str) -> Dict[str, Any]:
    library, build = ZOO[name]
    model, inputs = build()
    randomize_batchnorms(model).eval()
    with torch.no_grad():
        base = model(*inputs)
        try:
            ref = copy.deepcopy(model).double()(*(x.double() for x in inputs))
        except RuntimeError:
            ref = base
    row: Dict[str, Any] = {"model": name, "library": library, "unfused_error": _error(base, ref)}
    start = time.perf_counter()
    result = fx_lightning.fuse(model, example_inputs=inputs)
    row["seconds"] = time.perf_counter() - start
    with torch.no_grad():
        row["error"] = _error(result.graph_module(*inputs), ref)
    report = result.report
    row.update(capture=report.capture_mode, before=report.before.batchnorms, after=report.after.batchnorms,
               reasons=dict(Counter(reason_kind(r.reason) for r in report.remaining_batchnorms)))
    row["torch_fx"] = _torch_fx(model, inputs, ref)
    return row


def _torch_fx(model: Any, inputs: tuple, ref: Any) -> Dict[str, Any]:
    try:
        gm = torch_fx_fuse(copy.deepcopy(model))
    except Exception as exc:  # noqa: BLE001
        return {"status": "crash", "why": f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"}
    try:
        with torch.no_grad():
            err = _error(gm(*inputs), ref)
    except Exception as exc:  # noqa: BLE001
        return {"status": "WRONG", "why": f"fused module raises {type(exc).__name__}"}
    left = _bn_nodes(gm) + sum(1 for m in gm.modules() if type(m).__name__.endswith("FrozenBatchNormAct2d"))
    return {"status": "WRONG" if err > 1e-3 else "ok", "left": left, "error": err}


def markdown(rows: List[Dict[str, Any]]) -> str:
    by_lib: Dict[str, List[Dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_lib[r["library"]].append(r)
    lines = ["| library | models | BatchNorms | fx-lightning: folded | left | worst error (fp32 model's) | "
             "torch.fx `fuse`: folded | crashed | wrong output |", "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for lib, rs in by_lib.items():
        bn = sum(r["before"] for r in rs)
        left = sum(r["after"] for r in rs)
        worst = max(rs, key=lambda r: r["error"] / max(r["unfused_error"], 1e-12))
        ok = [r for r in rs if r["torch_fx"]["status"] == "ok"]
        tfx_folded = sum(r["before"] - r["torch_fx"]["left"] for r in ok)
        lines.append(f"| {lib} | {len(rs)} | {bn} | {bn - left} | {left} | {worst['error']:.1e} "
                     f"({worst['unfused_error']:.1e}) | {tfx_folded} | "
                     f"{sum(r['torch_fx']['status'] == 'crash' for r in rs)} | "
                     f"{sum(r['torch_fx']['status'] == 'WRONG' for r in rs)} |")
    lines += ["", "Left by fx-lightning, all models, by reason:", ""]
    reasons: Counter = Counter()
    for r in rows:
        reasons.update(r["reasons"])
    lines += [f"- {n} x {k}" for k, n in reasons.most_common()]
    lines += ["", "| model | capture | BatchNorms | left | error (fp32 model's) | torch.fx `fuse` |", "|---|---|---:|---:|---|---|"]
    for r in rows:
        t = r["torch_fx"]
        tfx = f"{t['status']}" + (f", {r['before'] - t['left']} folded" if t["status"] == "ok" else f" ({t['why']})")
        lines.append(f"| {r['model']} | {r['capture']} | {r['before']} | {r['after']} | {r['error']:.1e} "
                     f"({r['unfused_error']:.1e}) | {tfx} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    torch.set_num_threads(1)
    names = sys.argv[1:] or list(ZOO)
    rows = []
    for name in names:
        rows.append(one(name))
        r = rows[-1]
        print(f"{name:55s} {r['capture']:6s} {r['before']:4d} -> {r['after']:3d}  err {r['error']:.1e}  "
              f"torch.fx: {r['torch_fx']['status']}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "real_models.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "real_models.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
