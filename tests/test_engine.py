"""The engine end to end (eager): incremental decoding, caller order, grouping, generate, report."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers import DEVICES, TableAttentionModel, eager_engine, make_seqs, rel_err
from hypothesis import given
from hypothesis import strategies as st

import graphattn as ga
from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights
from graphattn.validation import check_step


def _llama(device="cpu", dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(**overrides)
    return init_random_weights(LlamaForCausalLM(cfg), seed=1).to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_incremental_decoding_equals_recomputing(device):
    """Prefill 20 tokens then decode 6 one at a time; the last logits equal one prefill of 26."""
    model = _llama(device)
    engine = eager_engine(model, cudagraph_mode="NONE", num_blocks=64, max_model_len=128)
    ids = torch.randint(0, 512, (26,), generator=torch.Generator().manual_seed(3)).tolist()
    blocks = engine.kv_cache.allocate(2)
    engine.step(ga.Batch.from_requests([ga.Request(ids[:20], 0, blocks)]))
    for n in range(20, 26):
        hidden = engine.step(ga.Batch.from_requests([ga.Request(ids[n : n + 1], n, blocks)]))
    incremental = engine.compute_logits(hidden)[-1]
    other = engine.kv_cache.allocate(2)
    full = engine.step(ga.Batch.from_requests([ga.Request(ids, 0, other)]))
    recomputed = engine.compute_logits(full)[-1]
    assert rel_err(incremental, recomputed) < 1e-5


def test_compute_logits_takes_2d_float_rows():
    model = _llama()
    engine = eager_engine(model, cudagraph_mode="NONE", num_blocks=8, max_model_len=64)
    hidden = engine.step(
        ga.Batch.from_requests([ga.Request([1, 2, 3], 0, engine.kv_cache.allocate(1))])
    )
    assert engine.compute_logits(hidden[-1:]).shape == (1, model.vocab_size)
    for bad, got in (
        (hidden[-1], rf"torch.float32\[{hidden.shape[1]}\]"),
        (torch.tensor([[1, 2]]), r"torch.int64\[1, 2\]"),
        ([0.5] * 64, "list"),
    ):
        with pytest.raises(
            ga.InvalidInputError, match=r"compute_logits takes step rows \[T, hidden\] .*got " + got
        ):
            engine.compute_logits(bad)


@given(order=st.permutations(list(range(6))), seed=st.integers(0, 1000))
def test_caller_order_is_preserved(order, seed):
    """Rows come back in the caller's request order however decodes and prefills are mixed."""
    model = TableAttentionModel(64, 4, 2, 64, seed=seed)
    engine = eager_engine(model, num_blocks=64, max_model_len=128)
    shapes = [(0, 9), (5, 1), (0, 3), (17, 1), (8, 6), (30, 1)]
    seqs = make_seqs(np.random.default_rng(seed), shapes, 64, 16, 64)
    seqs = [seqs[i] for i in order]
    for s in seqs:
        if s.num_computed:
            engine.step(ga.Batch.from_requests([s.prefix_request()]))
    out = engine.step(ga.Batch.from_requests([s.request() for s in seqs]))
    expected = torch.cat([model.expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])
    assert rel_err(out, expected) < 1e-5
    one_by_one = torch.cat([engine.step(ga.Batch.from_requests([s.request()])) for s in seqs])
    torch.testing.assert_close(out, one_by_one, rtol=1e-5, atol=1e-6)


class _Spy:
    """Records each builder's build calls and the metadata object each layer saw."""

    def __init__(self, engine):
        self.builds = {g.group_id: 0 for g in engine.attn_groups}
        self.seen: dict[str, int] = {}
        for group in engine.attn_groups:
            build = group.builder.build

            def counted(prefix_len, cam, _build=build, _id=group.group_id):
                self.builds[_id] += 1
                return _build(prefix_len, cam)

            group.builder.build = counted
        for name, bound in engine.bound.items():
            forward = bound.impl.forward

            def seen(layer_, q, k, v, cache, md, out, *a, _name=name, _fwd=forward, **kw):
                self.seen[_name] = id(md)
                return _fwd(layer_, q, k, v, cache, md, out, *a, **kw)

            bound.impl.forward = seen


