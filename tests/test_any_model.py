"""Models that are not image classifiers, at zero configuration: ``FXFuseCallback()`` observes how the target is
called during the module's own steps, proves (or refuses) a sample axis, captures, verifies and exports; the export,
loaded in a fresh process without the training code, matches an fp64 copy of the trained target at sizes never
seen during fit, with the same output structure. And ``load_fused`` never splits or pads along a dimension that is
not a proven sample axis (the 192-rows-for-40-molecules case)."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from export_helpers import REPO, clean_env
from fusion_helpers import rel_err
from fx_lightning import ExportError, FXFuseCallback, fuse, load_fused
from fx_lightning.common.calls import Call, plain, tree_of, tree_of_call
from fx_lightning.export.manifest import read_manifest
from fx_lightning.export.write.writer import export_fused
from fx_lightning.config import load_config
from fx_lightning.signature.signature import DimKind
import model_patterns as mp

# ----------------------------------------------------------------------------------------- unseen inputs


def _graph_batches() -> List[Any]:
    g = torch.Generator().manual_seed(11)
    many = mp.collate_graphs([mp.random_graph(g, n) for n in (1, 13, 4, 17, 2)])  # 17 > any graph in fit
    lone = mp.collate_graphs([(torch.randn(1, 8, generator=g), torch.zeros(2, 0, dtype=torch.long), 0)])
    return [many, lone]  # the lone graph: one node, no edge


def _molecule_batches() -> List[Any]:
    g = torch.Generator().manual_seed(12)
    many = mp.collate_molecules([mp.random_molecule(g, n) for n in (12, 1, 7, 14, 3, 10, 2)])  # 7 molecules
    lone = mp.collate_molecules([mp.random_molecule(g, 1)])  # one atom, no bond
    return [many, lone]


def _rows(dataset: Any, n: int) -> Any:
    from torch.utils.data import DataLoader

    return next(iter(DataLoader(dataset, batch_size=n)))


UNSEEN: Dict[str, Callable[[], List[Any]]] = {
    "graph": _graph_batches,
    "molecule": _molecule_batches,
    "tabular": lambda: [_rows(mp.TabularSet(7, 9), 7), _rows(mp.TabularSet(1, 10), 1)],
    "single_cell": lambda: [_rows(mp.CellSet(5, 9), 5)],
    "anomaly": lambda: [_rows(mp.ImageSet(3, 9), 3)],
    "fixed_batch": lambda: [_rows(torch.utils.data.TensorDataset(torch.randn(6, 3, 8, 8), torch.zeros(6).long()), 6)],
}


def _fit(name: str, tmp_path: Path, **callback: Any) -> Tuple[pl.LightningModule, FXFuseCallback]:
    torch.manual_seed(0)
    lit = mp.PATTERNS[name]()
    train, val = lit.loaders()
    cb = FXFuseCallback(**callback)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, enable_progress_bar=False,
                         enable_model_summary=False, logger=CSVLogger(tmp_path), default_root_dir=tmp_path,
                         callbacks=[cb], enable_checkpointing=False)
    trainer.fit(lit, train, val)
    return lit, cb


def _target_call(lit: pl.LightningModule, target: torch.nn.Module, batch: Any) -> Call:
    """What ``target`` receives when the module's own validation step runs on ``batch`` (the trainer still
    attached after fit; logging made a no-op: it is outside Lightning's loop here)."""
    calls: List[Call] = []
    handle = target.register_forward_pre_hook(lambda m, a, k: calls.append(Call(a, k)) if not calls else None,
                                              with_kwargs=True)
    lit.log = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            lit.eval().validation_step(batch, 0)
    finally:
        handle.remove()
        del lit.log
    assert calls, "the validation step never called the target"
    return calls[0]


def _fp64(value: Any) -> Any:
    tree = tree_of_call(value) if isinstance(value, Call) else tree_of(value)
    return tree.rebuild([t.double() if t.is_floating_point() else t for t in tree.leaves(value)])


