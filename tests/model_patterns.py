"""Models that are not image classifiers, written the way their libraries write them (without importing the
libraries), each as a LightningModule with its data: what ``FXFuseCallback()`` must handle at zero configuration.

- :class:`GraphLit`: graph classification as graph libraries batch it: one batch object with node features ``x``
  [N, F], ``edge_index`` [2, E] and a ``batch`` vector [N]; ``forward(x, edge_index, batch)``; message-passing
  layers with their own ``propagate`` (which refuses a traced ``edge_index``); pooling whose size is
  ``int(batch.max()) + 1``.
- :class:`MoleculeLit`: molecular property regression as chemistry libraries write it: a dataclass batch (atoms,
  bonds, ``edge_index``, ``rev_edge_index``, ``batch``) that is no pytree, ``forward(bmg, V_d=None, X_d=None)``,
  buffers made with ``torch.zeros(len(bmg.V), d)``, a training step that calls submodules, not ``self``.
- :class:`TabularLit`: a tabular model taking the whole batch dict (``continuous``, ``categorical``, ``target``),
  returning a dict, with ``backbone`` a property.
- :class:`SingleCellLit`: a training plan around a VAE module that takes the batch dict, an encoder returning a
  ``torch.distributions.Normal`` and a sample, called as ``encoder(x, *cat_list)``; the plan reads its trainer in
  its steps (and raises without one).
- :class:`AnomalyLit`: a model that carries its preprocessing (torchvision v2 ``Resize``, ``Normalize`` in a
  ``Compose``) in front of a feature extractor, returning an anomaly map and a score.
- :class:`FixedBatchLit`: a model whose code fixes the batch size it was built for (an ensemble that reshapes by it).

Every dataset is synthetic and small; every fit takes seconds on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, InitVar
from typing import Any, Dict, Optional, Sequence, Tuple

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

# ----------------------------------------------------------------------------------------------- graphs


class GraphBatch:
    """A graph library's batch: graphs stacked into one disconnected graph, with a ``batch`` vector."""

    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.edge_index, self.batch, self.y = x, edge_index, batch, y

    @property
    def num_graphs(self) -> int:
        return int(self.y.shape[0])

    def to(self, device: Any) -> "GraphBatch":  # Lightning moves any object with a ``to``
        return GraphBatch(self.x.to(device), self.edge_index.to(device), self.batch.to(device), self.y.to(device))


def random_graph(g: torch.Generator, nodes: int, features: int = 8) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Node features, undirected edges (both directions; a lone node has none) and a label."""
    x = torch.randn(nodes, features, generator=g)
    pairs = [(i, j) for i in range(nodes) for j in range(i + 1, nodes) if torch.rand(1, generator=g).item() < 0.35]
    edges = torch.tensor(pairs + [(j, i) for i, j in pairs], dtype=torch.long).reshape(-1, 2).t()
    label = int(x[:, 0].mean() > 0)
    return x, edges.reshape(2, -1), label


def collate_graphs(samples: Sequence[Tuple[torch.Tensor, torch.Tensor, int]]) -> GraphBatch:
    xs, edges, batch, offset = [], [], [], 0
    for i, (x, e, _) in enumerate(samples):
        xs.append(x)
        edges.append(e + offset)
        batch.append(torch.full((x.shape[0],), i, dtype=torch.long))
        offset += x.shape[0]
    return GraphBatch(torch.cat(xs), torch.cat(edges, dim=1), torch.cat(batch),
                      torch.tensor([label for _, _, label in samples]))


class GraphSet(Dataset):
    def __init__(self, n: int, seed: int, max_nodes: int = 9) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = [random_graph(g, int(torch.randint(1, max_nodes + 1, (1,), generator=g))) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
        return self.items[i]


class MessagePassing(nn.Module):
    """A graph library's message-passing base: ``propagate`` checks its ``edge_index`` like theirs do."""

    def propagate(self, edge_index: Any, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise ValueError("`MessagePassing.propagate` only supports integer tensors of shape `[2, num_messages]`")
        messages = x.index_select(0, edge_index[0])
        return torch.zeros_like(x).index_add_(0, edge_index[1], messages)


class GraphConv(MessagePassing):
    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.lin_rel, self.lin_root = nn.Linear(fin, fout), nn.Linear(fin, fout, bias=False)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.lin_rel(self.propagate(edge_index, x)) + self.lin_root(x)


def global_add_pool(x: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    size = int(batch.max()) + 1
    return x.new_zeros(size, x.size(-1)).index_add_(0, batch, x)


class GNN(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 2) -> None:
        super().__init__()
        self.conv1, self.bn1 = GraphConv(features, hidden), nn.BatchNorm1d(hidden)
        self.conv2, self.bn2 = GraphConv(hidden, hidden), nn.BatchNorm1d(hidden)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.1),
                                  nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x, edge_index)))
        h = F.relu(self.bn2(self.conv2(h, edge_index)))
        return self.head(global_add_pool(h, batch))


