"""HTTP serving throughput and latency: ``fx-lightning serve`` against plain LitServe servers of the same model.

The model is torchvision's resnet18 trained on scikit-learn's handwritten digits at 224x224 (``digits.py``; no
download, cached), exported with the serving preset plus ``export.preprocess`` (the training normalisation
compiled into the graph: a client sends raw pixels) and the selection made for batch 8 back to back, the way a
batching server runs it. The clients send the same 224x224 RGB PNG of a held-out digit to every server, the way
each server's users send it:

- (a) plain LitServe as its docs show an image classifier: JSON ``{"image_data": base64 PNG}``, decoded with PIL,
  torchvision's ``ToTensor`` + ``Normalize``, the eager unfused model, no batching;
- (b) the same with LitServe's dynamic batching (``max_batch_size=8``, ``batch_timeout=0.005``);
- (c) ``fx-lightning serve`` on the export (same batching settings): the PNG as the request body, the selected
  artifact with the normalisation in its graph.

Each server runs in a process of its own (LitServe's HTTP process plus one inference worker, 2 threads) on
loopback; one asyncio client process (aiohttp) sends a fixed number of requests at concurrency 1, 4 and 16 after
a warm-up, and every answer's class is checked against the eager model's. The servers take turns, ``--repeats``
times, and the table shows the median throughput and latency percentiles over the repeats. Everything shares the
machine's cores (clients included), as on a small serving host.

    python benchmarks/http_serving.py                 # the README table
    python benchmarks/http_serving.py --requests 60 --repeats 1 --concurrency 1 16   # quick look
    python benchmarks/http_serving.py --render        # the table again from the JSON
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
from typing import Any, Dict, List, Sequence, Tuple

import litserve as ls  # the serve extra: pip install 'fx-lightning[serve]'

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
}


# ------------------------------------------------------------------------------------------------ the export


def export_dir() -> Path:
    from digits import CACHE  # benchmarks/digits.py

    return CACHE / "exports" / f"{MODEL}-http"


def make_export(console: Any) -> Path:
    """The trained model exported with the serving preset, the normalisation as a prologue, digit labels, and
    the selection for batch 8 back to back (kept between runs; delete the directory to export again)."""
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


def request_images(count: int = 16) -> Tuple[List[bytes], List[int]]:
    """PNGs (224x224 RGB) of held-out digits, as a camera would give them, and the eager model's class of each."""
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
    if kind == "c":
        command = [sys.executable, "-m", "fx_lightning", "serve", str(directory), "--port", str(port),
                   "--max-batch-size", str(MAX_BATCH), "--batch-timeout", str(BATCH_TIMEOUT), "--threads", "2"]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--serve-peer", kind, "--port", str(port)]
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


def request_for(kind: str, png: bytes) -> Tuple[bytes, str]:
    if kind == "c":
        return png, "image/png"
    return json.dumps({"image_data": base64.b64encode(png).decode()}).encode(), "application/json"


def class_of(kind: str, body: Dict[str, Any]) -> int:
    return int(body["class_idx"]) if kind != "c" else int(body["top_k"][0]["index"])


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


def run(concurrency: Sequence[int], requests: int, repeats: int, console: Any) -> Dict[str, Any]:
    from machine import cpu_description  # benchmarks/machine.py

    directory = make_export(console)
    from fx_lightning.export import read_manifest
    from fx_lightning.serve.server import ServeOptions, artifact_for

    artifact = artifact_for(read_manifest(directory), ServeOptions(max_batch_size=MAX_BATCH))
    pngs, classes = request_images()
    samples: Dict[str, Dict[int, List[Dict[str, float]]]] = {k: {c: [] for c in concurrency} for k in SERVERS}
    order = list(SERVERS)
    for repeat in range(repeats):
        for kind in (order if repeat % 2 == 0 else order[::-1]):
            port = free_port()
            proc = start_server(kind, port, directory, RESULTS / "cache" / f"http_serving_{kind}.log")
            url = f"http://127.0.0.1:{port}"
            try:
                wait_ready(url, proc)
                for c in concurrency:
                    result = asyncio.run(load(url, kind, pngs, classes, c, requests * max(1, c // 4)))
                    samples[kind][c].append(result)
                    console.print(f"repeat {repeat + 1} ({kind}) concurrency {c}: {result['rps']:.1f} req/s, "
                                  f"p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, "
                                  f"{result['errors']} errors, {result['wrong']} wrong")
            finally:
                stop_server(proc)
    table = {kind: {str(c): {key: statistics.median(s[key] for s in runs) for key in ("rps", "p50_ms", "p99_ms")}
                    | {"errors": sum(s["errors"] for s in runs), "wrong": sum(s["wrong"] for s in runs),
                       "requests": sum(s["requests"] for s in runs)}
                    for c, runs in by_c.items()} for kind, by_c in samples.items()}
    return {"machine": cpu_description(), "threads": 2, "model": f"{MODEL} {SIZE}x{SIZE} (digits, 10 classes)",
            "artifact": {"name": artifact[0], "runtime": artifact[1]}, "repeats": repeats,
            "requests": requests, "servers": SERVERS, "table": table, "samples": samples}


def to_markdown(result: Dict[str, Any]) -> str:
    table = result["table"]
    levels = list(next(iter(table.values())))
    lines = [f"Machine: {result['machine']}; {result['threads']} threads per inference worker; clients on the same "
             f"cores. Model: {result['model']}; (c) serves `{result['artifact']['name']}`"
             + (f" ({result['artifact']['runtime']})" if result['artifact']['runtime'] else "")
             + f". Median of {result['repeats']} repeats.", "",
             "| server | concurrency | req/s | p50 ms | p99 ms | vs (a) | vs (b) | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, label in result["servers"].items():
        for c in levels:
            row = table[kind][c]
            ratio_a = row["rps"] / table["a"][c]["rps"]
            ratio_b = row["rps"] / table["b"][c]["rps"]
            lines.append(f"| ({kind}) {label} | {c} | {row['rps']:.1f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
                         f"{ratio_a:.2f}x | {ratio_b:.2f}x | {row['errors']} of {row['requests']}"
                         + (f", {row['wrong']} wrong class" if row["wrong"] else "") + " |")
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=200, help="requests per level (x concurrency/4 above 4)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--render", action="store_true")
    parser.add_argument("--serve-peer", choices=["a", "b"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=8000, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_peer:
        serve_plain_litserve(args.serve_peer == "b", args.port)
        return 0
    from rich.console import Console

    console = Console()
    out = RESULTS / "http_serving.json"
    if args.render:
        result = json.loads(out.read_text())
    else:
        result = run(args.concurrency, args.requests, args.repeats, console)
        out.write_text(json.dumps(result, indent=1))
    (RESULTS / "http_serving.md").write_text(to_markdown(result))
    console.print(to_markdown(result), markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
