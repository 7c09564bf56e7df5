"""The records of a Triton model repository (:class:`TritonModel`, what was skipped, what was written) and their
text: each model's ``config.pbtxt`` (protobuf text of Triton's ModelConfig, written without protobuf) and the
repository's README. :mod:`fx_lightning.serve.triton` plans, checks and writes them."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from fx_lightning.common.dtypes import BY_TORCH, TORCH_TO_TRITON
from fx_lightning.errors import ConfigError
from fx_lightning.export.manifest import Manifest
from fx_lightning.export.select.sweep import recorded_batching
from fx_lightning.serve.contract import Contract
from fx_lightning.signature.signature import DimKind, DimSpec, LeafSpec

__all__ = ["TritonOptions", "DEFAULT_MAX_BATCH_SIZE", "DEFAULT_MAX_QUEUE_DELAY_US", "TritonModel", "SkippedArtifact",
           "TritonRepository", "stated_leaf", "data_type", "contract_model", "MODEL_NAME", "default_model_name",
           "config_text", "config_json", "readme_text",
           "describe", "int_at_least", "model_name_at"]

# Batching: a dynamic-batch artifact gets this max_batch_size unless told otherwise. Small on purpose: on a CPU,
# batches beyond a few samples add latency and little throughput, and OpenVINO's backend runs every batch padded
# to max_batch_size (see _openvino_parameters).
DEFAULT_MAX_BATCH_SIZE = 8
# How long Triton's dynamic batcher holds a request for others to join it: 0.1 ms, against CPU runs of milliseconds.
DEFAULT_MAX_QUEUE_DELAY_US = 100


def stated_leaf(name: str, dtype: str, sizes: Sequence[Optional[int]]) -> LeafSpec:
    """A tensor as a runtime states it (an artifact's declared tensor, a Triton config's): a fixed size where
    ``sizes`` gives one, any size (variable) where it gives None."""
    dims = tuple(DimSpec(DimKind.variable, 0, 0, 0) if s is None else DimSpec(DimKind.fixed, s, s, s) for s in sizes)
    return LeafSpec(name, name, (), dtype, dims)


def data_type(tensor: LeafSpec) -> str:
    """Triton's data type of a tensor (``float32`` -> ``TYPE_FP32``)."""
    return TORCH_TO_TRITON[tensor.dtype]


@dataclass
class TritonModel:
    """One model of the repository: where it is, what it serves and how Triton is to run it. Its tensors are leaves
    as the config states them: the artifact's names, a fixed size or any (:func:`stated_leaf`)."""

    name: str
    entry: str  # the manifest's format entry (onnx, onnx-int8, openvino...)
    backend: str  # onnxruntime | openvino
    directory: Path
    files: List[str]  # under directory/VERSION
    max_batch_size: int
    inputs: List[LeafSpec]
    outputs: List[LeafSpec]
    instances: int = 1
    dynamic_batching: bool = False
    preferred_batch_sizes: List[int] = field(default_factory=list)
    max_queue_delay_us: int = DEFAULT_MAX_QUEUE_DELAY_US
    parameters: Dict[str, str] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)  # decisions a user should know (no batching, padding, precision)
    labels: List[str] = field(default_factory=list)  # written to labels.txt, named by the first output
    selection: bool = False  # serves the export's selection (``entry`` is what this machine picks), not one entry
    # The export's name of a tensor the artifact names differently (OpenVINO names outputs after their operation).
    export_names: Dict[str, str] = field(default_factory=dict)
    # Inputs a request may leave out (``optional: true``): a stand-in was proven to mean leaving them out, and the
    # model fills it in (the Python backend and fx-lightning serve; a native backend's artifact needs every input).
    optional_inputs: List[str] = field(default_factory=list)

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    def dims(self, tensor: LeafSpec) -> Tuple[int, ...]:
        """The config's dims: after the batch axis when the model batches, -1 where any size; ``[1]`` for a tensor
        with no axis but the batch one (reshaped to ``[]``: Triton wants at least one dim)."""
        sizes = [-1 if d is None else d for d in tensor.sizes()]
        return tuple(sizes[1:] if self.batching else sizes) or (1,)

    def stated_shape(self, tensor: LeafSpec) -> List[int]:
        """A tensor's shape as the protocol states it: the config's dims, after the sample axis where the model
        batches (-1: any size). A tensor with no axis but the sample axis is ``[-1, 1]``, as in Triton."""
        return ([-1] if self.batching else []) + list(self.dims(tensor))

    def reshape(self, tensor: LeafSpec) -> Optional[Tuple[int, ...]]:
        """The shape the model itself sees where it differs from the dims: ``[]`` for a tensor stated as ``[1]``."""
        return () if len(tensor.dims) == int(self.batching) else None

    def label_file(self, tensor: LeafSpec) -> Optional[str]:
        """``labels.txt``, the export's class names, for the first output when they were attached."""
        return "labels.txt" if self.labels and tensor is self.outputs[0] else None