# Runs in a fresh process: no tests/, no examples/ on the path; loads the export and runs each job's inputs
# (positional, by name, or as a duck-typed object with the recorded fields).
FRESH = textwrap.dedent('''
    import json, os, sys, types
    repo, job_path, out_path = sys.argv[1:4]
    for entry in sys.path:
        full = os.path.abspath(entry or os.getcwd())
        assert full != repo and not full.startswith(os.path.join(repo, "tests")), full
    import torch
    from fx_lightning import load_fused
    from fx_lightning.common.calls import plain  # containers and distributions as plain ones: they load without classes
    job = torch.load(job_path, weights_only=True)
    model = load_fused(job["dir"], job["format"] or None)
    outs = []
    with torch.no_grad():
        for kind, args, named in job["calls"]:
            if kind == "named":
                outs.append(plain(model(**named)))
            elif kind == "object":
                outs.append(plain(model(types.SimpleNamespace(**named))))
            else:
                outs.append(plain(model(*args)))
    torch.save(outs, out_path)
''')


def _run_fresh(tmp: Path, directory: Path, calls: List[Tuple[str, List[Any], Dict[str, Any]]],
               fmt: str = "") -> List[Any]:
    script, job, out = tmp / "fresh.py", tmp / "job.pt", tmp / "out.pt"
    script.write_text(FRESH)
    torch.save({"dir": str(directory), "format": fmt, "calls": calls}, job)
    proc = subprocess.run([sys.executable, "-I", str(script), str(REPO), str(job), str(out)], cwd=tmp,
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)


def _fixed_batch_reference(model64: torch.nn.Module, x: torch.Tensor, size: int) -> torch.Tensor:
    """What a model built for ``size`` samples gives each sample (its rows are independent, as the signature
    proved): pieces of ``size``, the last padded, the padding's rows dropped."""
    outs = []
    for start in range(0, x.shape[0], size):
        piece = x[start:start + size]
        padded = torch.cat([piece, piece[: size - piece.shape[0]]]) if piece.shape[0] < size else piece
        outs.append(model64(padded)[: piece.shape[0]])
    return torch.cat(outs)


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", list(mp.PATTERNS))
def test_zero_configuration_export_matches_fp64_at_unseen_sizes_in_a_fresh_process(name: str, tmp_path: Path) -> None:
    lit, cb = _fit(name, tmp_path)
    assert cb.parity_report is not None and cb.parity_report.passed, cb.summary
    assert cb.export_dir is not None
    manifest = read_manifest(cb.export_dir)
    signature = manifest.signature
    assert signature is not None and manifest.format_version == 3
    target = lit.get_submodule(cb.outcome.target) if cb.outcome.target else lit
    target64 = copy.deepcopy(target).double().eval()
    stochastic = {i for i, leaf in enumerate(signature.outputs) if leaf.stochastic}
    jobs, wants = [], []
    for batch in UNSEEN[name]():
        # The fixed-batch model cannot run 6 samples eagerly: its call is the batch's images.
        call = Call((batch[0],)) if name == "fixed_batch" else _target_call(lit, target, batch)
        leaves = tree_of_call(call).leaves(call)
        names = [leaf.name for leaf in signature.inputs]
        if signature.flat:
            jobs.append(("named", [], dict(zip(names, leaves))))
        else:
            jobs.append(("positional", list(call.args), {}))
        with torch.no_grad():
            if name == "fixed_batch":
                want = _fixed_batch_reference(target64, _fp64(call).args[0], 4)
            else:
                want = _fp64(call).run(target64)
        wants.append(want)
    if name == "molecule":  # the original argument, duck-typed: an object with the recorded fields
        call = _target_call(lit, target, UNSEEN[name]()[0])
        bmg = call.args[0]
        jobs.append(("object", [], {f: getattr(bmg, f) for f in ("V", "E", "edge_index", "rev_edge_index", "batch")}))
        with torch.no_grad():
            wants.append(_fp64(call).run(target64))
    got = _run_fresh(tmp_path, cb.export_dir, jobs)
    assert len(got) == len(wants)
    for out, want in zip(got, wants):
        plain_want = plain(want)
        # The same structure: nesting, names, shapes and dtypes (fp32 against the fp64 reference's fp32 dtypes).
        want_tree, got_tree = tree_of(plain_want), tree_of(out)
        assert got_tree.leaf_paths() == want_tree.leaf_paths(), (got_tree.leaf_paths(), want_tree.leaf_paths())
        got_leaves, want_leaves = got_tree.leaves(out), want_tree.leaves(plain_want)
        for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
            assert tuple(g.shape) == tuple(w.shape), (i, g.shape, w.shape)
            assert g.dtype == (torch.float32 if w.dtype == torch.float64 else w.dtype), (i, g.dtype)
            if i not in stochastic and w.is_floating_point():
                assert rel_err(g, w) < 1e-5, (name, i, rel_err(g, w))
    if name == "single_cell":  # one output is the batch's loss (a mean over the cells): pieces would change it
        assert not signature.sample.proven and "does not follow the number of samples" in signature.sample.how
    if name in ("tabular", "anomaly", "fixed_batch"):  # rows of a table, images: every input carries samples on dim 0
        assert signature.sample.proven, signature.sample.how
        assert signature.input_axes() == [0] * len(signature.inputs), signature.describe()
        assert all(a == 0 for a, leaf in zip(signature.output_axes(), signature.outputs) if not leaf.stochastic)
    if name in ("graph", "molecule"):  # every dimension that carries nodes, edges or graphs varies; none is a sample axis
        assert not signature.sample.proven, signature.sample.how
        kinds = {d.kind for leaf in signature.inputs for d in leaf.dims}
        assert DimKind.variable in kinds and DimKind.sample not in kinds


