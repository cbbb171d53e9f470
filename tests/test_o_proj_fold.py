"""o_proj folded into the split-KV reduction: the kernel (``split_kv.reduce_splits_o_proj``
with the attention launch zeroing its output), the attention op that carries o_proj's
weight, and the graph rewrite that makes the model call it (``passes/o_proj_fold.py``)."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kernels import make_case, run_kernel

from graphattn.kernels import split_kv
from graphattn.kernels.split_kv import SplitScratch
from graphattn.kernels.unified_attention import unified_attention


def _folded(case, plan, weight, *, scale, out=None, scratch=None, window=None):
    """The launch with o_proj folded: ``out`` poisoned with NaN first (the launch zeroes it)."""
    if out is None:
        out = torch.empty(
            case.query.shape[0], weight.shape[0], dtype=torch.float32, device=case.query.device
        )
    out.fill_(float("nan"))
    if scratch is None:
        scratch = SplitScratch.allocate(
            case.query.shape[0], case.key_cache.shape[2], case.query.shape[2], case.query.device
        )
    scratch.out.fill_(float("nan"))
    scratch.lse.fill_(float("nan"))
    result = unified_attention(
        case.query, case.key_cache, case.value_cache, torch.empty_like(case.query),
        case.block_table, case.query_start_loc, case.seq_lens, plan, scale=scale,
        sliding_window=window, scratch=scratch, fused_merge=False, o_proj=(weight, out),
    )  # fmt: skip
    assert result is out
    return out


def _filled_splits(seq_len: int, num_splits: int, tile_n: int, window: int | None) -> int:
    """How many of a decode token's splits hold keys, as the attention launch cuts them:
    whole tiles of the span a split, the last split shorter (written apart from the kernel)."""
    span = seq_len - (max(seq_len - window, 0) if window else 0)
    if span <= 0:
        return 0
    per_split = -(-span // num_splits)
    seg = -(-per_split // tile_n) * tile_n
    return -(-span // seg)


def _poison_splits(monkeypatch, splits_of):
    """Between the attention launch and the folded reduction, NaN into the scratch rows of
    token 0's splits ``splits_of(plan, seq_len)``: a reduction that reads one turns NaN."""
    reduce = split_kv.reduce_splits_o_proj

    def poisoned(scratch, out, weight, query_start_loc, plan, seq_lens, window=0):
        heads, s, device = plan.num_kv_heads * plan.group, plan.num_splits, scratch.lse.device
        dims = torch.arange(plan.head_size, device=device)
        for split in splits_of(plan, int(seq_lens[0])):
            rows = torch.arange(heads, device=device) * s + split  # token 0's rows of the split
            scratch.lse[rows] = float("nan")
            scratch.out[(rows[:, None] * plan.head_size + dims).flatten()] = float("nan")
        return reduce(scratch, out, weight, query_start_loc, plan, seq_lens, window)

    monkeypatch.setattr(split_kv, "reduce_splits_o_proj", poisoned)


@settings(max_examples=16, deadline=None)
@given(
    context=st.integers(0, 200),
    num_splits=st.integers(2, 8),
    window=st.sampled_from([None, 5, 40, 120]),
    seed=st.integers(0, 2**16),
)
def test_one_token_folded_reduction_reads_only_the_splits_with_keys(
    context, num_splits, window, seed
):
    """A launch of one token (the engine's fold) skips the splits the attention launch
    left without keys: their scratch rows, NaN here, are never read; the rows equal
    attention then the matmul, with and without a sliding window."""
    case = make_case(
        [(context, 1)], num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seed=seed
    )
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(40, 8 * 64, generator=gen) / 16
    plan = case.plan(num_splits)
    attn = run_kernel(case, plan, scale=0.1, window=window)
    with pytest.MonkeyPatch.context() as mp:
        _poison_splits(
            mp,
            lambda p, n: range(_filled_splits(n, p.num_splits, p.tiles.tile_n, window), num_splits),
        )
        out = _folded(case, plan, weight, scale=0.1, window=window)
    assert rel_err(out, attn.reshape(1, -1) @ weight.T) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("context", [0, 1, 127, 512, 1500])