@dataclass(frozen=True)
class SkippedArtifact:
    """An entry of the export that was not written, and why."""

    entry: str
    reason: str


@dataclass
class TritonRepository:
    """What :func:`write_triton_repository` wrote."""

    root: Path
    models: List[TritonModel]
    skipped: List[SkippedArtifact] = field(default_factory=list)
    readme: Optional[Path] = None

    @property
    def directories(self) -> List[Path]:
        return [m.directory for m in self.models]


# What Triton accepts as a model name (it names the model's directory).
MODEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def default_model_name(export_dir: Path) -> str:
    """The export directory's name, made a valid Triton model name: what the repository and the server call the
    model unless told otherwise."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", export_dir.resolve().name).lstrip(".-")
    return cleaned or "model"


def contract_model(name: str, contract: Contract, entry: str, backend: str, directory: Path, *,
                   max_batch_size: int, instances: int = 1, dynamic_batching: bool = True,
                   preferred_batch_sizes: Sequence[int] = (),
                   max_queue_delay_us: int = DEFAULT_MAX_QUEUE_DELAY_US) -> TritonModel:
    """A model that serves the export's contract as it stands (its input and output names, dtypes and shapes from
    the manifest): what ``fx-lightning serve`` states at ``/v2/models/{name}/config`` and what the repository's
    Python-backend models are written with, one record for both. It batches when the export has a sample axis
    (dim 0 of every input and output) and ``max_batch_size`` > 0; else dims are full shapes (-1: any size). Raises
    ValueError for a tensor whose dtype Triton has no data type for."""
    batching = contract.batched and max_batch_size > 0

    def tensor(leaf: LeafSpec, sizes: Sequence[Optional[int]]) -> LeafSpec:
        if leaf.dtype not in TORCH_TO_TRITON:
            raise ValueError(f"{leaf.name!r} has dtype {leaf.dtype}, which Triton has no data type for")
        return stated_leaf(leaf.name, leaf.dtype, sizes)

    # An input of a batched contract takes any number of samples: the server pieces and pads what the artifact takes.
    inputs = [tensor(s, s.sizes(contract.any_samples or contract.batched)) for s in contract.inputs]
    outputs = [tensor(o, o.sizes(contract.any_samples)) for o in contract.outputs]
    return TritonModel(name=name, entry=entry, backend=backend, directory=directory, files=[],
                       max_batch_size=max_batch_size if batching else 0, inputs=inputs, outputs=outputs,
                       instances=instances, dynamic_batching=batching and dynamic_batching,
                       preferred_batch_sizes=list(preferred_batch_sizes) if batching else [],
                       max_queue_delay_us=max_queue_delay_us,
                       optional_inputs=[s.name for s in contract.inputs if s.optional])


def config_json(model: TritonModel) -> Dict[str, object]:
    """The model's config as Triton's ``GET /v2/models/{name}/config`` renders it (JSON of the same ModelConfig
    :func:`config_text` writes)."""

    def tensor(t: LeafSpec) -> Dict[str, object]:
        out: Dict[str, object] = {"name": t.name, "data_type": data_type(t), "dims": list(model.dims(t))}
        reshape, labels = model.reshape(t), model.label_file(t)
        if reshape is not None:
            out["reshape"] = {"shape": list(reshape)}
        if labels:
            out["label_filename"] = labels
        if t.name in model.optional_inputs:
            out["optional"] = True
        return out

    config: Dict[str, object] = {
        "name": model.name, "platform": "", "backend": model.backend, "max_batch_size": model.max_batch_size,
        "input": [tensor(t) for t in model.inputs], "output": [tensor(t) for t in model.outputs],
        "instance_group": [{"name": f"{model.name}_0", "kind": "KIND_CPU", "count": model.instances}],
        "version_policy": {"latest": {"num_versions": 1}},
        "parameters": {k: {"string_value": v} for k, v in model.parameters.items()},
    }
    if model.dynamic_batching:
        config["dynamic_batching"] = {"preferred_batch_size": list(model.preferred_batch_sizes),
                                      "max_queue_delay_microseconds": model.max_queue_delay_us}
    return config


def config_text(model: TritonModel) -> str:
    """The model's ``config.pbtxt``: protobuf text of Triton's ModelConfig, written without protobuf."""
    lines = [f"name: {_quote(model.name)}", f"backend: {_quote(model.backend)}",
             f"max_batch_size: {model.max_batch_size}"]
    for kind, tensors in (("input", model.inputs), ("output", model.outputs)):
        lines.append(f"{kind} [")
        lines.append(",\n".join(_tensor_text(model, t) for t in tensors))
        lines.append("]")
    lines += ["instance_group [", "  {", f"    count: {model.instances}", "    kind: KIND_CPU", "  }", "]"]
    if model.dynamic_batching:
        lines.append("dynamic_batching {")
        lines += [f"  preferred_batch_size: {size}" for size in model.preferred_batch_sizes]
        lines += [f"  max_queue_delay_microseconds: {model.max_queue_delay_us}", "}"]
    for key, value in model.parameters.items():
        lines.append(f"parameters {{ key: {_quote(key)} value: {{ string_value: {_quote(value)} }} }}")
    return "\n".join(lines) + "\n"


def _tensor_text(model: TritonModel, tensor: LeafSpec) -> str:
    lines = ["  {", f"    name: {_quote(tensor.name)}", f"    data_type: {data_type(tensor)}",
             f"    dims: {_list_text(model.dims(tensor))}"]
    reshape, labels = model.reshape(tensor), model.label_file(tensor)
    if reshape is not None:
        lines.append(f"    reshape: {{ shape: {_list_text(reshape)} }}")
    if labels:
        lines.append(f"    label_filename: {_quote(labels)}")
    if tensor.name in model.optional_inputs:
        lines.append("    optional: true")
    return "\n".join(lines + ["  }"])


def _list_text(values: Sequence[int]) -> str:
    return f"[ {', '.join(map(str, values))} ]" if values else "[ ]"


def _quote(text: str) -> str:
    """A protobuf text-format string literal (C escapes; other characters as UTF-8)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