def test_the_summary_says_how_each_pattern_was_called(tmp_path: Path) -> None:
    _, cb = _fit("single_cell", tmp_path)
    kinds = {note.kind.name for note in cb.outcome.notes}
    # Its steps call self.forward(...) directly: the submodule they call is fused, and said so.
    assert "target_called_by_steps" in kinds and "observed_calls" in kinds, kinds
    assert cb.outcome.target == "module"
    manifest = read_manifest(cb.export_dir)
    outputs = {leaf.name: leaf for leaf in manifest.signature.outputs}
    assert {"output_0.qz.loc", "output_0.qz.scale"} <= set(outputs), list(outputs)  # a Normal as its parameters
    assert outputs["output_0.z"].stochastic and not outputs["output_0.qz.loc"].stochastic


def test_a_distribution_returning_encoder_as_the_target(tmp_path: Path) -> None:
    lit, cb = _fit("single_cell", tmp_path, target="module.z_encoder")
    assert cb.parity_report.passed
    manifest = read_manifest(cb.export_dir)
    assert manifest.signature.sample.proven  # its rows are independent: the server may batch it
    x = torch.log1p(torch.poisson(torch.rand(6, 20) * 5))
    cats = torch.randint(0, 2, (6, 1))
    loaded = load_fused(cb.export_dir)
    (qz, z) = loaded(x, cats)
    ref = copy.deepcopy(lit.module.z_encoder).double().eval()
    with torch.no_grad():
        want, _ = ref(x.double(), cats)
    assert type(qz) is type(want) and z.shape == (6, 4)  # the distribution, as the model returns it
    assert rel_err(qz.loc, want.loc) < 1e-5 and rel_err(qz.scale, want.scale) < 1e-5


# ------------------------------------------------------------------------------ never split a non-sample axis


