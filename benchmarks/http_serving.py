"""HTTP serving throughput and latency: ``fx-lightning serve`` against plain LitServe servers of the same model, and
``fx-lightning serve`` with the batching its export's throughput sweep recorded against itself without batching.

The model is torchvision's resnet18 trained on scikit-learn's handwritten digits at 224x224 (``digits.py``; no
download, cached; ``--size 32``: at 32x32, a CIFAR-sized input, where a batch costs far less per sample), exported with the serving preset plus ``export.preprocess`` (the training normalisation
compiled into the graph: a client sends raw pixels) and the selection made for batch 8 back to back, the way a
batching server runs it; the export records the throughput sweep (batch sizes 1, 2, 4... until throughput stops
growing). An export cached from before the sweep existed gets one first, in place, with
``fx-lightning bench DIR --select --strategy max_throughput --select-traffic back_to_back --no-unfused --threads 2``
(the output says so). The clients send the same 224x224 RGB PNG of a held-out digit to every server, the way each
server's users send it:

- (a) plain LitServe as its docs show an image classifier: JSON ``{"image_data": base64 PNG}``, decoded with PIL,
  torchvision's ``ToTensor`` + ``Normalize``, the eager unfused model, no batching;
- (b) the same with LitServe's dynamic batching (``max_batch_size=8``, ``batch_timeout=0.005``);
- (c) ``fx-lightning serve`` on the export (same batching settings, given as flags): the PNG as the request body,
  the selected artifact with the normalisation in its graph;
- (d) ``fx-lightning serve`` with no batching flags: the max batch size, batch timeout and artifact come from the
  export's sweep (the max-throughput batch size of its best artifact, which it serves; no queue delay);
- (e) ``fx-lightning serve --max-batch-size 1``: no batching, the artifact the server picks for batch 1.

What (c), (d) and (e) served (artifact, max batch size, batch timeout and where they came from) is read from each
server's ``GET /info`` and recorded. Each server runs in a process of its own (LitServe's HTTP process plus one
inference worker, 2 threads) on loopback; one asyncio client process (aiohttp) sends a fixed number of requests at
concurrency 1, 4 and 16 after a warm-up, and every answer's class is checked against the eager model's. The
servers take turns, ``--repeats`` times, and the table shows the median throughput and latency percentiles over
the repeats; below it, per concurrency, (d)'s throughput over (e)'s (the issue's done-when: at least 1.2x).
Everything shares the machine's cores (clients included), as on a small serving host.

    python benchmarks/http_serving.py                 # the README table (all servers)
    python benchmarks/http_serving.py --servers d e   # the sweep's batching against none (-> http_serving_de.*)
    python benchmarks/http_serving.py --servers d e --merge   # ... its rows into http_serving.json/.md
    python benchmarks/http_serving.py --servers d e --size 32  # the same at 32x32 (-> http_serving_de_32px.*)
    python benchmarks/http_serving.py --requests 60 --repeats 1 --concurrency 1 16   # quick look
    python benchmarks/http_serving.py --render        # the table again from the JSON

A run of some servers only writes ``results/http_serving_<servers>.json`` and ``.md`` unless ``--out`` says where;
``--merge`` instead keeps the other servers' rows of ``--out`` (default ``results/http_serving.json``), which must
have been measured on the same machine, and the table says which run each row comes from.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import litserve as ls  # the serve extra: pip install 'fx-lightning[serve]'

from fx_lightning.serve.artifact import SWEPT
from fx_lightning.serve.server import stop_on_sigterm

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

RESULTS = HERE / "results"
MODEL = "resnet18"
SIZE = 224
MAX_BATCH, BATCH_TIMEOUT = 8, 0.005
SERVERS = {
    "a": "LitServe, eager, no batching (LitServe's docs)",
    "b": f"LitServe, eager, batching ({MAX_BATCH}, {BATCH_TIMEOUT * 1000:g} ms)",
    "c": f"fx-lightning serve, selected artifact, batching ({MAX_BATCH}, {BATCH_TIMEOUT * 1000:g} ms)",
    "d": "fx-lightning serve, no batching flags: the export's sweep",
    "e": "fx-lightning serve --max-batch-size 1 (no batching)",
}
FXL = ("c", "d", "e")  # the fx-lightning servers: the PNG as the body, /info says what they serve
# (d)'s throughput over (e)'s that the issue asks for (the sweep's batching against none).
DONE_WHEN = 1.2
SWEEP_COMMAND = ["bench", "--select", "--strategy", "max_throughput", "--select-traffic", "back_to_back",
                 "--no-unfused", "--threads", "2"]


# ------------------------------------------------------------------------------------------------ the export


def export_dir() -> Path:
    from digits import CACHE  # benchmarks/digits.py

    return CACHE / "exports" / (f"{MODEL}-http" if SIZE == 224 else f"{MODEL}-{SIZE}px-http")


def make_export(console: Any) -> Path:
    """The trained model exported with the serving preset, the normalisation as a prologue, digit labels, and
    the selection for batch 8 back to back, with the throughput sweep every export records now (kept between runs;
    delete the directory to export again; :func:`ensure_sweep` adds the sweep to one cached from before)."""
    from digits import MEAN, STD, digits_splits, trained_model
    from serving import serving_config  # benchmarks/serving.py

    from fx_lightning.pipeline import Batches, fuse_verify_export

    target = export_dir()
    if (target / "manifest.json").is_file():
        return target
    train, held_out = digits_splits()
    model = trained_model(MODEL, SIZE, log=console.print)
    held = list(held_out.batches(32, SIZE))
    calibration = [x for x, _ in train.batches(32, SIZE, shuffle=True, seed=1)][:8]
    config = serving_config(len(held))
    config.export.select_batch_size = MAX_BATCH
    config.export.select_traffic = type(config.export.select_traffic)["back_to_back"]
    config.export.preprocess.enabled = True
    config.export.preprocess.mean = [MEAN] * 3
    config.export.preprocess.std = [STD] * 3
    config.export.labels = [str(d) for d in range(10)]
    start = time.perf_counter()
    fuse_verify_export(model, config, Batches(held, "held-out digits", calibration=calibration), export_dir=target)
    console.print(f"exported {MODEL} in {time.perf_counter() - start:.0f} s to {target}")
    return target


def ensure_sweep(directory: Path, console: Any, again: bool = False) -> Dict[str, Any]:
    """The batching the export's throughput sweep implies (what (d) takes); an export made before the sweep existed
    (or any, ``again``: the sweep taken on the machine as it is now) gets one first, in place (``fx-lightning bench
    --select --strategy max_throughput ...`` rewrites manifest.json; 5 to 10 minutes on 2 cores)."""
    from fx_lightning.export import read_manifest
    from fx_lightning.export.select.sweep import recorded_batching

    added = None
    if again or recorded_batching(read_manifest(directory)) is None:
        command = [sys.executable, "-m", "fx_lightning", SWEEP_COMMAND[0], str(directory.resolve()),
                   *SWEEP_COMMAND[1:]]
        log = RESULTS / "cache" / "http_serving_sweep.log"
        console.print(f"{directory}: " + ("sweeping again (--resweep)" if again else "no throughput sweep in its "
                      "manifest (exported before it existed); adding one") + ": "
                      f"fx-lightning {' '.join(command[3:4] + [str(directory)] + command[5:])} (log: {log})",
                      markup=False)
        start = time.perf_counter()
        with open(log, "w") as handle:
            done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=HERE)
        if done.returncode != 0:
            raise RuntimeError(f"fx-lightning bench exited with {done.returncode}: see {log}")
        added = {"command": f"fx-lightning {' '.join(SWEEP_COMMAND[:1] + [str(directory)] + SWEEP_COMMAND[1:])}",
                 "seconds": round(time.perf_counter() - start, 1)}
        console.print(f"sweep recorded in {added['seconds']:.0f} s", markup=False)
    manifest = read_manifest(directory)
    batching = recorded_batching(manifest)
    if batching is None:
        raise RuntimeError(f"{directory}: still no throughput sweep to take the batching from (see "
                           f"{RESULTS / 'cache' / 'http_serving_sweep.log'}); (d) would serve the defaults")
    console.print(f"the sweep's batching: up to {batching.max_batch_size} samples a run, preferred "
                  f"{list(batching.preferred_batch_sizes)}, a batch waits at most "
                  f"{1e3 * batching.queue_delay_s:.1f} ms ({batching.why})", markup=False)
    return {"max_batch_size": batching.max_batch_size, "preferred_batch_sizes": list(batching.preferred_batch_sizes),
            "queue_delay_ms": 1e3 * batching.queue_delay_s, "why": batching.why, "added_by_this_run": added,
            "sweeps": [{"artifact": w.artifact, "runtime": w.runtime, "traffic": w.traffic, "stop": w.stop,
                        "points": [{"batch_size": p.batch_size, "throughput": p.throughput, "p50_ms": p.p50_ms,
                                    "p99_ms": p.p99_ms} for p in w.points]}
                       for w in manifest.bench.sweeps]}


def request_images(count: int = 16) -> Tuple[List[bytes], List[int]]:
    """PNGs (SIZE x SIZE RGB) of held-out digits, as a camera would give them, and the eager model's class of each."""
    import torch
    from PIL import Image

    from digits import MEAN, STD, digits_splits, to_model_input, trained_model

    _, held_out = digits_splits()
    x = to_model_input(held_out.images[:count], SIZE)
    pixels = ((x * STD + MEAN) * 255).round().clamp(0, 255).to(torch.uint8)  # what the camera gave
    model = trained_model(MODEL, SIZE)
    with torch.no_grad():
        classes = model((pixels.double() / 255 - MEAN).div(STD).float()).argmax(1).tolist()
    pngs = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy(), "RGB").save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    return pngs, classes


