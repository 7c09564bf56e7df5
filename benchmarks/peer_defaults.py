"""The artifact selected with ``configs/fx_fuse/serving.yaml`` against the peers a user would try by hand, each
run with its own defaults in a process of its own (runtimes in one process steal each other's cores):

- ``onnxruntime``: ``torch.onnx.export(model, x, path)`` of the trained, unfused model, then
  ``onnxruntime.InferenceSession(path)`` with no options (all graph optimisations, intra-op threads spinning);
- ``openvino``: ``openvino.convert_model(model, example_input=x)``, then ``Core().compile_model(m, "CPU")`` with
  no config (on a CPU with AVX512-BF16 or AMX that runs bf16);
- ``fx-lightning``: ``load_fused(dir, batch_size=1, traffic=...)``: what the export recorded as the fastest for
  batch 1 in that traffic, with the runtime settings that made it so.

and the int8 models a user makes by hand with each peer's own post-training quantiser, its defaults, calibrated
on 64 images of the digits' training split (batch 1, as the quickstarts feed them):

- ``openvino-int8``: NNCF as its quickstart shows: ``nncf.quantize(ov.convert_model(model, example_input=x),
  nncf.Dataset(calibration_loader, transform_fn))`` (preset, subset size, bias correction: its defaults), then
  ``ov.Core().compile_model(q, "CPU")`` with no config;
- ``onnxruntime-int8``: ONNX Runtime's static quantisation as its docs show: ``torch.onnx.export`` of the trained,
  unfused model, ``quant_pre_process`` (the docs recommend it: shape inference and graph optimisation, which
  folds BatchNorm into Conv so it can be quantised), then ``quantize_static(model_fp32, model_int8,
  calibration_data_reader)`` with its defaults (QDQ, int8 activations and weights, per tensor, MinMax), then
  ``InferenceSession(path)`` with no options.

The int8 models are made once, each in a process of its own before any timing, and kept under
``benchmarks/results/cache/peer_int8/<model>_<size>px`` (the OpenVINO one saved with ``compress_to_fp16=False``,
so the file is the model ``nncf.quantize`` returned); they are made again when the trained model, the
calibration count or a package version changes. Each int8 peer's process also runs it once on the 359 held-out
images, after its timings, for fx-lightning's gate: top-1 agreement with the fp32 model (a pick the fp32 model
scores within the gate's rtol of its top counts as agreeing, as the gate does), accuracy drop against the
labels and the worst per-image cosine of the logits, against the thresholds of fx-lightning's int8 gate
(``VariantOptions``: agreement >= 0.99, drop <= 0.5 points, cosine >= 0.99). fx-lightning's figures are its
selected artifact's, as its manifest recorded them.

Each process loads its model, warms up, then times batch 1 back to back (each call right after the previous one)
and with a 20 ms idle gap before each call; medians. The models and exports are those of ``serving.py`` (run it
first; it keeps the exports under ``benchmarks/results/cache/exports``).

    python benchmarks/peer_defaults.py                       # resnet18 and mobilenet_v3_large
    python benchmarks/peer_defaults.py --models resnet18 --calls 100
    python benchmarks/peer_defaults.py --models resnet18 --kinds fx-lightning onnxruntime-int8 openvino-int8
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from digits import CACHE, digits_splits, trained_model  # benchmarks/digits.py
from machine import cpu_description  # benchmarks/machine.py

INT8 = ["onnxruntime-int8", "openvino-int8"]
KINDS = ["onnxruntime", "openvino", "fx-lightning", *INT8]
GAP_S = 0.02
HERE = Path(__file__).parent
CALIBRATION = 64  # training images the int8 peers are calibrated on
PEER_INT8 = CACHE / "peer_int8"
TARGET = 1.05  # the done-when: fx-lightning's selected artifact within 1.05x of the fastest peer int8
# Issue 39's peers: the selected artifact within TARGET of the fastest of these, in both traffics.
FASTEST_OF = ["onnxruntime", "openvino", "openvino-int8"]
PACKAGES = ["torch", "onnx", "onnxruntime", "openvino", "nncf"]


def _input(size: int) -> torch.Tensor:
    return next(digits_splits()[1].batches(1, size))[0]


def _runner(kind: str, model_name: str, size: int, traffic: str) -> Callable[[torch.Tensor], Any]:
    x = _input(size)
    if kind == "fx-lightning":
        from fx_lightning import load_fused
        from serving import EXPORTS  # benchmarks/serving.py

        module = load_fused(EXPORTS / model_name, batch_size=1, traffic=traffic)
        return lambda t: module(t)
    if kind == "onnxruntime-int8":
        import onnxruntime as ort

        session = ort.InferenceSession(str(int8_model(kind, model_name, size)))
        name = session.get_inputs()[0].name
        return lambda t: session.run(None, {name: t.numpy()})
    if kind == "openvino-int8":
        import openvino as ov

        compiled = ov.Core().compile_model(str(int8_model(kind, model_name, size)), "CPU")
        return lambda t: compiled(t.numpy())
    model = trained_model(model_name, size)
    if kind == "onnxruntime":
        import onnxruntime as ort

        path = Path(tempfile.mkdtemp()) / "model.onnx"
        torch.onnx.export(model, (x,), str(path))
        session = ort.InferenceSession(str(path))
        name = session.get_inputs()[0].name
        return lambda t: session.run(None, {name: t.numpy()})
    if kind == "openvino":
        import openvino as ov

        compiled = ov.Core().compile_model(ov.convert_model(model, example_input=x), "CPU")
        return lambda t: compiled(t.numpy())
    raise ValueError(kind)


# ------------------------------------------------------------------------- the int8 a user makes by hand


def _calibration_items(size: int) -> List[Any]:
    """``CALIBRATION`` (image, label) batches of one from the training split, shuffled (seeded): the data loader
    of the quickstarts, batch size 1."""
    train, _ = digits_splits()
    return list(itertools.islice(train.batches(1, size, shuffle=True, seed=1), CALIBRATION))


def _made_from(model_name: str, size: int) -> Dict[str, Any]:
    """What an int8 model is made from: the trained checkpoint (digits.py's cache file), the calibration, the
    packages. A cached int8 model whose record differs is made again."""
    trained_model(model_name, size, log=lambda *_: None)  # trains it if it is not cached yet
    epochs = inspect.signature(trained_model).parameters["epochs"].default  # digits.py's cache file name
    checkpoint = CACHE / f"digits_{model_name}_{size}px_{epochs}ep.pt"
    stat = checkpoint.stat()
    return {"checkpoint": checkpoint.name, "checkpoint_bytes": stat.st_size, "checkpoint_mtime": stat.st_mtime,
            "calibration_images": CALIBRATION, "calibration": "training split, shuffled with seed 1, batch 1",
            "versions": {p: version(p) for p in PACKAGES}}


def int8_model(kind: str, model_name: str, size: int) -> Path:
    """The path of the int8 model ``kind``'s quantiser makes of the trained model; made once and cached."""
    folder = PEER_INT8 / f"{model_name}_{size}px" / kind
    target = folder / ("model_int8.onnx" if kind == "onnxruntime-int8" else "model_int8.xml")
    record = folder / "made.json"
    made_from = _made_from(model_name, size)
    if target.exists() and record.exists():
        if json.loads(record.read_text()).get("made_from") == made_from:
            return target
    PEER_INT8.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=PEER_INT8))  # moved into place when whole
    work.chmod(0o755)
    start = time.perf_counter()
    (_quantise_ort if kind == "onnxruntime-int8" else _quantise_nncf)(model_name, size, work / target.name)
    (work / "made.json").write_text(json.dumps({"made_from": made_from, "seconds": time.perf_counter() - start},
                                               indent=2) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    work.rename(folder)
    return target


def _quantise_nncf(model_name: str, size: int, out: Path) -> None:
    """NNCF's quickstart for an OpenVINO model: its defaults, a data loader and a transform function."""
    import nncf
    import openvino as ov

    model = trained_model(model_name, size)
    calibration_loader = _calibration_items(size)

    def transform_fn(data_item):
        images, _ = data_item
        return images.numpy()

    q = nncf.quantize(ov.convert_model(model, example_input=_input(size)),
                      nncf.Dataset(calibration_loader, transform_fn))
    ov.save_model(q, str(out), compress_to_fp16=False)


def _quantise_ort(model_name: str, size: int, out: Path) -> None:
    """ONNX Runtime's static quantisation as its docs show: export, pre-process, ``quantize_static`` with a
    calibration data reader and the defaults (QDQ)."""
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, quant_pre_process, quantize_static

    model = trained_model(model_name, size)
    model_fp32 = out.with_name("model_fp32.onnx")
    torch.onnx.export(model, (_input(size),), str(model_fp32))
    model_prep = out.with_name("model_fp32_prep.onnx")
    quant_pre_process(str(model_fp32), str(model_prep))
    name = ort.InferenceSession(str(model_prep)).get_inputs()[0].name

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter([{name: x.numpy()} for x, _ in _calibration_items(size)])

        def get_next(self) -> Optional[Dict[str, Any]]:
            return next(self.items, None)

    quantize_static(str(model_prep), str(out), Reader())


@torch.no_grad()
def int8_gate(kind: str, model_name: str, size: int) -> Dict[str, Any]:
    """The int8 peer against the fp32 model on the held-out split, one image at a time (the ONNX export has a
    fixed batch of 1), judged as fx-lightning's int8 gate judges its own variants."""
    from fx_lightning.parity.metrics import sample_cosine
    from fx_lightning.common.tolerance import GATE_RTOL
    from fx_lightning.variants.base import VariantOptions

    run = _runner(kind, model_name, size, "back_to_back")
    model = trained_model(model_name, size)
    _, held_out = digits_splits()
    agree = strict = right_fp32 = right_int8 = 0
    cosines = []
    for x, y in held_out.batches(1, size):
        ref = model(x).double()
        out = torch.as_tensor(run(x)[0]).double().reshape(ref.shape)
        ref_top1, top1 = int(ref.argmax()), int(out.argmax())
        # the gate's tolerance: a pick the fp32 model scores within rtol of its top agrees (a near tie)
        agree += bool(ref[0, top1] >= ref.max() - GATE_RTOL * ref.abs().max())
        strict += top1 == ref_top1
        right_fp32 += ref_top1 == int(y)
        right_int8 += top1 == int(y)
        cosines.append(float(sample_cosine(out, ref).min()))
    n = len(held_out.labels)
    figures = {"top1_agreement": agree / n, "top1_agreement_strict": strict / n,
               "accuracy_reference": right_fp32 / n, "accuracy_fused": right_int8 / n,
               "accuracy_drop": (right_fp32 - right_int8) / n, "cosine_similarity_min": min(cosines),
               "samples": n}
    return {**figures, **_judge(figures, VariantOptions())}


def _judge(figures: Dict[str, Any], gate: Any) -> Dict[str, Any]:
    failures = []
    if not figures["top1_agreement"] >= gate.min_top1_agreement:
        failures.append(f"top-1 agreement {figures['top1_agreement']:.4f} < {gate.min_top1_agreement}")
    if not figures["accuracy_drop"] <= gate.max_accuracy_drop:
        failures.append(f"accuracy drop {100 * figures['accuracy_drop']:.2f} pt > {100 * gate.max_accuracy_drop} pt")
    if not figures["cosine_similarity_min"] >= gate.min_cosine:
        failures.append(f"worst cosine {figures['cosine_similarity_min']:.4f} < {gate.min_cosine}")
    return {"passed": not failures, "failures": failures}


# ----------------------------------------------------------------------------------------- the processes


def worker(kind: str, model_name: str, size: int, calls: int, threads: int) -> Dict[str, Any]:
    """Times one peer in this process: batch 1, back to back and after an idle gap; an int8 peer's gate after."""
    torch.set_num_threads(threads)
    x = _input(size)
    out: Dict[str, Any] = {"kind": kind, "model": model_name}
    with torch.no_grad():
        for traffic in ("back_to_back", "idle"):
            run = _runner(kind, model_name, size, traffic)
            for _ in range(20):
                run(x)
            times = []
            for _ in range(calls):
                if traffic == "idle":
                    time.sleep(GAP_S)
                start = time.perf_counter()
                run(x)
                times.append(time.perf_counter() - start)
            out[traffic] = 1e3 * statistics.median(times)
            if kind == "fx-lightning":
                from fx_lightning.export import read_manifest
                from fx_lightning.export.load.loader import selection_for
                from serving import EXPORTS

                manifest = read_manifest(EXPORTS / model_name)
                pick = selection_for(manifest, 1, traffic)
                out[f"{traffic}_artifact"] = f"{pick.format}{' (' + pick.runtime + ')' if pick.runtime else ''}" \
                    if pick else "default"
                chosen = pick or manifest.selected
                entry = manifest.formats.get(chosen.format) if chosen is not None else None
                gate = entry.gate if entry is not None else None
                out[f"{traffic}_gate"] = None if gate is None else {**gate.metrics, "passed": gate.passed,
                                                                     "failures": [str(f) for f in gate.failures]}
            del run
    if kind in INT8:
        out["gate"] = int8_gate(kind, model_name, size)
    return out


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v3_large"])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS, help="the peers to time (default: all)")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5,
                        help="processes per peer, interleaved with the others' (this machine's speed drifts over "
                             "minutes: one process per peer in a row differed by 30%% between identical runtimes)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(HERE / "results" / "peer_defaults"))
    args = parser.parse_args(argv)
    if args.worker:
        if args.prepare:  # the int8 model made (or found) in a process that times nothing
            torch.set_num_threads(args.threads)
            path = int8_model(args.worker, args.models[0], args.size)
            made = json.loads((path.parent / "made.json").read_text())
            print(json.dumps({"kind": args.worker, "model": args.models[0], "int8": str(path),
                              "made_in_s": made.get("seconds")}))
        else:
            print(json.dumps(worker(args.worker, args.models[0], args.size, args.calls, args.threads)))
        return 0
    kinds = [k for k in KINDS if k in args.kinds]
    runs = []
    made = []
    order = random.Random(0)
    for model in args.models:
        for kind in (k for k in kinds if k in INT8):
            done = _subprocess(kind, model, args, prepare=True)
            if done is None:
                return 1
            made.append(done)
            print(done, flush=True)
        for _ in range(args.repeats):
            shuffled = list(kinds)
            order.shuffle(shuffled)
            for kind in shuffled:
                done = _subprocess(kind, model, args)
                if done is None:
                    return 1
                runs.append(done)
                print(runs[-1], flush=True)
    results = aggregate(runs)
    meta = {"cpu": cpu_description(), "threads": args.threads, "calls": args.calls, "size": args.size,
            "torch": torch.__version__, "repeats": args.repeats, "versions": {p: version(p) for p in PACKAGES},
            "calibration_images": CALIBRATION, "int8_made": made}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results, "runs": runs}, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(results, meta))
    print(to_markdown(results, meta))
    return 0