class GraphLit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GNN()

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return self.model(x, edge_index, batch)

    def training_step(self, data: GraphBatch, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(data.x, data.edge_index, data.batch), data.y)
        self.log("train_loss", loss, batch_size=data.num_graphs)
        return loss

    def validation_step(self, data: GraphBatch, batch_idx: int) -> None:
        out = self(data.x, data.edge_index, data.batch)
        self.log("val_acc", (out.argmax(-1) == data.y).float().mean(), batch_size=data.num_graphs)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    @staticmethod
    def loaders(batch_size: int = 6) -> Tuple[DataLoader, DataLoader]:
        return (DataLoader(GraphSet(48, 0), batch_size=batch_size, shuffle=True, collate_fn=collate_graphs),
                DataLoader(GraphSet(20, 1), batch_size=batch_size, collate_fn=collate_graphs))


# -------------------------------------------------------------------------------------------- molecules


@dataclass(repr=False, eq=False)
class BatchMolGraph:
    """A chemistry library's batch of molecular graphs: built from the molecules (an ``InitVar``), not a pytree."""

    mgs: InitVar[Sequence[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]]
    V: torch.Tensor = field(init=False)  # atom features [n_atoms, d_v]
    E: torch.Tensor = field(init=False)  # bond features [n_bonds, d_e] (each bond twice, once per direction)
    edge_index: torch.Tensor = field(init=False)  # [2, n_bonds]
    rev_edge_index: torch.Tensor = field(init=False)  # [n_bonds]: the reverse of each directed bond
    batch: torch.Tensor = field(init=False)  # [n_atoms]: the molecule of each atom

    def __post_init__(self, mgs: Sequence[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        Vs, Es, edges, revs, batch, atoms, bonds = [], [], [], [], [], 0, 0
        for i, (V, E, edge_index, rev) in enumerate(mgs):
            Vs.append(V)
            Es.append(E)
            edges.append(edge_index + atoms)
            revs.append(rev + bonds)
            batch.append(torch.full((V.shape[0],), i, dtype=torch.long))
            atoms, bonds = atoms + V.shape[0], bonds + E.shape[0]
        self.V, self.E = torch.cat(Vs), torch.cat(Es)
        self.edge_index, self.rev_edge_index, self.batch = torch.cat(edges, 1), torch.cat(revs), torch.cat(batch)

    def to(self, device: Any) -> "BatchMolGraph":
        for name in ("V", "E", "edge_index", "rev_edge_index", "batch"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def random_molecule(g: torch.Generator, atoms: int) -> Tuple[Tuple[torch.Tensor, ...], float]:
    """A chain of atoms with a few extra bonds; each bond in both directions."""
    pairs = [(i, i + 1) for i in range(atoms - 1)] + [(i, i + 2) for i in range(atoms - 2)
                                                       if torch.rand(1, generator=g).item() < 0.3]
    src = [a for a, b in pairs] + [b for a, b in pairs]
    dst = [b for a, b in pairs] + [a for a, b in pairs]
    n = len(pairs)
    V = torch.randn(atoms, 6, generator=g)
    E = torch.randn(2 * n, 3, generator=g)
    edge_index = torch.tensor([src, dst], dtype=torch.long).reshape(2, -1)
    rev = torch.tensor(list(range(n, 2 * n)) + list(range(n)), dtype=torch.long)
    return (V, E, edge_index, rev), float(V[:, 0].sum() * 0.1)


def collate_molecules(samples: Sequence[Tuple[Tuple[torch.Tensor, ...], float]]) -> Tuple[Any, ...]:
    """A chemistry library's training batch: (bmg, V_d, X_d, targets, weights, lt_mask, gt_mask)."""
    targets = torch.tensor([[y] for _, y in samples])
    return (BatchMolGraph([m for m, _ in samples]), None, None, targets, torch.ones_like(targets), None, None)


class MoleculeSet(Dataset):
    def __init__(self, n: int, seed: int, max_atoms: int = 9) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = [random_molecule(g, int(torch.randint(1, max_atoms + 1, (1,), generator=g))) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


class BondMessagePassing(nn.Module):
    def __init__(self, d_v: int = 6, d_e: int = 3, d_h: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.W_i = nn.Linear(d_v + d_e, d_h, bias=False)
        self.W_h = nn.Linear(d_h, d_h, bias=False)
        self.W_o = nn.Linear(d_v + d_h, d_h)
        self.depth = depth

    def message(self, H: torch.Tensor, bmg: BatchMolGraph) -> torch.Tensor:
        index_torch = bmg.edge_index[1].unsqueeze(1).repeat(1, H.shape[1])
        M_all = torch.zeros(len(bmg.V), H.shape[1], dtype=H.dtype, device=H.device).scatter_reduce_(
            0, index_torch, H, reduce="sum", include_self=False)[bmg.edge_index[0]]
        return M_all - H[bmg.rev_edge_index]

    def forward(self, bmg: BatchMolGraph, V_d: Optional[torch.Tensor] = None) -> torch.Tensor:
        H_0 = self.W_i(torch.cat([bmg.V[bmg.edge_index[0]], bmg.E], dim=1))
        H = F.relu(H_0)
        for _ in range(1, self.depth):
            H = F.relu(H_0 + self.W_h(self.message(H, bmg)))
        index_torch = bmg.edge_index[1].unsqueeze(1).repeat(1, H.shape[1])
        M = torch.zeros(len(bmg.V), H.shape[1], dtype=H.dtype, device=H.device).scatter_reduce_(
            0, index_torch, H, reduce="sum", include_self=False)
        return F.relu(self.W_o(torch.cat((bmg.V, M), dim=1)))


class SumAggregation(nn.Module):
    def forward(self, H: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        dim_size = batch.max().int() + 1
        index_torch = batch.unsqueeze(1).repeat(1, H.shape[1])
        return torch.zeros(dim_size, H.shape[1], dtype=H.dtype, device=H.device).scatter_reduce_(
            0, index_torch, H, reduce="sum", include_self=False)


class MoleculeLit(pl.LightningModule):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.message_passing = BondMessagePassing(d_h=hidden)
        self.agg = SumAggregation()
        self.bn = nn.BatchNorm1d(hidden)
        self.predictor = nn.Sequential(nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                       nn.Linear(hidden, 1))

    def fingerprint(self, bmg: BatchMolGraph, V_d: Optional[torch.Tensor] = None,
                    X_d: Optional[torch.Tensor] = None) -> torch.Tensor:
        H = self.bn(self.agg(self.message_passing(bmg, V_d), bmg.batch))
        return H if X_d is None else torch.cat((H, X_d), 1)

    def forward(self, bmg: BatchMolGraph, V_d: Optional[torch.Tensor] = None,
                X_d: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.predictor(self.fingerprint(bmg, V_d, X_d))

    def training_step(self, batch: Tuple[Any, ...], batch_idx: int) -> torch.Tensor:
        bmg, V_d, X_d, targets, weights, *_ = batch
        preds = self.predictor(self.fingerprint(bmg, V_d, X_d))  # the library's train step: not self(...)
        loss = (F.mse_loss(preds, targets, reduction="none") * weights).mean()
        self.log("train_loss", loss, batch_size=len(targets))
        return loss

    def validation_step(self, batch: Tuple[Any, ...], batch_idx: int) -> None:
        bmg, V_d, X_d, targets, *_ = batch
        self.log("val_mse", F.mse_loss(self(bmg, V_d, X_d), targets), batch_size=len(targets))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    @staticmethod
    def loaders(batch_size: int = 5) -> Tuple[DataLoader, DataLoader]:
        return (DataLoader(MoleculeSet(40, 0), batch_size=batch_size, shuffle=True, collate_fn=collate_molecules),
                DataLoader(MoleculeSet(18, 1), batch_size=batch_size, collate_fn=collate_molecules))


# ---------------------------------------------------------------------------------------------- tabular


class TabularSet(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.continuous = torch.randn(n, 5, generator=g) * torch.tensor([1.0, 10.0, 0.1, 3.0, 1.0])
        self.categorical = torch.stack([torch.randint(0, 4, (n,), generator=g),
                                        torch.randint(0, 7, (n,), generator=g)], dim=1)
        self.target = ((self.continuous[:, 0] > 0) ^ (self.categorical[:, 0] > 1)).long()

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"continuous": self.continuous[i], "categorical": self.categorical[i], "target": self.target[i]}


class Embeddings(nn.Module):
    def __init__(self, cardinalities: Sequence[int], dim: int = 4, continuous: int = 5) -> None:
        super().__init__()
        self.cat_embedding_layers = nn.ModuleList(nn.Embedding(c, dim) for c in cardinalities)
        self.normalizing_batch_norm = nn.BatchNorm1d(continuous)

    def forward(self, x: Dict[str, torch.Tensor]) -> torch.Tensor:
        continuous, categorical = x["continuous"], x["categorical"]
        embedded = [layer(categorical[:, i]) for i, layer in enumerate(self.cat_embedding_layers)]
        return torch.cat([self.normalizing_batch_norm(continuous), *embedded], dim=1)


class TabularLit(pl.LightningModule):
    """A tabular library's model: embedding layer, backbone, head; ``forward`` takes the whole batch dict."""

    def __init__(self) -> None:
        super().__init__()
        self._embedding_layer = Embeddings([4, 7])
        self._backbone = nn.Sequential(nn.Linear(13, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1),
                                       nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU())
        self._head = nn.Linear(16, 2)

    @property
    def backbone(self) -> nn.Module:
        return self._backbone

    def forward(self, x: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        features = self._backbone(self._embedding_layer(x))
        return {"logits": self._head(features), "backbone_features": features}

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch)["logits"], batch["target"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch)["logits"], batch["target"]))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    @staticmethod
    def loaders(batch_size: int = 16) -> Tuple[DataLoader, DataLoader]:
        return (DataLoader(TabularSet(96, 0), batch_size=batch_size, shuffle=True),
                DataLoader(TabularSet(40, 1), batch_size=batch_size))


# ------------------------------------------------------------------------------------------ single cell


class CellSet(Dataset):
    def __init__(self, n: int, seed: int, genes: int = 20) -> None:
        g = torch.Generator().manual_seed(seed)
        self.X = torch.poisson(torch.rand(n, genes, generator=g) * 5, generator=g)
        self.batch = torch.randint(0, 2, (n, 1), generator=g)
        self.labels = torch.randint(0, 3, (n, 1), generator=g)

    def __len__(self) -> int:
        return len(self.X)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"X": self.X[i], "batch": self.batch[i], "labels": self.labels[i]}


class Encoder(nn.Module):
    """A single-cell library's encoder: categorical covariates as ``*cat_list``, a Normal and a sample out."""

    def __init__(self, n_input: int, n_output: int, n_cat: int = 2, n_hidden: int = 32) -> None:
        super().__init__()
        self.n_cat = n_cat
        self.encoder = nn.Sequential(nn.Linear(n_input + n_cat, n_hidden), nn.BatchNorm1d(n_hidden, momentum=0.01,
                                                                                         eps=1e-3),
                                     nn.ReLU(), nn.Dropout(0.1))
        self.mean_encoder = nn.Linear(n_hidden, n_output)
        self.var_encoder = nn.Linear(n_hidden, n_output)

    def forward(self, x: torch.Tensor, *cat_list: torch.Tensor) -> Tuple[torch.distributions.Normal, torch.Tensor]:
        one_hot = [F.one_hot(c.squeeze(-1), self.n_cat).float() for c in cat_list]
        q = self.encoder(torch.cat([x, *one_hot], dim=-1))
        q_m, q_v = self.mean_encoder(q), torch.exp(self.var_encoder(q)) + 1e-4
        dist = torch.distributions.Normal(q_m, q_v.sqrt())
        return dist, dist.rsample()


class VAE(nn.Module):
    def __init__(self, genes: int = 20, latent: int = 4) -> None:
        super().__init__()
        self.z_encoder = Encoder(genes, latent)
        self.decoder = nn.Sequential(nn.Linear(latent + 2, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, genes))

    def inference(self, x: torch.Tensor, batch_index: torch.Tensor) -> Dict[str, Any]:
        qz, z = self.z_encoder(torch.log1p(x), batch_index)
        return {"qz": qz, "z": z}

    def generative(self, z: torch.Tensor, batch_index: torch.Tensor) -> Dict[str, Any]:
        rate = F.softplus(self.decoder(torch.cat([z, F.one_hot(batch_index.squeeze(-1), 2).float()], -1)))
        return {"px": torch.distributions.Poisson(rate + 1e-4)}

    def forward(self, tensors: Dict[str, torch.Tensor], loss_kwargs: Optional[Dict[str, float]] = None
                ) -> Tuple[Dict[str, Any], Dict[str, Any], torch.Tensor]:
        inference = self.inference(tensors["X"], tensors["batch"])
        generative = self.generative(inference["z"], tensors["batch"])
        kl = torch.distributions.kl_divergence(inference["qz"], torch.distributions.Normal(0.0, 1.0)).sum(-1)
        weight = (loss_kwargs or {}).get("kl_weight", 1.0)
        loss = (-generative["px"].log_prob(tensors["X"]).sum(-1) + weight * kl).mean()
        return inference, generative, loss


class SingleCellLit(pl.LightningModule):
    """A single-cell library's training plan: it wraps the module and reads its trainer in every step."""

    def __init__(self) -> None:
        super().__init__()
        self.module = VAE()

    @property
    def kl_weight(self) -> float:
        return min(1.0, (self.trainer.current_epoch + 1) / 2)  # raises without a trainer, as the library's does

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, _, loss = self.forward(batch, loss_kwargs={"kl_weight": self.kl_weight})
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        _, _, loss = self.forward(batch, loss_kwargs={"kl_weight": self.kl_weight})
        self.log("validation_loss", loss)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    @staticmethod
    def loaders(batch_size: int = 16) -> Tuple[DataLoader, DataLoader]:
        return (DataLoader(CellSet(80, 0), batch_size=batch_size, shuffle=True),
                DataLoader(CellSet(40, 1), batch_size=batch_size))


# ---------------------------------------------------------------------------------------- anomaly maps


class ImageSet(Dataset):
    def __init__(self, n: int, seed: int, size: int = 40) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 3, size, size, generator=g)
        self.labels = torch.zeros(n, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"image": self.images[i], "label": self.labels[i]}


class FeatureModel(nn.Module):
    """An anomaly-detection model: its preprocessing inside, features from a small CNN, a map and a score."""

    def __init__(self, size: int = 32) -> None:
        super().__init__()
        from torchvision.transforms import v2

        self.pre_processor = v2.Compose([v2.Resize((size, size), antialias=True),
                                         v2.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
        self.feature_extractor = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.register_buffer("memory_bank", torch.randn(16, 16))
        self.size = size

    def forward(self, images: torch.Tensor) -> Dict[str, torch.Tensor]:
        features = self.feature_extractor(self.pre_processor(images))
        b, c, h, w = features.shape
        flat = features.permute(0, 2, 3, 1).reshape(-1, c)
        distances = torch.cdist(flat, self.memory_bank).min(dim=1).values.reshape(b, 1, h, w)
        anomaly_map = F.interpolate(distances, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return {"anomaly_map": anomaly_map, "pred_score": anomaly_map.amax(dim=(1, 2, 3))}


class AnomalyLit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = FeatureModel()

    def forward(self, images: torch.Tensor) -> Dict[str, torch.Tensor]:
        return self.model(images)

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(batch["image"])
        loss = out["anomaly_map"].mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("score", self(batch["image"])["pred_score"].mean())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    @staticmethod
    def loaders(batch_size: int = 4) -> Tuple[DataLoader, DataLoader]:
        return (DataLoader(ImageSet(16, 0), batch_size=batch_size, shuffle=True),
                DataLoader(ImageSet(10, 1), batch_size=batch_size))


# ----------------------------------------------------------------------------------- a fixed batch size


class Ensemble(nn.Module):
    """``members`` heads over a shared trunk, the batch reshaped by the size the ensemble was built for."""

    def __init__(self, batch_size: int, members: int = 3) -> None:
        super().__init__()
        self.batch_size, self.members = batch_size, members
        self.trunk = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.heads = nn.Linear(8, 4 * members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.heads(self.trunk(x)).reshape(self.batch_size, self.members, 4)
        return out.mean(dim=1)


class FixedBatchLit(pl.LightningModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.backbone = Ensemble(batch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    @staticmethod
    def loaders(batch_size: int = 4) -> Tuple[DataLoader, DataLoader]:
        from torch.utils.data import TensorDataset

        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
        return (DataLoader(TensorDataset(x[:24], y[:24]), batch_size=batch_size, shuffle=True, drop_last=True),
                DataLoader(TensorDataset(x[24:], y[24:]), batch_size=batch_size, drop_last=True))


PATTERNS = {
    "graph": GraphLit,
    "molecule": MoleculeLit,
    "tabular": TabularLit,
    "single_cell": SingleCellLit,
    "anomaly": AnomalyLit,
    "fixed_batch": FixedBatchLit,
}
