"""``fx-lightning serve DIR``: serve an export over HTTP (LitServe), with its input contract enforced."""

from __future__ import annotations

import argparse
from typing import Any

from fx_lightning.cli.common import flags_of
from fx_lightning.serve.artifact import DEFAULT_BATCH_TIMEOUT, DEFAULT_MAX_BATCH_SIZE
from fx_lightning.serve.server import ServeOptions

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    defaults = ServeOptions()
    serve = sub.add_parser(
        "serve", help="serve an export over HTTP: POST /predict, GET /health, GET /info, and the Open Inference "
                      "Protocol (/v2, as Triton and KServe speak it)",
        description="Loads the artifact the export selected for the batch size the server forms (or --format), "
                    "checks its sha256 and runs it on check.pt before /health reports ready; batches requests "
                    "dynamically; refuses a request that does not fit the export's input contract with a 4xx "
                    "naming what was expected. Speaks the Open Inference Protocol (KServe v2 REST, JSON and binary "
                    "tensors) under /v2 too, so Triton's clients and perf_analyzer work unchanged. Needs the serve "
                    "extra: pip install 'fx-lightning[serve]'.",
    )
    serve.add_argument("directory", help="an export directory (holds manifest.json)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--format", default=None, metavar="FORMAT",
                       help="the format or variant to serve (default: the export's selection)")
    serve.add_argument("--max-batch-size", type=int, default=None,
                       help="requests batched into one run (1: no batching; default: the batch size of most "
                            "throughput in the export's sweep, whose artifact is then served, else "
                            f"{DEFAULT_MAX_BATCH_SIZE})")
    serve.add_argument("--batch-timeout", type=float, default=None,
                       help="seconds a batch waits to fill (default "
                            f"{DEFAULT_BATCH_TIMEOUT:g}: none; a batch is what waits when the worker is free)")
    serve.add_argument("--workers", type=int, default=defaults.workers, help="inference worker processes")
    serve.add_argument("--threads", type=int, default=None, help="threads per worker (default: cores / workers)")
    serve.add_argument("--max-request-batch", type=int, default=defaults.max_request_batch,
                       help=f"samples in one request (default {defaults.max_request_batch})")
    serve.add_argument("--max-body-mb", type=float, default=defaults.max_body_mb,
                       help=f"request body limit in MiB (default {defaults.max_body_mb:g})")
    serve.add_argument("--top-k", type=int, default=defaults.top_k,
                       help=f"labels per row in a response when the export has labels (default {defaults.top_k})")
    serve.add_argument("--model-name", default=None,
                       help="the model's name under /v2/models/ (default: the export directory's name, as "
                            "fx-lightning triton names it)")
    serve.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace, console: Any) -> int:
    from fx_lightning.export import read_manifest
    from fx_lightning.serve.server import serve

    options = ServeOptions(**flags_of(args, ServeOptions))
    options.check()  # before anything is read: the flag's own error
    console.print(f"serving {args.directory} on http://{args.host}:{args.port} (POST /predict, GET /health, "
                  "GET /info; Open Inference Protocol under /v2)", markup=False)
    batching = options.with_batching(read_manifest(args.directory))
    wait = (f"waiting at most {1e3 * batching.batch_timeout:.1f} ms to fill" if batching.batch_timeout else
            "what waits when the worker is free")
    console.print(f"batching: up to {batching.max_batch_size} samples a run, {wait} ({batching.batching})",
                  markup=False)
    serve(args.directory, options, host=args.host, port=args.port, log_level=args.log_level)
    return 0