# ------------------------------------------------------------------------------------------------ the peers


class ImageClassifierAPI(ls.LitAPI):
    """(a)/(b): an image classifier as LitServe's docs write one, on the eager unfused model."""

    def setup(self, device: str) -> None:
        import torch
        from torchvision import transforms

        from digits import MEAN, STD, trained_model

        torch.set_num_threads(2)
        self.batching = self.max_batch_size > 1
        self.model = trained_model(MODEL, SIZE).eval()
        self.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize([MEAN] * 3, [STD] * 3)])

    def decode_request(self, request):  # noqa: ANN001 - unannotated: LitServe reads the annotation as the body type
        from PIL import Image

        image = Image.open(io.BytesIO(base64.b64decode(request["image_data"]))).convert("RGB")
        return self.transform(image)

    def batch(self, inputs: List[Any]) -> Any:
        import torch

        return torch.stack(inputs)

    def predict(self, x: Any) -> Any:
        import torch

        with torch.no_grad():
            probabilities = torch.softmax(self.model(x if self.batching else x.unsqueeze(0)), dim=1)
        return probabilities.max(dim=1)

    def unbatch(self, output: Any) -> List[Tuple[float, int]]:
        values, indices = output
        return list(zip(values.tolist(), indices.tolist()))

    def encode_response(self, output):  # noqa: ANN001,ANN201 - LitServe reads the annotation as the response type
        if not self.batching:
            values, indices = output
            output = (values.item(), indices.item())
        return {"class_idx": output[1], "probability": output[0]}


