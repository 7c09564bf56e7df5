"""``fx-lightning triton DIR OUT``: a Triton Inference Server model repository from an export."""

from __future__ import annotations

import argparse
from typing import Any

from fx_lightning.cli.common import flags_of
from fx_lightning.serve.triton import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUE_DELAY_US

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    triton = sub.add_parser(
        "triton", help="write a Triton Inference Server model repository from an export (ONNX Runtime, OpenVINO, "
                       "Python backend)",
        description="Writes OUT/<name>_<format>/config.pbtxt and 1/<the artifact's files> for each artifact Triton "
                    "can serve: onnx and openvino (and their int8/bf16 variants) on their own backends, with names, "
                    "data types and dims read off the artifact and checked against the manifest; the export's "
                    "selection (OUT/<name>: the model fx-lightning serve names so too) and each pt2/aoti artifact on "
                    "the Python backend, through the export's checked loader. Each file is checked against its "
                    "sha256; plus OUT/README.md on running tritonserver on it. graph_module and code artifacts are "
                    "not written (the reason is printed).",
    )
    triton.add_argument("directory", help="an export directory (holds manifest.json)")
    triton.add_argument("out", help="the model repository to write into (created if missing)")
    triton.add_argument("--name", default=None, help="model name prefix (default: the export directory's name)")
    triton.add_argument("--format", action="append", dest="formats", metavar="FORMAT",
                        help="manifest entry to write (repeatable; default: every one Triton can serve)")
    triton.add_argument("--max-batch-size", type=int, default=None, metavar="N",
                        help="Triton's max_batch_size for dynamic-batch artifacts (default: the batch size of most "
                             "throughput in the export's sweep of the artifact, else "
                             f"{DEFAULT_MAX_BATCH_SIZE}; 0: no batching, full shapes); fixed-batch artifacts get 0")
    triton.add_argument("--instances", type=int, default=1, metavar="N", help="CPU instances of each model")
    triton.add_argument("--no-dynamic-batching", action="store_false", dest="dynamic_batching",
                        help="leave Triton's dynamic batcher off (requests still may hold a batch)")
    triton.add_argument("--preferred-batch-size", type=int, action="append", dest="preferred_batch_sizes",
                        metavar="N", help="the dynamic batcher's preferred batch size (repeatable; default: the "
                                          "swept sizes within 5%% of the most throughput, else Triton's default)")
    triton.add_argument("--max-queue-delay-us", type=int, default=None, metavar="US",
                        help="how long the batcher waits for a batch to fill (default: 0 with the export's sweep, "
                             f"a batch being what waits when the model is free; else {DEFAULT_MAX_QUEUE_DELAY_US})")
    triton.add_argument("--overwrite", action="store_true", help="replace model directories of the same name")
    triton.add_argument("--no-python", action="store_false", dest="python",
                        help="write no Python-backend models (the server then needs no torch or fx-lightning)")


def run(args: argparse.Namespace, console: Any) -> int:
    from fx_lightning.serve.triton import TritonOptions, describe, write_triton_repository

    repository = write_triton_repository(args.directory, args.out, **flags_of(args, TritonOptions))
    for line in describe(repository):
        console.print(line, markup=False, soft_wrap=True)
    return 0