def sum_per_molecule(h: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return h.new_zeros(int(batch.max()) + 1, h.shape[1]).index_add_(0, batch, h)


torch.fx.wrap("sum_per_molecule")  # symbolic tracing keeps the data-dependent pooling as one call


class AtomsToMolecules(torch.nn.Module):
    """Atoms [n_atoms, 6] and their molecule [n_atoms] -> one row per molecule: dim 0 of the input counts atoms."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, V: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return sum_per_molecule(self.bn(self.lin(V)), batch)


def test_load_fused_never_splits_or_pads_a_dimension_that_is_not_a_proven_sample_axis(tmp_path: Path) -> None:
    """A model exported (as a pickled GraphModule) from one batch of 171 atoms: dim 0 counts atoms, not samples.
    Earlier, load_fused ran 200 atoms as pieces of 171 (padding the atoms by repeating them) and returned 16 rows for
    8 molecules: wrong answers, with only a warning. It now refuses, naming the input, the dimension and what it
    was built for."""
    model = AtomsToMolecules().eval()
    g = torch.Generator().manual_seed(0)
    V = torch.randn(171, 6, generator=g)
    batch = torch.sort(torch.randint(0, 8, (171,), generator=g)).values
    fused = fuse(model, example_inputs=(V, batch))
    directory = export_fused(fused.graph_module, tmp_path / "e", example_inputs=(V, batch),
                             config=load_config(export={"formats": ["graph_module"]}))
    manifest = read_manifest(directory)
    assert not manifest.signature.sample.proven, manifest.signature.sample.how
    loaded = load_fused(directory)
    with torch.no_grad():
        same = loaded(V, batch)
        assert rel_err(same, model.double()(V.double(), batch)) < 1e-5
    V2 = torch.randn(200, 6, generator=g)
    batch2 = torch.sort(torch.randint(0, 8, (200,), generator=g)).values
    with pytest.raises(ExportError, match=r"(?i)input v .* dim 0 is 200; the artifact was built for 171"):
        loaded(V2, batch2)


def test_a_bf16_variant_of_a_model_that_only_exports_for_its_batch_size(tmp_path: Path) -> None:
    """The fp32 export of a model fixed to its batch size falls back to a static export; the bf16 variant did not
    (it always asked for a dynamic batch), so the preflight stopped training. Now it falls back alike: pt2-bf16 is
    built for that batch size and run as pieces of it."""
    lit, cb = _fit("fixed_batch", tmp_path, export={"formats": ["pt2"]},
                   passes={"cast_bf16": {"enabled": True, "min_top1_agreement": 0.5, "max_accuracy_drop": 0.5,
                                         "min_cosine": 0.9}})
    manifest = read_manifest(cb.export_dir)
    assert manifest.formats["pt2-bf16"].batch_sizes == [4] and manifest.formats["pt2"].batch_sizes == [4]
    x = torch.randn(6, 3, 8, 8)
    want = _fixed_batch_reference(copy.deepcopy(lit.backbone).double().eval(), x.double(), 4)
    got = load_fused(cb.export_dir, "pt2-bf16")(x)
    assert got.shape == (6, 4) and got.dtype == torch.float32 and rel_err(got, want) < 0.05


class PythonBatchSize(torch.nn.Module):
    """Branches on its batch size (a path for the batch size it usually runs): torch.export fixes the graph to the
    example's batch size, while the model itself runs any."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = torch.nn.Conv2d(3, 6, 3), torch.nn.BatchNorm2d(6), torch.nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(self.bn(self.conv(x)).mean((2, 3)))
        if x.shape[0] == 4:
            return h * 1.0
        return h


class PythonBatchSizeLit(mp.FixedBatchLit):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = PythonBatchSize()

    @staticmethod
    def loaders(batch_size: int = 4) -> Tuple[Any, Any]:
        from torch.utils.data import DataLoader, TensorDataset

        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(30, 3, 8, 8, generator=g), torch.randint(0, 4, (30,), generator=g)
        return (DataLoader(TensorDataset(x[:20], y[:20]), batch_size=batch_size, shuffle=True),
                DataLoader(TensorDataset(x[20:], y[20:]), batch_size=batch_size))  # 4, 4, 2


def test_a_graph_fixed_to_its_batch_size_is_compared_in_pieces_of_it(tmp_path: Path) -> None:
    """The last validation batch holds 2 samples; the captured graph takes 4 only. Earlier parity stopped with
    "Guard failed: x.size()[0] == 4" and the advice to check parity.input; now the 2 samples run as a piece of 4
    (padded: the rows were shown independent), and the export says what it is built for."""
    torch.manual_seed(0)
    lit = PythonBatchSizeLit()
    train, val = lit.loaders()
    cb = FXFuseCallback(export={"formats": ["pt2"]})
    pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, callbacks=[cb], default_root_dir=tmp_path).fit(lit, train, val)
    assert cb.parity_report.passed and cb.parity_report.batches == 3, cb.summary
    kinds = {n.kind.name for n in cb.outcome.notes}
    assert "static_export" in kinds, kinds  # built for batch size 4, run as pieces of it
    manifest = read_manifest(cb.export_dir)
    assert manifest.signature.sample.proven and manifest.formats["pt2"].batch_sizes == [4]
    x = torch.randn(7, 3, 8, 8)
    want = copy.deepcopy(lit.backbone).double().eval()(x.double())
    assert rel_err(load_fused(cb.export_dir)(x), want) < 1e-5


