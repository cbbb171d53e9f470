"""Uniform decode batches of more than one token a request (speculative decoding's verify
steps): the config, the capture sizes, dispatch, padding and metadata on the CPU; full
graphs of such batches against an eager engine on CUDA.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import Seq, TableAttentionModel, make_seqs, prefill_prefixes, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import graphattn as ga
from graphattn.attention.backend import AttentionCGSupport
from graphattn.capture.dispatcher import ONE_TOKEN_DECODES, BatchDescriptor, CudagraphDispatcher
from graphattn.capture.manager import describe_decode_gap
from graphattn.capture.resolve import resolve_for_engine
from graphattn.capture.sizes import default_capture_sizes
from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights

M = ga.CUDAGraphMode


# -- the config and the sizes -------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "3", None])
def test_the_query_length_is_a_positive_int(bad):
    with pytest.raises(ga.ConfigError, match=r"uniform_decode_query_len must be a positive int"):
        ga.CompileConfig(uniform_decode_query_len=bad)


def test_a_query_length_no_step_could_hold_is_refused():
    with pytest.raises(
        ga.ConfigError, match=r"uniform_decode_query_len=9 exceeds max_num_tokens=8"
    ):
        ga.CompileConfig(uniform_decode_query_len=9, max_num_tokens=8)
    with pytest.raises(ga.ConfigError, match=r"or max_model_len=4"):
        ga.CompileConfig(uniform_decode_query_len=5, max_model_len=4)
    assert ga.CompileConfig(uniform_decode_query_len=8, max_num_tokens=8).max_num_tokens == 8


def test_default_sizes_count_requests_times_the_query_length():
    assert default_capture_sizes(8, 4096, 3) == [3, 6, 12, 24]
    assert default_capture_sizes(8, 4096, 1) == default_capture_sizes(8, 4096) == [1, 2, 4, 8]
    # the token limit bounds the requests: 250 // 4 = 62 of them, the last size 248
    sizes = default_capture_sizes(100, 250, 4)
    assert sizes[:4] == [4, 8, 16, 32] and sizes[-2:] == [224, 248]
    assert all(s % 4 == 0 for s in sizes)
    # every uniform batch of 1..bound requests pads to a size it fills with whole requests
    d = CudagraphDispatcher(M.FULL_AND_PIECEWISE, sizes, 100, uniform_decode_query_len=4)
    assert d.decode_gap() is None
    assert all(d.dispatch(4 * n, n, True).mode == M.FULL for n in range(1, 63))


def test_a_decode_only_mode_needs_a_size_of_whole_requests():
    ok = ga.CompileConfig(
        uniform_decode_query_len=3,
        cudagraph_capture_sizes=[4, 6],
        cudagraph_mode="FULL_DECODE_ONLY",
    )
    assert ok.has_decode_capture_size()
    # a verify batch of one request (3 tokens) pads past 4, which has no uniform graph, to 6
    d = CudagraphDispatcher(M.FULL_DECODE_ONLY, [4, 6], 8, uniform_decode_query_len=3)
    assert d.dispatch(3, 1, True) == (M.FULL, BatchDescriptor(6, 2, True), None)
    assert d.decode_gap() is None
    with pytest.raises(ga.ConfigError, match=r"needs a capture size <= 24 that is a multiple of"):
        ga.CompileConfig(
            max_num_seqs=8,
            uniform_decode_query_len=3,
            cudagraph_capture_sizes=[4, 8, 32],
            cudagraph_mode="FULL_DECODE_ONLY",
        )


# -- dispatch and mode resolution ------------------------------------------------------------


def test_uniform_batches_get_full_graphs_and_one_token_decodes_are_counted():
    d = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [3, 6, 12, 24], 8, uniform_decode_query_len=3)
    assert d.dispatch(6, 2, True) == (M.FULL, BatchDescriptor(6, 2, True), None)
    assert d.dispatch(9, 3, True) == (M.FULL, BatchDescriptor(12, 4, True), None)  # one pad
    mixed = d.dispatch(9, 4, False)
    assert mixed == (M.PIECEWISE, BatchDescriptor(12), None)
    single = d.dispatch(5, 5, False)  # five one-token decodes: not the graphs' batches
    assert single.mode == M.PIECEWISE and single.fallback.startswith(ONE_TOKEN_DECODES)
    assert "=3 tokens a request" in single.fallback
    # FULL has graphs for any batch: one-token decodes take a mixed one and lose nothing
    full = CudagraphDispatcher(M.FULL, [3, 6, 12, 24], 8, uniform_decode_query_len=3)
    assert full.dispatch(5, 5, False) == (M.FULL, BatchDescriptor(6, 6, False), None)
    assert full.dispatch(9, 3, True) == (M.FULL, BatchDescriptor(12, 4, True), None)


def test_verify_batches_pad_to_a_size_of_whole_requests():
    """User sizes that are not all multiples of the length: a uniform batch skips them for
    the next size that has a uniform graph; mixed batches still pad to the next size."""
    d = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [4, 6, 8, 12], 8, uniform_decode_query_len=3)
    assert d.dispatch(3, 1, True) == (M.FULL, BatchDescriptor(6, 2, True), None)
    assert d.dispatch(9, 3, True) == (M.FULL, BatchDescriptor(12, 4, True), None)
    assert d.dispatch(3, 2, False) == (M.PIECEWISE, BatchDescriptor(4), None)
    assert d.decode_gap() is None
    # sizes of which none holds 4 requests of 3: the warning names multiples of the length
    gap = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [3, 6, 8, 16], 8, uniform_decode_query_len=3)
    assert gap.decode_gap() == (9, 15)
    text = describe_decode_gap(gap)
    assert "multiples of uniform_decode_query_len=3" in text and "capture size of 15" in text
    fixed = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [3, 6, 8, 15, 16], 8, 3)
    assert fixed.decode_gap() is None


def test_under_full_a_verify_batch_takes_the_least_padding():
    """FULL has a mixed graph at every size: a verify batch of 2 x 2 tokens with sizes (3, 4,
    6) has a uniform graph at 4; one request of 2 tokens pads to 3 (mixed) rather than 4."""
    d = CudagraphDispatcher(M.FULL, [3, 4, 6], 8, uniform_decode_query_len=2)
    assert d.dispatch(2, 1, True) == (M.FULL, BatchDescriptor(3, 3, False), None)
    assert d.dispatch(4, 2, True) == (M.FULL, BatchDescriptor(4, 2, True), None)
    fap = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [3, 4, 6], 8, uniform_decode_query_len=2)
    assert fap.dispatch(2, 1, True) == (M.FULL, BatchDescriptor(4, 2, True), None)


def test_one_token_decodes_under_full_decode_only_run_without_graphs():
    d = CudagraphDispatcher(M.FULL_DECODE_ONLY, [4, 8], 8, uniform_decode_query_len=4)
    out = d.dispatch(3, 3, False)
    assert out.mode == M.NONE and out.fallback.startswith(ONE_TOKEN_DECODES)
    assert d.dispatch(6, 2, False) == (M.NONE, None, None)  # a mixed batch: by design


@settings(max_examples=300, deadline=None)
@given(
    q=st.integers(1, 5),
    max_num_seqs=st.integers(1, 40),
    sizes=st.lists(st.integers(1, 120), min_size=1, max_size=8),
    mode=st.sampled_from([M.FULL, M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY]),
    data=st.data(),
)
def test_dispatch_never_pads_a_batch_into_fewer_requests_or_tokens(
    q, max_num_seqs, sizes, mode, data
):
    """Any sizes, length and limit: a FULL key holds the batch's tokens and requests, a
    uniform key is exactly q tokens a request, and a uniform batch that some uniform graph
    can hold gets a full graph: that one, or under FULL a smaller mixed one."""
    d = CudagraphDispatcher(mode, sizes, max_num_seqs, uniform_decode_query_len=q)
    reqs = data.draw(st.integers(1, max_num_seqs))
    uniform = data.draw(st.booleans())
    tokens = reqs * q if uniform else data.draw(st.integers(reqs, reqs * 6))
    out = d.dispatch(tokens, reqs, uniform)
    if out.mode == M.FULL:
        key = out.descriptor
        assert key.num_tokens >= tokens and key.num_reqs >= reqs
        assert key.uniform_decode <= uniform
        if key.uniform_decode:
            assert key.num_tokens == q * key.num_reqs
    holders = [k for k in d.keys[M.FULL] if k.uniform_decode and k.num_tokens >= tokens]
    if uniform and holders:
        assert out.mode == M.FULL
        if mode == M.FULL:
            assert out.descriptor.num_tokens == min(d.pad_to[tokens], min(holders).num_tokens)
        else:
            assert out.descriptor == min(holders)


@pytest.mark.parametrize(
    "support, expected",
    [
        (AttentionCGSupport.ALWAYS, M.FULL_AND_PIECEWISE),
        (AttentionCGSupport.UNIFORM_BATCH, M.FULL_AND_PIECEWISE),
        (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, M.PIECEWISE),
    ],
)
def test_single_token_support_cannot_serve_verify_batches(support, expected):
    mode, records = resolve_for_engine(
        M.FULL_AND_PIECEWISE,
        support,
        has_cuda=True,
        attention_is_splitting_op=True,
        backend_name="B",
        uniform_decode_query_len=4,
    )
    assert mode == expected
    if expected == M.PIECEWISE:
        assert "decode batches of 4 tokens per request need UNIFORM_BATCH" in str(records[0])


# -- padding and metadata through the runner (TRITON under the interpreter) -----------------


def _table_engine(model, q, backend="TRITON"):
    return ga.compile(
        model,
        cudagraph_mode="NONE",
        compile_backend="none",
        block_size=16,
        num_blocks=96,
        max_model_len=256,
        max_num_seqs=8,
        attention_backend=backend,
        uniform_decode_query_len=q,
    )


def _expected(model, seqs):
    return torch.cat([model.expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])


def test_verify_batches_pad_with_whole_requests(monkeypatch):
    """The dispatcher of a FULL_AND_PIECEWISE engine with uniform_decode_query_len=3 drives
    the runner (on the CPU nothing is captured: a FULL step runs its padded batch eagerly).
    A verify batch of 3 requests runs as the (12 tokens, 4 requests) key: the padding
    request gets 3 tokens too, and the metadata says every request has 3; rows match
    dense attention. Five one-token decodes are not such a batch: PIECEWISE, counted."""
    model = TableAttentionModel(64, 8, 2, 64, seed=4)
    engine = _table_engine(model, 3)
    runner = engine.runner
    dispatcher = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [3, 6, 12, 24], 8, 3)
    runner.planner = dispatcher.dispatch
    (group,) = engine.attn_groups
    builder_cls = type(group.builder)
    monkeypatch.setattr(builder_cls, "full_replay_needs_build", True)  # no graph to replay
    cams = []
    build = group.builder.build
    group.builder.build = lambda p, cam: cams.append(cam) or build(p, cam)

    seqs = make_seqs(np.random.default_rng(4), [(20, 3), (0, 3), (37, 3)], 64, 16, 96)
    prefill_prefixes(engine, seqs)
    out = engine.step(ga.Batch.from_requests([s.request() for s in seqs]))
    assert rel_err(out, _expected(model, seqs)) < 1e-5
    cam = cams[-1]
    assert (cam.num_reqs, cam.num_input_tokens, cam.num_actual_tokens) == (4, 12, 9)
    assert cam.uniform_query_len == 3 and not cam.uniform_decode
    assert cam.query_start_loc_cpu.tolist() == [0, 3, 6, 9, 12]
    assert cam.seq_lens_cpu[3] == 0 and cam.slot_mapping[9:].tolist() == [-1, -1, -1]
    assert engine.stats.runtime_modes["FULL"] == 1

    decodes = make_seqs(np.random.default_rng(5), [(9, 1)] * 5, 64, 16, 96)
    prefill_prefixes(engine, decodes)
    out = engine.step(ga.Batch.from_requests([s.request() for s in decodes]))
    assert rel_err(out, _expected(model, decodes)) < 1e-5
    assert cams[-1].uniform_query_len == 1 and cams[-1].uniform_decode  # this batch, eager
    assert engine.stats.fallbacks[dispatcher.dispatch(5, 5, False).fallback] == 1


def test_the_report_says_what_the_decode_graphs_serve():
    engine = _table_engine(TableAttentionModel(64, 8, 2, 64, seed=4), 3)
    assert engine.report.uniform_decode_query_len == 3
    assert "decode graphs serve batches of 3 tokens a request" in str(engine.report)
    assert engine.report.to_dict()["uniform_decode_query_len"] == 3
    plain = _table_engine(TableAttentionModel(64, 8, 2, 64, seed=4), 1)
    assert "decode graphs serve" not in str(plain.report)


def test_the_capture_batch_of_a_verify_key_is_uniform():
    """What a capture records for a uniform key of 3 tokens a request: 3 each, not a long
    first request and one-token rest (as a mixed key's synthetic batch has)."""
    engine = _table_engine(TableAttentionModel(64, 8, 2, 64, seed=4), 3)
    runner = engine.runner
    plan = runner._synthetic_plan(M.FULL, BatchDescriptor(12, 4, True))
    assert plan.uniform_decode and plan.max_query_len == 3
    assert runner.buffers.query_start_loc.np[:5].tolist() == [0, 3, 6, 9, 12]
    (cam,) = runner.common_metadata(plan)
    assert cam.uniform_query_len == 3 and not cam.uniform_decode
    mixed = runner._synthetic_plan(M.FULL, BatchDescriptor(12, 4, False))
    assert not mixed.uniform_decode and mixed.max_query_len == 9
    (cam,) = runner.common_metadata(mixed)
    assert cam.uniform_query_len is None


def test_triton_plans_a_verify_graph_on_the_decode_tiles():
    """The metadata of a verify key carries the length into TRITON's plan: 3 tokens x 4
    heads a KV head fit one decode tile on CUDA (the prefill tiles' 128 rows would mask most
    of theirs); with the choice off (benchmarks/spec_decode.py's comparison) the prefill
    tiles. The interpreter has one tile shape for all."""
    engine = _table_engine(TableAttentionModel(64, 8, 2, 64, seed=4), 3)
    runner = engine.runner
    (group,) = engine.attn_groups
    (cam,) = runner.common_metadata(runner._synthetic_plan(M.FULL, BatchDescriptor(12, 4, True)))
    md = group.builder.build(0, cam)
    assert md.uniform_query_len == 3 and not md.uniform_decode
    impl = next(iter(engine.bound.values())).impl
    verify = impl.plan(md, torch.bfloat16, "cuda")
    assert verify.tiles.block_m == 16 and verify.block_q == 4
    impl.verify_decode_tiles = False
    assert impl.plan(md, torch.bfloat16, "cuda").tiles.block_m == 128


def test_uniform_single_token_decodes_keep_their_metadata_at_length_one():
    """An engine of the default length: a FULL key of decodes says uniform_decode (TRITON
    then writes keys and values inside its attention launch), as before."""
    engine = _table_engine(TableAttentionModel(64, 8, 2, 64, seed=4), 1)
    plan = engine.runner._synthetic_plan(M.FULL, BatchDescriptor(4, 4, True))
    (cam,) = engine.runner.common_metadata(plan)
    assert cam.uniform_decode and cam.uniform_query_len == 1


def test_a_decode_only_mode_without_a_size_of_whole_requests_says_why():
    mode, records = resolve_for_engine(
        M.FULL_AND_PIECEWISE,
        AttentionCGSupport.ALWAYS,
        has_cuda=True,
        attention_is_splitting_op=False,  # no split: FULL_DECODE_ONLY, then nothing to capture
        backend_name="B",
        uniform_decode_query_len=3,
        has_decode_size=False,
    )
    assert mode == M.NONE
    assert "<= max_num_seqs x 3 that is a multiple of uniform_decode_query_len" in str(records[-1])


def speculative_generate(engine, prompts, max_new, k, drafts_for, rng):
    """Greedy speculative decoding on ``engine.step``: prefill every prompt, then verify
    steps of each request's last token and k drafts (``drafts_for(i, generated, rng)``),
    accepting the drafts that equal the target's greedy choice and one token more. Drafts a
    step rejects leave keys and values past the accepted length, which the next step
    overwrites. Returns the new tokens per prompt, and how many drafts were accepted of how
    many proposed."""
    q, block_size = k + 1, engine.config.block_size
    seqs = [list(p) for p in prompts]
    # a request verifies only while it has fewer than max_new tokens: its last verify step
    # starts below max_new and caches at most k + 1 more
    blocks = [engine.kv_cache.allocate(-(-(len(p) + max_new + k) // block_size)) for p in prompts]
    try:
        first = ga.Batch.from_requests(ga.Request(p, 0, b) for p, b in zip(prompts, blocks))
        rows = torch.as_tensor(first.last_token_rows())
        firsts = ga.greedy(engine.compute_logits(engine.step(first)[rows])).tolist()
        for s, t in zip(seqs, firsts):
            s.append(t)
        accepted = proposed = 0
        while live := [i for i, s in enumerate(seqs) if len(s) - len(prompts[i]) < max_new]:
            drafts = {i: drafts_for(i, seqs[i][len(prompts[i]) :], rng) for i in live}
            requests = [
                ga.Request([seqs[i][-1], *drafts[i]], len(seqs[i]) - 1, blocks[i]) for i in live
            ]
            logits = engine.compute_logits(engine.step(ga.Batch.from_requests(requests)))
            for i, g in zip(live, ga.greedy(logits).view(len(live), q).tolist()):
                d, n = drafts[i], 0
                while n < k and d[n] == g[n]:
                    n += 1
                accepted, proposed = accepted + n, proposed + k
                seqs[i].extend([*d[:n], g[n]])
    finally:
        for b in blocks:
            engine.kv_cache.free(b)
    return [s[len(p) : len(p) + max_new] for s, p in zip(seqs, prompts)], accepted, proposed


def _oracle_drafts(reference, k, hits):
    """Drafts from the reference continuation, each of request i's wrong with probability
    1 - hits[i] (a number: the same for every request)."""

    def drafts_for(i, generated, rng):
        hit = hits[i] if isinstance(hits, tuple) else hits
        ahead = reference[i][len(generated) : len(generated) + k]
        ahead += [1] * (k - len(ahead))  # past the reference's end: any token
        return [t if rng.random() < hit else int(rng.integers(1, 500)) for t in ahead]

    return drafts_for


def _tiny_llama(device, dtype):
    from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=2))
    return init_random_weights(model, seed=5).to(device, dtype)


@pytest.mark.parametrize("hits", [(0.0,) * 3, (0.7,) * 3, (1.0,) * 3, (1.0, 0.0, 0.0)])
def test_speculative_decoding_on_verify_steps_gives_greedy_tokens(hits):
    """A speculative-decoding loop on an engine with uniform_decode_query_len=k+1: drafts
    all wrong, mixed, all right, and one request all right while the others are all wrong
    (it finishes steps before them and leaves their batches). Rolled-back positions are
    rewritten by later steps. Every token equals plain greedy generate's."""
    model = _tiny_llama("cpu", torch.float32)
    limits = dict(num_blocks=128, max_model_len=256, compile_backend="none")
    reference = ga.compile(model, cudagraph_mode="NONE", **limits).generate(
        [[3, 14, 15, 92], [65, 35], [89, 79, 32, 38, 46]], max_new_tokens=20
    )
    engine = ga.compile(model, cudagraph_mode="NONE", uniform_decode_query_len=4, **limits)
    prompts = [[3, 14, 15, 92], [65, 35], [89, 79, 32, 38, 46]]
    for seed in range(3):
        got, accepted, proposed = speculative_generate(
            engine, prompts, 20, 3, _oracle_drafts(reference, 3, hits), np.random.default_rng(seed)
        )
        assert got == reference
        assert (accepted == 0) == (max(hits) == 0.0) and accepted <= proposed
        assert engine.kv_cache.num_free_blocks == 128


# -- on CUDA: full graphs of verify batches ------------------------------------------------


@pytest.fixture(scope="module")
def verify_engines(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(
        num_hidden_layers=2,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    model = init_random_weights(LlamaForCausalLM(cfg), seed=3).to("cuda", torch.bfloat16)
    limits = dict(max_num_seqs=16, max_num_tokens=256, max_model_len=256, num_blocks=256)
    ref = ga.compile(copy.deepcopy(model), cudagraph_mode="NONE", compile_backend="none", **limits)
    eng = ga.compile(
        copy.deepcopy(model),
        cudagraph_mode="FULL_AND_PIECEWISE",
        uniform_decode_query_len=4,
        cache_dir=str(tmp_path_factory.mktemp("spec-cache")),
        debug=True,
        **limits,
    )
    return ref, eng


@pytest.mark.gpu
@pytest.mark.parametrize("num_reqs", [1, 3, 8, 16])
def test_verify_steps_replay_full_graphs_and_match_eager(verify_engines, num_reqs):
    ref, eng = verify_engines
    assert eng.resolved_mode == M.FULL_AND_PIECEWISE
    assert eng.report.capture["uniform_decode_query_len"] == 4
    assert eng.report.capture["full_graphs"]["uniform decode"] == default_capture_sizes(16, 256, 4)
    rng = np.random.default_rng(num_reqs)
    blocks = rng.permutation(256).tolist()
    seqs = []
    for i in range(num_reqs):
        computed = int(rng.integers(1, 200))
        need = -(-(computed + 4) // 16)
        ids = rng.integers(0, 512, computed + 4).tolist()
        seqs.append(Seq(ids, computed, blocks[i * 16 : i * 16 + need]))
    for e in (ref, eng):
        prefill_prefixes(e, seqs)
    before = eng.stats.runtime_modes["FULL"]
    batch = ga.Batch.from_requests([s.request() for s in seqs])
    out_ref, out = ref.step(batch), eng.step(batch)
    assert eng.stats.runtime_modes["FULL"] == before + 1
    assert rel_err(out, out_ref) < 2e-2
    assert eng.stats.recompiles == 0 and eng.stats.captures_after_startup == 0


@pytest.mark.gpu
def test_speculative_decoding_replays_full_graphs_for_its_verify_steps(tmp_path):
    """The same loop on CUDA (fp32, so the greedy choices cannot differ by rounding): every
    verify step replays a full decode graph, and the tokens are plain greedy generate's."""
    model = _tiny_llama("cuda", torch.float32)
    limits = dict(num_blocks=128, max_model_len=256, max_num_seqs=8, max_num_tokens=128)
    prompts = [[3, 14, 15, 92], [65, 35], [89, 79, 32, 38, 46]]
    reference = ga.compile(
        copy.deepcopy(model), cudagraph_mode="NONE", compile_backend="none", **limits
    ).generate(prompts, max_new_tokens=20)
    engine = ga.compile(
        copy.deepcopy(model),
        cudagraph_mode="FULL_AND_PIECEWISE",
        uniform_decode_query_len=4,
        cache_dir=str(tmp_path),
        **limits,
    )
    got, accepted, proposed = speculative_generate(
        engine, prompts, 20, 3, _oracle_drafts(reference, 3, 0.7), np.random.default_rng(0)
    )
    assert got == reference
    assert 0 < accepted < proposed
    verify_steps = engine.stats.steps - 1  # all but the prefill
    assert engine.stats.runtime_modes["FULL"] == verify_steps
    assert engine.stats.recompiles == 0 and engine.stats.captures_after_startup == 0