# --- README ------------------------------------------------------------------------------------------------------


def readme_text(models: Sequence[TritonModel], skipped: Sequence[SkippedArtifact], manifest: Manifest) -> str:
    """The repository's README.md: how to start Triton on it and send each model a request."""
    lines = [
        "# Triton Inference Server model repository (written by fx-lightning)",
        "",
        "Start Triton on this directory, from this directory (pick a release for `<yy.mm>`; the `-py3` image has "
        "the ONNX Runtime and OpenVINO backends):",
        "",
        "    docker run --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 -v \"$PWD\":/models \\",
        "        nvcr.io/nvidia/tritonserver:<yy.mm>-py3 tritonserver --model-repository=/models",
        "",
        "or, where `tritonserver` is installed: `tritonserver --model-repository=$PWD`. Ready when "
        "`curl -sf localhost:8000/v2/health/ready` succeeds.",
        "",
        "Each model's files were copied from the export and checked against its `manifest.json` sha256. They hold "
        "no code: an ONNX graph, or OpenVINO's XML graph and raw weights.",
        "",
    ]
    if manifest.selected is not None:
        chosen = manifest.selected
        lines += [f"On the machine that exported it, `fx-lightning bench` found `{chosen.format}` fastest at batch "
                  f"{chosen.batch_size} ({chosen.median_ms:.3g} ms median, {chosen.traffic} traffic).", ""]
    for model in models:
        lines += _model_readme(model, manifest)
    if skipped:
        lines += ["## Not written", ""]
        lines += [f"- `{s.entry}`: {s.reason}." for s in skipped]
        lines.append("")
    return "\n".join(lines)