def serve_plain_litserve(batching: bool, port: int) -> None:
    api = ImageClassifierAPI(max_batch_size=MAX_BATCH if batching else 1,
                             batch_timeout=BATCH_TIMEOUT if batching else 0.0)
    stop_on_sigterm()
    ls.LitServer(api, accelerator="cpu", devices=1).run(port=port, host="127.0.0.1", generate_client_file=False,
                                                        log_level="warning", num_api_servers=1)


# ------------------------------------------------------------------------------------------------ timing


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(kind: str, port: int, directory: Path, log: Path) -> subprocess.Popen:
    if kind in FXL:
        batching = {"c": ["--max-batch-size", str(MAX_BATCH), "--batch-timeout", str(BATCH_TIMEOUT)],
                    "d": [],  # the export's sweep
                    "e": ["--max-batch-size", "1"]}[kind]
        command = [sys.executable, "-m", "fx_lightning", "serve", str(directory), "--port", str(port), *batching,
                   "--threads", "2"]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--serve-peer", kind, "--port", str(port),
                   "--size", str(SIZE)]
    handle = open(log, "w")
    return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=HERE, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (a graceful LitServe shutdown), then SIGKILL to the whole process group if it lingers."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # any HTTP or worker process left behind
    except ProcessLookupError:
        pass


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def served(url: str) -> Dict[str, Any]:
    """What an fx-lightning server serves and how it batches, from its ``GET /info``."""
    with urllib.request.urlopen(f"{url}/info", timeout=10) as response:
        info = json.loads(response.read())["model"]
    options = info["options"]
    return {"artifact": info["artifact"]["name"], "runtime": info["artifact"]["runtime"],
            "max_batch_size": options["max_batch_size"], "batch_timeout_ms": 1e3 * options["batch_timeout"],
            "batching": options["batching"]}


