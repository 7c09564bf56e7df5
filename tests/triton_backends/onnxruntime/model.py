"""Stand-in for Triton's ONNX Runtime backend (tests only): runs 1/model.onnx with onnxruntime, tensors by DLPack."""

import json
import os

import onnxruntime as ort
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        folder = os.path.join(args["model_repository"], args["model_version"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(os.path.join(folder, "model.onnx"), options,
                                            providers=["CPUExecutionProvider"])
        self.inputs = [(t["name"], (t.get("reshape") or {}).get("shape")) for t in config["input"]]
        self.outputs = [t["name"] for t in config["output"]]
        self.batching = int(config.get("max_batch_size", 0)) > 0

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {}
            for name, reshape in self.inputs:
                tensor = from_dlpack(pb_utils.get_input_tensor_by_name(request, name).to_dlpack())
                if reshape is not None:  # config reshape: the model sees [batch] + reshape
                    tensor = tensor.reshape(([tensor.shape[0]] if self.batching else []) + list(reshape))
                feeds[name] = tensor.contiguous().numpy()
            outputs = self.session.run(self.outputs, feeds)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor.from_dlpack(n, to_dlpack(torch.from_numpy(o.copy()))) for n, o in
                 zip(self.outputs, outputs)]))
        return responses