def test_one_token_folded_reduction_skips_empty_splits_on_cuda(monkeypatch, context, window):
    """The same on CUDA, compiled, with PDL, at the engine's split count for one token on
    a GPU (16) and bf16: NaN in the empty splits' rows is never read."""
    case = make_case(
        [(context, 1)], num_heads=32, num_kv_heads=8, head_size=64, block_size=16,
        dtype=torch.bfloat16, device="cuda", seed=context,
    )  # fmt: skip
    weight = (torch.randn(2048, 32 * 64, device="cuda") / 32).to(torch.bfloat16)
    plan = case.plan(16)
    attn = run_kernel(case, plan, scale=0.125, window=window)
    _poison_splits(
        monkeypatch,
        lambda p, n: range(_filled_splits(n, p.num_splits, p.tiles.tile_n, window), 16),
    )
    out = _folded(case, plan, weight, scale=0.125, window=window)
    expected = attn.reshape(1, -1).float() @ weight.float().T
    assert rel_err(out, expected) < 2e-2


def test_the_poison_reaches_a_split_with_keys(monkeypatch):
    """The check above can fail: NaN in the last split that holds keys turns the rows NaN.
    129 keys in 32-key tiles over 8 splits: 5 splits of one tile each hold keys, 3 none."""
    case = make_case([(128, 1)], num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    plan = case.plan(8)
    assert plan.tiles.tile_n == 32 and _filled_splits(129, 8, 32, None) == 5
    weight = torch.randn(40, 8 * 64) / 16
    _poison_splits(monkeypatch, lambda p, n: [4])
    assert _folded(case, plan, weight, scale=0.1).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "num_splits"), [(8, 2, 4), (6, 2, 3)])
def test_folded_reduction_matches_attention_then_o_proj(dtype, num_heads, num_kv_heads, num_splits):
    """Decodes with padding tokens and requests, a group of 3 (padded to 4) and 4, N not a
    multiple of the row block: the sum of every KV head's share equals the attention rows
    (rounded to the weight's dtype, as they are stored) times the weight; padding rows 0."""
    shapes = [(0, 1), (15, 1), (40, 1), (7, 1)]
    case = make_case(
        shapes, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64, block_size=16,
        dtype=dtype, seed=5, pad_tokens=2, pad_reqs=1,
    )  # fmt: skip
    n_out = split_kv.o_proj_block_n(4, 64) + 24
    gen = torch.Generator().manual_seed(9)
    weight = (torch.randn(n_out, num_heads * 64, generator=gen) / 16).to(dtype)
    plan = case.plan(num_splits)
    attn = run_kernel(case, plan, scale=0.125)
    n = case.num_tokens
    expected = attn[:n].reshape(n, -1).to(dtype).float() @ weight.float().T
    out = _folded(case, plan, weight, scale=0.125)
    assert not out.isnan().any()
    assert rel_err(out[:n], expected) < (1e-6 if dtype == torch.float32 else 2e-3)
    assert torch.count_nonzero(out[n:]) == 0