def describe(s: Dict[str, Any]) -> str:
    runtime = f" [{s['runtime']}]" if s["runtime"] else ""
    if s["max_batch_size"] == 1:
        return f"`{s['artifact']}`{runtime}, no batching" + (f" (max batch size 1: {s['batching']})"
                                                              if s["batching"] == SWEPT else "")
    return (f"`{s['artifact']}`{runtime}, up to {s['max_batch_size']} a batch, waiting at most "
            f"{s['batch_timeout_ms']:.1f} ms ({s['batching']})")


def request_for(kind: str, png: bytes) -> Tuple[bytes, str]:
    if kind in FXL:
        return png, "image/png"
    return json.dumps({"image_data": base64.b64encode(png).decode()}).encode(), "application/json"


def class_of(kind: str, body: Dict[str, Any]) -> int:
    return int(body["top_k"][0]["index"]) if kind in FXL else int(body["class_idx"])


async def load(url: str, kind: str, pngs: List[bytes], classes: List[int], concurrency: int,
               requests: int) -> Dict[str, float]:
    """``requests`` requests from ``concurrency`` concurrent clients; throughput, latency percentiles, errors."""
    import aiohttp

    bodies = [request_for(kind, png) for png in pngs]
    latencies: List[float] = []
    errors = wrong = 0
    counter = iter(range(requests))

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal errors, wrong
        for i in counter:
            body, content_type = bodies[i % len(bodies)]
            start = time.perf_counter()
            async with session.post(f"{url}/predict", data=body, headers={"Content-Type": content_type}) as resp:
                answer = await resp.read()
            latencies.append(time.perf_counter() - start)
            if resp.status != 200:
                errors += 1
            elif class_of(kind, json.loads(answer)) != classes[i % len(classes)]:
                wrong += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        warm = iter(range(2 * concurrency))
        for _ in warm:  # warm-up: compile, caches, connections
            body, content_type = bodies[0]
            async with session.post(f"{url}/predict", data=body, headers={"Content-Type": content_type}) as resp:
                await resp.read()
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    ordered = sorted(latencies)
    return {"rps": requests / elapsed, "p50_ms": 1000 * ordered[len(ordered) // 2],
            "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "errors": errors, "wrong": wrong, "requests": requests}


def run(kinds: Sequence[str], concurrency: Sequence[int], requests: int, repeats: int, console: Any,
        resweep: bool = False) -> Dict[str, Any]:
    from machine import cpu_description  # benchmarks/machine.py

    directory = make_export(console)
    sweep = ensure_sweep(directory, console, resweep) if any(k in FXL for k in kinds) else None
    pngs, classes = request_images()
    samples: Dict[str, Dict[str, List[Dict[str, float]]]] = {k: {str(c): [] for c in concurrency} for k in kinds}
    what: Dict[str, Dict[str, Any]] = {}  # what each fx-lightning server served (its /info)
    order = list(kinds)
    for repeat in range(repeats):
        for kind in (order if repeat % 2 == 0 else order[::-1]):
            port = free_port()
            proc = start_server(kind, port, directory, RESULTS / "cache" / f"http_serving_{kind}.log")
            url = f"http://127.0.0.1:{port}"
            try:
                wait_ready(url, proc)
                if kind in FXL:
                    now = served(url)
                    if what.setdefault(kind, now) != now:
                        raise RuntimeError(f"({kind}) served {now} in repeat {repeat + 1}, {what[kind]} before")
                    console.print(f"({kind}) serves {describe(now)}", markup=False)
                for c in concurrency:
                    result = asyncio.run(load(url, kind, pngs, classes, c, requests * max(1, c // 4)))
                    samples[kind][str(c)].append(result)
                    console.print(f"repeat {repeat + 1} ({kind}) concurrency {c}: {result['rps']:.1f} req/s, "
                                  f"p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, "
                                  f"{result['errors']} errors, {result['wrong']} wrong")
            finally:
                stop_server(proc)
    table = {kind: {c: {key: statistics.median(s[key] for s in runs) for key in ("rps", "p50_ms", "p99_ms")}
                    | {"errors": sum(s["errors"] for s in runs), "wrong": sum(s["wrong"] for s in runs),
                       "requests": sum(s["requests"] for s in runs)}
                    for c, runs in by_c.items()} for kind, by_c in samples.items()}
    labels = {kind: SERVERS[kind] for kind in kinds}
    if "d" in what:
        d = what["d"]
        labels["d"] = (f"fx-lightning serve, no batching flags: {d['batching']} ({d['max_batch_size']}, "
                       f"{d['batch_timeout_ms']:.1f} ms)")
    run_info = {"when": time.strftime("%Y-%m-%d %H:%M", time.localtime()), "servers": list(kinds),
                "repeats": repeats, "requests": requests, "concurrency": list(concurrency)}
    result = {"machine": cpu_description(), "threads": 2, "model": f"{MODEL} {SIZE}x{SIZE} (digits, 10 classes)",
              "repeats": repeats, "requests": requests, "servers": labels, "served": what, "sweep": sweep,
              "runs": [run_info], "run_of": {kind: 0 for kind in kinds}, "table": table, "samples": samples}
    if "c" in what:  # the key older results have
        result["artifact"] = {"name": what["c"]["artifact"], "runtime": what["c"]["runtime"]}
    return result


def merged(previous: Dict[str, Any], new: Dict[str, Any]) -> Dict[str, Any]:
    """``previous`` with the servers ``new`` measured replaced by ``new``'s rows (same machine only)."""
    if previous["machine"] != new["machine"]:
        raise RuntimeError(f"--merge: the results to merge into were measured on {previous['machine']}, this run on "
                           f"{new['machine']}; write them apart (--out)")
    out = dict(previous)
    runs = list(previous.get("runs") or [{"when": "earlier", "servers": list(previous["table"]),
                                          "repeats": previous["repeats"], "requests": previous["requests"]}])
    run_of = dict(previous.get("run_of") or {kind: 0 for kind in previous["table"]})
    runs.append(new["runs"][0])
    for key in ("servers", "served", "table", "samples"):
        out[key] = dict(previous.get(key) or {})
    for kind in new["table"]:
        run_of[kind] = len(runs) - 1
        for key in ("servers", "table", "samples"):
            out[key][kind] = new[key][kind]
        if kind in new["served"]:
            out["served"][kind] = new["served"][kind]
    out["servers"] = {k: out["servers"][k] for k in sorted(out["servers"])}
    out["runs"], out["run_of"] = runs, run_of
    out["sweep"] = new["sweep"] or previous.get("sweep")
    if "c" in new["served"]:
        out["artifact"] = new["artifact"]
    return out


def ratio(table: Dict[str, Any], kind: str, base: str, c: str) -> str:
    if base not in table or c not in table[base] or c not in table[kind]:
        return "-"
    return f"{table[kind][c]['rps'] / table[base][c]['rps']:.2f}x"


def sweep_gain(sweep: Optional[Dict[str, Any]], d: Optional[Dict[str, Any]], clients: int) -> str:
    """The recorded sweep's samples/s (back to back, the artifact (d) serves) at the largest batch ``clients`` can
    fill within (d)'s max batch size, over its batch 1: what batching gains inside the worker, before any HTTP,
    so about the most (d) / (e) can reach at that concurrency."""
    for w in (sweep or {}).get("sweeps") or []:
        if not d or (w["artifact"], w["runtime"], w["traffic"]) != (d["artifact"], d["runtime"], "back_to_back"):
            continue
        at = {p["batch_size"]: p["throughput"] for p in w["points"]}
        fill = max((b for b in at if b <= min(clients, d["max_batch_size"])), default=None)
        if 1 in at and fill:
            return f"{at[fill] / at[1]:.2f}x (batch {fill})"
    return "-"


def to_markdown(result: Dict[str, Any]) -> str:
    table = result["table"]
    served = dict(result.get("served") or {})
    if "c" in table and "c" not in served and result.get("artifact"):  # results from before /info was read
        served["c"] = {"artifact": result["artifact"]["name"], "runtime": result["artifact"]["runtime"],
                       "max_batch_size": MAX_BATCH, "batch_timeout_ms": BATCH_TIMEOUT * 1e3, "batching": "given"}
    runs = result.get("runs") or [{"repeats": result["repeats"], "requests": result["requests"]}]
    run_of = result.get("run_of") or {kind: 0 for kind in table}
    if len(runs) == 1:
        repeats = f"Median of {result['repeats']} repeats."
    else:
        repeats = " ".join(f"{', '.join(f'({k})' for k in sorted(table) if run_of[k] == i)}: run of {r['when']}, "
                           f"median of {r['repeats']} repeats." for i, r in enumerate(runs)
                           if any(run_of[k] == i for k in table))
    lines = [f"Machine: {result['machine']}; {result['threads']} threads per inference worker; clients on the same "
             f"cores. Model: {result['model']}. {repeats}", ""]
    lines += [f"- ({kind}) serves {describe(s)}" for kind, s in sorted(served.items()) if kind in table]
    sweep = result.get("sweep")
    if sweep and ("d" in table or "e" in table):
        added = sweep.get("added_by_this_run")
        lines.append(f"- the sweep: {sweep['why']}"
                     + (f" (recorded by this run: `{added['command']}`)" if added else ""))
    lines += ["", "| server | concurrency | req/s | p50 ms | p99 ms | vs (a) | vs (b) | errors |",
              "|---|---|---|---|---|---|---|---|"]
    for kind, label in result["servers"].items():
        for c, row in table[kind].items():
            lines.append(f"| ({kind}) {label} | {c} | {row['rps']:.1f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
                         f"{ratio(table, kind, 'a', c)} | {ratio(table, kind, 'b', c)} | "
                         f"{row['errors']} of {row['requests']}"
                         + (f", {row['wrong']} wrong class" if row["wrong"] else "") + " |")
    if "d" in table and "e" in table:
        lines += ["", f"The export's sweep batching (d) against no batching (e), throughput (done when at least "
                      f"{DONE_WHEN:g}x). The sweep's column: the export's own samples/s at the largest batch that many "
                      "clients can fill over batch 1, inside the worker (no HTTP), about the most (d) / (e) can reach:",
                  "",
                  "| concurrency | (d) req/s | (e) req/s | (d) / (e) | per repeat | at least " f"{DONE_WHEN:g}x | the sweep's |",
                  "|---|---|---|---|---|---|---|"]
        for c in table["d"]:
            if c not in table["e"]:
                continue
            d, e = table["d"][c]["rps"], table["e"][c]["rps"]
            each = [sd["rps"] / se["rps"] for sd, se in zip(result["samples"]["d"][c], result["samples"]["e"][c])]
            lines.append(f"| {c} | {d:.1f} | {e:.1f} | {d / e:.2f}x | {', '.join(f'{r:.2f}' for r in each)} | "
                         f"{'yes' if d / e >= DONE_WHEN else 'no'} | {sweep_gain(sweep, served.get('d'), int(c))} |")
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> int:
    global SIZE  # --size: the module's functions (and the peer servers it starts) read it
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS),
                        help="the servers to run (default: all)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=200, help="requests per level (x concurrency/4 above 4)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON to write (the .md beside it); default: results/http_serving.json for all "
                             "servers or --merge, else results/http_serving_<servers>.json")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the servers not run from --out's JSON (same machine only)")
    parser.add_argument("--resweep", action="store_true",
                        help="record the export's throughput sweep again first (fx-lightning bench --select ...), "
                             "on the machine as it is now, even when it has one")
    parser.add_argument("--render", action="store_true", help="the table again from --out's JSON")
    parser.add_argument("--size", type=int, default=SIZE,
                        help=f"the model's input size in pixels (default {SIZE}; each size is trained and exported "
                             "once and cached)")
    parser.add_argument("--serve-peer", choices=["a", "b"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=8000, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    SIZE = args.size
    if args.serve_peer:
        serve_plain_litserve(args.serve_peer == "b", args.port)
        return 0
    from rich.console import Console

    console = Console()
    kinds = [k for k in SERVERS if k in args.servers]
    everything = kinds == list(SERVERS) or args.merge
    size = "" if SIZE == 224 else f"_{SIZE}px"
    out = args.out or RESULTS / (f"http_serving{size}.json" if everything else f"http_serving_{''.join(kinds)}{size}.json")
    previous: Optional[Dict[str, Any]] = json.loads(out.read_text()) if args.merge and out.is_file() else None
    if previous is not None and not args.render:
        from machine import cpu_description  # benchmarks/machine.py

        if previous["machine"] != cpu_description():
            console.print(f"--merge: {out} was measured on {previous['machine']}, this machine is "
                          f"{cpu_description()}: write this run apart (--out)", markup=False)
            return 2
    if args.render:
        result = json.loads(out.read_text())
    else:
        result = run(kinds, args.concurrency, args.requests, args.repeats, console, args.resweep)
        if previous is not None:
            result = merged(previous, result)
        out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(to_markdown(result))
    console.print(to_markdown(result), markup=False, soft_wrap=True)
    console.print(f"written: {out} and {out.with_suffix('.md')}", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
