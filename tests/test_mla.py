"""Multi-head latent attention: ``ga.MLAAttention``, its cache spec, backend selection,
TORCH_REF_MLA and the example MLA model, against a dense MLA written from the model's
weights without the engine (keys and values expanded through kv_b_proj, no absorption,
no paged cache).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import DEVICES, TableAttentionModel, make_seqs, prefill_prefixes, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import graphattn as ga
from graphattn.attention.backends.mla import TorchRefMLABackend
from graphattn.kv_cache import MLAAttentionSpec
from graphattn.models import MLAConfig, MLAForCausalLM, init_random_weights
from graphattn.models.llama import apply_rotary

M = ga.CUDAGraphMode


def _model(device="cpu", dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    model = init_random_weights(MLAForCausalLM(MLAConfig.tiny(**overrides)), seed=1, std=0.05)
    return model.to(device, dtype)


def _engine(model, **kw):
    kw = {
        "cudagraph_mode": "NONE",
        "compile_backend": "none",
        "num_blocks": 64,
        "max_model_len": 256,
        **kw,
    }
    return ga.compile(model, **kw)


@torch.no_grad()
def dense_mla(model: MLAForCausalLM, ids: list[int]) -> torch.Tensor:
    """The model's hidden states for one whole sequence, attention computed the plain way:
    every head's key and value expanded from the compressed KV through kv_b_proj, causal
    softmax over the sequence, in float64."""
    cfg = model.config
    model = copy.deepcopy(model).double()
    t, h = len(ids), cfg.num_attention_heads
    nope, r, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    device = model.embed_tokens.weight.device
    tokens = torch.tensor(ids, device=device)
    positions = torch.arange(t, device=device)
    x = model.embed_tokens(tokens)
    rope = tuple(c.double() for c in model.rotary_emb(positions))
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    for layer in model.layers:
        a = layer.self_attn
        hidden = layer.input_layernorm(x)
        q = a.queries(hidden).view(t, h, nope + r)
        q_pe = apply_rotary(q[..., nope:].reshape(t, -1), rope, r).view(t, h, r)
        kv_c, k_pe = a.kv_a_proj_with_mqa(hidden).split([cfg.kv_lora_rank, r], dim=-1)
        k_pe = apply_rotary(k_pe.contiguous(), rope, r)
        k_nope, value = (
            a.kv_b_proj(a.kv_a_layernorm(kv_c))
            .view(t, h, nope + v_dim)
            .split([nope, v_dim], dim=-1)
        )
        query = torch.cat([q[..., :nope], q_pe], dim=-1)
        key = torch.cat([k_nope, k_pe[:, None, :].expand(t, h, r)], dim=-1)
        scores = torch.einsum("thd,shd->hts", query, key) * cfg.softmax_scale
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hts,shd->thd", probs, value).reshape(t, h * v_dim)
        x = x + a.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


def _expected(model, seqs):
    return torch.cat([dense_mla(model, s.ids)[s.num_computed :] for s in seqs])


# -- the engine against the dense MLA ---------------------------------------------------------


SHAPES = {
    "tiny": {},
    # no low-rank queries; every head size different, so a swapped slice cannot pass
    "q_proj": dict(q_lora_rank=None, kv_lora_rank=48, qk_nope_head_dim=24, v_head_dim=40),
    # DeepSeek-V2's mixture of experts in the second layer, routed within groups, and YaRN
    "moe": dict(
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=3,
        topk_group=2,
        routed_scaling_factor=2.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    ),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batches_match_dense_mla(device, shape):
    """Prefills, a chunked prefill and decodes in one step, after their prefixes were cached
    by earlier steps: the rows match the dense computation of each whole sequence."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    shape_name = shape
    model = _model(device, dtype, **SHAPES[shape])
    engine = _engine(model)
    shape = [(0, 9), (21, 1), (40, 13), (17, 1), (0, 1)]
    seqs = make_seqs(np.random.default_rng(1), shape, 512, 16, 64)
    prefill_prefixes(engine, seqs)
    out = engine.step(ga.Batch.from_requests([s.request() for s in seqs]))
    expected = _expected(model, seqs)
    assert out.shape == expected.shape
    if dtype == torch.float32:
        assert rel_err(out, expected) < 1e-5
    elif "n_routed_experts" not in SHAPES[shape_name]:
        assert rel_err(out, expected) < 3e-2
    else:  # bf16 may flip a token's route where two experts nearly tie (one row of 25 here,
        # on the CPU and the H200 alike): most rows, not all, are held to the bound
        rows = (out.double() - expected).norm(dim=-1) / expected.norm(dim=-1)
        assert (rows < 3e-2).double().mean() >= 0.9, rows


