"""NVIDIA's Triton Model Navigator (``triton-model-navigator`` 0.14.0) against fx-lightning's serving preset on CPU,
on the trained models of ``digits.py`` (resnet18 and mobilenet_v3_large trained on scikit-learn's digits upsampled
to 224x224), each tool picking its own artifacts and one harness timing the picks.

- Navigator as its users run it on a machine without GPU: ``nav.torch.optimize(model, dataloader,
  target_device=nav.DeviceKind.CPU)`` (its default target device is CUDA) with everything else at its defaults
  (target formats, CPU runners, ``sample_count``, ``OptimizationProfile()``), the dataloader the 359 held-out
  digits one image per item (Navigator keeps the first image of each item for its checks, so single images let it
  check the most: ``sample_count`` of them, 100 by default). Recorded: the wall time of the call; every format and
  runner it made; which passed its correctness check (output differences against the source model on the
  dataloader's samples) and its profiling; its picks with its own strategies, ``MinLatencyStrategy``,
  ``MaxThroughputStrategy`` and ``MaxThroughputWithLatencyBudgetStrategy`` (budget ``--latency-budget-ms``,
  default twice its min latency); and how far its reference outputs are from the fp32 model's.
- fx-lightning: ``serving.py``'s export with ``configs/fx_fuse/serving.yaml`` into
  ``benchmarks/results/cache/exports/<model>`` (kept for ``peer_defaults.py``), timed; ``--reuse-export`` keeps
  an export already there (its time is then not measured). Its min-latency pick is
  ``load_fused(dir, batch_size=1, traffic=t)``; its max-throughput pick the ``selections`` entry of
  ``manifest.json`` with ``"strategy": "max_throughput"`` (loaded with ``load_artifact``); an export that recorded
  none falls back to the min-latency pick at the largest batch size recorded, labelled as a fallback.

One harness then times every pick, each in a fresh process of its own (``--repeats`` processes per pick,
interleaved in shuffled order; figures are the median over the processes), with ``--threads`` torch threads and
every runtime's other settings as the tool configured them; on a machine with more CPUs than ``--threads`` each
process is confined to that many CPUs (``--no-pin``: not). ONNX Runtime's default session (as Navigator's OnnxCPU
runner makes it) sizes its thread pool by the machine's physical cores whatever the affinity, so the figures are
cleanest on a machine with ``--threads`` cores; each process records its OS thread count. Navigator's
picks run through ``package.get_runner(strategies=[...])`` and ``runner.infer`` (the runner its PyTritonAdapter
serves).
Measured: batch-1 latency of the min-latency pick (median and p99 of ``--calls`` calls) back to back and with a
20 ms idle gap before each call, and a back-to-back throughput sweep of the max-throughput pick over batch sizes
1, 2, 4, ... until samples per second grow by less than 5% over the previous size (the pick's figure is the best
point); the held-out accuracy of each pick, by the same harness.

Navigator runs in a virtual environment of its own, ``benchmarks/results/cache/venv-navigator`` (ignored by git;
``.venv`` is left alone): ``--setup`` makes it with the pins of ``constraints.txt``::

    python -m venv benchmarks/results/cache/venv-navigator
    V=benchmarks/results/cache/venv-navigator/bin/python
    $V -m pip install -c constraints.txt -e ".[vision,onnx,openvino,int8]" scikit-learn
    $V -m pip install --no-deps triton-model-navigator==0.14.0
    $V -m pip install -c constraints.txt <its requirements that fit the pins: NAVIGATOR_DEPS below>

Navigator 0.14.0 requires ``numpy<2``, ``packaging~=24.1``, ``onnxruntime-gpu``, ``tensorrt``,
``nvidia-modelopt[onnx]`` and ``tritonclient[grpc]`` (which wants ``protobuf<7``); the pins have numpy 2.4.6,
packaging 26.3, onnxruntime 1.31.1 and protobuf 7.36.2. The venv keeps the pins (so both tools run the same torch,
ONNX Runtime and OpenVINO) and leaves out the GPU-only packages: with ``target_device=CPU`` Navigator builds no
TensorRT or Torch-TensorRT step and needs neither (``model_navigator/pipelines/builders``; it imports them only
when installed). Every run of
Navigator and of the harness uses that venv's Python (``--python`` to change it); this script itself runs in any
environment with fx-lightning.

    python benchmarks/navigator.py --setup                               # once: the venv (a few minutes)
    python benchmarks/navigator.py                                       # both models, the full measurement
    python benchmarks/navigator.py --models resnet18 --calls 100 --repeats 1
    python benchmarks/navigator.py --models resnet18 --quick --reuse-export   # smoke run: tiny settings
    python benchmarks/navigator.py --render                              # the tables again from the JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from digits import CACHE, digits_splits, to_model_input, trained_model  # benchmarks/digits.py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENV = CACHE / "venv-navigator"
EXPORTS = CACHE / "exports"  # serving.py's
WORKSPACES = CACHE / "navigator"  # Navigator's workspaces, the workers' results and logs
MODELS = ["resnet18", "mobilenet_v3_large"]
TOOLS = ["navigator", "fx-lightning"]
TRAFFICS = ["back_to_back", "idle"]
GAP_S = 0.02
GROWTH = 0.05  # the sweep stops when samples/s grow by less than this over the previous batch size
MAX_CALL_S = 5.0  # ... or when one call takes longer
NAVIGATOR_VERSION = "0.14.0"
# triton-model-navigator 0.14.0's requirements that fit constraints.txt (its metadata, less numpy<2,
# packaging~=24.1, onnxruntime-gpu, tensorrt, nvidia-modelopt and tritonclient's grpc extra: see the docstring).
NAVIGATOR_DEPS = ["dacite~=1.8", "fire>=0.4.0", "jsonlines>=3.1.0", "loguru>=0.7.2", "mpmath~=1.3", "onnx~=1.16",
                  "onnx_graphsurgeon~=0.5", "onnxscript", "polygraphy>=0.49.0", "psutil>=5.7", "py-cpuinfo>=8.0",
                  "pynvml~=11.5", "python-slugify~=8.0", "pyyaml~=6.0", "tabulate>=0.8", "wrapt>=1.16",
                  "pyee>=11.1.0", "rich>=13.7.1", "tritonclient~=2.47", "grpcio"]


@dataclass
class Settings:
    """How long each measurement runs; ``--quick`` shrinks everything to prove the script works end to end."""

    calls: int = 200  # batch-1 calls per traffic
    warmup: int = 20
    sweep_s: float = 2.0  # timed seconds per batch size of the sweep
    sweep_min_calls: int = 5
    sweep_warmup: int = 3
    max_batch: int = 256
    repeats: int = 3  # processes per pick
    nav_batch: int = 1  # Navigator's dataloader: held-out batches of this size (it checks the first of each)
    nav_batches: Optional[int] = None  # ... this many (None: the whole held-out split)
    nav_profile: Optional[Dict[str, Any]] = None  # OptimizationProfile(**this); None: Navigator's defaults
    nav_sample_count: Optional[int] = None  # None: Navigator's default (100)


QUICK = Settings(calls=10, warmup=2, sweep_s=0.2, sweep_min_calls=2, sweep_warmup=1, max_batch=4, repeats=1,
                 nav_batch=1, nav_batches=4,
                 nav_profile={"max_batch_size": 4, "window_size": 3, "min_trials": 2, "stabilization_windows": 2,
                              "max_trials": 3, "stability_percentage": 100.0})


# ------------------------------------------------------------------------------------------------- the harness


def _nearest_rank(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def time_batch1(run: Callable[[torch.Tensor], Any], x: torch.Tensor, traffic: str, s: Settings) -> Dict[str, float]:
    """Batch-1 latency: ``s.warmup`` calls, then ``s.calls`` timed ones, each after a 20 ms gap when idle."""
    for _ in range(s.warmup):
        run(x)
    times = []
    for _ in range(s.calls):
        if traffic == "idle":
            time.sleep(GAP_S)
        start = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - start)
    return {"median_ms": 1e3 * statistics.median(times), "p99_ms": 1e3 * _nearest_rank(times, 0.99),
            "calls": len(times)}


def throughput_sweep(run: Callable[[torch.Tensor], Any], images: torch.Tensor, size: int, s: Settings
                     ) -> Dict[str, Any]:
    """Back to back at batch sizes 1, 2, 4, ...: each timed for ``s.sweep_s`` (at least ``s.sweep_min_calls``
    calls) after ``s.sweep_warmup`` calls; stops when samples/s grew by less than 5% over the previous size, at
    ``s.max_batch``, when a call takes longer than 5 s or where the artifact raises."""
    points: List[Dict[str, float]] = []
    batch, stop = 1, ""
    while True:
        index = torch.arange(batch) % len(images)
        x = to_model_input(images[index], size)
        try:
            for _ in range(s.sweep_warmup):
                run(x)
            times: List[float] = []
            start = time.perf_counter()
            while len(times) < s.sweep_min_calls or time.perf_counter() - start < s.sweep_s:
                t0 = time.perf_counter()
                run(x)
                times.append(time.perf_counter() - t0)
                if times[-1] > MAX_CALL_S:
                    break
        except Exception as exc:  # noqa: BLE001 - a runtime that refuses a batch size ends the sweep there
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            stop = f"raised at batch {batch}: {type(exc).__name__}: {first}"
            break
        points.append({"batch": batch, "p50_ms": 1e3 * statistics.median(times),
                       "p99_ms": 1e3 * _nearest_rank(times, 0.99), "samples_per_s": batch * len(times) / sum(times),
                       "calls": len(times)})
        if len(points) > 1 and points[-1]["samples_per_s"] < (1 + GROWTH) * points[-2]["samples_per_s"]:
            stop = f"samples/s grew by less than {100 * GROWTH:.0f}% from batch {points[-2]['batch']} to {batch}"
            break
        if statistics.median(times) > MAX_CALL_S:
            stop = f"a call at batch {batch} took more than {MAX_CALL_S:.0f} s"
            break
        if 2 * batch > s.max_batch:
            stop = f"reached the largest batch size swept ({s.max_batch})"
            break
        batch *= 2
    best = max(points, key=lambda p: (p["samples_per_s"], -p["batch"])) if points else None
    return {"points": points, "best": best, "stop": stop}


def held_out_accuracy(run: Callable[[torch.Tensor], Any], size: int) -> float:
    _, held_out = digits_splits()
    correct = 0
    for x, y in held_out.batches(32, size):
        correct += int((_logits(run(x)).argmax(1) == y).sum())
    return correct / len(held_out.labels)


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, dict):
        out = next(iter(out.values()))
    if isinstance(out, (list, tuple)):
        out = out[0]
    return torch.as_tensor(out).float()


def _pick_runner(tool: str, model_name: str, pick: str, traffic: str, size: int, fx_entry: Optional[Dict]
                 ) -> Tuple[Callable[[torch.Tensor], Any], str]:
    """The tool's pick as a callable on a batch of images, and what it is."""
    if tool == "fx-lightning":
        root = EXPORTS / model_name
        if pick == "min_latency":
            from fx_lightning import load_fused
            from fx_lightning.export import read_manifest
            from fx_lightning.export.load.loader import selection_for

            module = load_fused(root, batch_size=1, traffic=traffic)
            chosen = selection_for(read_manifest(root), 1, traffic)
            label = _fx_label(dataclasses.asdict(chosen)) if chosen is not None else "default format"
        else:
            from fx_lightning.export import read_manifest
            from fx_lightning.export.load.loader import load_artifact

            assert fx_entry is not None
            module = load_artifact(root, read_manifest(root), fx_entry["format"], runtime=fx_entry.get("runtime", ""))
            label = _fx_label(fx_entry)
        torch.set_grad_enabled(False)
        return (lambda x: module(x)), label
    import model_navigator as nav
    from model_navigator.utils.format_helpers import is_source_format

    package = nav.package.load_from_workspace(WORKSPACES / model_name)
    strategy = {"min_latency": nav.MinLatencyStrategy(), "max_throughput": nav.MaxThroughputStrategy()}[pick]
    best = package.get_best_runtime(strategies=[strategy])
    if is_source_format(best.model_status.model_config.format):
        package.load_source_model(trained_model(model_name, size))
    runner = package.get_runner(strategies=[strategy], device="cpu")
    runner.activate()
    name = next(iter(package.status.input_metadata.keys()))
    label = f"{best.model_status.model_config.key} on {best.runner_status.runner_name}"
    return (lambda x: runner.infer({name: x.numpy()})), label