def test_grouping_one_builder_and_one_metadata_per_group():
    # layers 0 and 2 have 4 query heads, layers 1 and 3 have 8: same KV spec, two groups
    model = TableAttentionModel(32, 4, 2, 64, heads_per_layer=[4, 8, 4, 8])
    engine = eager_engine(model, num_blocks=32)
    assert len(engine.kv_cache.groups) == 1
    groups = {g.group_id: g.layer_names for g in engine.attn_groups}
    assert groups == {0: ["layers.0.attn", "layers.2.attn"], 1: ["layers.1.attn", "layers.3.attn"]}
    spy = _Spy(engine)
    seqs = make_seqs(np.random.default_rng(0), [(0, 5), (0, 1)], 32, 16, 32)
    engine.step(ga.Batch.from_requests([s.request() for s in seqs]))
    assert spy.builds == {0: 1, 1: 1}
    assert spy.seen["layers.0.attn"] == spy.seen["layers.2.attn"]
    assert spy.seen["layers.1.attn"] == spy.seen["layers.3.attn"]
    assert spy.seen["layers.0.attn"] != spy.seen["layers.1.attn"]
    report = engine.report.to_dict()
    assert [g["layers"] for g in report["groups"]] == list(groups.values())


def test_sliding_window_layers_form_their_own_kv_cache_group():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vocab_size = 16
            self.full = ga.Attention(2, 64, 0.125, prefix="full")
            self.local = ga.Attention(2, 64, 0.125, prefix="local", sliding_window=8)
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, ids, pos):
            x = torch.randn(ids.shape[0], 128) * self.w
            return self.full(x, x, x) + self.local(x, x, x)

    engine = eager_engine(Mixed(), num_blocks=8)
    assert [g.layer_names for g in engine.kv_cache.groups] == [("full",), ("local",)]
    assert "sliding(window=8" in engine.report.groups[1].spec


def test_generate_continuous_batching_matches_one_prompt_at_a_time():
    model = _llama()
    prompts = [[1, 2, 3], list(range(5, 40)), [7] * 20, [9, 8, 7, 6, 5]]
    # two slots and a small token budget: prompts join late and prefills are chunked; debug's
    # checks of every block each step uses (blocks of finished requests handed out again)
    engine = eager_engine(
        model, max_num_seqs=2, max_num_tokens=24, num_blocks=64, max_model_len=128, debug=True
    )
    together = engine.generate(prompts, 6)
    assert engine.kv_cache.num_free_blocks == 64, "blocks of finished requests are freed"
    alone = eager_engine(model, num_blocks=64, max_model_len=128)
    assert together == [alone.generate([p], 6)[0] for p in prompts]
    assert all(len(t) == 6 for t in together)