def _subprocess(kind: str, model: str, args: Any, prepare: bool = False) -> Optional[Dict[str, Any]]:
    cmd = [sys.executable, str(Path(__file__)), "--worker", kind, "--models", model, "--size", str(args.size),
           "--calls", str(args.calls), "--threads", str(args.threads)] + (["--prepare"] if prepare else [])
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def aggregate(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One result per model and peer: the median over its processes of each process's median, and their range."""
    results = []
    for model in dict.fromkeys(r["model"] for r in runs):
        for kind in KINDS:
            mine = [r for r in runs if (r["model"], r["kind"]) == (model, kind)]
            if not mine:
                continue
            result = {**mine[0]}
            for traffic in ("back_to_back", "idle"):
                values = [r[traffic] for r in mine]
                result[traffic] = statistics.median(values)
                result[f"{traffic}_range"] = [min(values), max(values)]
            if "gate" in result:  # the same model and data in every process: the figures must agree
                result["gate_same_in_every_process"] = all(r.get("gate") == result["gate"] for r in mine)
            results.append(result)
    return results


# ------------------------------------------------------------------------------------------------ tables


def to_markdown(results: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    lines = [f"torch {meta['torch']}, {meta['threads']} threads, {meta['cpu']}, input {meta['size']}x{meta['size']}, "
             f"batch 1, each peer in a process of its own with its own defaults, {meta.get('repeats', 1)} processes "
             f"per peer interleaved with the others'; ms: the median over those processes of each one's median of "
             f"{meta['calls']} calls (range in brackets); idle: a 20 ms gap before each call."]
    models = list(dict.fromkeys(r["model"] for r in results))
    by_model = {m: {r["kind"]: r for r in results if r["model"] == m} for m in models}
    if any({"onnxruntime", "openvino", "fx-lightning"} <= set(k) for k in by_model.values()):
        lines += ["", "| model | traffic | onnxruntime (defaults) ms | openvino (defaults) ms | fx-lightning selected "
                  "| ms | vs onnxruntime | vs openvino |", "|---|---|---|---|---|---|---|---|"]
        for model in models:
            by_kind = by_model[model]
            if not {"onnxruntime", "openvino", "fx-lightning"} <= set(by_kind):
                continue
            for traffic in ("back_to_back", "idle"):
                ort_ms, ov_ms = by_kind["onnxruntime"][traffic], by_kind["openvino"][traffic]
                ours = by_kind["fx-lightning"]
                cells = [_ms(by_kind[k], traffic) for k in ("onnxruntime", "openvino")]
                lines.append(f"| {model} | {traffic.replace('_', ' ')} | {cells[0]} | {cells[1]} | "
                             f"{ours[traffic + '_artifact']} | {_ms(ours, traffic)} | "
                             f"{ort_ms / ours[traffic]:.2f}x | {ov_ms / ours[traffic]:.2f}x |")
    if any("fx-lightning" in k and set(FASTEST_OF) & set(k) for k in by_model.values()):
        lines += _fastest_peer_table(models, by_model)
    if any("fx-lightning" in k and set(INT8) & set(k) for k in by_model.values()):
        lines += _int8_tables(models, by_model, meta)
    return "\n".join(lines) + "\n"


def _fastest_peer_table(models: List[str], by_model: Dict[str, Dict[str, Dict[str, Any]]]) -> List[str]:
    """Issue 39's bound: the selected artifact against the fastest of ONNX Runtime's defaults, OpenVINO's defaults
    and NNCF's int8 (those of them that were timed), in each traffic."""
    lines = ["", f"**fx-lightning / fastest peer**: fx-lightning's ms over the fastest of {', '.join(FASTEST_OF)} "
             f"(those timed; the target: <= {TARGET:.2f}x).", "",
             "| model | traffic | fx-lightning selected | ms | fastest peer | ms | **fx-lightning / fastest peer** | "
             f"within {TARGET:.2f}x |", "|---|---|---|---|---|---|---|---|"]
    for model in models:
        by_kind = by_model[model]
        ours, peers = by_kind.get("fx-lightning"), [by_kind[k] for k in FASTEST_OF if k in by_kind]
        if ours is None or not peers:
            continue
        for traffic in ("back_to_back", "idle"):
            fastest = min(peers, key=lambda r: r[traffic])
            ratio = ours[traffic] / fastest[traffic]
            lines.append(f"| {model} | {traffic.replace('_', ' ')} | {ours[traffic + '_artifact']} | {_ms(ours, traffic)} "
                         f"| {fastest['kind']} | {_ms(fastest, traffic)} | **{ratio:.3f}x** "
                         f"({_ratio_range(ours, fastest, traffic)}) | {'yes' if ratio <= TARGET else '**no**'} |")
    return lines


def _int8_tables(models: List[str], by_model: Dict[str, Dict[str, Dict[str, Any]]], meta: Dict[str, Any]) -> List[str]:
    versions = meta.get("versions", {})
    lines = ["", f"Against the int8 a user makes by hand with each peer's own quantiser and its defaults, calibrated "
             f"on {meta.get('calibration_images', CALIBRATION)} training images: onnxruntime-int8 = "
             f"`quant_pre_process` + `quantize_static` (QDQ) of onnxruntime {versions.get('onnxruntime', '?')}, "
             f"run by `InferenceSession(path)`; openvino-int8 = `nncf.quantize` of nncf {versions.get('nncf', '?')} "
             f"on `ov.convert_model`, run by `Core().compile_model(q, \"CPU\")` of openvino "
             f"{versions.get('openvino', '?')}. **fx-lightning / fastest int8 peer** is fx-lightning's ms over the "
             f"fastest int8 peer's ms (the target: <= {TARGET:.2f}x; below 1 fx-lightning is faster).", "",
             "| model | traffic | onnxruntime-int8 ms | openvino-int8 ms | fx-lightning selected | ms | fastest int8 "
             f"peer | **fx-lightning / fastest int8 peer** | within {TARGET:.2f}x | fx-lightning / fastest int8 peer "
             "that passes the gate |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        by_kind = by_model[model]
        ours = by_kind.get("fx-lightning")
        peers = [by_kind[k] for k in INT8 if k in by_kind]
        if ours is None or not peers:
            continue
        for traffic in ("back_to_back", "idle"):
            cells = [_ms(by_kind[k], traffic) if k in by_kind else "-" for k in INT8]
            fastest = min(peers, key=lambda r: r[traffic])
            ratio = ours[traffic] / fastest[traffic]
            passing = [r for r in peers if r.get("gate", {}).get("passed")]
            fastest_passing = min(passing, key=lambda r: r[traffic]) if passing else None
            lines.append(f"| {model} | {traffic.replace('_', ' ')} | {cells[0]} | {cells[1]} | "
                         f"{ours[traffic + '_artifact']} | {_ms(ours, traffic)} | {fastest['kind']} | "
                         f"**{ratio:.3f}x** ({_ratio_range(ours, fastest, traffic)}) | "
                         f"{'yes' if ratio <= TARGET else '**no**'} | "
                         + (f"{ours[traffic] / fastest_passing[traffic]:.3f}x ({fastest_passing['kind']})"
                            if fastest_passing else "none passes") + " |")
    lines += ["", "The gate on the held-out images, as fx-lightning's int8 gate judges (top-1 agreement with the "
              "fp32 model >= 0.99, accuracy drop <= 0.5 points, worst per-image cosine of the logits >= 0.99); "
              "fx-lightning's figures are those its manifest recorded for the selected artifact (fp32 artifacts "
              "are exact: their parity check, not this gate).", "",
              "| model | int8 | top-1 agreement (strict) | accuracy fp32 -> int8 | accuracy drop | worst cosine | "
              "images | gate |", "|---|---|---|---|---|---|---|---|"]
    for model in models:
        by_kind = by_model[model]
        rows = [(k, by_kind[k].get("gate")) for k in INT8 if k in by_kind]
        ours = by_kind.get("fx-lightning")
        if ours is not None:
            for artifact, gate in dict.fromkeys((ours[f"{t}_artifact"], json.dumps(ours.get(f"{t}_gate")))
                                                for t in ("back_to_back", "idle")):
                rows.append((f"fx-lightning: {artifact}", json.loads(gate)))
        for name, gate in rows:
            if not gate:
                lines.append(f"| {model} | {name} | - | - | - | - | - | fp32 (exact) |")
                continue
            verdict = "passes" if gate.get("passed") else "**fails**: " + "; ".join(gate.get("failures", []))
            lines.append(f"| {model} | {name} | {gate['top1_agreement']:.4f} ({gate['top1_agreement_strict']:.4f}) | "
                         f"{100 * gate['accuracy_reference']:.2f}% -> {100 * gate['accuracy_fused']:.2f}% | "
                         f"{100 * gate['accuracy_drop']:+.2f} pt | {gate['cosine_similarity_min']:.4f} | "
                         f"{int(gate['samples'])} | {verdict} |")
    return lines


def _ms(result: Dict[str, Any], traffic: str) -> str:
    return f"{result[traffic]:.2f} ({_range(result, traffic)})"


def _ratio_range(ours: Dict[str, Any], peer: Dict[str, Any], traffic: str) -> str:
    """The ratio's extremes over the processes' medians: ours fastest against the peer slowest, and back."""
    (low, high), (peer_low, peer_high) = (r.get(f"{traffic}_range", [r[traffic]] * 2) for r in (ours, peer))
    return f"{low / peer_high:.2f}-{high / peer_low:.2f}"


def _range(result: Dict[str, Any], traffic: str) -> str:
    low, high = result.get(f"{traffic}_range", [result[traffic]] * 2)
    return f"{low:.2f}-{high:.2f}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
