"""The piecewise compiler (graphattn.passes) on a toy model: split, Inductor builds, compile
sizes, recompiles, piece wrapper, compile cache (warm start in a fresh process, corrupt
entries, changed factors), trace cache (a warm start without Dynamo, what its key covers,
stale and unusable entries) and debug dumps.

The toy model has L layers around a toy attention op with a call counter (as vLLM's
compilation tests do); the ops are this module's own, so the splitting ops are configured,
which also tests that they are configurable. Inductor builds are shared by the tests
through one module-scoped compile (CPU compiles are slow).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from graphattn.errors import ConfigError, InvalidInputError, RecompileError
from graphattn.passes import inductor
from graphattn.passes.backend import trace_model
from graphattn.passes.compiler import CompileOptions, PieceInfo, compile_model
from graphattn.passes.split import is_splitting_node, resolve_splitting_ops, split_graph

# -- the toy model ------------------------------------------------------------------------

_lib = torch.library.Library("graphattn_test", "FRAGMENT")
_lib.define("toy_cache_update(Tensor k, int layer) -> Tensor")
_lib.define("toy_attention(Tensor q, Tensor k, Tensor(a!) out, Tensor dep, int layer) -> ()")
CALLS = {"update": 0, "attention": 0}
RAISE_IN_ATTENTION = [False]  # the kernel-precompile tests make a dry run raise


def _toy_cache_update(k: torch.Tensor, layer: int) -> torch.Tensor:
    CALLS["update"] += 1
    return k.new_empty(0)


def _toy_attention(q, k, out, dep, layer) -> None:
    CALLS["attention"] += 1
    if RAISE_IN_ATTENTION[0]:
        raise ValueError("garbage in a routing op")
    out.copy_(q * torch.sigmoid(k) + layer)


_lib.impl("toy_cache_update", _toy_cache_update, "CompositeExplicitAutograd")
_lib.impl("toy_attention", _toy_attention, "CompositeExplicitAutograd")
torch.library.register_fake("graphattn_test::toy_cache_update")(lambda k, layer: k.new_empty(0))
torch.library.register_fake("graphattn_test::toy_attention")(lambda q, k, out, dep, layer: None)

TOY_OPS = ("graphattn_test::toy_cache_update", "graphattn_test::toy_attention")
HIDDEN, VOCAB, LAYERS, MAX_TOKENS = 16, 50, 3, 64
SIZES = (4,)


class ToyModel(nn.Module):
    """L layers of: linear -> toy cache update + toy attention -> residual.

    Each layer also computes a size (``2 * T``) before its attention op and uses it after,
    so a SymInt would cross a piece boundary if the split did not localise it.
    """

    def __init__(self, num_layers: int = LAYERS, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.position_scale = 0.01  # a plain attribute the trace bakes in
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen), requires_grad=False)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen) / 4, requires_grad=False)
            for _ in range(num_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed[input_ids] + positions[:, None] * self.position_scale  # [T, H]
        for i, w in enumerate(self.weights):
            doubled = x.shape[0] * 2  # a size computed before the split point...
            h = x @ w
            q, k = h * 2, h + 1
            out = torch.empty_like(q)
            dep = torch.ops.graphattn_test.toy_cache_update(k, i)
            torch.ops.graphattn_test.toy_attention(q, k, out, dep, i)
            x = x + out.reshape(doubled // 2, HIDDEN)  # ...and used after it
        return x.relu()


def _inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=gen), torch.arange(n)


def _options(cache_dir, **changes) -> CompileOptions:
    base = dict(
        splitting_ops=TOY_OPS,
        compile_backend="inductor",
        compile_sizes=SIZES,
        cache_dir=str(cache_dir),
        cache_factors={"test": "toy"},
    )
    return CompileOptions(**{**base, **changes})


def _compile(model, options, n=MAX_TOKENS, **kwargs):
    with torch.inference_mode():
        return compile_model(model, options, _inputs(n), **kwargs)


def _eager(model, n, seed=0):
    with torch.inference_mode():
        return model(*_inputs(n, seed))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("toy-cache")


@pytest.fixture(scope="module")
def toy(cache_dir):
    """(model, compiled forward, Inductor compiles it took): one cold Inductor compile."""
    model = ToyModel()
    before = inductor.compile_count()
    compiled = _compile(model, _options(cache_dir))
    return model, compiled, inductor.compile_count() - before


# -- split --------------------------------------------------------------------------------


def _traced_split(num_layers: int):
    model = ToyModel(num_layers)
    with torch.inference_mode():
        trace = trace_model(model, *_inputs(8))
    return split_graph(trace.graph_module, resolve_splitting_ops(TOY_OPS))


class FloatAttribute(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.scale = scale  # as RMSNorm's eps: a float attribute at a fixed module path

    def forward(self, input_ids, positions):
        return self.emb(input_ids) * self.scale + positions[:, None]


def test_a_later_model_traces_its_float_attributes_as_constants():
    """Dynamo remembers the values it saw per code location across traces (automatic
    dynamic). A second model in the process whose float attribute differs (an MLA model's
    eps of 1e-6, then a Llama's 1e-5) had it traced as a dynamic float input, which the
    GEMV passes did not match and Inductor could refuse (TensorifyScalarRestartAnalysis)."""
    for scale in (0.5, 0.25, 0.125):
        with torch.inference_mode():
            trace = trace_model(FloatAttribute(scale), *_inputs(5))
        floats = [
            n.name
            for n in trace.graph_module.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.SymFloat)
        ]
        assert floats == [], scale
        assert scale in [a for n in trace.graph_module.graph.nodes for a in n.args]


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_split_yields_two_pieces_per_layer_plus_one(num_layers):
    # Each layer's two consecutive toy ops share one splitting piece (L of them); the code
    # before the first, between each two, and after the last gives L + 1 compiled pieces:
    # 2 * L + 1 pieces, alternating compiled / splitting.
    split = _traced_split(num_layers)
    assert len(split.pieces) == 2 * num_layers + 1
    assert [p.is_splitting for p in split.pieces] == [i % 2 == 1 for i in range(2 * num_layers + 1)]


def test_splitting_ops_named_with_their_overload_split_the_same():
    """The trace calls the ops through their packets (no overload); "ns::op.default", a form
    the config accepts, must split there too, not silently leave one piece."""
    model = ToyModel(2)
    with torch.inference_mode():
        trace = trace_model(model, *_inputs(8))
    named = [f"{op}.default" for op in TOY_OPS]
    split = split_graph(trace.graph_module, resolve_splitting_ops(named))
    assert [p.is_splitting for p in split.pieces] == [i % 2 == 1 for i in range(5)]


def test_splitting_ops_appear_only_in_their_own_pieces_in_order():
    split = _traced_split(3)
    ops = resolve_splitting_ops(TOY_OPS)
    layers = []
    for piece in split.pieces:
        calls = [n for n in piece.module.graph.nodes if n.op == "call_function"]
        if piece.is_splitting:
            assert calls and all(is_splitting_node(n, ops) for n in calls)
            layers += [n.args[-1] for n in calls]
        else:
            assert not any(is_splitting_node(n, ops) for n in calls)
    # update then attention, layer by layer: the original node order
    assert layers == [0, 0, 1, 1, 2, 2]


def test_sizes_never_cross_a_piece_boundary():
    """No piece returns a SymInt; the size computed before each split point is recomputed
    after it from the token count.
    """
    split = _traced_split(2)
    for piece in split.pieces:
        out = piece.module.graph.output_node().args[0]
        outs = out if isinstance(out, (tuple, list)) else [out]
        for node in outs:
            assert not isinstance(node.meta.get("example_value"), torch.SymInt), piece.name


def test_split_graph_runs_like_the_model_eagerly():
    model = ToyModel(2)
    ids, pos = _inputs(7)
    with torch.inference_mode():
        trace = trace_model(model, ids, pos)
        split = split_graph(trace.graph_module, resolve_splitting_ops(TOY_OPS))
        for n in (1, 5, 33):
            ids, pos = _inputs(n, seed=n)
            got = split.module(*trace.binding(ids, pos))[0]
            torch.testing.assert_close(got, model(ids, pos))


class WritesItsInputs(nn.Module):
    """Before its toy attention: a buffer written in place and a view of a parameter made
    (used after it); after it, linears of the attention output by a parameter, the buffer
    and the view."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen), requires_grad=False)
        self.w = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen), requires_grad=False)
        self.v = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen), requires_grad=False)
        self.register_buffer("buf", torch.randn(HIDDEN, HIDDEN, generator=gen))
        self.write = lambda buf: buf.mul_(1.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed[input_ids]
        self.write(self.buf)
        vt = self.v.t()
        q, k = x * 2, x + 1
        out = torch.empty_like(q)
        dep = torch.ops.graphattn_test.toy_cache_update(k, 0)
        torch.ops.graphattn_test.toy_attention(q, k, out, dep, 0)
        return out @ self.w + out @ self.buf + out @ vt


def test_only_model_inputs_no_piece_writes_are_marked_as_weights():
    """``split.MODEL_INPUT`` (the only placeholders a GEMV pass takes for a weight): a
    parameter no piece writes is marked in every piece; a buffer written in place in an
    earlier piece, a parameter whose view leaves its piece (another could write through
    it), and values earlier pieces compute (the attention output, the view) are not."""
    with torch.inference_mode():
        trace = trace_model(WritesItsInputs(), *_inputs(8))
    split = split_graph(trace.graph_module, resolve_splitting_ops(TOY_OPS))
    first, _, last = split.pieces

    tensors = {k: v for k, v in _marks(first).items() if not k.startswith("s")}
    assert tensors == {
        "l_model_parameters_embed_": True,
        "l_input_ids_": True,  # 1-D integers: never a weight
        "l_model_buffers_buf_": False,  # written in place here
        "l_model_parameters_v_": False,  # its view leaves the piece
    }
    tensors = {k: v for k, v in _marks(last).items() if not k.startswith("s")}
    assert tensors == {
        "out": False,  # the attention's output
        "l_model_parameters_w_": True,
        "l_model_buffers_buf_": False,
        "vt": False,  # computed in the first piece
    }
    # computed values are not model inputs; the report names the two model inputs and why
    assert split.not_weights == {
        "l_model_buffers_buf_": "submod_0 may write it (mul_)",
        "l_model_parameters_v_": "submod_0 lets it or a view of it leave the piece",
    }


def _marks(piece) -> dict[str, bool]:
    """Each placeholder of ``piece`` by name: whether it carries ``split.MODEL_INPUT``."""
    from graphattn.passes.split import MODEL_INPUT

    nodes = piece.module.graph.find_nodes(op="placeholder")
    return {n.name: bool(n.meta.get(MODEL_INPUT)) for n in nodes}


WRITES = {
    "out=": lambda buf: torch.add(buf, 1.0, out=buf),
    "inplace=True": lambda buf: torch.nn.functional.relu(buf, inplace=True),
    ".data": lambda buf: buf.data.mul_(1.0),
    ".to(its dtype)": lambda buf: buf.to(torch.float32).mul_(1.0),
    "a transposed setitem": lambda buf: buf.t().__setitem__(0, 1.0),
    "_foreach_mul_": lambda buf: torch._foreach_mul_([buf], 1.0),
    "index_put_": lambda buf: buf.index_put_((torch.tensor([0]),), torch.tensor(1.0)),
}


@pytest.mark.parametrize("form", sorted(WRITES))
def test_a_buffer_written_in_any_form_is_no_weight(form):
    """Each way Dynamo records a write of a buffer before the attention leaves the buffer
    unmarked in the piece after it (a GEMV would read it early), its neighbours marked."""
    model = WritesItsInputs()
    model.write = WRITES[form]
    with torch.inference_mode():
        trace = trace_model(model, *_inputs(8))
    marks = _marks(split_graph(trace.graph_module, resolve_splitting_ops(TOY_OPS)).pieces[-1])
    assert marks["l_model_buffers_buf_"] is False and marks["l_model_parameters_w_"] is True


class WritesASharedBuffer(nn.Module):
    """A buffer over a parameter's memory (``shadow``, made from ``w`` by ``share``), written
    in place before the toy attention; after it, linears by ``w`` and by ``u``."""

    def __init__(self, share) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen), requires_grad=False)
        self.w = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen), requires_grad=False)
        self.u = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=gen), requires_grad=False)
        self.w, shadow = share(self.w)
        self.register_buffer("shadow", shadow)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed[input_ids]
        self.shadow.mul_(1.0)
        q, k = x * 2, x + 1
        out = torch.empty_like(q)
        dep = torch.ops.graphattn_test.toy_cache_update(k, 0)
        torch.ops.graphattn_test.toy_attention(q, k, out, dep, 0)
        return out @ self.w + out @ self.u