def test_report_names_backend_per_layer_and_prints():
    model = _llama()
    engine = eager_engine(model, cudagraph_mode="NONE", num_blocks=16)
    text = str(engine.report)
    assert "requested NONE -> resolved NONE" in text
    assert all(layer.backend == "TORCH_REF" for layer in engine.report.layers)
    assert [x.name for x in engine.report.layers] == [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    assert engine.report.groups[0].cudagraph_support == "NEVER"
    d = engine.report.to_dict()
    assert d["fallbacks"] == [] and d["kv_cache"]["num_blocks"] == 16
    assert d["kernels"] == {
        "pdl": "off: cpu is not a CUDA device",  # and why
        "split_kv_merge": "by a reduction kernel after the attention launch",
        "ptxas": "not pinned: kernels compile only for CUDA devices, got cpu",
        "inductor_pdl": "off: compile_backend='none' runs no Inductor",
        "o_proj_fold": "off (GRAPHATTN_FOLD_O_PROJ=1 folds o_proj into the attention op)",
    }
    assert "kernels: pdl=off: cpu is not a CUDA device" in text


@pytest.mark.parametrize(
    "backend, inductor_own, env, graphattn_pdl, mode, expected",
    [
        ("inductor", False, None, True, "FULL", "on (graphattn's builds set Inductor's triton.enable_pdl)"),
        ("inductor", False, "1", True, "PIECEWISE", "on (graphattn's builds set Inductor's triton.enable_pdl)"),
        ("eager", False, None, True, "FULL", "off: compile_backend='eager' runs no Inductor"),
        ("inductor", True, "0", True, "NONE", "on: Inductor's own config (TORCHINDUCTOR_ENABLE_PDL)"),
        ("inductor", False, "0", True, "FULL", "off: GRAPHATTN_INDUCTOR_PDL=0"),
        ("inductor", False, None, False, "FULL", "off: graphattn's kernels launch without PDL"),
        ("inductor", False, None, True, "NONE", "off: no CUDA graphs (resolved mode NONE)"),
    ],
)  # fmt: skip
def test_inductor_pdl_decision_and_its_reason(
    monkeypatch, backend, inductor_own, env, graphattn_pdl, mode, expected
):
    """Every branch of whether Inductor's kernels launch with PDL (graphattn's PDL faked: the
    CPU has none); graphattn patches Inductor's config only where it says "on (...)"."""
    import torch._inductor.config as inductor_config

    from graphattn import engine as engine_module

    monkeypatch.setattr(engine_module.pdl, "use_pdl", lambda device: graphattn_pdl)
    if env is None:
        monkeypatch.delenv("GRAPHATTN_INDUCTOR_PDL", raising=False)
    else:
        monkeypatch.setenv("GRAPHATTN_INDUCTOR_PDL", env)
    with inductor_config.patch({"triton.enable_pdl": inductor_own}):
        on, line = engine_module._inductor_pdl(
            torch.device("cuda"), ga.CUDAGraphMode[mode], backend
        )
    assert (on, line) == (expected.startswith("on ("), expected)


def test_a_bad_inductor_pdl_variable_fails_before_anything_is_allocated(monkeypatch):
    monkeypatch.setenv("GRAPHATTN_INDUCTOR_PDL", "yes")
    with pytest.raises(ga.ConfigError, match=r"GRAPHATTN_INDUCTOR_PDL must be 0 or 1, got 'yes'"):
        eager_engine(_llama(), cudagraph_mode="NONE", num_blocks=16)


@pytest.mark.parametrize("value", ["false", "off", "no", "2"])
def test_a_bad_pdl_variable_fails_instead_of_leaving_pdl_on(monkeypatch, value):
    monkeypatch.setenv("GRAPHATTN_PDL", value)
    with pytest.raises(ga.ConfigError, match=f"GRAPHATTN_PDL must be 0 or 1, got '{value}'"):
        eager_engine(_llama(), cudagraph_mode="NONE", num_blocks=16)


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("GRAPHATTN_PDL", "off", "must be 0 or 1, got 'off'"),
        ("GRAPHATTN_INDUCTOR_PDL", "yes", "must be 0 or 1, got 'yes'"),
        ("GRAPHATTN_FUSED_SPLIT_MERGE", "true", "must be 0 or 1, got 'true'"),
        ("GRAPHATTN_FOLD_O_PROJ", "on", "must be 0 or 1, got 'on'"),
        ("GRAPHATTN_INPUT_STAGING", "memcpy", "must be one of ('copies', 'kernel'), got 'memcpy'"),
        ("GRAPHATTN_PRECOMPILE_THREADS", "-2", "must be an int >= 0, got '-2'"),
        ("GRAPHATTN_PREFETCH_MIB", "16MiB", "must be an int >= 0 (MiB), got '16MiB'"),
        ("GRAPHATTN_DEBUG", "no", "must be 0 or 1, got 'no'"),
    ],
)
def test_every_bad_setting_fails_the_start_before_the_kv_cache(
    monkeypatch, variable, value, message
):
    """Each variable docs/modes.md lists ("Settings from the environment"), given a value it
    does not take, fails ``ga.compile`` with a ConfigError naming it, before the KV cache
    is allocated (the prefetch MiB too, which only a named pass reads later)."""
    from graphattn import engine as engine_module
    from graphattn.kernels import attention_plan

    def allocated(self):
        raise AssertionError(f"the KV cache was allocated before {variable} was checked")

    monkeypatch.setattr(engine_module.CompiledModel, "_allocate_kv_cache", allocated)
    monkeypatch.setenv(variable, value)
    attention_plan.fused_merge.cache_clear()  # read once per process: read it again
    try:
        with pytest.raises(ga.ConfigError, match=re.escape(f"{variable} {message}")):
            eager_engine(_llama(), cudagraph_mode="NONE", num_blocks=16)
    finally:
        monkeypatch.delenv(variable)
        attention_plan.fused_merge.cache_clear()


