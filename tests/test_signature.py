"""The signature: what the observed calls prove about how the target is called (the sample axis, or none), and the
artifacts that follow it. Each test here is a way to a wrong answer that the package must observe or refuse."""

from __future__ import annotations

import collections.abc
import copy
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

import fx_lightning
from fusion_helpers import randomize_batchnorms, rel_err
from fx_lightning import ExportError, fuse, load_fused
from fx_lightning.common.calls import Call, tree_of
from fx_lightning.config import load_config
from fx_lightning.export.manifest import read_manifest
from fx_lightning.export.write.writer import export_fused
from fx_lightning.signature.signature import DimKind, Observed, Signature, derive_signature, shape_problem


def _run(model: nn.Module) -> Any:
    def run(call: Call, seed: int = 0) -> Any:
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(seed)
            return call.run(model)
    return run


def _signature(model: nn.Module, calls: List[Call], samples: List[Any]) -> Signature:
    model.eval()
    run = _run(model)
    return derive_signature([Observed(c, n) for c, n in zip(calls, samples)], run, rerun=lambda c: run(c, 1))


class Scaled(nn.Module):
    """Its outputs depend on how many rows the batch holds: rows are independent at one size, not across sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * x.shape[0]


class BranchOnBatch(nn.Module):
    """Code that branches on the batch size it is called with (torch.export specialises it)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.bn = nn.Linear(3, 2), nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.linear(x))
        return h * 1.0 if x.shape[0] == 4 else h * 2.0


class Centred(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


class Noisy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x)


class TimeMajor(nn.Module):
    """A recurrent model's layout: [time, batch, features], the samples on dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def test_outputs_that_depend_on_the_batch_size_prove_no_sample_axis() -> None:
    """Before: rows independent at 4 samples made dim 0 a sample axis 'padded only', and the export padded 3 rows
    to 4, giving linear(x) * 4 where the model gives linear(x) * 3."""
    sig = _signature(Scaled(), [Call((torch.randn(4, 3),)), Call((torch.randn(4, 3),))], [4, 4])
    assert not sig.sample.proven and "depend on the batch size" in sig.sample.how


class FixedReshape(nn.Module):
    """Built for batches of 4 (a reshape to that size): at 2 rows it runs but gives outputs of another shape."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).reshape(4, -1)


def test_outputs_of_another_shape_at_fewer_rows_mean_padding_to_the_size_seen() -> None:
    """The first rows alone gave [2, 2] where the batch gives [4, 4]: the model does not run at 2 rows (as if it
    raised). Rows are independent at 4, so padding to 4 is exact. Before: refused as 'depends on the batch size',
    and the third-party ensemble lost its padded pieces."""
    sig = _signature(FixedReshape(), [Call((torch.randn(4, 3),)), Call((torch.randn(4, 3),))], [4, 4])
    assert sig.sample.proven and not sig.sample.any_size and "another structure" in sig.sample.how, sig.describe()


