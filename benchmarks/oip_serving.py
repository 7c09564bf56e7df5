"""The Open Inference Protocol under load: ``fx-lightning serve`` against tritonserver's Python backend serving the
same selected artifact with the same batching, both driven by Triton's own load generator, ``perf_analyzer``.

The model and export are ``http_serving.py``'s (torchvision's resnet18 trained on the digits at 224x224,
``digits.py``; the serving preset, the normalisation compiled in so requests are raw uint8 pixels, the selection
made for batch 8 back to back). ``fx-lightning triton`` writes the repository; tritonserver (the
``nvidia-pytriton`` wheel's 2.51, CPU; ``python tests/engines.py install``) loads only its model of the export's
selection (``--model-control-mode=explicit``), which runs the same artifact through the same checked loader as
``fx-lightning serve``. Same batching on both: requests joined up to 8 samples, waiting up to 5 ms; same threads:
2 for the model. Each server runs alone, in processes of its own; perf_analyzer runs in a process of its own too
(HTTP, binary tensors, zero-filled images, batch 1 per request) at concurrency 1, 4 and 16: three windows of at least
``--requests`` requests each, and its averages over them (throughput, p50, p99; client side). Everything shares
the machine's cores, as on a small serving host. Servers take turns ``--repeats`` times; the table shows medians.

    python benchmarks/oip_serving.py                  # the README table
    python benchmarks/oip_serving.py --requests 50 --repeats 1 --concurrency 16    # quick look
    python benchmarks/oip_serving.py --render         # the table again from the JSON
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Sequence

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

RESULTS = HERE / "results"
MAX_BATCH, BATCH_TIMEOUT = 8, 0.005
THREADS = 2
NAME = "resnet18-http"  # the export directory's name (http_serving.py's export): both servers' default model name
SERVERS = {
    "serve": f"fx-lightning serve (batching {MAX_BATCH}, {BATCH_TIMEOUT * 1000:g} ms)",
    "triton": f"tritonserver 2.51, Python backend (dynamic batching {MAX_BATCH}, {BATCH_TIMEOUT * 1000:g} ms)",
}


def measure(kind: str, directory: Path, repository: Path, concurrency: Sequence[int], requests: int,
            work: Path, engines: Any) -> Dict[int, Dict[str, float]]:
    """One server started alone, perf_analyzer at each concurrency, the server stopped."""
    from http_serving import free_port, start_server, stop_server, wait_ready

    results: Dict[int, Dict[str, float]] = {}
    if kind == "serve":
        port = free_port()
        proc = start_server("c", port, directory, work / "serve.log")  # --threads 2, batching 8 / 5 ms
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            for level in concurrency:
                results[level] = _perf(engines, f"127.0.0.1:{port}", level, requests, work / f"serve-{level}.csv")
        finally:
            stop_server(proc)
        return results
    os.environ["OMP_NUM_THREADS"] = str(THREADS)  # the Python backend's torch threads, as serve's worker
    with engines.tritonserver(repository, work, 300.0, ["--model-control-mode=explicit",
                                                        f"--load-model={NAME}"]) as url:
        for level in concurrency:
            results[level] = _perf(engines, url, level, requests, work / f"triton-{level}.csv")
    return results


def _perf(engines: Any, url: str, concurrency: int, requests: int, out: Path) -> Dict[str, float]:
    run = engines.run_perf_analyzer(NAME, url, out, concurrency=concurrency, requests=requests)
    if run.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed against {url}:\n{run.stdout[-3000:]}\n{run.stderr[-2000:]}")
    with open(out) as handle:
        row = next(csv.DictReader(handle))
    return {"rps": float(row["Inferences/Second"]), "p50_ms": float(row["p50 latency"]) / 1000,
            "p99_ms": float(row["p99 latency"]) / 1000, "errors": 0}


def run(concurrency: Sequence[int], requests: int, repeats: int, console: Any) -> Dict[str, Any]:
    from engines import Engines, engines_dir
    from http_serving import make_export
    from machine import cpu_description

    from fx_lightning.export import read_manifest
    from fx_lightning.serve.artifact import ServeOptions, artifact_for
    from fx_lightning.serve.triton import write_triton_repository

    engines = Engines(engines_dir())
    missing = engines.missing()
    if missing:
        raise SystemExit(missing)
    directory = make_export(console)
    artifact = artifact_for(read_manifest(directory), ServeOptions(max_batch_size=MAX_BATCH))
    samples: Dict[str, Dict[int, List[Dict[str, float]]]] = {k: {c: [] for c in concurrency} for k in SERVERS}
    with tempfile.TemporaryDirectory(prefix="oip-") as tmp:
        work = Path(tmp)
        assert directory.name == NAME, directory
        repository = write_triton_repository(directory, work / "repository", max_batch_size=MAX_BATCH,
                                             max_queue_delay_us=int(BATCH_TIMEOUT * 1e6)).root
        for repeat in range(repeats):
            for kind in SERVERS:
                console.print(f"repeat {repeat + 1}/{repeats}: {SERVERS[kind]}")
                for level, row in measure(kind, directory, repository, concurrency, requests, work,
                                          engines).items():
                    samples[kind][level].append(row)
    table = {kind: {c: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                    for c, runs in by_c.items()} for kind, by_c in samples.items()}
    return {"machine": cpu_description(), "threads": THREADS, "model": "resnet18 224x224 (digits, 10 classes)",
            "artifact": {"name": artifact[0], "runtime": artifact[1]}, "repeats": repeats, "requests": requests,
            "servers": SERVERS, "table": table, "samples": samples}


def to_markdown(result: Dict[str, Any]) -> str:
    table = result["table"]
    levels = list(next(iter(table.values())))
    lines = [f"Machine: {result['machine']}; {result['threads']} threads for the model in each server; perf_analyzer "
             f"on the same cores. Model: {result['model']}; both serve `{result['artifact']['name']}`. "
             f"Median of {result['repeats']} repeats.", "",
             "| server | concurrency | req/s | p50 ms | p99 ms | req/s vs Triton | p99 vs Triton |",
             "|---|---|---|---|---|---|---|"]
    for kind, label in result["servers"].items():
        for c in levels:
            row, peer = table[kind][c], table["triton"][c]
            lines.append(f"| {label} | {c} | {row['rps']:.1f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
                         f"{row['rps'] / peer['rps']:.2f}x | {row['p99_ms'] / peer['p99_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=150, help="requests per measurement window")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args(argv)
    from rich.console import Console

    console = Console()
    out = RESULTS / "oip_serving.json"
    if args.render:
        result = json.loads(out.read_text())
        result["table"] = {k: {int(c): v for c, v in by_c.items()} for k, by_c in result["table"].items()}
    else:
        result = run(args.concurrency, args.requests, args.repeats, console)
        out.write_text(json.dumps(result, indent=1))
    (RESULTS / "oip_serving.md").write_text(to_markdown(result))
    console.print(to_markdown(result), markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