def _model_readme(model: TritonModel, manifest: Manifest) -> List[str]:
    batch = (f"batches of up to {model.max_batch_size} (Triton's dynamic batcher joins requests)"
             if model.max_batch_size else "no batching by Triton: each request holds the model's full shape")
    what = f"the export's selection (`{model.entry}` here)" if model.selection else f"`{model.entry}` of the export"
    lines = [f"## `{model.name}`", "", f"{what}, {model.backend} backend, {batch}.", ""]
    lines += ["| | name | type | shape per request | export's name |", "|---|---|---|---|---|"]
    for kind, tensors in (("input", model.inputs), ("output", model.outputs)):
        for t in tensors:
            lines.append(f"| {kind} | `{t.name}` | {data_type(t)} | {_request_shape(model, t)} | "
                         f"{model.export_names.get(t.name, t.name)} |")
    lines.append("")
    if manifest.preprocess is not None:
        p = manifest.preprocess
        lines += ["The model normalises its input itself: send raw {input_dtype} pixels in {layout} layout, "
                  "{channel_order} channel order.".format(**p.client_input()), ""]
    lines += [f"- {note}." for note in model.notes] + ([""] if model.notes else [])
    lines += ["With `tritonclient` (`pip install 'tritonclient[http]'`):", "", "```python",
              "import numpy as np", "import tritonclient.http as httpclient", "",
              'client = httpclient.InferenceServerClient("localhost:8000")', "inputs = []"]
    for t in model.inputs:
        shape, dtype = _example_shape(model, t), BY_TORCH[t.dtype].v2
        lines += [f"x = np.zeros({shape}, dtype={BY_TORCH[t.dtype].numpy!r})",
                  f"inputs.append(httpclient.InferInput({t.name!r}, x.shape, {dtype!r}))",
                  "inputs[-1].set_data_from_numpy(x)"]
    lines += [f"result = client.infer({model.name!r}, inputs)"]
    lines += [f"print(result.as_numpy({t.name!r}).shape)" for t in model.outputs]
    lines += ["```", "", "With curl (the JSON body built by Python: a flat list of zeros per input):", "", "```sh",
              f"python3 -c {shlex.quote(_json_body_program(model))} |",
              f"  curl -s -X POST localhost:8000/v2/models/{model.name}/infer -H 'Content-Type: application/json' "
              "-d @-", "```", ""]
    return lines


def _json_body_program(model: TritonModel) -> str:
    """Python that prints a KServe v2 JSON request for ``model``: zeros of a shape each input may have."""
    items = []
    for t in model.inputs:
        shape = _example_shape(model, t)
        zero = "False" if t.dtype == "bool" else "0"
        items.append(f'{{"name": {json.dumps(t.name)}, "shape": {list(shape)}, "datatype": '
                     f'{json.dumps(BY_TORCH[t.dtype].v2)}, "data": [{zero}] * {math.prod(shape)}}}')
    return f'import json; print(json.dumps({{"inputs": [{", ".join(items)}]}}))'


def _request_shape(model: TritonModel, tensor: LeafSpec) -> str:
    dims = ["any" if d is None else str(d) for d in tensor.sizes()[int(model.batching):]]
    return "[" + ", ".join((["batch"] if model.max_batch_size else []) + dims) + "]"


def _example_shape(model: TritonModel, tensor: LeafSpec) -> Tuple[int, ...]:
    """A shape a request may have: batch 1 when batching, 1 on every other dynamic axis."""
    return tuple(1 if d == -1 else d for d in model.stated_shape(tensor))


def describe(repository: TritonRepository) -> List[str]:
    """One line per model written and per entry skipped, for the command line."""
    lines = [f"{m.directory}: {'the selection, ' if m.selection else ''}{m.entry} on the {m.backend} backend, "
             f"max_batch_size {m.max_batch_size}"
             + "".join(f"\n  note: {n}" for n in m.notes) for m in repository.models]
    lines += [f"not written: {s.entry}: {s.reason}" for s in repository.skipped]
    if repository.readme is not None:
        lines.append(f"how to run it: {repository.readme}")
    return lines