class HalfNoisy(nn.Module):
    """A mean and a sample drawn around it (a VAE's encoder): one output drawn at random, both with a sample axis."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> Any:
        loc = self.linear(x)
        return loc, loc + torch.randn_like(loc)


def test_an_output_drawn_at_random_does_not_hide_that_pieces_of_any_size_are_exact() -> None:
    """Before the fix, the output drawn at random was checked for the structure of a batch of n at k rows (its
    axis left out of the comparison was taken for none), and every such model was padded to the size seen."""
    sig = _signature(HalfNoisy(), [Call((torch.randn(6, 3),))], [6])
    assert sig.sample.proven and sig.sample.any_size, sig.describe()
    assert [o.stochastic for o in sig.outputs] == [False, True]


def test_rows_that_interact_prove_no_sample_axis() -> None:
    sig = _signature(Centred(), [Call((torch.randn(6, 3),))], [6])
    assert not sig.sample.proven and "not independent" in sig.sample.how


def test_outputs_all_drawn_at_random_prove_nothing() -> None:
    """Nothing to compare rows with: before, the empty comparison passed and the axis was 'proven'."""
    sig = _signature(Noisy(), [Call((torch.randn(4, 3),))], [4])
    assert not sig.sample.proven and "drawn at random" in sig.sample.how
    assert sig.outputs[0].stochastic


def test_a_time_major_input_has_its_samples_on_dim_1() -> None:
    calls = [Call((torch.randn(7, 5, 3),)), Call((torch.randn(9, 3, 3),))]
    sig = _signature(TimeMajor(), calls, [5, 3])
    assert sig.sample.proven and sig.input_axes() == [1] and sig.output_axes() == [1], sig.describe()
    assert sig.inputs[0].dims[0].kind is DimKind.variable  # time varied: dynamic, never split


def test_inputs_with_different_numbers_of_samples_are_refused() -> None:
    sig = _signature(nn.Bilinear(3, 3, 2), [Call((torch.randn(4, 3), torch.randn(4, 3)))], [4])
    assert sig.sample.proven and sig.input_axes() == [0, 0]
    problem = shape_problem(sig.inputs, [torch.randn(6, 3), torch.randn(9, 3)])
    assert problem is not None and "different numbers of samples" in problem and "6" in problem and "9" in problem


@pytest.mark.parametrize("built", [None, [[None, 3], [None, 3]], [[None, 4], [None, 3]]])
def test_the_interfaces_quick_check_refuses_exactly_what_shape_problem_refuses(built: Any) -> None:
    """ArtifactInterface checks each call's shapes with a test worked out once (the Python per call is latency);
    it must refuse every call shape_problem refuses, with shape_problem's message, and pass the others through."""
    from fx_lightning.export.load.interface import ArtifactInterface

    sig = _signature(nn.Bilinear(3, 3, 2), [Call((torch.randn(4, 3), torch.randn(4, 3)))], [4])
    iface = ArtifactInterface(lambda a, b: torch.zeros(a.shape[0], 2), sig, built)
    outcomes = []
    for shapes in [((4, 3), (4, 3)), ((1, 3), (1, 3)), ((6, 3), (9, 3)), ((4, 4), (4, 3)), ((4, 3), (4, 3, 1)),
                   ((4,), (4, 3)), ((2, 3), (2, 2))]:
        tensors = [torch.randn(s) for s in shapes]
        problem = shape_problem(sig.inputs, tensors, built)
        outcomes.append(problem is None)
        if problem is None:
            assert iface(*tensors).shape == (shapes[0][0], 2), shapes
        else:
            with pytest.raises(ExportError) as refused:
                iface(*tensors)
            assert problem in str(refused.value), shapes
    assert True in outcomes and False in outcomes


def test_the_signature_survives_the_manifest() -> None:
    calls = [Call((torch.randn(7, 5, 3),)), Call((torch.randn(9, 3, 3),))]
    sig = _signature(TimeMajor(), calls, [5, 3])
    again = Signature.from_dict(sig.to_dict())
    assert again.to_dict() == sig.to_dict()
    assert again.input_axes() == sig.input_axes() and again.sample == sig.sample


@pytest.mark.parametrize("built_with", ["logits", "probs"])
def test_a_categorical_whose_derived_parameter_was_read_keeps_one_parameter(built_with: str) -> None:
    """Reading ``.probs`` of a Categorical built from logits caches it on the instance: before, both became leaves,
    and rebuilding the distribution raised (``Either probs or logits must be specified, but not both``)."""
    logits = torch.randn(3, 4)
    dist = torch.distributions.Categorical(**{built_with: logits.softmax(-1) if built_with == "probs" else logits})
    _ = dist.probs, dist.logits
    tree = tree_of(dist)
    assert tree.leaf_paths() == [(("attr", built_with),)]
    rebuilt = tree.rebuild(tree.leaves(dist))
    assert rel_err(rebuilt.probs, dist.probs) < 1e-6


# ------------------------------------------------------------------------------------------- exported


def _fuse_and_export(model: nn.Module, directory: Path, batches: Any = None, example_inputs: Any = None) -> Any:
    return fx_lightning.fuse_and_export(model, directory, batches=batches, example_inputs=example_inputs,
                                        config={"export": {"formats": ["pt2", "graph_module"]}})


