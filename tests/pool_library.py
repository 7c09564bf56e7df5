"""A stand-in for a library's pooling (torch_geometric's ``global_add_pool`` calling its ``scatter``): the inner
function reads a tensor's value, so symbolic tracing cannot follow it, and it is called from the library's own
module, where torch.fx does not patch a function kept whole; it reads the value through numpy, so torch.export cannot
capture it either (not even with the example's values)."""

import torch


def scatter_sum(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    size = int(index.max().numpy()) + 1  # numpy: no tracer follows it (torch.export: not even with the values)
    if size > 10_000:  # a Python branch on the value: torch.export cannot capture it either
        raise ValueError(f"{size} groups")
    return torch.zeros(size, x.shape[1], dtype=x.dtype).index_add_(0, index, x)


def global_pool(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return scatter_sum(x, index)