def test_bf16_on_the_cpu_matches_dense_mla():
    """The cache, the absorbed projections and the reference kernel in bf16 (the GPU's
    dtype), against the float64 dense MLA of the same bf16 weights."""
    model = _model(dtype=torch.bfloat16)
    engine = _engine(model)
    seqs = make_seqs(np.random.default_rng(6), [(0, 11), (19, 1), (25, 5)], 512, 16, 64)
    prefill_prefixes(engine, seqs)
    out = engine.step(ga.Batch.from_requests([s.request() for s in seqs]))
    assert out.dtype == torch.bfloat16
    assert rel_err(out, _expected(model, seqs)) < 3e-2


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_grouped_and_dense_experts_give_the_same_sums(dtype, tol):
    """The two ways Experts runs (see its docstring) on one routing: tokens that share
    experts, experts no token picked, a token's picks in any order."""
    from graphattn.models.mla import Experts

    torch.manual_seed(0)
    experts = Experts(6, 64, 32).to(dtype).requires_grad_(False)
    for p in experts.parameters():
        p.normal_(0, 0.2)
    x = torch.randn(9, 64).to(dtype)
    picked = torch.tensor([[5, 0], [0, 5], [2, 3], [3, 2], [5, 2], [0, 3], [3, 5], [2, 0], [5, 3]])
    weights = torch.rand(9, 2)
    dense, grouped = experts.dense(x, picked, weights), experts.grouped(x, picked, weights)
    assert rel_err(grouped, dense) < tol
    one = experts.dense(x[4:5], picked[4:5, :1], weights[4:5, :1])  # one token, one expert
    gate, up = torch.nn.functional.linear(x[4:5], experts.gate_up_proj[5]).chunk(2, dim=-1)
    mlp = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, experts.down_proj[5])
    assert rel_err(one, mlp * weights[4, 0]) < tol


def test_bf16_experts_are_grouped_and_compiled_as_dense_ones_are(tmp_path, monkeypatch):
    """bf16 on the CPU: the traced model takes the grouped GEMM (torch._grouped_mm, through
    Inductor) and gives the rows of an engine whose experts run densely
    (GRAPHATTN_DENSE_EXPERTS=1); both close to the dense float64 MLA."""
    from graphattn.models.mla import grouped_gemm_serves

    model = _model(dtype=torch.bfloat16, **SHAPES["moe"])
    cpu, inner = torch.device("cpu"), model.config.moe_intermediate_size
    assert grouped_gemm_serves(cpu, torch.bfloat16, 128, inner)
    assert not grouped_gemm_serves(cpu, torch.float32, 128, inner)
    assert model.layers[1].mlp.experts.use_grouped  # decided when the model was cast
    assert not model.float().layers[1].mlp.experts.use_grouped  # and again on each cast
    model = model.bfloat16()
    grouped = _engine(copy.deepcopy(model), compile_backend="inductor", cache_dir=str(tmp_path))
    monkeypatch.setenv("GRAPHATTN_DENSE_EXPERTS", "1")
    model = model.to(torch.bfloat16)  # read again on a move or cast
    assert not model.layers[1].mlp.experts.use_grouped
    dense = _engine(copy.deepcopy(model), compile_backend="inductor", cache_dir=str(tmp_path))
    seqs = make_seqs(np.random.default_rng(8), [(0, 11), (19, 1), (25, 5)], 512, 16, 64)
    for e in (grouped, dense):
        prefill_prefixes(e, seqs)
    batch = ga.Batch.from_requests([s.request() for s in seqs])
    got, want = grouped.step(batch), dense.step(batch)
    assert rel_err(got, want) < 2e-2
    assert rel_err(got, _expected(model, seqs)) < 3e-2
    # the setting is part of the trace cache's key: the second engine traced anew
    assert not dense.report.compile["trace_cache"].startswith("loaded")


def test_incremental_decoding_equals_one_prefill():
    model = _model()
    engine = _engine(model)
    ids = np.random.default_rng(2).integers(0, 512, 30).tolist()
    blocks = engine.kv_cache.allocate(2)
    engine.step(ga.Batch.from_requests([ga.Request(ids[:24], 0, blocks)]))
    for n in range(24, 30):
        out = engine.step(ga.Batch.from_requests([ga.Request(ids[n : n + 1], n, blocks)]))
    assert rel_err(out, dense_mla(model, ids)[-1:]) < 1e-5


def test_generate_agrees_with_the_dense_model():
    model = _model()
    engine = _engine(model)
    prompt = [5, 17, 200, 3]
    (new,) = engine.generate([prompt], max_new_tokens=5)
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(model.compute_logits(dense_mla(model, ids)[-1:].float()).argmax()))
    assert new == ids[len(prompt) :]


@pytest.mark.parametrize("shape", ["tiny", "moe"])
def test_compiled_piecewise_matches_eager(tmp_path, shape):
    """Traced, split at the attention ops and compiled by Inductor: the pieces around the
    absorbed projections (and the experts, routed per token) give the eager engine's rows."""
    model = _model(**SHAPES[shape])
    eager = _engine(copy.deepcopy(model))
    compiled = _engine(
        copy.deepcopy(model), compile_backend="inductor", cache_dir=str(tmp_path), debug=True
    )
    assert compiled.report.compile["num_pieces"] == 2 * 2 + 1  # 2 layers: 2 attention + 3 compiled
    # each piece reads kv_b_proj's weight itself (no view of it crosses the split)
    assert not [n for n in compiled.report.compile["not_weights"] if "kv_b_proj" in n]
    seqs = make_seqs(np.random.default_rng(3), [(0, 7), (12, 1), (30, 4)], 512, 16, 64)
    for e in (eager, compiled):
        prefill_prefixes(e, seqs)
    batch = ga.Batch.from_requests([s.request() for s in seqs])
    assert rel_err(compiled.step(batch), eager.step(batch)) < 1e-5
    assert compiled.stats.recompiles == 0