def test_graph_modes_fall_back_to_none_without_cuda_and_say_why():
    with pytest.warns(ga.FallbackWarning, match=r"FULL -> NONE \(CUDA graphs need a CUDA device\)"):
        engine = eager_engine(_llama(), cudagraph_mode="FULL", num_blocks=16)
    assert engine.resolved_mode == ga.CUDAGraphMode.NONE
    (record,) = engine.report.fallbacks
    assert record.requested == ga.CUDAGraphMode.FULL and record.backend == "TORCH_REF"
    assert str(engine.report).startswith("cudagraph mode: requested FULL -> resolved NONE")
    assert engine.report.to_dict()["fallbacks"][0]["rule"] == "CUDA graphs need a CUDA device"
    # the backend's support level did not cause it, so the message leaves it out (the
    # record keeps it)
    assert str(record) == (
        "cudagraph_mode FULL -> NONE (CUDA graphs need a CUDA device); every batch runs "
        "without graphs"
    )
    assert record.support == "NEVER" and record.from_support is False


def test_strict_turns_a_fallback_into_an_error():
    with pytest.raises(ga.GraphAttnError, match="strict=True forbids lowering"):
        eager_engine(_llama(), cudagraph_mode="PIECEWISE", num_blocks=16, strict=True)


def test_default_mode_is_full_and_piecewise():
    assert ga.CompileConfig().cudagraph_mode == ga.CUDAGraphMode.FULL_AND_PIECEWISE


def test_two_engines_can_serve_one_model():
    """Each engine keeps its own impls and caches: interleaved steps do not disturb each other."""
    model = TableAttentionModel(64, 4, 2, 64, seed=9)
    a = eager_engine(model, cudagraph_mode="NONE", num_blocks=32, block_size=16)
    b = eager_engine(model, cudagraph_mode="NONE", num_blocks=8, block_size=32)
    seqs = make_seqs(np.random.default_rng(3), [(12, 1), (0, 7)], 64, 32, 8)
    for s in seqs:  # prefixes into b only
        if s.num_computed:
            b.step(ga.Batch.from_requests([s.prefix_request()]))
    a.step(ga.Batch.from_requests([ga.Request(list(range(30)), 0, [0, 1])]))
    out = b.step(ga.Batch.from_requests([s.request() for s in seqs]))
    expected = torch.cat([model.expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])
    assert rel_err(out, expected) < 1e-5
    assert a.kv_cache.tensors["layers.0.attn"].shape[2] == 16
    assert b.kv_cache.tensors["layers.0.attn"].shape[2] == 32