def _from_one_array(w):
    """Two tensors over one numpy array: two storages, one memory."""
    array = w.detach().numpy().copy()
    return nn.Parameter(torch.from_numpy(array), requires_grad=False), torch.from_numpy(array)


SHARES = {
    "detached": lambda w: (w, w.detach()),
    "a row slice further on": lambda w: (w, w.detach()[HIDDEN // 2 :]),
    "one numpy array": _from_one_array,
}


@pytest.mark.parametrize("share", sorted(SHARES))
def test_a_parameter_sharing_memory_with_a_written_buffer_is_no_weight(share):
    """A write through another input over the same memory is a write: ``w`` is unmarked
    (its buffer twin is written), ``u`` marked. The marks come from the step's own input
    tensors (the trace's binding), as the compiler and the trace cache's restore hand them
    over; a graph without them or example values marks no tensor input (any could share the
    written buffer's memory)."""
    from graphattn.passes.split import split_graph_of

    model = WritesASharedBuffer(SHARES[share])
    w, shadow = model.w.untyped_storage(), model.shadow.untyped_storage()
    assert (w.data_ptr(), w.nbytes()) == (shadow.data_ptr(), shadow.nbytes())
    with torch.inference_mode():
        trace = trace_model(model, *_inputs(8))
    ops = resolve_splitting_ops(TOY_OPS)
    template = trace.binding.template
    assert sum(isinstance(v, torch.Tensor) for v in template) == 4  # embed, w, u, shadow
    split = split_graph(trace.graph_module, ops, template)

    def marks(split):
        return _marks(split.pieces[-1])

    fresh = marks(split)
    assert fresh["l_model_parameters_w_"] is False
    assert fresh["l_model_parameters_u_"] is True
    # what the report shows: the two inputs no GEMV may take, and why
    assert split.not_weights == {
        "l_model_buffers_shadow_": "submod_0 may write it (mul_)",
        "l_model_parameters_w_": "shares memory with l_model_buffers_shadow_, which may be written",
    }
    for node in split.module.graph.nodes:  # as the trace cache restores a graph
        node.meta.pop("example_value", None)
        node.meta.pop("val", None)
    assert marks(split_graph_of(split.module, ops, template)) == fresh
    blind = marks(split_graph_of(split.module, ops))
    assert blind["l_model_parameters_w_"] is False and blind["l_model_parameters_u_"] is False
    with pytest.raises(ValueError, match="input values for a split graph of"):
        split_graph_of(split.module, ops, template[:-1])


def test_where_an_input_lies_in_memory():
    """``_memory_of`` and ``_overlap``: a wrapper subclass's storage is a stand-in, not its
    memory, so it is unknown (it may share a written input's); a step input or size (None)
    and a scalar are no tensors; a view further into a tensor overlaps it, another tensor
    does not; a plain subclass of Parameter is told by its memory like a Parameter."""
    from torch.testing._internal.two_tensor import TwoTensor

    from graphattn.passes.split import _NOT_A_TENSOR, _UNKNOWN, _memory_of, _overlap

    plain = torch.zeros(4)
    node = torch.fx.Graph().placeholder("x")
    assert _memory_of(None, node, {node: TwoTensor(plain, plain.clone())}) is _UNKNOWN
    assert _memory_of(None, node, {node: None}) is _NOT_A_TENSOR
    assert _memory_of(None, node, {node: 3}) is _NOT_A_TENSOR
    a = _memory_of(None, node, {node: plain})
    b = _memory_of(None, node, {node: plain[2:]})
    c = _memory_of(None, node, {node: torch.zeros(4)})
    assert _overlap(a, b) and not _overlap(a, c)

    class OwnParameter(nn.Parameter):  # a plain subclass: its memory is its storage
        pass

    d = _memory_of(None, node, {node: OwnParameter(plain[1:], requires_grad=False)})
    assert d is not _UNKNOWN and _overlap(a, d)


@pytest.mark.parametrize(
    "ops, message",
    [
        (("graphattn_test::no_such_op",), "is not a registered torch op"),
        (("nonamespace",), "'namespace::op'"),
        (("graphattn_test::toy_attention.nope",), "has no overload 'nope'"),
        ("graphattn_test::toy_attention", "a list of op names"),
    ],
)
def test_unknown_splitting_op_is_a_config_error(ops, message):
    with pytest.raises(ConfigError, match=message):
        _compile(ToyModel(1), _options("unused", splitting_ops=ops, compile_backend="eager"))


def test_unknown_backend_and_pass_are_config_errors():
    with pytest.raises(ConfigError, match="compile_backend"):
        _compile(ToyModel(1), _options("unused", compile_backend="tvm"))
    with pytest.raises(ConfigError, match="unknown post-grad pass"):
        _compile(ToyModel(1), _options("unused", passes=("fuse_everything",)))


# -- compiled output ----------------------------------------------------------------------


@given(n=st.integers(1, MAX_TOKENS), seed=st.integers(0, 100))
def test_compiled_output_equals_eager_for_any_token_count(toy, n, seed):
    model, compiled, _ = toy
    with torch.inference_mode():
        got = compiled(*_inputs(n, seed))
    torch.testing.assert_close(got, _eager(model, n, seed), rtol=1e-5, atol=1e-5)
    assert compiled.num_recompiles == 0


def test_token_counts_beyond_the_example_reuse_the_trace(toy):
    model, compiled, _ = toy
    with torch.inference_mode():
        got = compiled(*_inputs(3 * MAX_TOKENS))
    torch.testing.assert_close(got, _eager(model, 3 * MAX_TOKENS), rtol=1e-5, atol=1e-5)
    assert compiled.num_recompiles == 0


def test_identical_middle_pieces_are_compiled_once(toy):
    _, compiled, compiles = toy
    info = compiled.info
    # 3 layers: first piece (embedding + layer 0), two identical middle pieces, last piece
    assert (info.num_pieces, info.num_compiled_pieces, info.num_distinct_graphs) == (7, 4, 3)
    # one dynamic build per distinct graph, plus one per compile size
    assert compiles == info.inductor_compiles == 3 * (1 + len(SIZES))
    middle = compiled.pieces[1:3]
    assert middle[0].dynamic is middle[1].dynamic
    assert (info.cache_misses, info.cache_hits, info.warm) == (3 * (1 + len(SIZES)), 0, False)


def test_compile_sizes_are_used_on_an_exact_match_only(toy):
    model, compiled, _ = toy
    used = {"specialised": 0, "dynamic": 0}

    def counting(kind, fn):
        def run(*args):
            used[kind] += 1
            return fn(*args)

        return run

    saved = [(p.dynamic, dict(p.specialised)) for p in compiled.pieces]
    for piece in compiled.pieces:
        assert sorted(piece.specialised) == list(SIZES)
        piece.specialised = {n: counting("specialised", f) for n, f in piece.specialised.items()}
        piece.dynamic = counting("dynamic", piece.dynamic)
    try:
        with torch.inference_mode():
            out4 = compiled(*_inputs(4))
            assert used == {"specialised": 4, "dynamic": 0}  # every compiled piece, once
            compiled(*_inputs(5))
            assert used == {"specialised": 4, "dynamic": 4}
    finally:
        for piece, (dynamic, specialised) in zip(compiled.pieces, saved):
            piece.dynamic, piece.specialised = dynamic, specialised
    torch.testing.assert_close(out4, _eager(model, 4), rtol=1e-5, atol=1e-5)


def test_splitting_ops_run_between_the_compiled_pieces(toy):
    _, compiled, _ = toy
    before = dict(CALLS)
    with torch.inference_mode():
        compiled(*_inputs(9))
    assert CALLS["update"] - before["update"] == LAYERS
    assert CALLS["attention"] - before["attention"] == LAYERS


# -- recompiles, wrapper, eager backend ---------------------------------------------------


@pytest.fixture(scope="module")
def eager_toy():
    model = ToyModel(2)
    return model, _compile(model, _options("unused", compile_backend="eager", strict=True))


def test_eager_backend_splits_without_inductor(eager_toy):
    model, compiled = eager_toy
    assert compiled.info.inductor_compiles == 0 and compiled.info.num_pieces == 5
    assert compiled.info.cache_dir == "" and compiled.info.compile_sizes == []
    with torch.inference_mode():
        torch.testing.assert_close(compiled(*_inputs(11)), _eager(model, 11))


def test_new_input_signature_is_a_recompile_error_when_strict(eager_toy):
    _, compiled = eager_toy
    ids, pos = _inputs(6)
    with torch.inference_mode(), pytest.raises(RecompileError, match="int32"):
        compiled(ids.int(), pos)
    with torch.inference_mode(), pytest.raises(InvalidInputError, match="input_ids"):
        compiled([1, 2], pos)
    assert compiled.num_recompiles == 0


def test_new_input_signature_is_counted_when_not_strict():
    model = ToyModel(1)
    compiled = _compile(model, _options("unused", compile_backend="eager"))
    with torch.inference_mode():
        # traced again once (from a padded 2-token copy: a 1-token trace would bake in T=1)...
        for n in (1, 6, 9):
            ids, pos = _inputs(n)
            torch.testing.assert_close(compiled(ids.int(), pos.int()), model(ids, pos))
        assert compiled.num_recompiles == 1  # ...then reused for every length
        compiled(*_inputs(6))
    assert compiled.num_recompiles == 1


def test_piece_wrapper_wraps_each_compiled_piece():
    seen: list[PieceInfo] = []
    calls: dict[int, int] = {}

    def wrapper(piece, info):
        seen.append(info)

        def run(*args):
            calls[info.index] = calls.get(info.index, 0) + 1
            return piece(*args)

        return run

    model = ToyModel(2)
    compiled = _compile(model, _options("unused", compile_backend="eager"), piece_wrapper=wrapper)
    assert [i.index for i in seen] == [0, 2, 4]  # the compiled pieces of 5
    assert {i.num_pieces for i in seen} == {5}
    assert [(i.is_first, i.is_last) for i in seen] == [(True, False), (False, False), (False, True)]
    calls.clear()
    with torch.inference_mode():
        got = compiled(*_inputs(5))
    assert calls == {0: 1, 2: 1, 4: 1}
    torch.testing.assert_close(got, _eager(model, 5))


# -- compile cache ------------------------------------------------------------------------

_WARM_START = """
import json, sys, torch, torch._dynamo.utils
sys.path.insert(0, {tests!r})
from test_passes import ToyModel, _inputs, _options
from graphattn.passes.compiler import compile_model
model = ToyModel()
with torch.inference_mode():
    compiled = compile_model(model, _options({cache!r}, trace_cache={trace_cache}), _inputs(64))
    ids, pos = _inputs(13, seed=5)
    err = (compiled(ids, pos) - model(ids, pos)).abs().max().item()
info = compiled.info
frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
print(json.dumps(dict(hits=info.cache_hits, misses=info.cache_misses, warm=info.warm,
                      inductor=info.inductor_compiles, key=info.cache_key, err=err,
                      trace=info.trace_source, frames=frames)))
"""


@pytest.mark.parametrize("trace_cache", [True, False])
def test_warm_start_in_a_fresh_process_loads_every_piece(toy, cache_dir, trace_cache, tmp_path):
    _, compiled, _ = toy
    script = _WARM_START.format(
        tests=os.path.dirname(__file__), cache=str(cache_dir), trace_cache=trace_cache
    )
    # another working directory and string-hash seed: neither may change a key
    env = os.environ | {"PYTHONHASHSEED": "12345"}
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    builds = compiled.info.cache_misses
    assert result["key"] == compiled.info.cache_key
    assert (result["hits"], result["misses"], result["inductor"]) == (builds, 0, 0)
    assert result["warm"] and result["err"] < 1e-5
    if trace_cache:  # the trace came from the trace cache: Dynamo never ran in that process
        assert (result["trace"], result["frames"]) == ("trace cache", 0)
    else:
        assert result["trace"] == "dynamo" and result["frames"] >= 1


def test_factors_are_written_next_to_the_entry(toy):
    _, compiled, _ = toy
    with open(os.path.join(compiled.info.cache_dir, "factors.json")) as f:
        factors = json.load(f)
    assert factors["engine"] == {"test": "toy"}
    assert factors["torch"] == torch.__version__
    assert any(name.startswith("test_passes.py:") for name in factors["model_sources"])
    assert factors["compiler"]["passes"] == [
        "noop_elimination",
        "unfuse_residual_addmm",
        "rms_norm_gemv",
        "silu_mul_epilogue",
        "rope_epilogue",
        "single_row_gemv",
    ]


def test_corrupt_and_half_written_entries_are_compiled_again(toy, cache_dir, tmp_path, caplog):
    model, compiled, _ = toy
    copy_dir = tmp_path / "cache"
    shutil.copytree(cache_dir, copy_dir)
    pieces = os.path.join(copy_dir, compiled.info.cache_key, "pieces")
    entries = sorted(f for f in os.listdir(pieces) if f.endswith(".bin"))
    corrupt, truncated = entries[0], entries[1]
    with open(os.path.join(pieces, corrupt), "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 64)
    with open(os.path.join(pieces, truncated), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    with caplog.at_level(logging.WARNING, logger="graphattn"):
        again = _compile(model, _options(copy_dir))
    assert (again.info.cache_misses, again.info.cache_hits) == (2, len(entries) - 2)
    assert again.info.inductor_compiles == 2
    assert sum("checksum does not match" in r.getMessage() for r in caplog.records) == 2
    with torch.inference_mode():
        torch.testing.assert_close(again(*_inputs(21)), _eager(model, 21), rtol=1e-5, atol=1e-5)
    third = _compile(model, _options(copy_dir))  # the rewritten entries load cleanly
    assert (third.info.cache_misses, third.info.inductor_compiles) == (0, 0)
    assert not [f for f in os.listdir(pieces) if f.endswith(".part")]


def test_a_changed_factor_misses(toy, cache_dir):
    model, compiled, _ = toy
    other = _compile(model, _options(cache_dir, cache_factors={"test": "changed"}))
    assert other.info.cache_key != compiled.info.cache_key
    assert other.info.cache_hits == 0
    assert other.info.cache_misses == compiled.info.cache_misses


def test_an_inductor_config_change_misses(toy, cache_dir):
    model, compiled, _ = toy
    with torch._inductor.config.patch(epilogue_fusion=False):
        other = _compile(model, _options(cache_dir, compile_sizes=()))
    assert other.info.cache_key != compiled.info.cache_key
    assert other.info.trace_source == "dynamo" and other.info.cache_hits == 0
    _check_outputs(other, model)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("inductor_pdl", [True, False])
def test_inductor_pdl_patches_inductors_config_and_enters_the_key(
    tmp_path, monkeypatch, inductor_pdl
):
    """The engine's choice reaches each build as a patch of Inductor's config (its kernels'
    code then depends on it, which Inductor's own cache sees), and graphattn's cache key."""
    from graphattn.passes.compiler import _base_factors
    from graphattn.passes.pass_manager import make_pass_manager

    seen = []

    def spy(gm, inputs, **kwargs):
        seen.append(kwargs["options"]["config_patches"])
        raise _Stop

    monkeypatch.setattr(torch._inductor, "standalone_compile", spy)
    options = _options(tmp_path, compile_sizes=(), inductor_pdl=inductor_pdl)
    with pytest.raises(_Stop):
        _compile(ToyModel(), options)
    assert seen[0].get("triton.enable_pdl", False) is inductor_pdl
    assert ("triton.enable_pdl" in seen[0]) is inductor_pdl  # off: Inductor's config decides
    passes = make_pass_manager(options.passes)
    factors = _base_factors(options, passes, MAX_TOKENS)
    flipped = dataclasses.replace(options, inductor_pdl=not inductor_pdl)
    other = _base_factors(flipped, passes, MAX_TOKENS)
    assert factors["compiler"]["inductor_pdl"] is inductor_pdl
    assert {k: v for k, v in factors.items() if k != "compiler"} == {
        k: v for k, v in other.items() if k != "compiler"
    }


def test_an_unusable_cache_folder_only_costs_the_cache(toy, tmp_path, caplog):
    model, _, _ = toy
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with caplog.at_level(logging.WARNING, logger="graphattn"):
        compiled = _compile(model, _options(not_a_folder))
    assert compiled.info.cache_dir == "" and compiled.info.cache_hits == 0
    assert any("no compile cache" in r.getMessage() for r in caplog.records)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(*_inputs(5)), _eager(model, 5), rtol=1e-5, atol=1e-5)


# -- trace cache --------------------------------------------------------------------------


def _frames() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture
def forget_dynamic_floats():
    """Forget Dynamo's automatic-dynamic state after a test that traces a changed float
    attribute: Dynamo would make the float a graph input of every later toy trace.
    """
    yield
    torch._dynamo.reset()


def _check_outputs(compiled, model, sizes=(1, 4, 13)):
    with torch.inference_mode():
        for n in sizes:
            got = compiled(*_inputs(n, seed=n))
            torch.testing.assert_close(got, _eager(model, n, seed=n), rtol=1e-5, atol=1e-5)


def test_a_second_compile_takes_its_trace_from_the_trace_cache(toy, cache_dir):
    model, first, _ = toy
    assert first.info.trace_source == "dynamo" and "saved" in first.info.trace_cache
    frames = _frames()
    again = _compile(ToyModel(), _options(cache_dir))
    assert _frames() == frames  # no Dynamo trace
    info = again.info
    assert (info.trace_source, info.trace_seconds, info.inductor_compiles) == ("trace cache", 0, 0)
    assert info.trace_cache.startswith("loaded ") and info.warm
    assert info.cache_key == first.info.cache_key
    assert [sorted(p.specialised) for p in again.pieces] == [list(SIZES)] * 4
    _check_outputs(again, model)


def test_a_changed_attribute_misses_the_trace_cache(toy, cache_dir, forget_dynamic_floats):
    model = ToyModel()
    model.position_scale = 0.5  # baked into the graph as a constant
    frames = _frames()
    compiled = _compile(model, _options(cache_dir))
    assert _frames() > frames and compiled.info.trace_source == "dynamo"
    _check_outputs(compiled, model)
    with torch.inference_mode():  # and the output is the new model's, not the cached graph's
        a, b = _eager(model, 6), _eager(ToyModel(), 6)
    assert (a - b).abs().max() > 0.1


def test_describe_model_sees_attributes_tensors_configs_and_hooks():
    from graphattn.passes.trace_cache import describe_model

    base = describe_model(ToyModel())
    assert describe_model(ToyModel(seed=1)) == base  # weights' values are not the trace's
    changed = [ToyModel() for _ in range(5)]
    changed[0].position_scale = 0.02
    changed[1].weights[0].data = changed[1].weights[0].data.double()
    changed[2].weights.append(nn.Parameter(torch.zeros(HIDDEN, HIDDEN)))
    changed[3].register_forward_pre_hook(lambda module, args: None)
    changed[4].eval()  # a fresh module trains
    for model in changed:
        assert describe_model(model) != base
    # nested plain objects are described by value, not by address
    a, b = ToyModel(), ToyModel()
    a.options, b.options = _Settings(2, {"x": (1, 2)}), _Settings(2, {"x": (1, 2)})
    assert describe_model(a) == describe_model(b)
    b.options.table["x"] = (1, 3)
    assert describe_model(a) != describe_model(b)


class _Settings:
    def __init__(self, heads, table):
        self.heads, self.table = heads, table


def _scaler(alpha):
    return lambda x: x * alpha


@dataclasses.dataclass
class _Late:
    ready: bool = dataclasses.field(init=False)  # never set: reading it raises


_ACTS = {"double": lambda x: x * 2, "neg": lambda x: -x}


@dataclasses.dataclass
class _Config:
    heads: int


def _describe_pair(change):
    """describe_model of two fresh toys, ``change`` applied to the second one."""
    from graphattn.passes.trace_cache import describe_model

    a, b = ToyModel(), ToyModel()
    for model in (a, b):
        model.config = _Config(2)
        model.config.logit_scale = 1.0
        model.shared, model.other = torch.zeros(2), torch.zeros(2)
        model.act_method = torch.zeros(2).mul
        model.act = _ACTS["double"]
        model.fn = _scaler(2.0)
        model.steps = [nn.LeakyReLU(0.1)]  # a module outside the module tree
        model.order = {"norm": 1, "gate": 2}
        model.table = np.arange(4)
    change(b)
    return describe_model(a), describe_model(b)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: setattr(m, "embed", m.weights[0]),  # tied: one tensor under two paths
        lambda m: setattr(m, "fn", _scaler(5.0)),  # a closure's captured value
        lambda m: setattr(m.steps[0], "negative_slope", 0.3),  # a module outside the tree
        lambda m: setattr(m, "order", {"gate": 2, "norm": 1}),  # dict order (code may loop)
        lambda m: m.table.__setitem__(0, 7),  # an array's contents
        lambda m: setattr(m, "method", m.steps[0].forward),  # a bound method
        lambda m: setattr(m, "act", _ACTS["neg"]),  # another lambda: same name, other code
        lambda m: setattr(m.config, "logit_scale", 3.0),  # a dataclass's non-field attribute
        lambda m: setattr(m, "shared", m.other),  # two names for one plain tensor
        lambda m: setattr(m, "act_method", torch.ones(3).mul),  # a builtin method's object
    ],
    ids=[
        "tied",
        "closure",
        "hidden-module",
        "dict-order",
        "ndarray",
        "bound-method",
        "same-named-lambda",
        "dataclass-extra",
        "shared-plain-tensor",
        "builtin-method",
    ],
)
def test_describe_model_sees_what_a_trace_reads(change):
    a, b = _describe_pair(change)
    assert a != b
    same_a, same_b = _describe_pair(lambda m: None)
    assert same_a == same_b


def test_a_model_holding_what_the_key_cannot_describe_has_no_trace_cache(tmp_path):
    import threading

    from graphattn.passes.trace_cache import trace_key

    model = ToyModel()
    model.late = _Late()  # an unset dataclass field is described, not an error
    assert trace_key({}, model, *_inputs(4))[0]
    model.lock = threading.Lock()  # no __dict__, no known form
    key, why = trace_key({}, model, *_inputs(4))
    assert key == "" and "lock (lock: no known form)" in why
    options = CompileOptions(
        compile_sizes=(), cache_dir=str(tmp_path), cache_factors={"test": "opaque"}
    )
    compiled = _compile(_ReadsAGlobalTensor(), options, n=8)  # a model without the lock...
    assert "off" not in compiled.info.trace_cache
    holder = _ReadsAGlobalTensor()
    holder.lock = threading.Lock()
    compiled = _compile(holder, options, n=8)  # ...and one with it
    assert compiled.info.trace_cache.startswith("off (the model holds values it cannot")
    _check_outputs(compiled, holder)


def test_a_failure_to_describe_only_turns_the_trace_cache_off(tmp_path, monkeypatch):
    from graphattn.passes import trace_cache

    def fail(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(trace_cache._Describer, "model", fail)
    options = CompileOptions(compile_sizes=(), cache_dir=str(tmp_path), cache_factors={"t": 1})
    compiled = _compile(_ReadsAGlobalTensor(), options, n=8)
    assert compiled.info.trace_cache == "off (describing the model failed: RuntimeError: boom)"


def test_trace_sources_check_everything_but_torch(toy):
    import dataclasses as dc
    import json as json_module

    from graphattn.passes.trace_cache import trace_sources

    model = ToyModel()
    with torch.inference_mode():
        trace = trace_model(model, *_inputs(8))
    checks, why = trace_sources(trace, model)
    sources = checks["sources"]
    assert why == "" and os.path.abspath(__file__) in sources
    assert not any(p.startswith(os.path.dirname(torch.__file__)) for p in sources)
    # the globals the toy's forward reads from this file, by value
    assert checks["globals"]["test_passes"]["HIDDEN"] == repr(HIDDEN)
    # the standard library (where site-packages can live) is checked, not assumed
    stdlib = dc.replace(trace, traced_files=(*trace.traced_files, json_module.__file__))
    assert json_module.__file__ in trace_sources(stdlib, model)[0]["sources"]
    # code with no file behind it (exec, a notebook cell) cannot be checked: not saved
    no_file = dc.replace(trace, traced_files=("<cell 3>",))
    assert trace_sources(no_file, model) == (
        None,
        "traced code from <cell 3>, which is not a file that can be checked",
    )


def test_an_exec_defined_model_is_traced_every_time(tmp_path):
    namespace = {}
    exec(
        "import torch\n"
        "class Exec(torch.nn.Module):\n"
        "    def forward(self, input_ids, positions):\n"
        "        return (input_ids + positions).float() * 2\n",
        namespace,
    )
    options = CompileOptions(compile_sizes=(), cache_dir=str(tmp_path), cache_factors={"t": 2})
    compiled = _compile(namespace["Exec"](), options, n=8)
    assert "not saved (traced code from <string>" in compiled.info.trace_cache


def test_verification_survives_the_pickle_round_trip_of_a_real_model():
    """Unpickling a graph module re-traces its code, which turns some defaults into
    keywords (Llama's embedding and SiLU): an unchanged model must still verify.
    """
    import pickle

    import graphattn as ga
    from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights
    from graphattn.passes.split import split_graph_of
    from graphattn.passes.trace_cache import pickle_split, same_graph

    def split_of(model):
        engine = ga.compile(
            model,
            cudagraph_mode="NONE",
            compile_backend="eager",
            max_num_seqs=4,
            max_num_tokens=16,
            max_model_len=64,
            num_blocks=16,
        )
        return engine.compiled.runtime.split

    cfg = LlamaConfig.tiny()
    saved = split_of(init_random_weights(LlamaForCausalLM(cfg)))
    ops = resolve_splitting_ops(None)
    restored = split_graph_of(pickle.loads(pickle_split(saved)), ops)
    assert same_graph(restored, split_of(init_random_weights(LlamaForCausalLM(cfg))))
    other = LlamaForCausalLM(dataclasses.replace(cfg, rms_norm_eps=1e-3))
    assert not same_graph(restored, split_of(init_random_weights(other)))


def test_an_entry_whose_graph_fails_to_run_is_traced_again(toy, cache_dir, tmp_path, caplog):
    from graphattn.passes.trace_cache import TraceCache

    model, _, _ = toy
    copy_dir = tmp_path / "cache"
    shutil.copytree(cache_dir, copy_dir)
    traces = TraceCache(str(copy_dir))
    key = _compile(model, _options(copy_dir)).info.trace_cache.split("/")[-1][: -len(".bin")]
    entry, _ = traces.load(key)
    for spec in entry.binding:  # bind the embedding where a layer weight belongs
        if spec[0] == "tensor" and spec[1] == "weights.0":
            spec[1] = "embed"
    traces.store(key, entry)
    with caplog.at_level(logging.WARNING, logger="graphattn"):
        again = _compile(model, _options(copy_dir))
    assert again.info.trace_source == "dynamo"
    assert again.info.trace_cache.startswith("missed (the restored graph failed")
    assert any("failed to run" in r.getMessage() for r in caplog.records)
    _check_outputs(again, model)


_HELPER = """
FLIP = {flip}


def flip() -> bool:
    return FLIP
"""

_MODEL = """
import torch
from torch import nn

import {helper} as helper


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.eye(4) * 2, requires_grad=False)

    def forward(self, input_ids, positions):
        x = (input_ids + positions)[:, None].float() * self.w[0]
        return -x if helper.flip() else x
"""


def test_a_changed_helper_file_misses_though_it_adds_no_graph_node(tmp_path, monkeypatch):
    """The helper only steers control flow (no node's stack trace names its file): the
    trace cache must still see that it changed.
    """
    import importlib

    code_dir = tmp_path / "code"
    code_dir.mkdir()
    (code_dir / "tiny_helper.py").write_text(_HELPER.format(flip=False))
    (code_dir / "tiny_model.py").write_text(_MODEL.format(helper="tiny_helper"))
    monkeypatch.syspath_prepend(str(code_dir))
    import tiny_helper
    import tiny_model

    options = CompileOptions(cache_dir=str(tmp_path / "cache"), cache_factors={"test": "tiny"})
    first = _compile(tiny_model.Tiny(), options, n=8)
    assert first.info.trace_source == "dynamo" and "saved" in first.info.trace_cache
    again = _compile(tiny_model.Tiny(), options, n=8)
    assert again.info.trace_source == "trace cache"

    (code_dir / "tiny_helper.py").write_text(_HELPER.format(flip=True))
    importlib.reload(tiny_helper)
    model = tiny_model.Tiny()
    changed = _compile(model, options, n=8)
    assert changed.info.trace_source == "dynamo"
    assert "tiny_helper.py changed since the trace" in changed.info.trace_cache
    with torch.inference_mode():
        ids, pos = _inputs(5)
        assert changed(ids, pos).sum() < 0
        torch.testing.assert_close(changed(ids, pos), model(ids, pos))


_CONSTS = """
SCALE = 2
"""

_GLOBALS_MODEL = """
from torch import nn

import tiny_consts
from tiny_consts import SCALE


class Base(nn.Module):
    OFFSET = 1


class UsesGlobals(Base):
    def forward(self, input_ids, positions):
        x = (input_ids + positions).float()
        return x * tiny_consts.SCALE * SCALE + self.OFFSET
"""


def _trace_checker(model_cls, options):
    """Compiles a fresh ``model_cls()``, checks where its trace came from and its outputs,
    and returns the trace cache's note."""

    def compile_and_check(expect_source):
        torch._dynamo.reset()  # a value seen twice would become a graph input otherwise
        model = model_cls()
        compiled = _compile(model, options, n=8)
        assert compiled.info.trace_source == expect_source, compiled.info.trace_cache
        _check_outputs(compiled, model)
        return compiled.info.trace_cache

    return compile_and_check


def _importable(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """Write ``files`` (relative path -> source) under a folder put first on sys.path."""
    code_dir = tmp_path / "code"
    for name, text in files.items():
        path = code_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.syspath_prepend(str(code_dir))


def test_globals_and_class_attributes_the_trace_read_are_checked(tmp_path, monkeypatch):
    """Values from other files (a module's attribute, a from-import, a base class's
    attribute) are baked into the graph; a change to any of them, on disk or at run
    time, must miss the trace cache.
    """
    _importable(
        tmp_path,
        monkeypatch,
        {"tiny_consts.py": _CONSTS, "tiny_globals_model.py": _GLOBALS_MODEL},
    )
    import tiny_consts
    import tiny_globals_model as m

    options = CompileOptions(cache_dir=str(tmp_path / "cache"), cache_factors={"test": "g"})
    compile_and_check = _trace_checker(m.UsesGlobals, options)

    assert "saved" in compile_and_check("dynamo")
    assert compile_and_check("trace cache").startswith("loaded")
    monkeypatch.setattr(tiny_consts, "SCALE", 3)  # read as tiny_consts.SCALE
    assert "a global the traced code reads changed" in compile_and_check("dynamo")
    monkeypatch.setattr(m, "SCALE", 5)  # the from-import's copy
    assert "a global the traced code reads changed" in compile_and_check("dynamo")
    monkeypatch.setattr(m.Base, "OFFSET", 4)  # a base class's attribute: another key
    assert compile_and_check("dynamo").startswith("missed (no entry)")
    assert compile_and_check("trace cache").startswith("loaded")


_DEEP_CONSTS = """
class Consts:
    SCALE = 2.0
"""

_DEEP_MODEL = """
from torch import nn

import tiny_deep_pkg.sub
from tiny_deep_consts import Consts


class Settings:  # a plain object the module holds; its class carries the value
    shift = 1.0


class UsesDeepValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.settings = Settings()

    def forward(self, input_ids, positions):
        x = (input_ids + positions).float()
        return x * Consts.SCALE + tiny_deep_pkg.sub.OFFSET + self.settings.shift
"""


def test_constants_read_through_a_class_a_nested_module_or_an_objects_class_are_checked(
    tmp_path, monkeypatch
):
    """The three forms the trace key used to describe by name only: a stale trace ran with
    the old value baked in (a review's reproducer: 0.0 then 5.2 off after an edit)."""
    _importable(
        tmp_path,
        monkeypatch,
        {
            "tiny_deep_pkg/__init__.py": "",
            "tiny_deep_pkg/sub.py": "OFFSET = 3.0\n",
            "tiny_deep_consts.py": _DEEP_CONSTS,
            "tiny_deep_model.py": _DEEP_MODEL,
        },
    )
    import tiny_deep_consts
    import tiny_deep_model as m
    import tiny_deep_pkg.sub

    options = CompileOptions(cache_dir=str(tmp_path / "cache"), cache_factors={"test": "deep"})
    compile_and_check = _trace_checker(m.UsesDeepValues, options)

    assert "saved" in compile_and_check("dynamo")
    assert compile_and_check("trace cache").startswith("loaded")
    monkeypatch.setattr(tiny_deep_consts.Consts, "SCALE", 5.0)
    assert not compile_and_check("dynamo").startswith("loaded")
    monkeypatch.setattr(tiny_deep_pkg.sub, "OFFSET", 7.0)
    assert not compile_and_check("dynamo").startswith("loaded")
    monkeypatch.setattr(m.Settings, "shift", 2.5)
    assert not compile_and_check("dynamo").startswith("loaded")
    assert compile_and_check("trace cache").startswith("loaded")


def test_an_enum_member_is_described_with_its_value():
    import enum

    from graphattn.passes.trace_cache import _Describer

    one = enum.Enum("Mode", {"A": 1}, module=__name__)
    two = enum.Enum("Mode", {"A": 2}, module=__name__)  # the same member after an edit
    describe = _Describer(nn.Module()).value
    assert describe(one.A, "m", 0) != describe(two.A, "m", 0)
    assert describe(one.A, "m", 0) == describe(one.A, "m", 0)


_GLOBAL_TABLE = torch.arange(VOCAB, dtype=torch.float32)


class _ReadsAGlobalTensor(nn.Module):
    def forward(self, input_ids, positions):
        return _GLOBAL_TABLE[input_ids] + positions


def test_a_graph_input_the_model_does_not_hold_is_not_saved(tmp_path):
    options = CompileOptions(cache_dir=str(tmp_path), cache_factors={"test": "global"})
    model = _ReadsAGlobalTensor()
    first = _compile(model, options, n=8)
    assert "not saved (graph input" in first.info.trace_cache
    assert "does not hold" in first.info.trace_cache
    assert not os.listdir(tmp_path / "traces")
    again = _compile(model, options, n=8)
    assert again.info.trace_source == "dynamo" and again.info.inductor_compiles == 0
    _check_outputs(again, model)


def test_a_corrupt_trace_entry_is_traced_again_and_rewritten(toy, cache_dir, tmp_path, caplog):
    model, _, _ = toy
    copy_dir = tmp_path / "cache"
    shutil.copytree(cache_dir, copy_dir)
    for entry in os.listdir(copy_dir / "traces"):  # the toy's, and other tests' entries
        with open(copy_dir / "traces" / entry, "r+b") as f:
            f.seek(60)
            f.write(b"\x00" * 16)
    with caplog.at_level(logging.WARNING, logger="graphattn"):
        again = _compile(model, _options(copy_dir))
    assert again.info.trace_source == "dynamo" and "checksum" in again.info.trace_cache
    assert any("checksum does not match" in r.getMessage() for r in caplog.records)
    assert again.info.inductor_compiles == 0  # the pieces still came from the compile cache
    _check_outputs(again, model)
    third = _compile(model, _options(copy_dir))
    assert third.info.trace_source == "trace cache", (
        again.info.trace_cache,
        third.info.trace_cache,
    )


def test_a_missing_piece_build_sends_the_start_back_to_dynamo(toy, cache_dir, tmp_path):
    model, compiled, _ = toy
    copy_dir = tmp_path / "cache"
    shutil.copytree(cache_dir, copy_dir)
    pieces = copy_dir / compiled.info.cache_key / "pieces"
    from graphattn.passes.fingerprint import graph_fingerprint

    # one of this model's builds (the directory also holds other tests' models' builds)
    fingerprint = graph_fingerprint(compiled.pieces[0].piece.module)
    os.remove(pieces / f"{fingerprint[:32]}-dynamic.bin")
    again = _compile(model, _options(copy_dir))
    info = again.info
    assert info.trace_source == "dynamo" and "is not in the compile cache" in info.trace_cache
    assert (info.cache_misses, info.inductor_compiles) == (1, 1)
    _check_outputs(again, model)
    assert _compile(model, _options(copy_dir)).info.trace_source == "trace cache"


def test_trace_cache_off_always_traces(toy, cache_dir):
    model, _, _ = toy
    compiled = _compile(model, _options(cache_dir, trace_cache=False))
    assert compiled.info.trace_source == "dynamo"
    assert compiled.info.trace_cache == "off (trace_cache=False)"
    assert compiled.info.cache_hits > 0


def test_verification_catches_an_entry_its_key_missed(
    toy, cache_dir, tmp_path, monkeypatch, caplog, forget_dynamic_floats
):
    """A key blind to the model (as it would be to a global changed at run time): without
    verification the stale graph runs; with it the fresh trace wins and replaces the entry.
    """
    import graphattn.passes.compiler as compiler_module

    copy_dir = tmp_path / "cache"
    shutil.copytree(cache_dir, copy_dir)
    monkeypatch.setattr(compiler_module, "trace_key", lambda *args: ("blind", ""))
    _compile(ToyModel(), _options(copy_dir))  # saves the entry "blind"
    changed = ToyModel()
    changed.position_scale = 0.5
    with torch.inference_mode():
        want, old = _eager(changed, 6), _eager(ToyModel(), 6)
    stale = _compile(changed, _options(copy_dir))
    assert stale.info.trace_source == "trace cache"
    with torch.inference_mode():
        torch.testing.assert_close(stale(*_inputs(6)), old)  # the hazard the key guards

    torch._dynamo.reset()  # else Dynamo, having seen two scales, makes the scale an input
    with caplog.at_level(logging.WARNING, logger="graphattn"):
        checked = _compile(changed, _options(copy_dir, verify_trace_cache=True))
    assert checked.info.trace_source == "dynamo"
    assert "stale entry replaced" in checked.info.trace_cache
    assert any("differs from a fresh trace" in r.getMessage() for r in caplog.records)
    with torch.inference_mode():
        torch.testing.assert_close(checked(*_inputs(6)), want)
    same = _compile(changed, _options(copy_dir, verify_trace_cache=True))
    assert same.info.trace_source == "trace cache" and "verified" in same.info.trace_cache


# -- graphattn's kernels compiled on a pool during start-up --------------------------------


def test_the_start_up_runs_report_the_kernel_precompile(toy, cache_dir):
    """On the CPU there is nothing to compile ahead (the report says why); a start from the
    trace cache skips it as the capture does after a warm compile."""
    _, compiled, _ = toy
    assert compiled.info.kernel_precompile == {
        "status": "unavailable: kernels compile only for CUDA devices, got cpu"
    }
    again = _compile(ToyModel(), _options(cache_dir))
    assert again.info.trace_source == "trace cache"
    assert again.info.kernel_precompile["status"].startswith("skipped: a warm compile")


@pytest.fixture
def pool_on(monkeypatch):
    """``compile_ahead`` as on a CUDA machine, minus the hook (the toy's ops run anyway):
    yields a switch that makes the toy attention raise while the dry run is inside."""
    import contextlib

    import graphattn.passes.compiler as compiler_module
    from graphattn.kernels.precompile import PrecompileReport

    raise_inside = [False]

    @contextlib.contextmanager
    def ahead(device, threads, skip=None):
        RAISE_IN_ATTENTION[0] = raise_inside[0]
        try:
            yield PrecompileReport("on", threads=threads)
        finally:
            RAISE_IN_ATTENTION[0] = False

    monkeypatch.setattr(compiler_module, "compile_ahead", ahead)
    monkeypatch.setenv("GRAPHATTN_PRECOMPILE_THREADS", "2")
    return raise_inside


@pytest.mark.parametrize("raises", [False, True])
def test_the_dry_run_reuses_its_builds_and_a_raise_leaves_the_real_runs(
    toy, cache_dir, pool_on, raises
):
    """The dry run (the first run and each specialisation, before the real ones) builds each
    piece and shape once: the real runs take its builds, so the compile cache is read as
    often as without it. If the dry run raises, the real runs build the rest as before and
    the report says why the pool stopped."""
    model, compiled, _ = toy
    pool_on[0] = raises
    before = dict(CALLS)
    again = _compile(model, _options(cache_dir, trace_cache=False))
    info = again.info
    assert (info.cache_hits, info.cache_misses) == (compiled.info.cache_misses, 0)
    assert (info.compile_sizes, info.inductor_compiles) == (list(SIZES), 0)
    real = LAYERS * (1 + len(SIZES))  # the first run and each specialisation, every layer
    dry = 1 if raises else real  # a raising dry run stops at its first attention
    assert CALLS["attention"] - before["attention"] == real + dry
    status = info.kernel_precompile["status"]
    if raises:
        assert status == "stopped: the dry run raised ValueError: garbage in a routing op"
    else:
        assert status == "on" and info.kernel_precompile["threads"] == 2
    _check_outputs(again, model)


# -- debug dump ---------------------------------------------------------------------------


def test_debug_dump_has_graphs_decompiled_code_and_output_code(tmp_path):
    pytest.importorskip("depyf")
    model = ToyModel(1)
    options = _options(tmp_path / "cache", compile_sizes=(), debug_dump_path=str(tmp_path / "dump"))
    compiled = _compile(model, options)
    folder = compiled.info.debug_dump_dir
    assert os.path.dirname(folder) == str(tmp_path / "dump")
    files = {
        os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs
    }
    assert {"graph_before_split.py", "graph_after_split.py"} <= files
    assert any(f.startswith("dynamo/transformed_") for f in files)
    outputs = sorted(f for f in files if f.startswith("pieces/") and f.endswith("-dynamic.py"))
    assert len(outputs) == 2  # the two compiled pieces of one layer
    with open(os.path.join(folder, outputs[0])) as f:
        assert "def call(" in f.read()  # Inductor's wrapper code


def test_debug_dump_without_depyf_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "depyf", None)  # import depyf raises ImportError
    options = _options("unused", compile_backend="eager", debug_dump_path=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="graphattn"):
        compiled = _compile(ToyModel(1), options)
    note = os.path.join(compiled.info.debug_dump_dir, "dynamo", "DEPYF_MISSING.txt")
    with open(note) as f:
        assert "depyf is not installed" in f.read()
    assert any("depyf is not installed" in r.getMessage() for r in caplog.records)
    assert os.path.exists(os.path.join(compiled.info.debug_dump_dir, "graph_after_split.py"))


def test_example_inputs_are_checked():
    only_ids = (torch.zeros(3, dtype=torch.long),)
    with pytest.raises(InvalidInputError, match=r"input_ids \[T\], positions \[T\]"):
        compile_model(ToyModel(1), _options("unused"), only_ids)


def test_deterministic_algorithms_enter_the_key(tmp_path):
    """Inductor lowers some ops differently under deterministic algorithms; a piece compiled
    without them must not serve a process that asked for them."""
    from graphattn.passes.compiler import _base_factors
    from graphattn.passes.pass_manager import make_pass_manager

    options = _options(tmp_path, compile_sizes=())
    passes = make_pass_manager(options.passes)
    before = _base_factors(options, passes, MAX_TOKENS)
    assert before["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
    try:
        torch.use_deterministic_algorithms(True)
        after = _base_factors(options, passes, MAX_TOKENS)
    finally:
        torch.use_deterministic_algorithms(False)
    assert (before["deterministic"], after["deterministic"]) == (False, True)