def test_the_one_token_build_with_the_gemv_passes_matches_eager(tmp_path, monkeypatch):
    """bf16 with a one-token build: the GEMV passes (as on CUDA; here through the Triton
    interpreter) rewrite the MLA model's linears and norms; a decode step's rows match the
    eager engine's. Guards the passes' patterns against the MLA graph (low-rank queries
    with their norm, the compressed KV's norm on a slice, the batched projections)."""
    from graphattn.kernels import prologue_gemv as prologue_kernels
    from graphattn.passes import single_row_gemv

    monkeypatch.setattr(single_row_gemv, "GEMV_DEVICES", ("cuda", "cpu"))
    model = _model(dtype=torch.bfloat16, num_hidden_layers=1)
    eager = _engine(copy.deepcopy(model))
    compiled = _engine(
        copy.deepcopy(model),
        compile_backend="inductor",
        compile_sizes=(1,),
        cache_dir=str(tmp_path),
        max_num_tokens=64,
    )
    calls = []
    real = prologue_kernels.rms_norm_gemv
    monkeypatch.setattr(
        prologue_kernels, "rms_norm_gemv", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    seqs = make_seqs(np.random.default_rng(8), [(13, 1)], 512, 16, 64)
    for e in (eager, compiled):
        prefill_prefixes(e, seqs)
    batch = ga.Batch.from_requests([s.request() for s in seqs])
    assert rel_err(compiled.step(batch), eager.step(batch)) < 2e-2
    assert calls  # the one-token build ran the folded norm + GEMV kernels


# -- TRITON_MLA: the decode kernel, and the backend through the engine ----------------------


@settings(max_examples=12, deadline=None)
@given(
    rank=st.sampled_from([16, 48, 64]),
    rope=st.sampled_from([8, 16, 32]),
    heads=st.sampled_from([1, 5, 16, 20]),
    block_size=st.sampled_from([8, 16]),
    splits=st.sampled_from([1, 3]),
    lens=st.lists(st.integers(0, 70), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_the_decode_kernel_matches_the_reference(
    rank, rope, heads, block_size, splits, lens, dtype, seed
):
    """kernels/mla_attention.py against paged_attention_ref with values a view of the keys:
    any rank, rotary width (padded to 16 for the dot), head count (blocks of 16 masked),
    block size, split count and lengths (0: a padding request, whose rows are not read)."""
    from graphattn.kernels import mla_attention, split_kv
    from graphattn.kernels.reference import paged_attention_ref

    gen = torch.Generator().manual_seed(seed)
    width = 70 // block_size + 1
    num_blocks = len(lens) * width
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), -1)
    table = table.int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), heads, rank + rope, generator=gen).to(dtype)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    out = torch.full((len(lens), heads, rank), float("nan"), dtype=dtype)
    scratch = None
    if splits > 1:
        rows = len(lens) * heads * splits
        scratch = split_kv.SplitScratch(torch.empty(rows * rank), torch.empty(rows), len(lens))
    mla_attention.mla_decode(
        query, cache, table, seq_lens, out, starts, kv_lora_rank=rank, scale=0.3,
        num_splits=splits, scratch=scratch,
    )  # fmt: skip
    keys = cache.float().unsqueeze(2)
    ref = torch.zeros(len(lens), heads, rank)
    paged_attention_ref(
        query.float(), keys, keys[..., :rank], table, starts.tolist(), lens, 0.3, ref,
        num_decodes=len(lens),
    )  # fmt: skip
    real = seq_lens > 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(out[real].float(), ref[real]) < tol


@settings(deadline=None, max_examples=25)
@given(
    rank=st.sampled_from([16, 48]),
    rope=st.sampled_from([8, 16]),
    heads=st.sampled_from([1, 3, 4, 16, 20]),
    block_size=st.sampled_from([8, 16]),
    splits=st.sampled_from([1, 3]),
    reqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 19)), min_size=1, max_size=4),
    # padding requests of length 0, owning one token each or (past the tokens) none
    padding=st.lists(st.sampled_from([0, 1]), max_size=3).map(sorted).map(lambda p: p[::-1]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_the_mixed_kernel_matches_the_reference(
    rank, rope, heads, block_size, splits, reqs, padding, dtype, seed
):
    """``mla_attention`` (any batch, causal, in one launch) against paged_attention_ref:
    prefills, chunked prefills, decodes and verify-sized requests together; tiles of several
    tokens where there are fewer than 16 heads; padding requests of length 0 that own a
    token (their rows zero, split or not) or none (as where a graph's key pads more requests
    than tokens), and padding tokens past the last request, which are not written."""
    from graphattn.kernels import mla_attention, split_kv
    from graphattn.kernels.reference import paged_attention_ref

    gen = torch.Generator().manual_seed(seed)
    real = [(c, q) for c, q in reqs]
    lens = [c + q for c, q in real] + [0] * len(padding)
    q_lens = [q for _, q in real] + padding
    starts_list = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    num_tokens = starts_list[-1] + 2  # two tokens past the last request
    width = 60 // block_size + 1
    num_reqs = len(lens)
    num_blocks = num_reqs * width
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen).view(num_reqs, width).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.tensor(starts_list, dtype=torch.int32)
    query = torch.randn(num_tokens, heads, rank + rope, generator=gen).to(dtype)
    out = torch.full((num_tokens, heads, rank), float("nan"), dtype=dtype)
    scratch = None
    if splits > 1:
        rows = num_tokens * heads * splits
        scratch = split_kv.SplitScratch(torch.empty(rows * rank), torch.empty(rows), num_tokens)
    mla_attention.mla_attention(
        query, cache, table, seq_lens, out, starts, num_reqs=num_reqs, kv_lora_rank=rank,
        scale=0.3, num_splits=splits, scratch=scratch,
    )  # fmt: skip
    keys = cache.float().unsqueeze(2)
    ref = torch.zeros(num_tokens, heads, rank)
    n = len(real)
    paged_attention_ref(
        query.float(), keys, keys[..., :rank], table[:n], starts_list[: n + 1], lens[:n], 0.3,
        ref,
    )  # fmt: skip
    end = starts_list[n]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(out[:end].float(), ref[:end]) < tol
    assert (out[end : starts_list[-1]] == 0).all()  # the padding requests' rows see no key
    assert out[starts_list[-1] :].isnan().all()  # past the last request: not written


