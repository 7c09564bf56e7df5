"""Stand-in for Triton's OpenVINO backend (tests only): runs 1/model.xml with OpenVINO, tensors by DLPack."""

import json
import os

import openvino as ov
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        folder = os.path.join(args["model_repository"], args["model_version"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        compile_config = {"INFERENCE_NUM_THREADS": "1"}
        if parameters.get("HINT_BF16") == "YES":
            compile_config["INFERENCE_PRECISION_HINT"] = "bf16"
        else:
            compile_config["INFERENCE_PRECISION_HINT"] = "f32"
        core = ov.Core()
        self.model = core.compile_model(core.read_model(os.path.join(folder, "model.xml")), "CPU", compile_config)
        self.inputs = [t["name"] for t in config["input"]]
        self.outputs = [t["name"] for t in config["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {n: from_dlpack(pb_utils.get_input_tensor_by_name(request, n).to_dlpack()).contiguous().numpy()
                     for n in self.inputs}
            result = self.model(feeds)
            by_name = {port.get_any_name(): value for port, value in result.items()}
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor.from_dlpack(n, to_dlpack(torch.from_numpy(by_name[n].copy()))) for n in
                 self.outputs]))
        return responses