@pytest.mark.parametrize("model_cls", [BranchOnBatch, Scaled])
def test_a_model_whose_answers_depend_on_the_batch_size_is_never_padded_to_it(model_cls: type,
                                                                             tmp_path: Path) -> None:
    """Before: the batch size was taken for a sample axis, and 6 samples came back from pieces padded to 4 with the
    answers the model gives at 4 (BranchOnBatch: h * 1 where it gives h * 2)."""
    model = randomize_batchnorms(model_cls()).eval()
    batches = [(torch.randn(4, 3), torch.zeros(4)) for _ in range(3)]
    _fuse_and_export(model, tmp_path / "e", batches=batches)
    manifest = read_manifest(tmp_path / "e")
    assert manifest.signature is not None and not manifest.signature.sample.proven
    x4 = torch.randn(4, 3)
    want4 = copy.deepcopy(model).double()(x4.double())
    for fmt in ("pt2", "graph_module"):
        loaded = load_fused(tmp_path / "e", fmt)
        with torch.no_grad():
            assert rel_err(loaded(x4), want4) < 1e-5
            x6 = torch.randn(6, 3)
            try:  # refused by name, or (the size shown to vary by trace.probe_sizes) the model's own answer at 6
                got6 = loaded(x6)
            except ExportError as exc:
                assert "dim 0 is 6; the artifact was built for 4" in str(exc), str(exc)
                continue
            want6 = copy.deepcopy(model).double()(x6.double())
            assert got6.shape == want6.shape and rel_err(got6, want6) < 1e-5, fmt  # never the answer at 4


def test_a_graph_fixed_to_the_batch_size_by_torch_export_is_exported_for_that_size_only(tmp_path: Path) -> None:
    """fuse() without a signature: torch.export fixes dim 0 (the model branches on it). Before: the capture was
    taken to be dynamic and its guard erased, and the export answered 6 rows with the branch taken at 4."""
    model = randomize_batchnorms(BranchOnBatch()).eval()
    x = torch.randn(4, 3)
    result = fuse(model, example_inputs=(x,))
    assert result.static_shapes == [[4, 3]]
    export_fused(result.graph_module, tmp_path / "e", example_inputs=(x,),
                 config=load_config({"export": {"formats": ["pt2", "graph_module"]}}))
    manifest = read_manifest(tmp_path / "e")
    assert {name: entry.batch_sizes for name, entry in manifest.formats.items()} == {"pt2": [4], "graph_module": [4]}
    assert not manifest.dynamic_batch


def test_a_constant_argument_is_baked_in_and_another_value_refused(tmp_path: Path) -> None:
    """``forward(x, n)`` called with n=3: the artifact takes x and computes with n=3. Before, the export failed
    with ``forward() missing 1 required positional argument: 'n'`` (the axes of the tensors were matched with
    the arguments, constants included)."""

    class Repeated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
            for _ in range(n):
                x = self.linear(x)
            return x

    model = Repeated().eval()
    x = torch.randn(4, 6)
    _fuse_and_export(model, tmp_path / "e", example_inputs=(x, 3))
    manifest = read_manifest(tmp_path / "e")
    assert manifest.signature is not None and [(c.path, c.value) for c in manifest.signature.constants] == [("n", 3)]
    want = copy.deepcopy(model).double()(x.double(), 3)
    for fmt in ("pt2", "graph_module"):
        loaded = load_fused(tmp_path / "e", fmt)
        with torch.no_grad():
            assert rel_err(loaded(x, 3), want) < 1e-5 and rel_err(loaded(x=x), want) < 1e-5
            with pytest.raises(ExportError, match="n is 5; the artifact was built with n=3"):
                loaded(x, 5)


# ------------------------------------------------------------------------------ batch objects with a store