@pytest.mark.parametrize("heads", [1, 4, 16, 20, 128])
def test_every_launch_splits_within_the_scratch(heads):
    """TRITON_MLA's split count for every padded batch up to max_num_seqs tokens, decode or
    not: its partial rows fit the scratch (split_rows), and only few programs split."""
    from graphattn.kernels import mla_attention as m

    max_tokens, sms = 64, 132
    rows = m.split_rows(max_tokens, heads, sms)
    assert rows < max_tokens * heads * m.MAX_SPLITS  # sized by the need, not the worst case
    for t in range(1, max_tokens + 2):
        for r in sorted({1, 2, t // 2 or 1, t}):
            for decode in (True, False) if r == t else (False,):
                splits = m.split_count(t, r, heads, sms, max_tokens, decode)
                assert 1 <= splits <= m.MAX_SPLITS
                assert splits == 1 or t * heads * splits <= rows, (t, r, decode, splits)
    assert m.split_count(1, 1, heads, sms, max_tokens, True) > 1  # one decode fills no GPU
    assert m.split_count(max_tokens + 1, 1, heads, sms, max_tokens, False) == 1


def test_the_mixed_kernel_with_one_token_a_request_equals_the_decode_kernel():
    """A batch of one-token decodes through both launches: the same rows (the same tiles
    and the same order of additions where a program holds one token)."""
    from graphattn.kernels import mla_attention

    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(40, 16, 80, generator=gen)
    table = torch.randperm(40, generator=gen).view(4, 10).int()
    lens = torch.tensor([1, 70, 33, 150], dtype=torch.int32)
    starts = torch.arange(5, dtype=torch.int32)
    query = torch.randn(4, 16, 80, generator=gen)
    decode, mixed = torch.empty(4, 16, 64), torch.empty(4, 16, 64)
    kw = dict(kv_lora_rank=64, scale=0.2, num_splits=1, scratch=None)
    mla_attention.mla_decode(query, cache, table, lens, decode, starts, **kw)
    mla_attention.mla_attention(query, cache, table, lens, mixed, starts, num_reqs=4, **kw)
    assert torch.equal(decode, mixed)


def test_the_decode_kernel_refuses_what_it_cannot_read():
    """A block table whose rows are not contiguous (the kernel indexes a row directly), too
    few sequence lengths, a scratch of another dtype: a ValueError before the launch."""
    from graphattn.kernels import mla_attention, split_kv

    cache = torch.randn(8, 16, 80)
    query, out = torch.randn(2, 4, 80), torch.empty(2, 4, 64)
    table = torch.zeros(2, 8, dtype=torch.int32)
    lens, starts = torch.tensor([5, 9], dtype=torch.int32), torch.arange(3, dtype=torch.int32)
    kw = dict(kv_lora_rank=64, scale=0.1, num_splits=1, scratch=None)
    mla_attention.mla_decode(query, cache, table, lens, out, starts, **kw)  # fine as it is
    with pytest.raises(ValueError, match="block_table must be contiguous in its last dim"):
        mla_attention.mla_decode(query, cache, table[:, ::2], lens, out, starts, **kw)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_attention.mla_decode(query, cache, table, lens[:1], out, starts, **kw)
    bad = split_kv.SplitScratch(
        torch.empty(2 * 4 * 2 * 64, dtype=torch.float64), torch.empty(16), 2
    )
    with pytest.raises(ValueError, match=r"scratch\.out must be float32"):
        mla_attention.mla_decode(
            query, cache, table, lens, out, starts, **{**kw, "num_splits": 2, "scratch": bad}
        )


def _count_split_launches(monkeypatch) -> list[int]:
    """The split counts of every TRITON_MLA launch from now on (the wrapped launchers)."""
    from graphattn.kernels import mla_attention

    splits: list[int] = []
    for name in ("mla_decode", "mla_attention"):
        launch = getattr(mla_attention, name)

        def counted(*args, _launch=launch, **kw):
            splits.append(kw["num_splits"])
            return _launch(*args, **kw)

        monkeypatch.setattr(mla_attention, name, counted)
    return splits


def test_triton_mla_through_the_engine_matches_dense_mla(monkeypatch):
    """Mixed batches (the causal kernel), then one-token decodes (the decode kernel, with
    splits on the interpreter's four "SMs"), on one engine."""
    from graphattn.kernels import mla_attention

    model = _model(**SHAPES["q_proj"])
    engine = _engine(model, attention_backend="TRITON_MLA")
    assert engine.report.groups[0].cudagraph_support == "ALWAYS"
    scratch = engine.attn_groups[0].builder.scratch  # made at start-up, at its largest
    heads, rank = model.config.num_attention_heads, model.config.kv_lora_rank
    rows = mla_attention.split_rows(engine.config.max_num_seqs, heads, 4)
    assert scratch.lse.numel() == rows and scratch.out.numel() == rows * rank
    rng = np.random.default_rng(9)
    for shape in ([(0, 9), (21, 1), (40, 13)], [(70, 1), (3, 1), (33, 1), (16, 1)]):
        seqs = make_seqs(rng, shape, 512, 16, 64)
        prefill_prefixes(engine, seqs)
        splits = _count_split_launches(monkeypatch)
        out = engine.step(ga.Batch.from_requests([s.request() for s in seqs]))
        assert rel_err(out, _expected(model, seqs)) < 1e-5
    assert max(splits) > 1  # the decodes ran split


@pytest.mark.parametrize(
    "shape, key",
    [
        # 3 decodes as a graph of 8 (padding requests of length 0)
        ([(30, 1), (5, 1), (61, 1)], (8, 8, True)),
        # a prefill, a chunk and decodes as a mixed graph of 48 tokens and 8 requests: the
        # causal kernel (8 requests fill the interpreter's four "SMs" twice: no split)
        ([(0, 9), (21, 1), (40, 13), (3, 1)], (48, 8, False)),
        # verify steps of 4 tokens a request as a graph of 8 tokens and 2 requests: the
        # causal kernel in two splits (4 tiles of 4 tokens x 4 heads fill no two waves)
        ([(12, 4), (33, 4)], (8, 2, False)),
    ],
)
def test_triton_mla_batches_padded_as_a_graph_replays_them(monkeypatch, shape, key):
    """A batch padded to a full graph's key: the metadata the graph would be captured with,
    run eagerly; the real rows match the dense MLA."""
    from graphattn.attention.backends.mla import TritonMLAMetadataBuilder
    from graphattn.capture.dispatcher import BatchDescriptor, Dispatch

    model = _model()
    engine = _engine(model, attention_backend="TRITON_MLA", max_num_seqs=64)
    monkeypatch.setattr(TritonMLAMetadataBuilder, "full_replay_needs_build", True)
    seqs = make_seqs(np.random.default_rng(10), shape, 512, 16, 64)
    prefill_prefixes(engine, seqs)
    splits = _count_split_launches(monkeypatch)
    engine.runner.planner = lambda t, r, u: Dispatch(M.FULL, BatchDescriptor(*key))
    out = engine.step(ga.Batch.from_requests([s.request() for s in seqs]))
    assert rel_err(out, _expected(model, seqs)) < 1e-5
    assert engine.stats.runtime_modes["FULL"] == 1
    assert (max(splits) > 1) == (key == (8, 2, False))


def test_triton_mla_needs_the_query_heads_in_its_spec():
    """Its builder sizes the split scratch by them; a spec made without them is refused."""
    from graphattn.attention.backends.mla import TritonMLAMetadataBuilder
    from graphattn.config import CompileConfig

    spec = MLAAttentionSpec(16, 1, 80, torch.float32, 64)  # num_heads left at 0
    with pytest.raises(ga.BackendError, match="expected an MLAAttentionSpec with num_heads >= 1"):
        TritonMLAMetadataBuilder(spec, ["l0"], CompileConfig(), torch.device("cpu"))


def test_triton_mla_allows_full_graphs_for_every_batch():
    """What its support level gives on a GPU (the report's mode_on_cuda off CUDA): FULL is
    kept, mixed batches included."""
    model = _model()
    split = dict(compile_backend="eager", attention_backend="TRITON_MLA")  # split at attention
    engine = _engine(model, cudagraph_mode="FULL_AND_PIECEWISE", **split)
    assert engine.report.mode_on_cuda == "FULL_AND_PIECEWISE, kept (backend TRITON_MLA)"
    with pytest.warns(ga.FallbackWarning, match=r"FULL -> NONE \(CUDA graphs need a CUDA"):
        engine = _engine(model, cudagraph_mode="FULL", **split)
    assert engine.report.mode_on_cuda == "FULL, kept (backend TRITON_MLA)"


# -- the layer, the cache and selection ------------------------------------------------------


def test_the_cache_keeps_one_entry_per_token():
    cfg = MLAConfig.tiny()
    engine = _engine(_model())
    (group,) = engine.attn_groups
    spec = group.kv_cache_group.spec
    entry = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    heads = cfg.num_attention_heads
    assert spec == MLAAttentionSpec(16, 1, entry, torch.float32, cfg.kv_lora_rank, heads)
    assert spec.page_size_bytes == 16 * entry * 4  # no second (value) tensor
    assert spec.describe() == f"mla(latent=64, rope=16, heads={heads}, float32)"
    for t in engine.kv_cache.tensors.values():
        assert t.shape == (64, 16, entry)
    assert engine.report.groups[0].backend == "TORCH_REF_MLA"
    assert engine.report.groups[0].spec == spec.describe()


class LooseMLABackend(TorchRefMLABackend):
    """An MLA backend ranked first on the CPU whose validate_configuration forgets the base
    class's checks (so it would accept any layer)."""

    @staticmethod
    def get_name():
        return "LOOSE_MLA"

    @classmethod
    def validate_configuration(cls, cfg):
        return []


@pytest.fixture
def loose_mla():
    ga.register_backend(LooseMLABackend, {"cpu": 1000}, replace=True)
    yield LooseMLABackend
    ga.register_backend(LooseMLABackend, {}, replace=True)  # off every device again


def test_plain_and_mla_backends_serve_only_their_own_layers(loose_mla):
    with pytest.raises(ga.BackendSelectionError, match="not an MLA backend"):
        _engine(_model(), attention_backend="TORCH_REF")
    plain = TableAttentionModel(64, 4, 2, 64)
    for name in ("TORCH_REF_MLA", "LOOSE_MLA"):  # the kind is checked before its reasons
        with pytest.raises(ga.BackendSelectionError, match=r"serves only ga\.MLAAttention"):
            _engine(plain, attention_backend=name)
    # automatic selection: a plain layer skips the first-ranked MLA backend without listing
    # it as passed over; an MLA layer takes it
    engine = _engine(plain)
    assert engine.report.layers[0].backend == "TORCH_REF"
    assert engine.report.layers[0].passed_over == {}
    assert _engine(_model()).report.layers[0].backend == "LOOSE_MLA"


def test_a_model_with_both_kinds_gets_a_cache_group_for_each():
    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vocab_size = 512
            self.mla = MLAForCausalLM(MLAConfig.tiny(num_hidden_layers=1))
            self.plain = TableAttentionModel(512, 4, 2, 32)

        def forward(self, input_ids, positions):
            return torch.cat(
                [self.mla(input_ids, positions), self.plain(input_ids, positions)], dim=-1
            )

    torch.manual_seed(0)
    engine = _engine(init_random_weights(Both(), seed=4))
    kinds = {g.backend.get_name(): g.kv_cache_group.spec.describe() for g in engine.attn_groups}
    assert kinds == {
        "TORCH_REF_MLA": "mla(latent=64, rope=16, heads=4, float32)",
        "TORCH_REF": "full(kv_heads=2, head=32, float32)",
    }
    out = engine.step(
        ga.Batch.from_requests([ga.Request([1, 2, 3], 0, engine.kv_cache.allocate(1))])
    )
    assert out.shape == (3, 128 + 4 * 32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv_lora_rank=0), "kv_lora_rank must be a positive int"),
        (dict(v_head_dim=True), "v_head_dim must be a positive int"),
        (dict(qk_rope_head_dim=15), "qk_rope_head_dim must be even"),
        (dict(prefix=""), "prefix must name the layer"),
        (dict(scale=float("nan")), "scale must be a finite number"),
    ],
)
def test_bad_layer_arguments_are_config_errors(kwargs, message):
    args = dict(
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        scale=0.1,
        prefix="attn",
    )
    with pytest.raises(ga.ConfigError, match=message):
        ga.MLAAttention(4, **{**args, **kwargs})