@settings(max_examples=10, deadline=None)
@given(
    group=st.sampled_from([1, 2, 3, 4, 8]),
    num_kv_heads=st.integers(1, 3),
    head_size=st.sampled_from([64, 80, 128]),
    num_splits=st.integers(2, 6),
    contexts=st.lists(st.integers(0, 70), min_size=1, max_size=3),
    pad=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_folded_reduction_over_shapes(
    group, num_kv_heads, head_size, num_splits, contexts, pad, seed
):
    """Any group, head size and split count the fold takes (widths up to 1024 columns), any
    decode batch with padding: the folded rows equal attention then the matmul (fp32)."""
    assert split_kv.o_proj_block_n(1 << (group - 1).bit_length(), head_size) is not None
    num_heads = group * num_kv_heads
    case = make_case(
        [(c, 1) for c in contexts], num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=16, seed=seed, pad_tokens=pad, pad_reqs=pad,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(40, num_heads * head_size, generator=gen) / 16
    plan = case.plan(num_splits)
    n = case.num_tokens
    attn = run_kernel(case, plan, scale=0.1)
    out = _folded(case, plan, weight, scale=0.1)
    assert rel_err(out[:n], attn[:n].reshape(n, -1) @ weight.T) < 1e-5
    assert torch.count_nonzero(out[n:]) == 0


def test_folded_reduction_takes_only_what_it_can_fold():
    case = make_case([(20, 1)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    weight = torch.randn(32, 4 * 64)
    with pytest.raises(ValueError, match="split-KV reduction kernel: the plan has 1 split"):
        _folded(case, case.plan(1), weight, scale=0.1)
    for bad, error, match in (
        (torch.randn(32, 4 * 64 + 1), ValueError, "Hq \\* D"),
        (torch.randn(32, 4 * 64, dtype=torch.float64), TypeError, "o_proj weight"),
        (torch.randn(4 * 64, 32).T, ValueError, "contiguous"),
    ):
        with pytest.raises(error, match=match):
            _folded(case, case.plan(2), bad, scale=0.1)
    wide = make_case([(20, 1)], num_heads=32, num_kv_heads=2, head_size=128, block_size=16)
    with pytest.raises(ValueError, match=r"at most 1024 columns .* group is 16 x 128"):
        _folded(wide, wide.plan(2), torch.randn(32, 32 * 128), scale=0.1)
    with pytest.raises(TypeError, match="o_proj out"):
        _folded(case, case.plan(2), weight, scale=0.1, out=torch.empty(1, 32, dtype=torch.bfloat16))


def _counting(monkeypatch, module, name, calls, label=None):
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls[label or name] = calls.get(label or name, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def test_folded_llama_matches_the_unfolded_one(monkeypatch, tmp_path):
    """A bf16 Llama compiled by Inductor (CPU, TRITON under the interpreter) with
    GRAPHATTN_FOLD_O_PROJ=1: its graph holds no o_proj linear; a one-token step runs o_proj
    in the split reduction and gate_up's prologue reads the fp32 row; a prefill runs
    attention and the matmul; both match the engine without the fold."""
    from helpers import small_bf16_llama

    import graphattn as ga
    from graphattn.attention.backends import triton_attn
    from graphattn.kernels import prologue_gemv as prologue_kernels
    from graphattn.passes import single_row_gemv

    monkeypatch.setattr(single_row_gemv, "GEMV_DEVICES", ("cuda", "cpu"))
    model = small_bf16_llama(128, 256, 96, norms_off_one=True)
    common = dict(
        cudagraph_mode="NONE",
        attention_backend="TRITON",
        compile_sizes=(1,),
        max_num_seqs=2,
        max_num_tokens=64,
        max_model_len=64,
        num_blocks=16,
    )
    engines = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("GRAPHATTN_FOLD_O_PROJ", setting)
        engines[setting] = ga.compile(model, cache_dir=str(tmp_path / setting), **common)
    folded, plain = engines["1"], engines["0"]
    assert folded.report.compile["o_proj_folded"] == 2
    assert plain.report.compile["o_proj_folded"] == 0
    assert folded.report.kernels["o_proj_fold"].startswith("on")
    assert folded.report.compile["cache_key"] != plain.report.compile["cache_key"]
    calls: dict[str, int] = {}
    _counting(monkeypatch, split_kv, "reduce_splits_o_proj", calls)
    _counting(monkeypatch, split_kv, "reduce_splits", calls)
    real_norm_gemv = prologue_kernels.rms_norm_gemv

    def norm_gemv(x, *args, **kwargs):
        label = f"rms_norm_gemv {x.dtype} {kwargs.get('epilogue')}"
        calls[label] = calls.get(label, 0) + 1
        return real_norm_gemv(x, *args, **kwargs)

    monkeypatch.setattr(prologue_kernels, "rms_norm_gemv", norm_gemv)
    prompt = ga.Request(list(range(1, 40)), 0, [0, 1, 2])
    got = folded.step(ga.Batch.from_requests([prompt]))
    want = plain.step(ga.Batch.from_requests([prompt]))
    assert rel_err(got, want) < 2e-2
    assert "reduce_splits_o_proj" not in calls  # a prefill: attention, then the matmul
    calls.clear()
    step = ga.Batch.from_requests([ga.Request([9], 39, [0, 1, 2])])
    got = folded.step(step)
    # per layer: o_proj in the reduction; gate_up's prologue takes the fp32 row (layer 1's
    # qkv takes the bf16 sum of the MLP)
    assert calls == {
        "reduce_splits_o_proj": 2,
        "rms_norm_gemv torch.float32 silu_mul": 2,
        "rms_norm_gemv torch.bfloat16 rope": 2,
    }
    want = plain.step(step)
    assert rel_err(got, want) < 2e-2
    assert triton_attn.O_PROJ_FOLD_MAX_TOKENS == 1
    # a second engine with the fold takes its trace, folded, from the trace cache
    monkeypatch.setenv("GRAPHATTN_FOLD_O_PROJ", "1")
    warm = ga.compile(model, cache_dir=str(tmp_path / "1"), **common)
    assert warm.report.compile["trace_source"] == "trace cache"
    assert warm.report.compile["o_proj_folded"] == 2
    warm.step(ga.Batch.from_requests([prompt]))
    calls.clear()
    assert torch.equal(warm.step(step), got)
    assert calls["reduce_splits_o_proj"] == 2


@pytest.mark.gpu
def test_folded_llama_in_full_graphs_on_cuda(monkeypatch, tmp_path):
    """The fold on the GPU: FULL graphs of one token record the folded reduction (counted
    while the engine captures: a replay runs no Python), and decode steps at 1 and 2 tokens
    (the second without the fold: attention, then the matmul), a mixed step of 4 tokens
    (PIECEWISE graphs around the eager op, which writes the buffer the piece before made)
    and a prefill (no graphs) match the engine without it."""
    from helpers import small_bf16_llama

    import graphattn as ga

    model = small_bf16_llama(512, 512, 512, device="cuda", norms_off_one=True)
    common = dict(
        max_num_seqs=4, max_num_tokens=64, max_model_len=128, num_blocks=32,
        cudagraph_capture_sizes=(1, 2, 4, 8), attention_backend="TRITON",
    )  # fmt: skip
    calls: dict[str, int] = {}
    _counting(monkeypatch, split_kv, "reduce_splits_o_proj", calls)
    engines = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("GRAPHATTN_FOLD_O_PROJ", setting)
        engines[setting] = ga.compile(model, cache_dir=str(tmp_path / setting), **common)
        if setting == "1":
            assert calls.get("reduce_splits_o_proj", 0) >= 2  # the size-1 FULL graph's layers
    folded, plain = engines["1"], engines["0"]
    assert folded.report.compile["o_proj_folded"] == 2
    prompts = [ga.Request(list(range(1, 30)), 0, [0, 1]), ga.Request(list(range(5, 20)), 0, [2])]
    for engine in (folded, plain):
        engine.step(ga.Batch.from_requests(prompts))
    for batch in (
        [ga.Request([7], 29, [0, 1])],
        [ga.Request([7], 29, [0, 1]), ga.Request([3], 15, [2])],
        [ga.Request([5], 29, [0, 1]), ga.Request([1, 2, 3], 15, [2, 3])],
    ):
        step = ga.Batch.from_requests(batch)
        got, want = folded.step(step), plain.step(step)
        assert rel_err(got, want) < 2e-2, len(batch)
    assert folded.stats.runtime_modes["FULL"] == 2
    assert folded.stats.runtime_modes["PIECEWISE"] == 1


class _ProjModel(torch.nn.Module):
    """Table q/k/v, one ``ga.Attention`` and an output projection, in the shapes the rewrite
    must leave alone when asked: a bias, a weight used twice, the attention rows read twice."""

    def __init__(self, *, bias=False, tied=False, reuse_rows=False, backend="TORCH_REF"):
        super().__init__()
        import graphattn as ga

        gen = torch.Generator().manual_seed(3)
        vocab, heads, kv_heads, d = 32, 4, 2, 64
        self.vocab_size = vocab
        self.q = torch.nn.Parameter(torch.randn(vocab, heads * d, generator=gen), False)
        self.kv = torch.nn.Parameter(torch.randn(vocab, 2 * kv_heads * d, generator=gen), False)
        self.attn = ga.Attention(heads, d, d**-0.5, kv_heads, prefix="attn", backend=backend)
        self.o_proj = torch.nn.Linear(heads * d, 48, bias=bias)
        with torch.no_grad():
            self.o_proj.weight.copy_(torch.randn(48, heads * d, generator=gen) / 16)
        self.tied, self.reuse_rows = tied, reuse_rows

    def forward(self, input_ids, positions):
        k, v = self.kv[input_ids].chunk(2, -1)
        rows = self.attn(self.q[input_ids], k, v)
        out = self.o_proj(rows)
        if self.tied:  # the weight read again: not a weight only o_proj reads
            out = out + (rows @ self.o_proj.weight.T).flip(-1)
        if self.reuse_rows:
            out = out + rows[:, :48]
        return out


_SMALL = dict(max_num_seqs=2, max_num_tokens=32, max_model_len=64, num_blocks=8)


@pytest.mark.parametrize(
    ("shape", "folded"),
    [({}, 1), ({"bias": True}, 0), ({"tied": True}, 0), ({"reuse_rows": True}, 0)],
)
def test_rewrite_takes_only_the_plain_projection(monkeypatch, shape, folded):
    """Split without Inductor (compile_backend="eager"): the plain o_proj folds into the op,
    a bias, a shared weight or attention rows read elsewhere keep the traced graph; each
    engine's steps (the generic path: attention, then the fp32 matmul) match the unfolded
    engine's."""
    import graphattn as ga

    monkeypatch.setenv("GRAPHATTN_FOLD_O_PROJ", "1")
    model = _ProjModel(**shape)
    eng = ga.compile(model, compile_backend="eager", cudagraph_mode="NONE", **_SMALL)
    assert eng.report.compile["o_proj_folded"] == folded
    monkeypatch.setenv("GRAPHATTN_FOLD_O_PROJ", "0")
    ref = ga.compile(model, compile_backend="eager", cudagraph_mode="NONE", **_SMALL)
    assert ref.report.compile["o_proj_folded"] == 0
    for batch in (
        [ga.Request(list(range(1, 20)), 0, [0, 1])],
        [ga.Request([5], 19, [0, 1]), ga.Request([4, 5, 6], 0, [2])],
    ):
        got, want = eng.step(ga.Batch.from_requests(batch)), ref.step(ga.Batch.from_requests(batch))
        assert rel_err(got, want) < 1e-6


def test_the_generic_path_is_attention_then_the_matmul():
    """``AttentionImpl.forward_o_proj`` of a backend that does not override it: forward's
    rows times the weight in their dtype (bf16 here, rounded as the linear it replaces rounds
    them), widened into the fp32 output."""
    from graphattn.attention.backends.torch_ref import TorchRefImpl

    rows = torch.randn(3, 4, 16).bfloat16()

    class KnownRows(TorchRefImpl):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a):
            return output.copy_(rows)

    impl = KnownRows(4, 16, 0.25, 2)
    query, kv = torch.randn(3, 4, 16).bfloat16(), torch.randn(3, 2, 16).bfloat16()
    weight = torch.randn(8, 64).bfloat16()
    out = torch.full((3, 8), float("nan"))
    assert impl.forward_o_proj(None, query, kv, kv, None, object(), weight, out) is out
    assert torch.equal(out, (rows.view(3, 64) @ weight.T).float())
    # the profile run: the base forward zeroes its rows, so the product is zero
    TorchRefImpl(4, 16, 0.25, 2).forward_o_proj(None, query, kv, kv, None, None, weight, out)
    assert torch.count_nonzero(out) == 0
    # fp32 rows: the matmul writes the output itself
    rows = rows.float()
    out32 = torch.full((3, 8), float("nan"))
    impl.forward_o_proj(
        None, query.float(), kv.float(), kv.float(), None, object(), weight.float(), out32
    )
    assert torch.equal(out32, rows.view(3, 64) @ weight.float().T)


@pytest.mark.gpu
def test_the_generic_path_on_cuda_writes_fp32_sums_in_one_matmul():
    """On CUDA the generic path's matmul writes its fp32 sums into the output (``mm``'s
    ``out_dtype``), with no copy kernel after it: the output is the fp32 product, not the
    bf16 one widened, and the profiler sees no copy kernel."""
    from graphattn.attention.backends.torch_ref import TorchRefImpl

    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = torch.randn(8, 32, 64, device="cuda", generator=gen).bfloat16()

    class KnownRows(TorchRefImpl):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a):
            return output.copy_(rows)

    impl = KnownRows(32, 64, 0.125, 8)
    query = torch.randn(8, 32, 64, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(8, 8, 64, device="cuda", generator=gen).bfloat16()
    weight = torch.randn(2048, 2048, device="cuda", generator=gen).bfloat16()
    out = torch.full((8, 2048), float("nan"), device="cuda")
    exact = rows.view(8, -1).double() @ weight.double().T
    assert impl.forward_o_proj(None, query, kv, kv, None, object(), weight, out) is out
    assert rel_err(out, exact) < 1e-5  # the bf16 product, widened, is off by ~2e-3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        impl.forward_o_proj(None, query, kv, kv, None, object(), weight, out)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert names, "the profiler saw no CUDA work"
    # this test's forward copies bf16 rows to bf16 (a memcpy); a widening copy is a kernel
    widening = [n for n in names if "copy" in n.lower() and "memcpy" not in n.lower()]
    assert not widening, names


def test_a_weight_the_step_may_write_is_not_folded(monkeypatch):
    """The folded kernel reads o_proj's weight before its PDL wait: a weight that shares
    memory with a buffer the model writes in place is refused with a ConfigError that says
    why, at start-up."""
    import graphattn as ga
    from graphattn.errors import ConfigError

    class Aliased(_ProjModel):
        def __init__(self):
            super().__init__()
            self.register_buffer("counter", self.o_proj.weight.data.view(-1)[:1])

        def forward(self, input_ids, positions):
            self.counter.add_(0.0)
            return super().forward(input_ids, positions)

    monkeypatch.setenv("GRAPHATTN_FOLD_O_PROJ", "1")
    with pytest.raises(ConfigError, match=r"may be written during the step \(shares memory with"):
        ga.compile(Aliased(), compile_backend="eager", cudagraph_mode="NONE", **_SMALL)
    monkeypatch.setenv("GRAPHATTN_FOLD_O_PROJ", "0")
    eng = ga.compile(Aliased(), compile_backend="eager", cudagraph_mode="NONE", **_SMALL)
    assert eng.report.compile["o_proj_folded"] == 0


def test_the_folded_op_writes_a_buffer_of_the_piece_before(monkeypatch):
    """After the split the op's output is an input of its splitting piece, made by the
    compiled piece before it (as attention's is): piecewise graphs read it at the address
    they were captured with, where an output the eager op allocated would move."""
    import graphattn as ga
    from graphattn.attention.ops import ATTENTION_O_PROJ_OP

    monkeypatch.setenv("GRAPHATTN_FOLD_O_PROJ", "1")
    eng = ga.compile(_ProjModel(), compile_backend="eager", cudagraph_mode="NONE", **_SMALL)
    split = eng.compiled.runtime.split
    calls = [
        (piece, n)
        for piece in split.pieces
        for n in piece.module.graph.nodes
        if n.target is ATTENTION_O_PROJ_OP
    ]
    assert len(calls) == 1
    piece, call = calls[0]
    assert piece.is_splitting
    out = call.args[4]
    assert out.op == "placeholder"
    assert out.meta["example_value"].dtype == torch.float32

    def allocations(p):
        return [
            n for n in p.module.graph.nodes if n.op == "call_method" and n.target == "new_empty"
        ]

    assert [len(allocations(p)) for p in split.pieces] == [1, 0, 0]  # the piece before the op


def test_a_bad_fold_setting_is_a_config_error(monkeypatch):
    import graphattn as ga
    from graphattn.errors import ConfigError

    monkeypatch.setenv("GRAPHATTN_FOLD_O_PROJ", "yes")
    with pytest.raises(ConfigError, match="GRAPHATTN_FOLD_O_PROJ must be 0 or 1, got 'yes'"):
        ga.compile(_ProjModel(), compile_backend="none", **_SMALL)
    monkeypatch.setenv("GRAPHATTN_FOLD_O_PROJ", "1")  # no trace to rewrite: said so
    eng = ga.compile(_ProjModel(), compile_backend="none", **_SMALL)
    assert eng.report.kernels["o_proj_fold"] == (
        "off: compile_backend='none' traces no graph to rewrite"
    )


def test_splitting_at_attention_splits_at_the_folded_op_too():
    from graphattn.attention.ops import ATTENTION_O_PROJ_NAME, DEFAULT_SPLITTING_OPS
    from graphattn.passes.split import resolve_splitting_ops

    assert ATTENTION_O_PROJ_NAME in DEFAULT_SPLITTING_OPS
    named = resolve_splitting_ops(["graphattn::unified_attention_with_output.default"])
    assert ATTENTION_O_PROJ_NAME in named
    assert ATTENTION_O_PROJ_NAME not in resolve_splitting_ops(["aten::mm"])


@pytest.mark.parametrize("device", DEVICES)
def test_prologue_gemv_rounds_an_fp32_row_before_the_add(device):
    """``rms_norm_gemv`` with an fp32 x and a bf16 residual (the folded o_proj's row): the
    same as rounding x to bf16 first, bit for bit; the sum comes back in bf16. The Triton
    interpreter converts fp32 to bf16 by truncation (the GPU rounds to nearest even), so on
    the CPU the expected x is truncated."""
    from graphattn.kernels.prologue_gemv import rms_norm_gemv

    gen = torch.Generator().manual_seed(2)
    x32 = torch.randn(1, 256, generator=gen).to(device)
    residual = torch.randn(1, 256, generator=gen).bfloat16().to(device)
    weight = (torch.randn(96, 256, generator=gen) / 8).bfloat16().to(device)
    norm = (torch.rand(256, generator=gen) + 0.5).bfloat16().to(device)
    if device == "cpu":  # the interpreter's conversion: the low 16 bits dropped
        x16 = (x32.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    else:
        x16 = x32.bfloat16()
    out, h = rms_norm_gemv(x32, weight, norm, 1e-5, residual)
    want_out, want_h = rms_norm_gemv(x16, weight, norm, 1e-5, residual)
    assert out.dtype == h.dtype == torch.bfloat16
    assert torch.equal(h, want_h) and torch.equal(out, want_out)
    with pytest.raises(TypeError, match="x must have dtype"):
        rms_norm_gemv(x32, weight, norm, 1e-5)  # fp32 only with a residual to round against