def _fx_label(entry: Dict[str, Any]) -> str:
    runtime = entry.get("runtime") or ""
    return f"{entry['format']}{' (' + runtime + ')' if runtime else ''}"


def time_worker(tool: str, model_name: str, kind: str, size: int, threads: int, s: Settings,
                fx_entry: Optional[Dict]) -> Dict[str, Any]:
    """One process: ``kind`` "latency" times the min-latency pick at batch 1 in both traffics; "sweep" the
    max-throughput pick over batch sizes. Each loaded artifact's held-out accuracy after its timing."""
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    _, held_out = digits_splits()
    out: Dict[str, Any] = {"tool": tool, "model": model_name, "kind": kind, "threads": torch.get_num_threads(),
                           "cpus": sorted(os.sched_getaffinity(0)), "versions": _versions()}
    if kind == "latency":
        x = to_model_input(held_out.images[:1], size)
        for traffic in TRAFFICS:
            run, label = _pick_runner(tool, model_name, "min_latency", traffic, size, None)
            out[traffic] = {"pick": label, **time_batch1(run, x, traffic, s)}
            out[traffic]["accuracy"] = held_out_accuracy(run, size)
            out[traffic]["os_threads"] = len(os.listdir("/proc/self/task"))
            del run
    else:
        run, label = _pick_runner(tool, model_name, "max_throughput", "back_to_back", size, fx_entry)
        out["sweep"] = {"pick": label, **throughput_sweep(run, held_out.images[:s.max_batch], size, s)}
        out["sweep"]["accuracy"] = held_out_accuracy(run, size)
        out["sweep"]["os_threads"] = len(os.listdir("/proc/self/task"))
    return out