def test_bad_inputs_are_refused_and_leave_the_cache_alone(monkeypatch):
    """A model handing the layer a wrong shape or dtype gets an InvalidInputError naming
    the input; nothing is written."""
    from helpers import assert_unchanged, snapshot

    model = _model()
    engine = _engine(model)
    blocks = engine.kv_cache.allocate(1)
    engine.step(ga.Batch.from_requests([ga.Request([1, 2, 3], 0, blocks)]))
    attn = model.layers[0].self_attn.attn
    forward = type(attn).forward
    for bad, message in (
        (
            lambda q, c, k, w: (q, c[:, :-1], k, w),
            r"kv_c_normed must be \[1, 64\] or \[1, 1, 64\], got \[1, 63\]",
        ),
        (lambda q, c, k, w: (q, c, k.double(), w), "k_pe is torch.float64"),
        (lambda q, c, k, w: (q, c, k, w.t()[:10]), "kv_b_proj_weight must be"),
    ):
        monkeypatch.setattr(
            type(attn), "forward", lambda self, *a, bad=bad: forward(self, *bad(*a))
        )
        snap = snapshot(engine)
        with pytest.raises(ga.InvalidInputError, match=message):
            engine.step(ga.Batch.from_requests([ga.Request([4], 3, blocks)]))
        assert_unchanged(engine, snap)


