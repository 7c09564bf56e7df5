"""Peak memory while fusing: fx-lightning's ``fuse()`` vs torch.fx's ``fuse``, as a multiple of the model.

Each measurement runs in a fresh subprocess, so one run's peak (or allocator state) cannot leak into the
next. The child builds the model (``weights=None``, BatchNorm statistics randomised so nothing folds to an
identity), records its resident set size, resets the kernel's high-water mark (``/proc/self/clear_refs``
<- "5" resets ``VmHWM``), fuses, and reads ``VmHWM``. The figure reported is

    extra peak = VmHWM during fuse - VmRSS before fuse,   as a multiple of the model's parameter+buffer bytes.

The fused result itself is one model's worth of weights, so 1.0x is the floor for any fuser that returns a
new model; fx-lightning's target is <= 2.5x (the original, one working copy and slack). Linux only.

    python benchmarks/memory.py                                  # README table: resnet50, wide_resnet101_2
    python benchmarks/memory.py --models resnet18 --variants fx_lightning torch_fx_fuse   # quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

MODELS = ["resnet50", "wide_resnet101_2"]
# name -> what it runs (the child's dispatch below); the README table shows them in this order.
VARIANTS: Dict[str, str] = {
    "fx_lightning": "fx_lightning.fuse(model)",
    "fx_lightning_inputs": "fx_lightning.fuse(model, example_inputs=x)  (x: 1x3x224x224, as the callback does)",
    "fx_lightning_export": "fx_lightning.fuse(model, {'trace': {'mode': 'export'}}, example_inputs=x)",
    "torch_fx_fuse": "torch.fx.experimental.optimization.fuse(model)",
}
DEFAULT_VARIANTS = list(VARIANTS)
TARGET = 2.5
RESULTS = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------------------- the child


def read_status() -> Dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out: Dict[str, int] = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def tensor_bytes(module: Any) -> int:
    """Bytes of a module's parameters and buffers (each storage counted once)."""
    import itertools

    seen: Dict[int, int] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(model_name: str, variant: str, threads: int) -> Dict[str, Any]:
    """One measurement in this (fresh) process."""
    import torch
    import torchvision

    import fx_lightning
    from torch.fx.experimental.optimization import fuse as torch_fx_fuse

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = torchvision.models.get_model(model_name, weights=None).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1.0, 1.0)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    x = torch.randn(1, 3, 224, 224)
    param_bytes = tensor_bytes(model)

    gc.collect()
    before = read_status()["VmRSS"]
    reset_peak()
    if read_status()["VmHWM"] > before + (8 << 20):
        raise RuntimeError("writing 5 to /proc/self/clear_refs did not reset VmHWM")
    start = time.perf_counter()
    if variant == "fx_lightning":
        fused = fx_lightning.fuse(model).graph_module
    elif variant == "fx_lightning_inputs":
        fused = fx_lightning.fuse(model, example_inputs=x).graph_module
    elif variant == "fx_lightning_export":
        fused = fx_lightning.fuse(model, {"trace": {"mode": "export"}}, example_inputs=x).graph_module
    elif variant == "torch_fx_fuse":
        fused = torch_fx_fuse(model)
    else:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    seconds = time.perf_counter() - start
    after = read_status()
    # Sanity: the fused model computes what the original does (a wrong fuser could be cheap).
    with torch.no_grad():
        ref, out = model(x), fused(x)
    rel_err = float((out - ref).abs().max() / ref.abs().max())
    return {
        "model": model_name,
        "variant": variant,
        "param_bytes": param_bytes,
        "fused_param_bytes": tensor_bytes(fused),
        "rss_before": before,
        "extra_peak_bytes": after["VmHWM"] - before,
        "extra_retained_bytes": after["VmRSS"] - before,
        "extra_peak_x": (after["VmHWM"] - before) / param_bytes,
        "extra_retained_x": (after["VmRSS"] - before) / param_bytes,
        "seconds": seconds,
        "max_rel_err": rel_err,
    }


# ------------------------------------------------------------------------------------------ the parent


def run_child(model: str, variant: str, threads: int, timeout: float) -> Dict[str, Any]:
    """Run one measurement in a fresh interpreter and return its JSON line."""
    cmd = [sys.executable, __file__, "--child", model, variant, "--threads", str(threads)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{model}/{variant} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    lines = [
        "| model | params+buffers | fuser | extra peak RSS | × model bytes | kept after | fuse time |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['param_bytes'] / 2**20:.0f} MiB | {r['variant']} | "
            f"{r['extra_peak_bytes'] / 2**20:.0f} MiB | **{r['extra_peak_x']:.2f}×** | "
            f"{r['extra_retained_x']:.2f}× | {r['seconds']:.1f} s |"
        )
    lines += [
        "",
        f"Extra peak = VmHWM during the call − VmRSS before it, each run in a fresh process "
        f"(`python benchmarks/memory.py`); target ≤ {TARGET}×. The result itself is 1.0× of that. "
        "\"kept after\": RSS still above the baseline when the call returns, with the result alive. "
        f"torch {meta['torch']}, torchvision {meta['torchvision']}, Python {meta['python']}, "
        f"{meta['machine']}, {meta['threads']} thread(s).",
        "",
        "Fusers: " + "; ".join(f"`{k}`: `{VARIANTS[k]}`" for k in meta["variants"]) + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each child (default 1)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per child")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for memory.json / memory.md")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.threads)))
        return 0
    if not os.path.exists("/proc/self/clear_refs"):
        print("benchmarks/memory.py needs Linux (/proc/self/clear_refs to reset the peak RSS)", file=sys.stderr)
        return 2

    import torch
    import torchvision
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))
    rows: List[Dict[str, Any]] = []
    for model in args.models:
        for variant in args.variants:
            with console.status(f"{model} / {variant}"):
                rows.append(run_child(model, variant, args.threads, args.timeout))

    table = Table(title="Extra peak RSS while fusing (× the model's parameter+buffer bytes)")
    for col in ("model", "MiB", "fuser", "extra peak MiB", "× model", "kept after ×", "seconds", "max rel err"):
        table.add_column(col, justify="left" if col in ("model", "fuser") else "right")
    for r in rows:
        over = r["variant"].startswith("fx_lightning") and r["extra_peak_x"] > TARGET
        table.add_row(
            r["model"], f"{r['param_bytes'] / 2**20:.0f}", r["variant"], f"{r['extra_peak_bytes'] / 2**20:.0f}",
            f"[red]{r['extra_peak_x']:.2f}[/red]" if over else f"{r['extra_peak_x']:.2f}",
            f"{r['extra_retained_x']:.2f}", f"{r['seconds']:.1f}", f"{r['max_rel_err']:.1e}",
        )
    console.print(table)

    meta = {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}",
        "threads": args.threads,
        "target_x": TARGET,
        "variants": args.variants,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    (args.out / "memory.md").write_text(markdown(rows, meta))
    console.print(f"wrote {args.out / 'memory.json'} and {args.out / 'memory.md'}")
    failed = [r for r in rows if r["variant"].startswith("fx_lightning") and r["extra_peak_x"] > TARGET]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
