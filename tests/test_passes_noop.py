"""The post-grad pass manager and the no-op elimination pass, each on a graph it changes
and a graph it must leave alone.

Graphs are ATen graphs from ``make_fx`` with symbolic shapes (``meta["val"]`` on every
node, sizes in the token count ``s0``), which is what Inductor hands a post-grad pass.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from graphattn.errors import ConfigError
from graphattn.passes.inductor import compile_piece
from graphattn.passes.noop_elimination import NoOpEliminationPass
from graphattn.passes.pass_manager import GraphPass, PostGradPassManager, make_pass_manager

aten = torch.ops.aten
_SHAPE_OPS = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.slice.Tensor,
}


def _aten_graph(fn, *shape) -> fx.GraphModule:
    return make_fx(fn, tracing_mode="symbolic")(torch.randn(*shape))


def _shape_ops(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.target in _SHAPE_OPS]


def _noops(x):  # x: [T, 8]
    t = x.shape[0]
    a = x * 2
    b = a.view(t, 8)  # same shape
    c = b.reshape(t, 8)
    d = c[:, :8]  # the whole of dim 1
    e = d[0:t]  # the whole of dim 0, symbolically
    f = e.expand(t, 8)
    return f + 1


def _not_noops(x):  # x: [T, 8]
    t = x.shape[0]
    a = x * 2
    b = a.view(t * 2, 4)  # other shape
    # (aten.slice directly: Python indexing adds genuine no-op slices of the other dims)
    c = aten.slice.Tensor(a, 1, 0, 4)  # part of dim 1
    d = aten.slice.Tensor(a, 1, 0, 8, 2)  # every other column
    e = aten.slice.Tensor(a, 0, 1)  # starts at 1
    f = aten.slice.Tensor(a, 0, 0, t - 1)  # ends before the end
    g = x.view(t, 8)  # same shape, but returning it would alias the graph input
    return b.sum() + c.sum() + d.sum() + e.sum() + f.sum(), g


def test_noop_elimination_removes_shape_preserving_views_and_full_slices():
    gm = _aten_graph(_noops, 5, 8)
    before = _shape_ops(gm)
    assert len(before) >= 4, gm.code  # the graph really holds no-op views and slices
    x = torch.randn(7, 8)
    expected = gm(x)
    removed = NoOpEliminationPass()(gm.graph)
    gm.recompile()
    assert removed == len(before)
    assert _shape_ops(gm) == []
    torch.testing.assert_close(gm(x), expected)


def test_noop_elimination_leaves_real_views_and_slices_alone():
    gm = _aten_graph(_not_noops, 5, 8)
    code = gm.code
    assert len(_shape_ops(gm)) >= 6, code
    assert NoOpEliminationPass()(gm.graph) == 0
    gm.recompile()
    assert gm.code == code


def test_pass_manager_runs_passes_in_order_and_hashes_them():
    order: list[str] = []

    class Record(GraphPass):
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, graph: fx.Graph) -> int:
            order.append(self.name)
            return 0

    manager = PostGradPassManager([Record("a"), Record("b")])
    manager(_aten_graph(_noops, 5, 8).graph)
    assert order == ["a", "b"]
    assert manager.uuid() == PostGradPassManager([Record("a"), Record("b")]).uuid()
    assert manager.uuid() != PostGradPassManager([Record("b"), Record("a")]).uuid()
    assert manager.uuid() != make_pass_manager(["noop_elimination"]).uuid()
    assert make_pass_manager([]).names == []


def test_unknown_pass_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown post-grad pass"):
        make_pass_manager(["noop_elimination", "fuse_everything"])
    with pytest.raises(ConfigError, match="'rms_norm_gemv' must come before 'single_row_gemv'"):
        make_pass_manager(["single_row_gemv", "rms_norm_gemv"])
    with pytest.raises(ConfigError, match="'silu_mul_gemv' must come before 'single_row_gemv'"):
        make_pass_manager(["single_row_gemv", "silu_mul_gemv"])
    with pytest.raises(ConfigError, match="'unfuse_residual_addmm' must come before 'silu_mul"):
        make_pass_manager(["silu_mul_gemv", "unfuse_residual_addmm"])
    with pytest.raises(ConfigError, match="'unfuse_residual_addmm' must come before"):
        make_pass_manager(["single_row_gemv", "unfuse_residual_addmm"])
    with pytest.raises(ConfigError, match="'rms_norm_gemv' must come before 'silu_mul_epil"):
        make_pass_manager(["silu_mul_epilogue", "rms_norm_gemv"])
    with pytest.raises(ConfigError, match="'silu_mul_epilogue' must come before 'silu_mul_gemv'"):
        make_pass_manager(["rms_norm_gemv", "silu_mul_gemv", "silu_mul_epilogue"])
    assert make_pass_manager(["single_row_gemv"]).names == ["single_row_gemv"]
    with pytest.raises(ConfigError, match="list of pass names"):
        make_pass_manager("noop_elimination")


def test_inductor_runs_the_pass_manager_and_keys_its_cache_by_the_uuid():
    seen: list[int] = []

    class Count(GraphPass):
        name = "count"
        token = uuid.uuid4().hex  # fresh per run: Inductor's on-disk cache cannot know it

        def __call__(self, graph: fx.Graph) -> int:
            seen.append(sum(n.op == "call_function" for n in graph.nodes))
            return 0

        def uuid(self) -> str:
            return self.token

    gm = fx.symbolic_trace(lambda x: (x.view(4, 8) * 3 + 1).relu())
    x = torch.randn(4, 8)
    manager = PostGradPassManager([Count()])

    def compile_and_check() -> None:
        out = compile_piece(gm, [x], dynamic=False, pass_manager=manager)(x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        torch.testing.assert_close(out, (x * 3 + 1).relu())

    compile_and_check()
    assert len(seen) == 1 and seen[0] > 0  # once, on the post-grad ATen graph
    compile_and_check()
    assert len(seen) == 1  # same graph, same uuid: Inductor's cache hit, no pass run
    Count.token = uuid.uuid4().hex
    compile_and_check()
    assert len(seen) == 2  # a new uuid is a new cache key: compiled (and passed) again


def test_a_pass_uuid_covers_its_whole_module(tmp_path, monkeypatch):
    """noop_elimination and unfuse_residual_addmm match in module-level helpers: an edit
    there must change the key Inductor's own FX graph cache uses, or a warm Inductor cache
    hands back code the old pass made (and graphattn's cache stores it under its new key)."""
    import importlib
    import sys

    source = (
        "from graphattn.passes.pass_manager import GraphPass\n"
        "def matches(node):\n    return {body}\n"
        "class Edited(GraphPass):\n    name = 'edited'\n"
        "    def __call__(self, graph):\n        return 0\n"
    )
    (tmp_path / "edited_pass.py").write_text(source.format(body="False"))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("edited_pass")
    before = module.Edited().uuid()
    (tmp_path / "edited_pass.py").write_text(source.format(body="True"))  # the helper only
    module = importlib.reload(module)
    assert module.Edited().uuid() != before
    sys.modules.pop("edited_pass")


def test_the_manager_uuid_covers_graphattns_compiler_sources(monkeypatch):
    from graphattn.passes import cache

    manager = make_pass_manager(["noop_elimination", "unfuse_residual_addmm"])
    before = manager.uuid()
    assert manager.uuid() == before  # stable within a process
    monkeypatch.setattr(cache, "compiler_source_hashes", lambda: ["unfuse_addmm.py:edited"])
    assert manager.uuid() != before


def test_a_pieces_manager_marks_its_model_inputs():
    """``for_piece`` carries which of a piece's inputs are model inputs no kernel of the
    step writes onto the post-grad graph's placeholders (one for one, in order; none where
    the counts differ or the piece calls a higher-order op), into the manager's uuid and
    into the piece's fingerprint; a manager without a piece leaves a graph's marks alone."""
    from graphattn.passes.fingerprint import graph_fingerprint
    from graphattn.passes.split import MODEL_INPUT

    def three(a, b, c):
        return (a + b * c,)

    def inputs(gm):
        return [n for n in gm.graph.nodes if n.op == "placeholder"]

    def marks(gm):
        return [bool(n.meta.get(MODEL_INPUT)) for n in inputs(gm)]

    piece = fx.symbolic_trace(three)
    unmarked = graph_fingerprint(piece)
    inputs(piece)[1].meta[MODEL_INPUT] = True
    assert graph_fingerprint(piece) != unmarked
    base = make_pass_manager(["noop_elimination"])
    manager = base.for_piece(piece)
    assert manager.inputs == (3, (1,)) and manager.names == base.names and base.inputs is None
    post_grad = make_fx(three)(*(torch.randn(4) for _ in range(3)))
    inputs(post_grad)[0].meta[MODEL_INPUT] = True  # only the piece's marks count
    manager(post_grad.graph)
    assert marks(post_grad) == [False, True, False]
    base(post_grad.graph)  # no piece: the graph keeps what it has
    assert marks(post_grad) == [False, True, False]
    assert manager.uuid() != base.uuid()
    inputs(piece)[2].meta[MODEL_INPUT] = True
    assert base.for_piece(piece).uuid() != manager.uuid()
    assert base.for_piece(piece).uuid() == base.for_piece(piece).uuid()
    two = make_fx(lambda a, b: (a + b,))(torch.randn(4), torch.randn(4))
    manager(two.graph)  # not the piece's inputs: none is trusted as a model input
    assert marks(two) == [False, False]

    nested = fx.symbolic_trace(three)
    first = inputs(nested)[0]
    with nested.graph.inserting_after(first):  # a cond call (never run here)
        nested.graph.call_function(torch.ops.higher_order.cond, (first, first, first, ()))
    for node in inputs(nested):
        node.meta[MODEL_INPUT] = True
    assert base.for_piece(nested).inputs == (3, ())  # Inductor runs the passes on its bodies