def test_the_other_layouts_of_the_inputs_are_accepted(monkeypatch):
    """vLLM's layouts: the query as [T, H, nope + rope], the compressed KV and the rotary key
    with a head axis of 1; the rows are the same."""
    model = _model()
    engine = _engine(copy.deepcopy(model))
    reshaped = _engine(model)
    cfg = model.config
    h, d = cfg.num_attention_heads, cfg.qk_head_dim

    forward = ga.MLAAttention.forward

    def three_d(self, q, c, k, w):
        t = q.shape[0]
        return forward(self, q.reshape(t, h, d), c[:, None], k[:, None], w)

    batch = ga.Batch.from_requests([ga.Request([5, 6, 7, 8], 0, [0])])
    want = engine.step(batch)
    monkeypatch.setattr(ga.MLAAttention, "forward", three_d)
    assert torch.equal(reshaped.step(batch), want)


def test_off_cuda_the_report_says_what_a_full_mode_would_get_on_a_gpu():
    """On CUDA selection takes TRITON_MLA (the mode kept); TORCH_REF_MLA, named, would run
    the model piecewise."""
    engine = _engine(_model(), cudagraph_mode="FULL_AND_PIECEWISE", compile_backend="eager")
    assert engine.resolved_mode == M.NONE and engine.report.groups[0].backend == "TORCH_REF_MLA"
    assert engine.mode_on_cuda == "FULL_AND_PIECEWISE, kept (backend TRITON_MLA)"
    named = _engine(
        _model(),
        cudagraph_mode="FULL_AND_PIECEWISE",
        compile_backend="eager",
        attention_backend="TORCH_REF_MLA",
    )
    assert "-> PIECEWISE" in named.mode_on_cuda and "TORCH_REF_MLA" in named.mode_on_cuda