def _versions() -> Dict[str, Optional[str]]:
    from importlib import metadata

    found: Dict[str, Optional[str]] = {"python": sys.executable}
    for name in ("torch", "onnxruntime", "openvino", "numpy", "triton-model-navigator", "fx-lightning"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


# ------------------------------------------------------------------------------------------------ Navigator


def optimise_worker(model_name: str, size: int, threads: int, s: Settings, budget_ms: Optional[float]
                    ) -> Dict[str, Any]:
    """``nav.torch.optimize`` on the held-out batches, timed, then what it made and picked."""
    import model_navigator as nav

    torch.set_num_threads(threads)
    model = trained_model(model_name, size)
    _, held_out = digits_splits()
    dataloader = [x for x, _ in held_out.batches(s.nav_batch, size)][:s.nav_batches]
    workspace = WORKSPACES / model_name
    shutil.rmtree(workspace, ignore_errors=True)
    kwargs: Dict[str, Any] = {}
    if s.nav_profile is not None:
        kwargs["optimization_profile"] = nav.OptimizationProfile(**s.nav_profile)
    if s.nav_sample_count is not None:
        kwargs["sample_count"] = s.nav_sample_count
    out: Dict[str, Any] = {"model": model_name, "versions": _versions(), "target_device": "cpu",
                           "dataloader": {"batches": len(dataloader), "batch_size": s.nav_batch,
                                          "images": sum(len(x) for x in dataloader)},
                           "settings": {"optimization_profile": s.nav_profile or "OptimizationProfile() (defaults)",
                                        "sample_count": s.nav_sample_count or "default (100)"}}
    start = time.perf_counter()
    try:
        package = nav.torch.optimize(model, dataloader, target_device=nav.DeviceKind.CPU, workspace=workspace,
                                     **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported, not hidden: Navigator did not run here
        out["optimise_s"] = time.perf_counter() - start
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-4000:]
        return out
    out["optimise_s"] = time.perf_counter() - start
    out["formats"] = _navigator_formats(package, workspace)
    out["picks"] = _navigator_picks(package, budget_ms)
    out["reference"] = _navigator_reference(model, package, workspace)
    return out


def _navigator_formats(package: Any, workspace: Path) -> List[Dict[str, Any]]:
    formats = []
    for key, model_status in package.status.models_status.items():
        runners = []
        for runner_name, runner_status in model_status.runners_status.items():
            result = runner_status.result or {}
            tolerance = (result.get("Correctness") or {}).get("per_output_tolerance") or {}
            diffs = [(t.atol, t.rtol) for t in tolerance.values()]
            profiling = (result.get("Performance") or {}).get("profiling_results") or []
            failed = [c for c in ("Correctness", "Performance") if _status(runner_status.status.get(c)) == "FAIL"]
            runners.append({
                "runner": runner_name,
                "correctness": _status(runner_status.status.get("Correctness")),
                "performance": _status(runner_status.status.get("Performance")),
                "max_abs_diff": max((d[0] for d in diffs), default=None),
                "max_rel_diff": max((d[1] for d in diffs), default=None),
                "profiling": [{"batch": p.batch_size, "p50_ms": p.p50_latency, "p99_ms": p.p99_latency,
                               "samples_per_s": p.throughput} for p in profiling],
                "errors": _why_failed(workspace, key, runner_name, failed),
            })
        formats.append({"key": key, "format": model_status.model_config.format.value,
                        "made_by": {k: _status(v) for k, v in (model_status.status or {}).items()},
                        "runners": runners})
    return formats


def _why_failed(workspace: Path, key: str, runner_name: str, failed: List[str]) -> List[str]:
    """Why a runner's correctness check or profiling failed: Navigator logs the error of a command it runs in
    its own process (the source model's runners) but drops a child script's output, so for those its own
    reproduction script (``<key>/reproduce_<command>-<runner>.sh``) is run once more and its error read."""
    errors: List[str] = []
    for command in failed:
        script = workspace / key / f"reproduce_{command.lower() if command == 'Correctness' else 'profiling'}-" \
            f"{runner_name.lower()}runner.sh"
        found = [e for e in _log_errors(workspace / key / "format.log") if not e.startswith("model_navigator.")]
        if not found and script.exists():
            try:
                done = subprocess.run(["bash", str(script.relative_to(workspace))], cwd=workspace, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
                found = [f"{e} (its {script.name})" for e in _error_lines(done.stdout)]
            except subprocess.TimeoutExpired:
                found = [f"{script.name} ran past 600 s"]
        errors += [f"{command}: {e}" for e in found or _log_errors(workspace / key / "format.log")]
    return errors


def _status(value: Any) -> Optional[str]:
    return None if value is None else str(getattr(value, "value", value))


def _log_errors(log: Path) -> List[str]:
    """The distinct exception lines of a format's log: why its commands failed."""
    return _error_lines(log.read_text(errors="replace")) if log.exists() else []


def _error_lines(text: str) -> List[str]:
    found: List[str] = []
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z_.]*(?:Error|Exception)): (.+)$", line.strip())
        if match and match.group(0)[:240] not in found:
            found.append(match.group(0)[:240])
    return found[:4]