@dataclass
class TritonOptions:
    """What to write (``formats``, ``name``) and how Triton is to run it; checked in one place by :meth:`check`.
    The dynamic batcher's settings are written only for a model that batches. ``python``: also Python-backend models
    (:mod:`fx_lightning.serve.triton_python`): ``NAME`` serving the export's selection as ``fx-lightning serve``
    does, and ``NAME_<entry>`` for each pt2/aoti artifact and variant."""

    name: Optional[str] = None  # None: the export directory's name
    formats: Optional[Sequence[str]] = None  # manifest entries; None: every one Triton can serve
    # None (these three; preferred_batch_sizes empty too): from the export's throughput sweep of the artifact
    # (export/select/sweep.py: recorded_batching; the model's notes say so), else DEFAULT_MAX_BATCH_SIZE for a dynamic
    # batch (0 for a fixed one), Triton's default preferred sizes (the largest batch it can form) and
    # DEFAULT_MAX_QUEUE_DELAY_US. max_batch_size 0: Triton does not batch, dims are full shapes; an artifact built
    # for fixed batch sizes gets 0 (a value > 0 is refused).
    max_batch_size: Optional[int] = None
    instances: int = 1  # CPU instances of each model
    dynamic_batching: bool = True
    preferred_batch_sizes: Optional[Sequence[int]] = None
    max_queue_delay_us: Optional[int] = None
    overwrite: bool = False  # replace a model directory of the same name in OUT
    python: bool = True

    def check(self) -> None:
        """Refuse a value Triton would refuse at load time (or silently misread), naming the key."""
        model_name_at("triton name", self.name, "it names the model directories")
        int_at_least("triton max_batch_size", self.max_batch_size, 0, " or None")
        int_at_least("triton instances", self.instances, 1)
        int_at_least("triton max_queue_delay_us", self.max_queue_delay_us, 0, " or None")
        for size in self.preferred_batch_sizes or []:
            int_at_least("triton preferred_batch_sizes", size, 1)
        if self.preferred_batch_sizes and self.max_batch_size is not None and \
                max(self.preferred_batch_sizes) > self.max_batch_size:
            raise ConfigError(f"triton preferred_batch_sizes: {list(self.preferred_batch_sizes)}; allowed: "
                              + (f"sizes from 1 to max_batch_size ({self.max_batch_size})." if self.max_batch_size
                                 else "none with max_batch_size 0 (Triton does not batch)."))
        if self.formats is not None and not self.formats:
            raise ConfigError("triton formats: []; allowed: manifest entries such as onnx or openvino, or None for "
                              "every one Triton can serve.")

    def with_recorded_batching(self, manifest: Manifest,
                               entry: Optional[str]) -> Tuple["TritonOptions", Optional[str]]:
        """These options with the batching settings left None taken from the export's throughput sweep of
        ``entry`` (None: the selection's max-throughput pick), and a note saying so; unchanged when the export
        recorded no sweep of it or every setting was given."""
        wanted = (self.max_batch_size, self.preferred_batch_sizes or None, self.max_queue_delay_us)
        recorded = recorded_batching(manifest, entry) if manifest.call_signature().batched else None
        if recorded is None or None not in wanted:
            return self, None
        max_batch = self.max_batch_size if self.max_batch_size is not None else recorded.max_batch_size
        preferred = self.preferred_batch_sizes or [size for size in recorded.preferred_batch_sizes if size <= max_batch]
        delay = self.max_queue_delay_us if self.max_queue_delay_us is not None else \
            round(recorded.queue_delay_s * 1e6)
        taken = [key for key, value in zip(("max_batch_size", "preferred_batch_sizes", "max_queue_delay_us"), wanted)
                 if value is None]
        return (dataclasses.replace(self, max_batch_size=max_batch, preferred_batch_sizes=preferred or None,
                                    max_queue_delay_us=delay),
                f"{', '.join(taken)} from {recorded.why}")

    @property
    def queue_delay_us(self) -> int:
        return DEFAULT_MAX_QUEUE_DELAY_US if self.max_queue_delay_us is None else self.max_queue_delay_us


def model_name_at(key: str, value: Optional[str], why: str) -> None:
    """``value`` a model name Triton takes, or None; else a ConfigError naming ``key`` (``why``: what the name is)."""
    if value is not None and not MODEL_NAME.match(value):
        raise ConfigError(f"{key}: {value!r}; allowed: letters, digits, '_', '-' and '.', not starting with '.' or '-' "
                          f"({why}).")


def int_at_least(key: str, value: object, minimum: int, or_none: str = "") -> None:
    """``value`` an integer >= ``minimum`` (a bool is not one), or None where ``or_none`` (what None means, worded
    for the message) is given; else a ConfigError naming ``key``, the value and what is allowed."""
    if value is None and or_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}: {value!r}; allowed: an integer >= {minimum}{or_none}.")
