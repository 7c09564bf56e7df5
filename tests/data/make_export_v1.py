# How tests/data/export_v1 was written: fx-lightning at commit 9ab0c4d (manifest format_version 1), torch 2.14.1.
# Kept to prove that later versions still load what version 1 wrote; not run by the tests.
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
batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]
cfg = load_config({"export": {"formats": ["graph_module", "pt2", "code"], "select": "fastest"}})
out = fuse_verify_export(model, cfg, Batches(batches, "val"), export_dir="tests/data/export_v1")
print(out.export_dir)
torch.save({"model": model.state_dict(), "batches": batches}, "tests/data/export_v1_inputs.pt")