class ListConv(mp.GraphConv):
    """Message passing over Python lists of node ids: no tracer follows values read into Python."""

    def propagate(self, edge_index: Any, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for src, dst in edge_index.t().tolist():
            out[dst] = out[dst] + x[src]
        return out


class ListGraphLit(mp.GraphLit):
    def __init__(self) -> None:
        super().__init__()
        self.model.conv1, self.model.conv2 = ListConv(8, 16), ListConv(16, 16)

    @staticmethod
    def loaders(batch_size: int = 2) -> Tuple[Any, Any]:  # few edges a batch: torch.export's attempts unroll them
        return mp.GraphLit.loaders(batch_size)


def test_a_model_neither_tracer_follows_is_captured_keeping_whole_what_they_cannot(tmp_path: Path) -> None:
    """torch.export cannot capture Python lists of node ids (in either mode), symbolic tracing cannot either: the
    message-passing layers are kept whole (leaves), the rest is traced, the head's BatchNorm folded, and the
    layers' own BatchNorms are reported as left; the formats that need torch.export are skipped with the reason."""
    torch.manual_seed(0)
    lit = ListGraphLit()
    train, val = lit.loaders()
    cb = FXFuseCallback()
    pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, callbacks=[cb], default_root_dir=tmp_path).fit(lit, train, val)
    assert cb.parity_report.passed, cb.summary
    report = cb.result.report
    kept = [n for n in report.notes if n.kind.name == "kept_whole"]
    assert kept and "ListConv" in str(kept[0]) and report.capture_mode == "fx"
    assert report.batchnorms_folded == 1 and report.after.batchnorms == 2  # bn1, bn2 follow an add: not foldable
    manifest = read_manifest(cb.export_dir)
    assert set(manifest.formats) == {"graph_module"} and "pt2" in manifest.failed_formats
    batch = _graph_batches()[0]
    call = Call((batch.x, batch.edge_index, batch.batch))
    with torch.no_grad():
        want = _fp64(call).run(copy.deepcopy(lit).double().eval())
        assert rel_err(load_fused(cb.export_dir)(*call.args), want) < 1e-5


def test_without_validation_data_the_preflight_runs_on_the_first_training_call_it_observed(tmp_path: Path) -> None:
    """No validation data: the rehearsal runs at the first optimizer step, on the call of the target that step
    made. Before, that step's call was kept only when the step ended, after the rehearsal: the preflight read the
    batches instead, could not find the backbone's input in the batch dict, and stopped training."""
    torch.manual_seed(0)
    lit = mp.TabularLit()
    train, _ = lit.loaders()
    cb = FXFuseCallback()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, enable_progress_bar=False,
                         enable_model_summary=False, logger=CSVLogger(tmp_path), default_root_dir=tmp_path,
                         callbacks=[cb], enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(lit, train)
    assert cb.preflight is not None and not cb.preflight.unproven, cb.preflight
    assert cb.parity_report is not None and cb.parity_report.passed and cb.parity_report.source == "train"