def _navigator_picks(package: Any, budget_ms: Optional[float]) -> Dict[str, Any]:
    import model_navigator as nav

    picks: Dict[str, Any] = {}
    strategies: List[Tuple[str, Any]] = [("min_latency", nav.MinLatencyStrategy()),
                                         ("max_throughput", nav.MaxThroughputStrategy())]
    for name, strategy in strategies:
        picks[name] = _navigator_pick(package, strategy)
    if budget_ms is None and picks["min_latency"].get("latency_ms"):
        budget_ms = 2 * picks["min_latency"]["latency_ms"]
    if budget_ms is not None:
        picks["max_throughput_budget"] = {
            **_navigator_pick(package, nav.MaxThroughputWithLatencyBudgetStrategy(latency_budget=budget_ms)),
            "budget_ms": budget_ms}
    return picks


def _navigator_pick(package: Any, strategy: Any) -> Dict[str, Any]:
    try:
        best = package.get_best_runtime(strategies=[strategy])
    except Exception as exc:  # noqa: BLE001 - no runtime passed both checks: said in the report
        return {"strategy": str(strategy), "error": f"{type(exc).__name__}: {exc}"}
    profiling = best.runner_status.result["Performance"]["profiling_results"]
    point = min(profiling, key=lambda p: (abs(p.throughput - best.throughput), p.batch_size or 0))
    return {"strategy": str(strategy), "key": best.model_status.model_config.key,
            "format": best.model_status.model_config.format.value, "runner": best.runner_status.runner_name,
            "latency_ms": best.latency, "samples_per_s": best.throughput, "batch": point.batch_size}


def _navigator_reference(model: torch.nn.Module, package: Any, workspace: Path) -> Dict[str, Any]:
    """Navigator's reference outputs (what its correctness check compares against) against the fp32 model's."""
    try:
        from model_navigator.core.dataloader import load_samples

        inputs = load_samples("correctness_samples", workspace, 0)
        outputs = load_samples("correctness_samples_output", workspace, 0)
        in_name = next(iter(package.status.input_metadata.keys()))
        out_name = next(iter(package.status.output_metadata.keys()))
        worst, agree, total = 0.0, 0, 0
        with torch.no_grad():
            for sample, reference in zip(inputs, outputs):
                fp32 = model(torch.as_tensor(sample[in_name]))
                ref = torch.as_tensor(reference[out_name]).float()
                worst = max(worst, float((fp32 - ref).abs().max()))
                agree += int((fp32.argmax(1) == ref.argmax(1)).sum())
                total += len(ref)
        return {"max_abs_diff_vs_fp32": worst, "top1_agreement_vs_fp32": agree / total if total else None,
                "samples": total, "autocast": _navigator_autocast(package)}
    except Exception as exc:  # noqa: BLE001 - a detail of the report, not a reason to stop
        return {"error": f"{type(exc).__name__}: {exc}"}


def _navigator_autocast(package: Any) -> Optional[str]:
    """The source model's runner settings: autocast on CPU (torch's CPU autocast dtype, bfloat16, when Navigator
    leaves ``autocast_dtype`` unset) or off."""
    for model_status in package.status.models_status.values():
        config = getattr(model_status.model_config, "runner_config", None)
        if model_status.model_config.format.value == "torch" and config is not None:
            if not getattr(config, "autocast", False):
                return "off"
            dtype = getattr(config, "autocast_dtype", None)
            dtype = getattr(dtype, "value", dtype)
            return f"on, {dtype if dtype not in (None, 'device') else torch.get_autocast_dtype('cpu')}"
    return None


# --------------------------------------------------------------------------------------------- fx-lightning


def export_worker(model_name: str, size: int, threads: int) -> Dict[str, Any]:
    """serving.py's export of the trained model, timed there (fuse, parity, every format and variant, selection)."""
    from rich.console import Console

    from serving import export_model  # benchmarks/serving.py

    torch.set_num_threads(threads)
    _, seconds = export_model(model_name, size, Console(stderr=True))
    return {"model": model_name, "export_s": seconds, "how": "exported in this run", "versions": _versions()}


def fx_summary(model_name: str) -> Dict[str, Any]:
    """What the export made, kept and selected, from its manifest."""
    from fx_lightning.export import read_manifest

    from serving import _variants  # benchmarks/serving.py

    root = EXPORTS / model_name
    raw = json.loads((root / "manifest.json").read_text())
    manifest = read_manifest(root)
    config_formats = list((raw.get("config") or {}).get("export", {}).get("formats") or [])
    variants = _variants(manifest)
    made_variants = [v["entry"] for v in variants if not v["skipped"] and not v["error"]]
    selections = list(raw.get("selections") or [])
    return {"formats_produced": config_formats + made_variants,
            "formats_failed": dict(raw.get("failed_formats") or {}),
            "formats_passed": list(manifest.formats),
            "variants": variants, "selections": selections,
            "max_throughput": fx_max_throughput_entry(selections),
            "created_utc": raw.get("created_utc"),
            "isa": (raw.get("bench") or {}).get("isa")}