def test_restore_order_clones_graph_outputs_unless_told_not_to():
    """A graph's output (any mode but NONE) comes back in a new tensor by default, and with
    clone=False as a new view of the graph's memory (never the graph's own tensor object);
    an eager output is the caller's either way, and a reordered one is always gathered."""
    from graphattn.runner import StepPlan

    eng = eager_engine(TableAttentionModel(64, 4, 2, 64, seed=2), cudagraph_mode="NONE")
    hidden = torch.randn(8, 4)
    for mode in (ga.CUDAGraphMode.FULL, ga.CUDAGraphMode.PIECEWISE):
        for padded in (8, 5):
            plan = StepPlan(5, 5, 1, 9, True, False, padded, padded, mode)
            graph_out = hidden[:padded]
            cloned = eng.runner.restore_order(graph_out, plan)
            assert cloned.untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr()
            in_place = eng.runner.restore_order(graph_out, plan, clone=False)
            assert in_place is not graph_out and in_place.data_ptr() == hidden.data_ptr()
            assert in_place.shape == (5, 4) and torch.equal(cloned, in_place)
    eager = StepPlan(5, 5, 1, 9, True, False, 5, 5, ga.CUDAGraphMode.NONE)
    assert eng.runner.restore_order(hidden[:5], eager).data_ptr() == hidden.data_ptr()
    order = torch.tensor([4, 0, 3, 1, 2])
    eng.runner.buffers.output_index.gpu[:5] = order
    reordered = StepPlan(5, 5, 1, 9, False, True, 8, 8, ga.CUDAGraphMode.FULL)
    gathered = eng.runner.restore_order(hidden, reordered, clone=False)
    assert torch.equal(gathered, hidden[order])
    assert gathered.untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr()


def test_full_replays_skip_the_metadata_only_when_no_builder_needs_it(monkeypatch):
    """A FULL step builds each group's metadata unless every builder declares
    ``full_replay_needs_build = False``; then no ``build`` runs, and a layer that looks its
    metadata up anyway is told why. Captures build either way."""
    from graphattn.attention.forward_context import get_forward_context
    from graphattn.capture.dispatcher import BatchDescriptor, Dispatch

    eng = eager_engine(TableAttentionModel(64, 4, 2, 64, seed=2), cudagraph_mode="NONE")
    runner = eng.runner
    builder_cls = type(runner.attn_groups[0].builder)
    (layer,) = runner.layer_names
    builds, seen = [], []
    build = builder_cls.build

    def counting_build(self, common_prefix_len, cam):
        builds.append(cam.num_reqs)
        return build(self, common_prefix_len, cam)

    def forward(input_ids, positions):
        seen.append(get_forward_context().attn_metadata)
        return torch.zeros(input_ids.shape[0], 4)

    monkeypatch.setattr(builder_cls, "build", counting_build)
    monkeypatch.setattr(runner, "forward", forward)
    key = BatchDescriptor(4, 4, True)
    monkeypatch.setattr(runner, "planner", lambda t, r, u: Dispatch(ga.CUDAGraphMode.FULL, key))
    seqs = make_seqs(np.random.default_rng(0), [(5, 1), (9, 1), (2, 1)], 64, 16, 64)
    batch = ga.Batch.from_requests([s.request() for s in seqs])

    assert builder_cls.full_replay_needs_build  # TORCH_REF keeps the default
    assert eng.runner.execute(batch).shape == (3, 4)
    assert builds == [4] and seen[-1][layer] is not None

    monkeypatch.setattr(builder_cls, "full_replay_needs_build", False)
    assert eng.runner.execute(batch).shape == (3, 4)
    assert builds == [4]
    with pytest.raises(ga.BackendError, match=f"{layer!r}.*full_replay_needs_build"):
        seen[-1][layer]
    assert eng.runner.stats.runtime_modes["FULL"] == 2

    runner.run(runner.prepare_inputs(batch), capturing=True)
    assert builds == [4, 4] and seen[-1][layer] is not None


def test_the_runner_names_the_builders_a_replay_needs(monkeypatch):
    """What the report's capture.metadata_on_full_replays lists (set where full graphs exist)."""
    eng = eager_engine(TableAttentionModel(64, 4, 2, 64, seed=2), cudagraph_mode="NONE")
    builder_cls = type(eng.runner.attn_groups[0].builder)
    assert eng.runner.builders_needing_replay_build() == [builder_cls.__name__]
    assert not eng.runner.replays_skip_build
    monkeypatch.setattr(builder_cls, "full_replay_needs_build", False)
    assert eng.runner.builders_needing_replay_build() == []
    assert eng.runner.replays_skip_build


