# How tests/data/export_v1_rich was written: fx-lightning at commit 9ab0c4d (manifest format_version 1), torch
# 2.14.1, run as `PYTHONPATH=<a checkout of 9ab0c4d> python tests/data/make_export_v1_rich.py`. Every part of a
# version-1 manifest whose shape changed in version 2 is in it: capture notes, parity notes, an int8 variant
# whose gate failed (failures as strings), provenance with the callback's keys and one of the user's own.
# Kept to prove that later versions still load it; not run by the tests.
import torch
from torch import nn
from fx_lightning.config import load_config
from fx_lightning.pipeline import Batches, fuse_verify_export
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
with torch.no_grad():
    model[1].running_mean.uniform_(-1, 1); model[1].running_var.uniform_(0.5, 2)
model.eval()
g = torch.Generator().manual_seed(1)
batches = [torch.randn(4, 3, 8, 8, generator=g) for _ in range(2)]  # no labels: a parity note says so
cfg = load_config({"trace": {"mode": "export"}, "export": {"formats": ["graph_module", "pt2", "onnx"]},
                   "passes": {"quantize_int8": {"enabled": True, "min_cosine": 1.0}}})  # a gate int8 cannot pass
extra = {"weights": {"source": "last", "description": "last (the LightningModule as training left it)", "epoch": 1,
                     "global_step": 8},
         "preflight": {"mode": "full", "seconds": 1.25, "device": "cpu", "stages": ["device", "target", "fuse", "export"]},
         "trainer": {"epoch": 1, "global_step": 8}, "world_size": 1, "lightning_module": "my_pkg.models.Classifier",
         "my_own_key": [1, 2]}
out = fuse_verify_export(model, cfg, Batches(batches, "val"), export_dir="tests/data/export_v1_rich", extra=extra)
torch.save({"model": model.state_dict(), "batches": batches}, "tests/data/export_v1_rich_inputs.pt")
print(out.export_dir, out.notes)