class StoreData:
    """A graph library's batch as PyG writes it: the fields live in a private store, read and written through
    ``__getattr__``/``__setattr__``, with ``to_dict()``; ``num_graphs`` is computed from the store."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__["_store"] = dict(fields)

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["_store"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self.__dict__["_store"][key] = value

    def __copy__(self) -> "StoreData":
        return StoreData(**self.__dict__["_store"])

    def to_dict(self) -> dict:
        return dict(self.__dict__["_store"])

    @property
    def num_graphs(self) -> int:
        return int(self.__dict__["_store"]["batch"].max()) + 1


class Hidden(StoreData):
    to_dict = None  # type: ignore[assignment]


class GraphRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.head = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)

    def forward(self, data: StoreData) -> torch.Tensor:
        h = self.bn(self.lin(data.x))
        src, dst = data.edge_index
        h = h.index_add(0, dst, h[src])
        pooled = torch.zeros(data.num_graphs, h.shape[1], dtype=h.dtype).index_add(0, data.batch, h)
        return self.head(pooled.relu())


def _graphs(g: torch.Generator, sizes: List[int], cls: type = StoreData) -> StoreData:
    xs, edges, batch, start = [], [], [], 0
    for i, n in enumerate(sizes):
        xs.append(torch.randn(n, 5, generator=g))
        if n > 1:
            src = torch.arange(n - 1) + start
            edges.append(torch.stack([src, src + 1]))
        batch.append(torch.full((n,), i))
        start += n
    edge_index = torch.cat(edges, 1) if edges else torch.zeros(2, 0, dtype=torch.long)
    return cls(x=torch.cat(xs), edge_index=edge_index, batch=torch.cat(batch))


def test_a_batch_object_keeping_its_fields_in_a_store_is_read_through_to_dict(tmp_path: Path) -> None:
    """Before: the fields were private attributes, so the object was taken for a constant (no leaf): the first
    batch baked into the graph. Now its ``to_dict()`` fields are the leaves, and the export answers new graphs."""
    model = randomize_batchnorms(GraphRegressor()).eval()
    g = torch.Generator().manual_seed(0)
    batches = [(_graphs(g, sizes), None) for sizes in ([3, 4, 2], [5, 1], [2, 2, 6, 3])]
    fx_lightning.fuse_and_export(model, tmp_path / "e", batches=[b for b, _ in batches],
                                 config={"parity": {"input": "*"}, "export": {"formats": ["pt2"]}})
    manifest = read_manifest(tmp_path / "e")
    assert [leaf.path for leaf in manifest.signature.inputs] == ["data.x", "data.edge_index", "data.batch"]
    loaded = load_fused(tmp_path / "e")
    for sizes in ([7, 1, 9], [1]):  # unseen: 17 nodes in 3 graphs; one node without edges
        data = _graphs(g, sizes)
        want = copy.deepcopy(model).double()(StoreData(x=data.x.double(), edge_index=data.edge_index,
                                                        batch=data.batch))
        with torch.no_grad():
            got = loaded(data)
        assert got.shape == (len(sizes), 1) and rel_err(got, want) < 1e-5


def test_a_batch_object_whose_tensors_cannot_be_read_is_refused_by_name(tmp_path: Path) -> None:
    model = GraphRegressor().eval()
    g = torch.Generator().manual_seed(0)
    with pytest.raises(fx_lightning.FXLightningError, match="Hidden that keeps its tensors in private attributes"):
        fx_lightning.fuse_and_export(model, tmp_path / "e", batches=[_graphs(g, [3, 4], Hidden)],
                                     config={"parity": {"input": "*"}, "export": {"formats": ["pt2"]}})
    assert not (tmp_path / "e").exists()


def test_every_runtime_and_the_manifest_name_an_input_as_forward_does(tmp_path: Path) -> None:
    """``forward(self, input)``: fx names the graph's placeholder ``input_1``. Before, the manifest and ONNX said
    ``input_1`` while the signature said ``input``: a server or a caller by name saw two names for one input."""
    pytest.importorskip("onnxruntime")

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 2)

        def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - the name is the point
            return self.linear(input)

    fx_lightning.fuse_and_export(Plain().eval(), tmp_path / "e", batches=[torch.randn(4, 3) for _ in range(2)],
                                 config={"export": {"formats": ["pt2", "onnx"]}})
    manifest = read_manifest(tmp_path / "e")
    assert [i["name"] for i in manifest.inputs] == [leaf.name for leaf in manifest.signature.inputs] == ["input"]
    assert manifest.formats["onnx"].options["input_names"] == ["input"]


class GraphPool(nn.Module):
    """torch_geometric's call: nodes of several graphs, each node's graph index, and the graphs' labels (never read);
    one output row per graph, as many as the index says."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pooled = torch.zeros(int(index.max()) + 1, 4).index_add_(0, index, x)
        return self.lin(pooled)