def fx_max_throughput_entry(selections: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The ``"strategy": "max_throughput"`` selection (without a latency budget when there is one, back to back
    traffic preferred); without one, the min-latency pick at the largest batch size recorded, marked
    ``fallback``."""
    chosen = [s for s in selections if s.get("strategy") == "max_throughput"]
    if chosen:
        chosen.sort(key=lambda s: (s.get("latency_budget_ms") is not None, s.get("traffic") != "back_to_back"))
        return {**chosen[0], "fallback": False}
    others = [s for s in selections if s.get("strategy", "min_latency") == "min_latency"]
    if not others:
        return None
    largest = max(s["batch_size"] for s in others)
    at_largest = sorted((s for s in others if s["batch_size"] == largest),
                        key=lambda s: s.get("traffic") != "back_to_back")
    return {**at_largest[0], "fallback": True}


def _serving_export_s(model_name: str) -> Optional[Dict[str, Any]]:
    """serving.py's recorded export time, only when it ran on this CPU (a cached export may come from another)."""
    from machine import cpu_description  # benchmarks/machine.py

    path = HERE / "results" / "serving.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if saved.get("meta", {}).get("cpu") != cpu_description():
        return None
    for result in saved.get("results", []):
        if result.get("model") == model_name:
            return {"export_s": result["export_s"], "how": "serving.json (an earlier run on this CPU)"}
    return None


# ------------------------------------------------------------------------------------------------ orchestration


def _spawn(python: str, args: List[str], log: Path, cpus: Optional[List[int]]) -> Dict[str, Any]:
    """Runs this script as a worker in a fresh process of ``python``; its result from a JSON file."""
    result = log.with_suffix(".json")
    result.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [python, str(Path(__file__).resolve()), *args, "--result", str(result)]
    with log.open("w") as sink:
        done = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=HERE,
                              preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if done.returncode != 0 or not result.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"worker {' '.join(args)} failed (exit {done.returncode}); log {log}:\n{tail}")
    return json.loads(result.read_text())


def run_all(args: argparse.Namespace, s: Settings) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    from machine import cpu_description  # benchmarks/machine.py

    available = sorted(os.sched_getaffinity(0))
    cpus = available[:args.threads] if args.pin and len(available) > args.threads else None
    common = ["--size", str(args.size), "--threads", str(args.threads), "--settings", json.dumps(dataclasses.asdict(s))]
    logs = WORKSPACES / "logs"
    results: Dict[str, Dict[str, Any]] = {}
    for model in args.models:
        entry: Dict[str, Any] = {"model": model}
        manifest = EXPORTS / model / "manifest.json"
        if args.reuse_export and manifest.exists():
            entry["fx_export"] = _serving_export_s(model) or {"export_s": None, "how": "cached export, not timed"}
            print(f"{model}: fx-lightning: reusing {EXPORTS / model}", flush=True)
        else:
            print(f"{model}: fx-lightning: exporting with the serving preset ...", flush=True)
            try:
                entry["fx_export"] = _spawn(args.python, ["--worker", "export", "--models", model, *common],
                                            logs / f"{model}-fx-export.log", cpus)
                print(f"{model}: fx-lightning: export {entry['fx_export']['export_s']:.0f} s", flush=True)
            except RuntimeError as exc:  # reported in the tables; the other tool and models still run
                entry["fx_export"] = {"export_s": None, "how": "the export failed", "error": str(exc)[-2000:]}
                print(f"{model}: fx-lightning: {exc}", flush=True)
        entry["fx"] = fx_summary(model) if "error" not in entry["fx_export"] else None
        print(f"{model}: Navigator: nav.torch.optimize ...", flush=True)
        budget = ["--latency-budget-ms", str(args.latency_budget_ms)] if args.latency_budget_ms else []
        try:
            entry["navigator"] = _spawn(args.python, ["--worker", "optimise", "--models", model, *common, *budget],
                                        logs / f"{model}-navigator-optimise.log", cpus)
        except RuntimeError as exc:  # the worker itself died (Navigator's own exceptions are caught in it)
            entry["navigator"] = {"model": model, "optimise_s": None, "error": str(exc)[-2000:], "versions": {}}
        nav = entry["navigator"]
        outcome = f"error: {nav['error']}" if nav.get("error") else \
            f"picks: {_nav_pick_label(nav['picks']['min_latency'])} (min latency), " \
            f"{_nav_pick_label(nav['picks']['max_throughput'])} (max throughput)"
        print(f"{model}: Navigator: {_num(nav['optimise_s'], '.0f')} s; {outcome}", flush=True)
        results[model] = entry
    jobs = []
    for model, entry in results.items():
        for tool in TOOLS:
            if tool == "navigator" and (entry["navigator"].get("error") or
                                        "error" in entry["navigator"]["picks"]["min_latency"]):
                continue  # nothing of Navigator's to time: the tables say why
            for kind in ("latency", "sweep"):
                if tool == "navigator" and kind == "sweep" and "error" in entry["navigator"]["picks"]["max_throughput"]:
                    continue
                if tool == "fx-lightning" and (entry["fx"] is None or
                                               kind == "sweep" and entry["fx"]["max_throughput"] is None):
                    continue
                jobs.append((model, tool, kind))
    order = random.Random(0)
    runs: List[Dict[str, Any]] = []
    for repeat in range(s.repeats):
        round_jobs = list(jobs)
        order.shuffle(round_jobs)
        for model, tool, kind in round_jobs:
            extra = ["--tool", tool, "--kind", kind]
            if tool == "fx-lightning" and kind == "sweep":
                extra += ["--fx-entry", json.dumps(results[model]["fx"]["max_throughput"])]
            try:
                run = _spawn(args.python, ["--worker", "time", "--models", model, *common, *extra],
                             logs / f"{model}-{tool}-{kind}-{repeat}.log", cpus)
            except RuntimeError as exc:  # one failed process does not lose the others' figures
                run = {"model": model, "tool": tool, "kind": kind, "error": str(exc)[-2000:]}
            runs.append(run)
            print(f"  {model} {tool} {kind} #{repeat + 1}: {_run_line(run)}", flush=True)
    for entry in results.values():
        entry["timing"] = aggregate([r for r in runs if r["model"] == entry["model"]])
    meta = {"cpu": cpu_description(), "threads": args.threads, "torch": torch.__version__, "size": args.size,
            "cpus_on_machine": len(available), "pinned_to": cpus, "repeats": s.repeats, "calls": s.calls,
            "settings": dataclasses.asdict(s), "quick": args.quick, "python": args.python,
            "held_out": len(digits_splits()[1].labels)}
    return [{**e, "runs": [r for r in runs if r["model"] == e["model"]]} for e in results.values()], meta