def test_debug_sees_the_first_step_write_every_mla_layer():
    engine = _engine(_model(), debug=True)
    out = engine.step(
        ga.Batch.from_requests([ga.Request([1, 2, 3], 0, engine.kv_cache.allocate(1))])
    )
    assert out.shape == (3, 128)
    assert not engine._check_kv_writes  # checked, and every layer changed


# -- on CUDA -------------------------------------------------------------------------------


@pytest.mark.gpu
def test_graph_modes_lower_to_piecewise_and_match_eager(tmp_path):
    """TORCH_REF_MLA allows no full graphs: FULL_AND_PIECEWISE becomes PIECEWISE (reported),
    and the piecewise graphs' steps match an eager engine on decodes and mixed batches."""
    model = _model("cuda", torch.bfloat16)
    ref = _engine(copy.deepcopy(model), attention_backend="TORCH_REF_MLA")
    with pytest.warns(ga.FallbackWarning, match="TORCH_REF_MLA"):
        eng = _engine(
            copy.deepcopy(model),
            attention_backend="TORCH_REF_MLA",  # TRITON_MLA is the default on CUDA
            cudagraph_mode="FULL_AND_PIECEWISE",
            compile_backend="inductor",
            cudagraph_capture_sizes=[1, 2, 4, 8, 16],
            cache_dir=str(tmp_path),
            debug=True,
        )
    assert eng.resolved_mode == M.PIECEWISE
    rng = np.random.default_rng(7)
    for shape in ([(20, 1), (33, 1), (5, 1)], [(0, 6), (14, 1), (40, 3)], [(50, 1)] * 9):
        seqs = make_seqs(rng, shape, 512, 16, 64)
        for e in (ref, eng):
            prefill_prefixes(e, seqs)
        batch = ga.Batch.from_requests([s.request() for s in seqs])
        assert rel_err(eng.step(batch), ref.step(batch)) < 2e-2
    assert eng.stats.runtime_modes["PIECEWISE"] >= 3
    assert eng.stats.recompiles == 0 and eng.stats.captures_after_startup == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL"])