def test_an_axis_only_an_unread_input_follows_is_no_sample_axis() -> None:
    """The graphs' labels are the one input whose dim 0 follows the loader's count of graphs. Replacing their last rows
    changed nothing (they are never read), and their first rows alone still gave one output row per graph: that was
    taken as a sample axis on which only padding is exact, and every artifact was built for the example's sizes
    (torch_geometric's GATv2Conv: held-out batches of 1, 5 and 7 graphs refused)."""
    calls, counts = [], []
    for graphs, nodes in ((6, 23), (6, 19)):
        index = torch.sort(torch.randint(0, graphs, (nodes,))).values
        index[:graphs] = torch.arange(graphs)
        calls.append(Call((torch.randn(nodes, 4), torch.sort(index).values, torch.randint(0, 3, (graphs,)))))
        counts.append(graphs)
    signature = _signature(GraphPool(), calls, counts)
    assert not signature.sample.proven
    assert "the outputs follow something else than these inputs' rows" in signature.sample.how, signature.sample.how


class _Store(collections.abc.MutableMapping):
    """A mapping of its own (torchrl's TensorDict): not built again from a dict (it needs its batch size)."""

    def __init__(self, data: Dict[str, Any], batch: int, shared: bool = False) -> None:
        self._data, self.batch, self.shared = data, batch, shared

    def __copy__(self) -> "_Store":
        return _Store(self._data if self.shared else dict(self._data), self.batch, self.shared)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        del self._data[key]

    def __iter__(self) -> Any:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_a_mapping_of_its_own_class_in_a_call_is_copied_as_that_class() -> None:
    """torchrl's SAC (held-out check 7): the recorded call's TensorDict was copied as a dict, and the actor, given
    the dict on the replay, raised (reported as a forward that needs what training fills)."""
    from fx_lightning.common.calls import map_leaves

    store = _Store({"observation": torch.randn(3, 5)}, batch=3)
    again = map_leaves(lambda t: t * 2, Call((store,)))
    assert type(again.args[0]) is _Store and again.args[0].batch == 3
    assert torch.equal(again.args[0]["observation"], store["observation"] * 2)
    shared = _Store({"observation": torch.randn(3, 5)}, batch=3, shared=True)  # its copy would share its store
    original = shared["observation"]
    again = map_leaves(lambda t: t * 2, shared)
    assert shared["observation"] is original and list(shared) == ["observation"]  # never changes the call it copies
    assert type(again) is _Store and again._data is not shared._data
    assert torch.equal(again["observation"], original * 2)


EDGE_TYPES = [("user", "rates", "item"), ("item", "rated_by", "user")]


class HeteroSum(nn.Module):
    """torch_geometric's ``to_hetero`` models take dicts keyed by edge types: tuples."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x_dict: Dict[Any, torch.Tensor]) -> torch.Tensor:
        return self.linear(x_dict[EDGE_TYPES[0]]) + 2 * self.linear(x_dict[EDGE_TYPES[1]])


def test_a_dict_keyed_by_tuples_survives_the_manifest(tmp_path: Path) -> None:
    """Held-out check 8 (torch_geometric's to_hetero SAGE): JSON gave the keys back as lists, and every call the
    loaded artifact took failed with ``TypeError: unhashable type: 'list'``."""
    model = HeteroSum().eval()
    _fuse_and_export(model, tmp_path / "e", example_inputs=({k: torch.randn(5, 4) for k in EDGE_TYPES},))
    steps = [leaf.steps for leaf in read_manifest(tmp_path / "e").signature.inputs]
    assert steps == [(("arg", 0), ("key", key)) for key in EDGE_TYPES], steps
    x = {k: torch.randn(3, 4) for k in EDGE_TYPES}
    want = copy.deepcopy(model).double()({k: v.double() for k, v in x.items()})
    for fmt in ("pt2", "graph_module"):
        assert rel_err(load_fused(tmp_path / "e", fmt)(x), want) < 1e-5, fmt