def _nav_pick_label(pick: Dict[str, Any]) -> str:
    return pick.get("error") or f"{pick['key']} on {pick['runner']}"


def _run_line(run: Dict[str, Any]) -> str:
    if "error" in run:
        return f"failed: {run['error'].splitlines()[0]}"
    if run["kind"] == "latency":
        return ", ".join(f"{t.replace('_', ' ')} {run[t]['median_ms']:.2f} ms ({run[t]['pick']})" for t in TRAFFICS)
    best = run["sweep"]["best"]
    return (f"{run['sweep']['pick']}: {best['samples_per_s']:.1f} samples/s at batch {best['batch']}" if best
            else f"{run['sweep']['pick']}: no point ({run['sweep']['stop']})")


def aggregate(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per tool: the median over its processes of each process's figures, with their range."""
    out: Dict[str, Any] = {}
    for tool in TOOLS:
        failed = [f"{r['kind']}: {r['error']}" for r in runs if r["tool"] == tool and "error" in r]
        mine = [r for r in runs if r["tool"] == tool and "error" not in r]
        if not mine and not failed:
            continue
        entry: Dict[str, Any] = {"failed_processes": failed} if failed else {}
        latency = [r for r in mine if r["kind"] == "latency"]
        for traffic in TRAFFICS if latency else []:
            medians = [r[traffic]["median_ms"] for r in latency]
            entry[traffic] = {"pick": latency[0][traffic]["pick"], "median_ms": statistics.median(medians),
                              "median_ms_range": [min(medians), max(medians)],
                              "p99_ms": statistics.median(r[traffic]["p99_ms"] for r in latency),
                              "accuracy": latency[0][traffic]["accuracy"],
                              "picks": sorted({r[traffic]["pick"] for r in latency})}
        sweeps = [r["sweep"] for r in mine if r["kind"] == "sweep" and r["sweep"]["best"]]
        if sweeps:
            rates = [s["best"]["samples_per_s"] for s in sweeps]
            entry["sweep"] = {"pick": sweeps[0]["pick"], "samples_per_s": statistics.median(rates),
                              "samples_per_s_range": [min(rates), max(rates)],
                              "batches": sorted({s["best"]["batch"] for s in sweeps}),
                              "accuracy": sweeps[0]["accuracy"], "stops": sorted({s["stop"] for s in sweeps}),
                              "points": sweeps[0]["points"] if len(sweeps) == 1 else _median_points(sweeps)}
        out[tool] = entry
    return out


def _median_points(sweeps: List[Dict[str, Any]]) -> List[Dict[str, float]]:
    batches = sorted({p["batch"] for s in sweeps for p in s["points"]})
    points = []
    for b in batches:
        at = [p for s in sweeps for p in s["points"] if p["batch"] == b]
        points.append({"batch": b, "samples_per_s": statistics.median(p["samples_per_s"] for p in at),
                       "p50_ms": statistics.median(p["p50_ms"] for p in at), "processes": len(at)})
    return points


# ------------------------------------------------------------------------------------------------- the report


def to_markdown(results: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    nav_version = next((r["navigator"]["versions"].get("triton-model-navigator") for r in results), NAVIGATOR_VERSION)
    pinned = f"each process confined to CPUs {meta['pinned_to']}" if meta.get("pinned_to") else \
        f"the machine's {meta['cpus_on_machine']} CPUs"
    lines = [f"torch {meta['torch']}, {meta['threads']} threads ({pinned}), {meta['cpu']}, input "
             f"{meta['size']}x{meta['size']}, models trained on scikit-learn's digits (upsampled), "
             f"{meta['held_out']} held-out images. Navigator {nav_version} (`nav.torch.optimize`, target device CPU, "
             f"its defaults otherwise) against fx-lightning's serving preset; every pick timed by one harness, each "
             f"in a process of its own, {meta['repeats']} process(es) per pick, medians over them: batch-1 latency of "
             f"the min-latency pick over {meta['calls']} calls (back to back; idle: a 20 ms gap before each call), "
             f"and a back-to-back sweep of the max-throughput pick over batch sizes 1, 2, 4, ... until samples/s "
             f"grew by less than 5%; held-out accuracy of each pick by the same harness."
             + (" **Quick smoke run: tiny settings, not a measurement.**" if meta.get("quick") else ""), ""]
    for r in results:
        lines += _model_table(r, meta)
    lines += ["", "What each tool verifies before it picks:", "",
              "- Navigator: for every format and runner it runs its correctness samples (the first image of each of "
              "up to `sample_count` dataloader items, 100 by default, drawn at random) and records the largest "
              "absolute and relative difference from the source model's outputs; the check fails only on NaN, inf "
              "or a different number of outputs: no tolerance and no labels (a user can add a `verify_func`). A "
              "runtime is eligible for its strategies when that check and its profiling both passed. Its reference "
              "outputs come from its source-model runner, which runs under `torch.autocast` by default (see the "
              "reference line of each model).",
              "- fx-lightning: parity of the fused model against the original on the labelled held-out split "
              "(relative error, worst cosine, top-1 agreement and accuracy drop, each gated), every fp32 artifact "
              "checked against an fp64 copy, and each lossy variant (int8, bf16) kept only when it passes its gate on "
              "the held-out images: top-1 agreement with fp32 >= 0.99, accuracy drop <= 0.5 points, worst cosine "
              ">= 0.99.", "",
              "Navigator's environment: `triton-model-navigator` installed with `--no-deps` beside fx-lightning's "
              "pins (numpy 2, packaging 26, onnxruntime instead of onnxruntime-gpu, tritonclient without its grpc "
              "extra's protobuf<7), without its GPU-only requirements (tensorrt, nvidia-modelopt): with target "
              "device CPU it builds no TensorRT step (benchmarks/navigator.py, docstring)."]
    return "\n".join(lines) + "\n"


def _model_table(r: Dict[str, Any], meta: Dict[str, Any]) -> List[str]:
    nav, fx, timing = r["navigator"], r["fx"], r.get("timing", {})
    lines = [f"### {r['model']}", "",
             "| tool | time to optimise (s) | formats produced | passing the tool's checks | min-latency pick | "
             "batch 1, back to back: median / p99 ms | batch 1, idle: median / p99 ms | max-throughput pick | "
             "its batch size: tool's / harness optimum | samples/s at the optimum | held-out accuracy (min-latency "
             "/ max-throughput pick) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    nav_t, fx_t = timing.get("navigator", {}), timing.get("fx-lightning", {})
    if nav.get("error"):
        lines.append(f"| Navigator | {_num(nav['optimise_s'], '.0f')} (failed) | - | - | "
                     f"{_cell(nav['error'][:400])} | - | - | - | - | - | - |")
    else:
        runtimes = [(f["key"], ru) for f in nav["formats"] for ru in f["runners"]]
        made = [f["key"] for f in nav["formats"] if f["made_by"]]
        source = [ru["runner"] for f in nav["formats"] if not f["made_by"] for ru in f["runners"]]
        produced = ", ".join(made) + (f", and the source model on {', '.join(source)}" if source else "")
        passed = [f"{k}/{ru['runner']}" for k, ru in runtimes
                  if ru["correctness"] == "OK" and ru["performance"] == "OK"]
        correct_only = [f"{k}/{ru['runner']}" for k, ru in runtimes if ru["correctness"] == "OK"
                        and ru["performance"] != "OK"]
        passing = ", ".join(passed) or "none"
        if correct_only:
            passing += f" (correctness only, profiling failed: {', '.join(correct_only)})"
        ml, mt = nav["picks"]["min_latency"], nav["picks"]["max_throughput"]
        lines.append(
            f"| Navigator {nav['versions'].get('triton-model-navigator')} | {nav['optimise_s']:.0f} | {produced} "
            f"({len(runtimes)} format/runner pairs) | {passing} | {_nav_pick_label(ml)} | "
            f"{_ms(nav_t.get('back_to_back'))} | {_ms(nav_t.get('idle'))} | {_nav_pick_label(mt)} | "
            f"{mt.get('batch', '-')} / {_batches(nav_t.get('sweep'))} | {_rate(nav_t.get('sweep'))} | "
            f"{_accuracy(nav_t)} |")
    export_s = r["fx_export"].get("export_s")
    mt_entry = fx["max_throughput"] if fx else None
    mt_label = "-" if mt_entry is None else _fx_label(mt_entry) + (
        f" (**fallback**: the export recorded no max_throughput selection; its min-latency pick at the largest batch "
        f"size recorded, {mt_entry['batch_size']}, {mt_entry.get('traffic', '').replace('_', ' ')})"
        if mt_entry.get("fallback") else "")
    if fx is None:
        lines.append(f"| fx-lightning | - (failed) | - | - | {_cell(r['fx_export']['error'][-400:])} | - | - | - | - "
                     "| - | - |")
    else:
        how = "" if export_s is not None else f" ({r['fx_export']['how']})"
        picks = " / ".join(fx_t[t]["pick"] for t in TRAFFICS) if "idle" in fx_t else "-"
        lines.append(
            f"| fx-lightning | {_num(export_s, '.0f')}{how} | {', '.join(fx['formats_produced'])} | "
            f"{', '.join(fx['formats_passed'])} | {picks} (back to back / idle) | {_ms(fx_t.get('back_to_back'))} | "
            f"{_ms(fx_t.get('idle'))} | {mt_label} | {mt_entry['batch_size'] if mt_entry else '-'} / "
            f"{_batches(fx_t.get('sweep'))} | {_rate(fx_t.get('sweep'))} | {_accuracy(fx_t)} |")
    ratio = lambda a, b: "-" if a is None or b is None or not b else f"{a / b:.2f}x"  # noqa: E731
    get = lambda t, traffic: (t.get(traffic) or {}).get("median_ms")  # noqa: E731
    rate = lambda t: (t.get("sweep") or {}).get("samples_per_s")  # noqa: E731
    lines.append(
        f"| fx-lightning / Navigator | {ratio(export_s, nav.get('optimise_s'))} | | | | "
        f"{ratio(get(fx_t, 'back_to_back'), get(nav_t, 'back_to_back'))} | "
        f"{ratio(get(fx_t, 'idle'), get(nav_t, 'idle'))} | | | {ratio(rate(fx_t), rate(nav_t))} | |")
    lines += ["", "Ratios: time and latency below 1, samples/s above 1 favour fx-lightning.", ""]
    for tool in TOOLS:
        for failure in timing.get(tool, {}).get("failed_processes", []):
            lines += [f"A timing process of {tool} failed ({_cell(failure.splitlines()[0])}); its figures are the "
                      "other processes'.", ""]
    if not nav.get("error"):
        lines += [f"Navigator's formats and runners (its dataloader: {nav['dataloader']['batches']} held-out items of "
                  f"{nav['dataloader']['batch_size']} image(s); optimisation profile: "
                  f"{nav['settings']['optimization_profile']}):", "",
                  "| model key | format | made by | runner | correctness: max abs / rel diff | profiling | "
                  "its best samples/s (batch) | min p50 ms | why it failed |", "|---|---|---|---|---|---|---|---|---|"]
        for f in nav["formats"]:
            made = ", ".join(f"{k} {v}" for k, v in f["made_by"].items()) or "source"
            for ru in f["runners"]:
                best = max(ru["profiling"], key=lambda p: p["samples_per_s"], default=None)
                fastest = min((p["p50_ms"] for p in ru["profiling"]), default=None)
                failed = ru["correctness"] != "OK" or ru["performance"] != "OK"
                lines.append(f"| {f['key']} | {f['format']} | {made} | {ru['runner']} | {ru['correctness']}: "
                             f"{_num(ru['max_abs_diff'], '.3g')} / {_num(ru['max_rel_diff'], '.3g')} | "
                             f"{ru['performance']} | "
                             f"{_best(best)} | "
                             f"{_num(fastest, '.2f')} | {'; '.join(ru['errors']) if failed else ''} |")
        picks = nav["picks"]
        budget = picks.get("max_throughput_budget")
        if budget:
            lines += ["", f"Navigator's `MaxThroughputWithLatencyBudgetStrategy({budget['budget_ms']:.1f} ms)`: "
                      f"{_nav_pick_label(budget)}" + (f" at batch {budget['batch']}, {budget['samples_per_s']:.1f} "
                                                      "samples/s in its profiling" if "batch" in budget else "") + "."]
        ref = nav.get("reference", {})
        if "error" not in ref:
            lines += ["", f"Navigator's reference outputs (from its source-model runner, autocast "
                      f"{ref.get('autocast')}) against the fp32 model's on its {ref['samples']} correctness images: "
                      f"max abs diff {ref['max_abs_diff_vs_fp32']:.3g}, top-1 agreement "
                      f"{ref['top1_agreement_vs_fp32']:.4f}; its correctness figures above are differences from "
                      "these."]
    if fx is None:
        return lines + [""]
    fx_failed = [f"{v['entry']}: {'; '.join(v['failures']) or v['error']}" for v in fx["variants"]
                 if not v["kept"] and not v["skipped"]]
    skipped = [f"{v['entry']}: {v['skipped']}" for v in fx["variants"] if v["skipped"]]
    if fx_failed or skipped or fx["formats_failed"]:
        lines += ["", "fx-lightning, not kept: " + "; ".join(
            [f"{k}: {v}" for k, v in fx["formats_failed"].items()] + fx_failed + [f"(not made) {s}" for s in skipped])
            + "."]
    return lines + [""]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _best(point: Optional[Dict[str, Any]]) -> str:
    return "-" if point is None else f"{point['samples_per_s']:.1f} ({point['batch']})"


def _ms(t: Optional[Dict[str, Any]]) -> str:
    return "-" if not t else f"{t['median_ms']:.2f} / {t['p99_ms']:.2f}"


def _rate(t: Optional[Dict[str, Any]]) -> str:
    return "-" if not t else f"{t['samples_per_s']:.1f}"


def _batches(t: Optional[Dict[str, Any]]) -> str:
    return "-" if not t else "/".join(str(b) for b in t["batches"])


def _accuracy(t: Dict[str, Any]) -> str:
    low = t.get("back_to_back", {}).get("accuracy")
    high = (t.get("sweep") or {}).get("accuracy")
    return f"{_pct(low)} / {_pct(high)}"


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _num(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


# ------------------------------------------------------------------------------------------------------- setup


def setup(base_python: str) -> int:
    """Makes ``VENV`` and installs fx-lightning (pinned) and Navigator into it (docstring)."""
    python = str(VENV / "bin" / "python")
    steps = []
    if not Path(python).exists():
        steps.append([base_python, "-m", "venv", str(VENV)])
    steps += [[python, "-m", "pip", "install", "-c", "constraints.txt", "-e", ".[vision,onnx,openvino,int8]",
               "scikit-learn"],
              [python, "-m", "pip", "install", "--no-deps", f"triton-model-navigator=={NAVIGATOR_VERSION}"],
              [python, "-m", "pip", "install", "-c", "constraints.txt", *NAVIGATOR_DEPS],
              [python, "-c", "import model_navigator, fx_lightning, sklearn, torchvision; "
                             "print('model_navigator', model_navigator.__version__)"]]
    for step in steps:
        print("+", " ".join(step), flush=True)
        if subprocess.run(step, cwd=ROOT).returncode != 0:
            return 1
    return 0


# -------------------------------------------------------------------------------------------------------- main


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--calls", type=int, help="batch-1 calls per traffic (default 200; --quick 10)")
    parser.add_argument("--repeats", type=int, help="processes per pick (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke run: few calls, batch "
                        "sizes up to 4, a small Navigator profile and dataloader; not a measurement")
    parser.add_argument("--reuse-export", action="store_true",
                        help="keep fx-lightning's export already under benchmarks/results/cache/exports (not timed)")
    parser.add_argument("--latency-budget-ms", type=float,
                        help="for MaxThroughputWithLatencyBudgetStrategy (default: twice Navigator's min latency)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not confine the processes to --threads CPUs")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--python", default=str(VENV / "bin" / "python"),
                        help="the Python of Navigator's venv, which runs Navigator, the export and the harness")
    parser.add_argument("--setup", action="store_true", help="make the venv with Navigator (docstring) and exit")
    parser.add_argument("--render", action="store_true", help="only write OUT.md again from OUT.json")
    parser.add_argument("--out", default=str(HERE / "results" / "navigator"))
    parser.add_argument("--worker", choices=["optimise", "export", "time"], help=argparse.SUPPRESS)
    parser.add_argument("--tool", choices=TOOLS, help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=["latency", "sweep"], help=argparse.SUPPRESS)
    parser.add_argument("--fx-entry", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        s = Settings(**json.loads(args.settings))
        model = args.models[0]
        if args.worker == "optimise":
            result = optimise_worker(model, args.size, args.threads, s, args.latency_budget_ms)
        elif args.worker == "export":
            result = export_worker(model, args.size, args.threads)
        else:
            result = time_worker(args.tool, model, args.kind, args.size, args.threads, s,
                                 json.loads(args.fx_entry) if args.fx_entry else None)
        Path(args.result).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    if args.setup:
        return setup(sys.executable)
    out = Path(args.out)
    if args.render:
        saved = json.loads(out.with_suffix(".json").read_text())
        out.with_suffix(".md").write_text(to_markdown(saved["results"], saved["meta"]))
        return 0
    if not Path(args.python).exists():
        print(f"{args.python} does not exist: make Navigator's venv first with python {Path(__file__).name} --setup",
              file=sys.stderr)
        return 2
    s = dataclasses.replace(QUICK if args.quick else Settings())
    if args.calls:
        s.calls = args.calls
    if args.repeats:
        s.repeats = args.repeats
    start = time.perf_counter()
    results, meta = run_all(args, s)
    meta["wall_s"] = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(results, meta))
    print(to_markdown(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