@pytest.mark.parametrize("layout", ["from_arrays", "strided table", "int64", "uint16"])
def test_decode_fill_writes_each_requests_slot(layout):
    """A decode step's slot mapping is block * block_size + offset of each request's position,
    whether the batch has Batch.from_arrays' layout or a hand-built one's (other integer
    types, a table that is a strided view)."""
    eng = eager_engine(TableAttentionModel(64, 4, 2, 64, seed=2), cudagraph_mode="NONE")
    rng = np.random.default_rng(5)
    r, width, bs = 7, 6, eng.runner.limits.block_size
    wide = rng.permutation(eng.runner.limits.num_blocks)[: r * 2 * width].astype(np.int32)
    table = (
        wide.reshape(r, 2 * width)[:, ::2]
        if layout == "strided table"
        else wide[: r * width].reshape(r, width)
    )
    computed = rng.integers(0, width * bs, r).astype(np.int32)
    tokens = rng.integers(0, 64, r).astype(np.int64)
    batch = ga.Batch.from_arrays(
        tokens,
        np.ones(r, np.int32),
        computed,
        np.ascontiguousarray(table),
        np.full(r, width, np.int32),
    )
    if layout != "from_arrays":
        dtype = {"int64": np.int64, "uint16": np.uint16}.get(layout, np.int32)
        batch = ga.Batch(
            tokens, np.ones(r, dtype), computed.astype(dtype), table, np.full(r, width, dtype)
        )
    assert batch.block_table.flags.c_contiguous == (layout != "strided table")
    expected = table[np.arange(r), computed // bs].astype(np.int64) * bs + computed % bs
    buffers = eng.runner.buffers
    # as a step runs it (the blocks the checks gathered, where they took the decode path),
    # and from the batch alone
    checked = check_step(batch, eng.runner.limits)
    assert (checked.decode_blocks is not None) == (layout in ("from_arrays", "strided table"))
    for blocks in (checked.decode_blocks, None):
        buffers.slot_mapping.np[:r] = -7
        eng.runner.prepare_inputs(batch, checked.longest, decode_blocks=blocks)
        np.testing.assert_array_equal(buffers.slot_mapping.np[:r], expected)
        np.testing.assert_array_equal(buffers.positions.np[:r], computed)


def test_stats_to_dict_keeps_each_counter_as_counted():
    # dataclasses.asdict would rebuild a Counter from its (key, count) pairs: {"('NONE', 3)": 1}
    with pytest.warns(ga.FallbackWarning):
        engine = eager_engine(_llama(), cudagraph_mode="FULL", num_blocks=16)
    blocks = engine.kv_cache.allocate(1)
    for n in range(3):
        engine.step(ga.Batch.from_requests([ga.Request([1 + n], n, blocks)]))
    stats = engine.stats.to_dict()
    assert stats["steps"] == 3 and stats["runtime_modes"] == {"NONE": 3}
    assert engine.report.to_dict()["resolved_mode"] == str(engine.resolved_mode)


def test_builders_are_made_before_the_kv_cache(monkeypatch):
    """What a builder allocates at start-up (split scratch) is gone from the memory the KV
    cache's size is checked against: the builders come first."""
    from graphattn import engine as engine_module
    from graphattn.attention.backends.torch_ref import TorchRefMetadataBuilder

    order = []
    builder_init, cache_cls = TorchRefMetadataBuilder.__init__, engine_module.KVCache

    def made_builder(self, *args, **kw):
        order.append("builder")
        builder_init(self, *args, **kw)

    def made_cache(*args, **kw):
        order.append("kv_cache")
        return cache_cls(*args, **kw)

    monkeypatch.setattr(TorchRefMetadataBuilder, "__init__", made_builder)
    monkeypatch.setattr(engine_module, "KVCache", made_cache)
    engine = eager_engine(_llama(), num_blocks=16)
    assert order == ["builder", "kv_cache"]
    assert all(b.kv_cache is engine.kv_cache.tensors[n] for n, b in engine.bound.items())