def test_triton_mla_replays_full_graphs_and_matches_eager(tmp_path, mode):
    """TRITON_MLA (ALWAYS: the mode is kept) against an eager TORCH_REF_MLA engine: decode
    batches of every size up to the largest graph (padded requests of length 0) replay full
    graphs, and mixed batches too under FULL (piecewise under FULL_AND_PIECEWISE)."""
    model = _model("cuda", torch.bfloat16, **SHAPES["q_proj"])
    ref = _engine(copy.deepcopy(model), num_blocks=256, attention_backend="TORCH_REF_MLA")
    eng = _engine(
        copy.deepcopy(model),
        num_blocks=256,
        cudagraph_mode=mode,
        compile_backend="inductor",
        attention_backend="TRITON_MLA",
        cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32],
        cache_dir=str(tmp_path),
        debug=True,
    )
    assert eng.resolved_mode == M[mode] and not eng.report.fallbacks
    rng = np.random.default_rng(11)
    for n in (1, 3, 8, 13, 16):
        seqs = make_seqs(rng, [(int(rng.integers(1, 200)), 1) for _ in range(n)], 512, 16, 256)
        for e in (ref, eng):
            prefill_prefixes(e, seqs)
        before = eng.stats.runtime_modes["FULL"]
        batch = ga.Batch.from_requests([s.request() for s in seqs])
        assert rel_err(eng.step(batch), ref.step(batch)) < 2e-2, n
        assert eng.stats.runtime_modes["FULL"] == before + 1, n
    mixed = "FULL" if mode == "FULL" else "PIECEWISE"
    for shape in ([(0, 6), (14, 1), (40, 3)], [(0, 17), (90, 1), (3, 5), (120, 4)]):
        seqs = make_seqs(rng, shape, 512, 16, 256)
        for e in (ref, eng):
            prefill_prefixes(e, seqs)
        before = eng.stats.runtime_modes[mixed]
        batch = ga.Batch.from_requests([s.request() for s in seqs])
        assert rel_err(eng.step(batch), ref.step(batch)) < 2e-2, shape
        assert eng.stats.runtime_modes[mixed] == before + 1, shape
    assert eng.stats.recompiles == 0 and eng.stats.captures_after_startup == 0


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 8])
def test_the_decode_kernel_at_deepseek_v2_shape_on_cuda(splits):
    """512 + 64 entries, 16 heads, bf16, long sequences, against the reference in fp32."""
    from graphattn.kernels import mla_attention, split_kv
    from graphattn.kernels.reference import paged_attention_ref

    gen = torch.Generator("cuda").manual_seed(3)
    reqs, heads, rank, rope, width = 6, 16, 512, 64, 64
    cache = torch.randn(reqs * width, 16, rank + rope, device="cuda", generator=gen)
    cache = cache.bfloat16()
    table = torch.randperm(reqs * width, device="cuda", generator=gen).view(reqs, width).int()
    lens = [1000, 17, 0, 513, 1024, 64]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    query = torch.randn(reqs, heads, rank + rope, device="cuda", generator=gen).bfloat16()
    starts = torch.arange(reqs + 1, dtype=torch.int32, device="cuda")
    out = torch.empty(reqs, heads, rank, device="cuda", dtype=torch.bfloat16)
    rows = reqs * heads * splits
    scratch = split_kv.SplitScratch(
        torch.empty(rows * rank, device="cuda"), torch.empty(rows, device="cuda"), reqs
    )
    mla_attention.mla_decode(
        query, cache, table, seq_lens, out, starts, kv_lora_rank=rank, scale=576**-0.5,
        num_splits=splits, scratch=scratch,
    )  # fmt: skip
    keys = cache.float().unsqueeze(2)
    ref = torch.zeros(reqs, heads, rank, device="cuda")
    paged_attention_ref(
        query.float(), keys, keys[..., :rank], table, starts.tolist(), lens, 576**-0.5, ref,
        num_decodes=reqs,
    )  # fmt: skip
    real = seq_lens > 0
    assert rel_err(out[real].float(), ref[real]) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128, 4])
def test_the_causal_kernel_at_deepseek_v2_shape_on_cuda(heads):
    """512 + 64 entries, bf16: a long prefill, chunks after a cached prefix, verify-sized
    requests and decodes in one launch, against the reference in fp32 (16 and 128 heads:
    DeepSeek-V2-Lite's and V2's; 4: tiles of four tokens)."""
    from graphattn.kernels import mla_attention
    from graphattn.kernels.reference import paged_attention_ref

    gen = torch.Generator("cuda").manual_seed(4)
    rank, rope, width = 512, 64, 80
    shape = [(0, 700), (300, 129), (1000, 4), (17, 1), (0, 1), (512, 33)]  # (cached, new)
    reqs = len(shape)
    cache = torch.randn(reqs * width, 16, rank + rope, device="cuda", generator=gen).bfloat16()
    table = torch.randperm(reqs * width, device="cuda", generator=gen).view(reqs, width).int()
    lens = [c + q for c, q in shape]
    starts_list = np.concatenate([[0], np.cumsum([q for _, q in shape])]).tolist()
    t = starts_list[-1]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    starts = torch.tensor(starts_list, dtype=torch.int32, device="cuda")
    query = torch.randn(t, heads, rank + rope, device="cuda", generator=gen).bfloat16()
    out = torch.empty(t, heads, rank, device="cuda", dtype=torch.bfloat16)
    mla_attention.mla_attention(
        query, cache, table, seq_lens, out, starts, num_reqs=reqs, kv_lora_rank=rank,
        scale=576**-0.5,
    )  # fmt: skip
    keys = cache.float().unsqueeze(2)
    ref = torch.zeros(t, heads, rank, device="cuda")
    paged_attention_ref(
        query.float(), keys, keys[..., :rank], table, starts_list, lens, 576**-0.5, ref
    )
    assert rel_err(out.float(), ref) < 2e-2


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(n_routed_experts=4, num_experts_per_tok=5), r"num_experts_per_tok must lie in \[1, 4\]"),
        (dict(n_routed_experts=4, num_experts_per_tok=2, topk_method="noaux_tc"), "topk_method must be"),
        (dict(n_routed_experts=6, num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=4), "n_group must divide"),
        (
            dict(n_routed_experts=6, num_experts_per_tok=3, topk_method="group_limited_greedy",
                 n_group=3, topk_group=1),
            "topk_group must lie in",
        ),
    ],
)  # fmt: skip
def test_a_mixture_of_experts_it_cannot_route_is_a_config_error(overrides, match):
    with pytest.raises(ga.ConfigError, match=match):
        MLAConfig.tiny(**overrides)
