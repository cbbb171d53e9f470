"""Every bad input gets a typed error naming the request and value, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import DEVICES, TableAttentionModel, assert_unchanged, eager_engine, snapshot
from hypothesis import example, given, settings
from hypothesis import strategies as st

import graphattn as ga


@pytest.fixture(params=DEVICES)
def engine(request):
    model = TableAttentionModel(40, 4, 2, 64).to(request.param)
    eng = eager_engine(model, max_num_seqs=4, max_num_tokens=64, num_blocks=8, max_model_len=96)
    eng.kv_cache.allocate(3)
    # something in the cache to protect
    eng.step(ga.Batch.from_requests([ga.Request(list(range(20)), 0, [0, 1])]))
    return eng


R = ga.Request
BAD_BATCHES = {
    "no blocks for its tokens": ([R([1] * 5, 30, [0, 1])], r"has 2 block\(s\) for 35 tokens"),
    "block id outside the cache": ([R([1, 2], 0, [8])], "block id 8"),
    "negative block id": ([R([1], 3, [-1])], "block id -1"),
    "empty request": ([R([1], 0, [0]), R([], 4, [1])], "request 1 has no tokens"),
    "too many requests": ([R([1], 0, [i]) for i in range(5)], "5 requests; max_num_seqs is 4"),
    "too many tokens": ([R([1] * 65, 0, [0, 1, 2, 3, 4])], "65 tokens; max_num_tokens is 64"),
    "beyond max_model_len": ([R([1] * 2, 95, list(range(7)))], "max_model_len is 96"),
    "token outside the vocabulary": ([R([1, 40], 0, [0])], "token id 40"),
    "negative computed tokens": ([R([1], -2, [0])], "num_computed_tokens"),
    "no requests": ([], "no requests"),
    "two requests write one block": (
        [R([1], 20, [0, 2]), R([1], 21, [1, 2])],
        "requests 0 and 1 both write block 2",
    ),
    "two tokens for one slot": ([R([1], 4, [2]), R([3], 4, [2])], "with different tokens"),
    "a request repeats a block it writes": (
        [R([1] * 20, 0, [2, 2])],
        "request 0 writes block 2 through entries 0 and 1",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_batch_is_rejected_and_changes_nothing(engine, case):
    requests, message = BAD_BATCHES[case]
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidBatchError, match=message):
        engine.step(ga.Batch.from_requests(requests))
    assert_unchanged(engine, snap)
    assert engine.stats.steps == 1


@pytest.mark.parametrize(
    "token_ids, message",
    [
        (torch.tensor([1.0, 2.0]), "integers on the CPU"),
        (["a"], "must hold ints"),
        (None, "sequence of ints"),
    ],
)
def test_bad_token_ids(engine, token_ids, message):
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidBatchError, match=message):
        engine.step(ga.Batch.from_requests([R(token_ids, 0, [0])]))
    assert_unchanged(engine, snap)


@pytest.mark.gpu
def test_token_ids_on_the_wrong_device(engine):
    with pytest.raises(ga.InvalidBatchError, match="on the CPU"):
        ga.Batch.from_requests([R(torch.tensor([1, 2], device="cuda"), 0, [0])])


def test_float_arrays_are_rejected():
    with pytest.raises(ga.InvalidBatchError, match="must hold integers"):
        ga.Batch.from_arrays([1.5], [1], [0], [[0]])


def test_rejected_step_then_good_step(engine):
    """A rejected step leaves the engine usable, and the cached prefix still answers."""
    with pytest.raises(ga.InvalidBatchError):
        engine.step(ga.Batch.from_requests([R([1], 20, [0, 9])]))
    out = engine.step(ga.Batch.from_requests([R([5], 20, [0, 1])]))
    ids = list(range(20)) + [5]
    expected = engine.model.cpu().expected(ids, 1)
    torch.testing.assert_close(out.cpu(), expected.float(), rtol=1e-4, atol=1e-5)


def test_model_dtype_must_match_config():
    model = TableAttentionModel(8, 2, 2, 64)
    with pytest.raises(ga.InvalidInputError, match="convert the model first"):
        eager_engine(model, dtype="bfloat16", num_blocks=4)


def test_layer_inputs_are_checked():
    from graphattn.attention import set_forward_context

    model = TableAttentionModel(8, 2, 2, 64)
    engine = eager_engine(model, num_blocks=4)
    attn = model.attns[0]
    q = torch.randn(3, 128)
    with set_forward_context(None, layers=engine.bound):
        with pytest.raises(ga.InvalidInputError, match=r"key must be \[3, 128\]"):
            attn(q, torch.randn(3, 64), torch.randn(3, 128))
        with pytest.raises(
            ga.InvalidInputError, match="query, key and value must have one dtype and device"
        ):
            attn(q, q.double(), q)


def test_out_of_blocks_is_typed_and_allocates_nothing(engine):
    free = engine.kv_cache.num_free_blocks
    with pytest.raises(ga.OutOfBlocksError, match=f"only {free} of 8 are free"):
        engine.kv_cache.allocate(free + 1)
    assert engine.kv_cache.num_free_blocks == free


# -- arrays and values a batch's int32 / int64 arrays cannot hold ----------------------------


@pytest.mark.parametrize(
    "arrays, message",
    [
        # numpy would wrap 2**32 to block 0, another request's block
        (([5, 6, 7], [3], [0], np.array([[2**32]], np.int64)), "block_table holds 4294967296"),
        (([5], [1], np.array([2**32 + 20], np.int64), [[0, 1]]), "num_computed_tokens holds"),
        (([5], np.array([2**31], np.int64), [0], [[0]]), "query_lens holds 2147483648"),
        (([5], [[1]], [0], [[0]]), r"query_lens must have 1 dimension\(s\), got shape \[1, 1\]"),
        (([[5]], [1], [0], [[0]]), r"token_ids must have 1 dimension\(s\)"),
        (([5], [1], [0], [0]), r"block_table must have 2 dimension\(s\)"),
        (([5, 6], [1, 1], [0], [[0], [1]]), "num_computed_tokens and num_block_ids must have 2"),
        (([5], [1], [0], [[0], [1]]), r"block_table 1 rows, got 1, 1 and shape \[2, 1\]"),
        (([True], [1], [0], [[0]]), "token_ids must hold integers, got dtype bool"),
    ],
)
def test_from_arrays_rejects_what_its_arrays_cannot_hold(engine, arrays, message):
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidBatchError, match=message):
        engine.step(ga.Batch.from_arrays(*arrays))
    assert_unchanged(engine, snap)


@pytest.mark.parametrize(
    "request_, message",
    [
        (R([2**70], 0, [0]), r"token_ids holds 1180591620717411303424, outside"),
        (R([1], 2**32, [0]), r"num_computed_tokens must be an int in \[0, 2147483647\]"),
        (R([1], 20, [0, 2**40]), r"block_ids holds 1099511627776, outside"),
        (
            R(torch.tensor([True]), 0, [0]),
            "token_ids must be integers on the CPU, got a torch.bool",
        ),
        (R(np.array([2**63], np.uint64), 0, [0]), "token_ids holds 9223372036854775808"),
    ],
)
def test_request_values_out_of_range(engine, request_, message):
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidBatchError, match=message):
        engine.step(ga.Batch.from_requests([request_]))
    assert_unchanged(engine, snap)


@pytest.mark.parametrize("batch", [[R([1], 0, [0])], None, "batch"])
def test_step_takes_only_a_batch(engine, batch):
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidBatchError, match="expected a graphattn Batch"):
        engine.step(batch)
    assert_unchanged(engine, snap)
    assert engine.stats.steps == 1


@pytest.mark.parametrize("n", [-1, 1.5, True, "2", None])
def test_allocate_takes_a_count(engine, n):
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidInputError, match="number of blocks must be an int >= 0"):
        engine.kv_cache.allocate(n)
    assert_unchanged(engine, snap)


@pytest.mark.parametrize(
    "ids, error, message",
    [
        (0, ga.InvalidInputError, "block_ids must be a sequence of ints, got int"),
        ([1.5], ga.InvalidInputError, "block ids must be ints, got 1.5"),
        ([True], ga.InvalidInputError, "block ids must be ints, got True"),
        ([0, 0], ga.OutOfBlocksError, "distinct allocated ids"),
        ([7], ga.OutOfBlocksError, r"cannot free block ids \[7\]"),
    ],
)
def test_free_takes_allocated_ids(engine, ids, error, message):
    snap = snapshot(engine)
    with pytest.raises(error, match=message):
        engine.kv_cache.free(ids)
    assert_unchanged(engine, snap)


# -- generate: every prompt checked before a block is allocated ------------------------------


def _tiny_llama_config(num_hidden_layers):
    from graphattn.models import LlamaConfig

    return LlamaConfig.tiny(
        vocab_size=64,
        num_hidden_layers=num_hidden_layers,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="module")
def llama_engine():
    from graphattn.models import LlamaForCausalLM, init_random_weights

    cfg = _tiny_llama_config(num_hidden_layers=2)
    model = init_random_weights(LlamaForCausalLM(cfg), seed=3)
    return eager_engine(
        model,
        cudagraph_mode="NONE",
        max_num_seqs=4,
        max_num_tokens=64,
        max_model_len=96,
        block_size=16,
        num_blocks=16,
    )


GOOD_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]


def test_generate_rejects_bad_prompts_and_keeps_every_block(llama_engine):
    eng = llama_engine
    expected = eng.generate(GOOD_PROMPTS, 4)
    free = list(eng.kv_cache.allocator._free)
    bad_calls = {
        "token outside the vocabulary": (([[1, 2, 64]], 4), "token id 64 is outside"),
        "negative token": (([[1, -1]], 4), "token id -1 is outside"),
        "float tokens": (([[1.7, 2.2]], 4), "token ids must be ints, got 1.7"),
        "bool token": (([[True, 2]], 4), "token ids must be ints, got True"),
        "a str prompt": ((["abc"], 4), "prompt 0 must be a list of token ids, got str"),
        "prompts not a list": ((5, 4), "prompts must be a list of token-id lists, got int"),
        "bool max_new_tokens": (([[1, 2]], True), "max_new_tokens must be a positive int"),
        "too long": (([[1] * 90], 8), "caches 97 > max_model_len=96"),
        # numpy ints are ints, but the lengths computed from them must not wrap
        "np.int32 max_new_tokens": (([[1, 2, 3]], np.int32(2**31 - 1)), "> max_model_len=96"),
        "np.uint64 max_new_tokens": (([[1, 2, 3]], np.uint64(2**64 - 2)), "> max_model_len=96"),
        "a set prompt": (([{5, 2}], 4), "prompt 0 must be a list of token ids, got set"),
        "a dict prompt": (([{7: 0, 3: 0}], 4), "prompt 0 must be a list of token ids, got dict"),
    }
    for _ in range(len(free) + 1):  # more calls than blocks: a leak would empty the pool
        for args, message in bad_calls.values():
            with pytest.raises(ga.InvalidInputError, match=message):
                eng.generate(*args)
    assert eng.kv_cache.allocator._free == free
    assert eng.generate(GOOD_PROMPTS, 4) == expected
    assert eng.generate([np.array([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8])], 4) == expected


def test_generate_caches_the_prompt_and_all_but_the_last_new_token(llama_engine):
    """The last sampled token is returned, never fed back: a prompt of 89 with 8 new tokens
    caches 96, which max_model_len=96 holds (6 blocks of 16, not 7), and the tokens are
    those of generating with room to spare."""
    eng = llama_engine
    prompt = [(7 * i) % 64 for i in range(89)]
    free = eng.kv_cache.num_free_blocks
    allocated = []
    allocate = eng.kv_cache.allocate
    eng.kv_cache.allocate = lambda n: allocated.append(n) or allocate(n)
    try:
        out = eng.generate([prompt], 8)
    finally:
        del eng.kv_cache.allocate
    assert allocated == [6] and eng.kv_cache.num_free_blocks == free
    assert len(out[0]) == 8
    assert out[0][:7] == eng.generate([prompt], 7)[0]  # greedy: a shorter run is its prefix


def test_generate_needs_a_head_and_says_so_before_it_runs():
    model = TableAttentionModel(40, 4, 2, 64)
    eng = eager_engine(model, max_num_seqs=4, max_num_tokens=64, num_blocks=8, max_model_len=96)
    assert not hasattr(model, "compute_logits")
    free = eng.kv_cache.num_free_blocks
    with pytest.raises(ga.InvalidInputError, match="TableAttentionModel has no compute_logits"):
        eng.generate([[1, 2, 3]], 4)
    assert eng.stats.steps == 0 and eng.kv_cache.num_free_blocks == free


def test_generate_without_free_blocks_is_a_typed_error(llama_engine):
    eng = llama_engine
    held = eng.kv_cache.allocate(15)
    try:
        with pytest.raises(
            ga.OutOfBlocksError, match="prompt 0 needs 2 KV-cache blocks and only 1"
        ):
            eng.generate([[1] * 20], 4)
        assert eng.kv_cache.num_free_blocks == 1
    finally:
        eng.kv_cache.free(held)


def test_generate_that_fails_midway_gives_its_blocks_back(llama_engine, monkeypatch):
    eng = llama_engine
    free = list(eng.kv_cache.allocator._free)
    real_step, calls = eng.step, []

    def failing_step(batch, **kwargs):
        calls.append(batch.num_reqs)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real_step(batch, **kwargs)

    monkeypatch.setattr(eng, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected failure"):
        eng.generate(GOOD_PROMPTS, 4)
    monkeypatch.undo()
    assert sorted(eng.kv_cache.allocator._free) == sorted(free)
    assert not eng.kv_cache.allocator._in_use.any()


def test_max_model_len_stays_within_the_models_positions():
    """The tiny Llama embeds 2048 positions: by default the engine takes that many, a larger
    max_model_len is refused at start-up, and a step past the table is a typed error."""
    from graphattn.models import LlamaForCausalLM

    cfg = _tiny_llama_config(num_hidden_layers=1)
    assert cfg.max_position_embeddings == 2048
    model = LlamaForCausalLM(cfg)
    sizes = dict(max_num_seqs=2, max_num_tokens=64, block_size=256, num_blocks=10)
    with pytest.raises(ga.ConfigError, match="max_model_len=4096 exceeds the model's"):
        eager_engine(model, max_model_len=4096, **sizes)
    eng = eager_engine(model, **sizes)
    assert eng.config.max_model_len == 2048
    assert eng.report.kv_cache["max_model_len"] == "2048 (the model's max_position_embeddings)"
    snap = snapshot(eng)
    with pytest.raises(ga.InvalidBatchError, match="max_model_len is 2048"):
        eng.step(ga.Batch.from_requests([R([1], 2100, list(range(9)))]))
    assert_unchanged(eng, snap)


class _TupleModel(TableAttentionModel):
    """A model whose forward returns (hidden, extra), as some Hugging Face modules do."""

    def forward(self, input_ids, positions):
        return super().forward(input_ids, positions), None


def test_a_forward_that_returns_a_tuple_is_named_uncompiled_too():
    # the compiled path refuses it at its trace; uncompiled, the first step used to fail
    # with "'tuple' object has no attribute 'shape'" deep in the runner; now the start-up's
    # profile run refuses it
    with pytest.raises(
        ga.InvalidInputError,
        match=r"forward\(input_ids, positions\) returns one tensor of hidden states; "
        r"_TupleModel returned tuple",
    ):
        eager_engine(_TupleModel(40, 4, 2, 64), num_blocks=8, max_model_len=96)


@pytest.mark.parametrize("device", DEVICES)
def test_table_entries_a_request_does_not_use_may_hold_anything(device):
    """Past the blocks a request uses, its row may hold junk (a reused np.empty table): the
    step runs and gives what the -1-padded table gives, on TORCH_REF, which reads whole
    rows up to the longest request's blocks."""
    model = TableAttentionModel(40, 4, 2, 64).to(device)
    eng = eager_engine(model, max_num_seqs=4, max_num_tokens=64, num_blocks=8, max_model_len=96)
    eng.kv_cache.allocate(4)
    eng.step(ga.Batch.from_requests([R(list(range(20)), 0, [0, 1]), R(list(range(3)), 0, [2])]))
    tokens, ones = np.array([5, 6]), np.ones(2, np.int32)
    computed, declared = np.array([20, 3], np.int32), np.array([2, 1], np.int32)
    outs = []
    for junk in (-1, 1_000_000):
        table = np.array([[0, 1], [2, junk]], np.int32)
        outs.append(eng.step(ga.Batch.from_arrays(tokens, ones, computed, table, declared)))
    torch.testing.assert_close(outs[0], outs[1])


class _SharedLayerModel(TableAttentionModel):
    """Calls its one ga.Attention twice, as a looped shared block would."""

    def forward(self, input_ids, positions):
        k, v = self.k[input_ids], self.v[input_ids]
        first = self.attns[0](self.q[0][input_ids], k, v)
        return self.attns[0](first, k, v)


class _OneArgumentModel(TableAttentionModel):
    """A Hugging Face style forward(input_ids)."""

    def forward(self, input_ids):
        return super().forward(input_ids, None)


class _KeywordPositionsModel(TableAttentionModel):
    """forward(input_ids, *, positions): positions only by keyword."""

    def forward(self, input_ids, *, positions):
        return super().forward(input_ids, positions)


class _BranchingModel(TableAttentionModel):
    """A Python branch on the tokens' values: no single graph holds it."""

    def forward(self, input_ids, positions):
        out = super().forward(input_ids, positions)
        return out * 2 if int(input_ids.max()) > 5 else out


class _WrongRowsModel(TableAttentionModel):
    """Returns other than one floating-point row per token, in the ways a model ported from
    elsewhere might."""

    def __init__(self, shape):
        super().__init__(40, 4, 2, 64)
        self.shape = shape

    def forward(self, input_ids, positions):
        out = super().forward(input_ids, positions)
        if self.shape == "batch in front":
            return out.unsqueeze(0)
        if self.shape == "last row":
            return out[-1:]
        if self.shape == "scalar":
            return out.sum()
        return input_ids  # "token ids"


@pytest.mark.parametrize("compile_backend", ["none", "eager"])
def test_one_attention_layer_called_twice_is_named(compile_backend):
    """The second call would overwrite the first's keys and values: the compiled path
    refuses the model at its trace, the uncompiled one at its profile run (both in
    ga.compile, before any step)."""
    sizes = dict(num_blocks=8, max_model_len=96, cudagraph_mode="NONE")
    with pytest.raises(ga.InvalidInputError, match=r"layers\.0\.attn ran twice in one forward"):
        ga.compile(_SharedLayerModel(40, 4, 2, 64), compile_backend=compile_backend, **sizes)
    # a model calling each of its layers once runs, step after step
    ok = eager_engine(TableAttentionModel(40, 4, 2, 64, num_layers=2), **sizes)
    ok.kv_cache.allocate(1)
    for _ in range(2):  # each step's forward starts with no layer called
        ok.step(ga.Batch.from_requests([ga.Request([1, 2, 3], 0, [0])]))


def test_a_model_dynamo_cannot_trace_is_a_typed_error_with_a_way_out():
    with pytest.raises(
        ga.InvalidInputError,
        match=r"_BranchingModel could not be traced .*"
        r"compile_backend='none' runs the model uncompiled",
    ):
        ga.compile(_BranchingModel(40, 4, 2, 64), compile_backend="eager", num_blocks=8,
                   max_model_len=96, cudagraph_mode="NONE")  # fmt: skip


@pytest.mark.parametrize("compile_backend", ["none", "eager"])
@pytest.mark.parametrize(
    ("model", "message"),
    [
        (_OneArgumentModel, r"forward\(input_ids\) cannot take them"),
        (_KeywordPositionsModel, r"forward\(input_ids, \*, positions\) cannot take them"),
    ],
)
def test_a_forward_that_cannot_take_ids_and_positions_is_named(compile_backend, model, message):
    """Uncompiled, such a model used to fail with Python's bare TypeError; both paths now
    say what graphattn calls and what the forward takes, before the KV cache is touched."""
    with pytest.raises(
        ga.InvalidInputError,
        match=r"graphattn calls model\(input_ids, positions\) with two positional tensors; "
        + rf"{model.__name__}\.{message}",
    ):
        ga.compile(model(40, 4, 2, 64), compile_backend=compile_backend, num_blocks=8,
                   max_model_len=96, cudagraph_mode="NONE")  # fmt: skip


@pytest.mark.parametrize("compile_backend", ["none", "eager"])
@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (
            "batch in front",
            r"one row per token, .*returned shape \[1, (16|32), 256\] for T=(16|32)",
        ),
        ("last row", r"one row per token, .*returned shape \[1, 256\] for T=(16|32)"),
        ("scalar", r"one row per token, .*returned shape \[\] for T=(16|32)"),
        ("token ids", r"returns hidden states, a floating-point tensor; .* a tensor of int64"),
    ],
)
def test_a_forward_that_returns_other_than_a_row_per_token_is_refused(
    compile_backend, shape, message
):
    """Such a model used to start, then give a step output of the wrong shape (one request)
    or a bare IndexError (two), after the step had written the KV cache: both paths now
    refuse it in ga.compile."""
    with pytest.raises(ga.InvalidInputError, match=message):
        ga.compile(_WrongRowsModel(shape), compile_backend=compile_backend, num_blocks=8,
                   max_model_len=96, max_num_tokens=32, cudagraph_mode="NONE")  # fmt: skip


def test_integer_query_key_value_are_refused():
    class IntModel(TableAttentionModel):
        def forward(self, input_ids, positions):
            q = self.q[0][input_ids].long()
            return self.attns[0](q, self.k[input_ids].long(), self.v[input_ids].long())

    with pytest.raises(ga.InvalidInputError, match=r"must be floating point, got torch\.int64"):
        eager_engine(IntModel(40, 4, 2, 64), num_blocks=8, max_model_len=96)


def test_mixed_parameter_dtypes_need_an_explicit_dtype():
    """A bf16 model with one fp32 parameter: the engine used to take float32 silently for
    its KV cache (twice the memory) while the layers ran in bf16."""
    model = TableAttentionModel(8, 2, 2, 64).to(torch.bfloat16)
    model.norm = torch.nn.Parameter(torch.ones(64))  # kept in float32, as some models do
    with pytest.raises(ga.InvalidInputError, match=r"mix dtypes: .*torch\.bfloat16.*pass dtype="):
        eager_engine(model, num_blocks=4)
    assert eager_engine(model, num_blocks=4, dtype="bfloat16").dtype == torch.bfloat16


@pytest.mark.parametrize(
    "model, message",
    [
        ("path/to/checkpoint", "got str"),
        (TableAttentionModel, "got the class TableAttentionModel"),
        ({"weight": torch.zeros(1)}, "got dict"),
    ],
)
def test_compile_takes_a_module_instance(model, message):
    with pytest.raises(ga.InvalidInputError, match=f"expected an nn.Module instance .*{message}"):
        ga.compile(model, compile_backend="none")


def test_the_vocabulary_is_read_from_the_models_config_too():
    """A model declaring its vocabulary the Hugging Face way (model.config.vocab_size, here a
    numpy int) gets its token ids checked."""
    import types

    model = TableAttentionModel(40, 4, 2, 64)
    del model.vocab_size
    model.config = types.SimpleNamespace(vocab_size=np.int64(40))
    engine = eager_engine(model, num_blocks=8, max_model_len=96)
    engine.kv_cache.allocate(1)
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidBatchError, match="token id 40 is outside the vocabulary"):
        engine.step(ga.Batch.from_requests([R([1, 40], 0, [0])]))
    assert_unchanged(engine, snap)


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "llama3", "factor": 8.0}, r"missing or not a number: \['low_freq_factor'"),
        ({"rope_type": "linear"}, r"missing or not a number: \['factor'\]"),
        ({"rope_type": "dynamic", "factor": 4.0}, "rope scaling 'dynamic' is not supported"),
        ({"rope_type": "yarn", "factor": "4"}, r"missing or not a number: \['factor'\]"),
        (
            {"rope_type": "yarn", "factor": 4, "mscale": "1"},
            r"missing or not a number: \['mscale'\]",
        ),
    ],
)
def test_a_llama_config_with_a_bad_rope_scaling_is_a_config_error(scaling, message):
    from graphattn.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.tiny(num_hidden_layers=1, rope_scaling=scaling)
    with pytest.raises(ga.ConfigError, match=message):
        LlamaForCausalLM(cfg)


@pytest.mark.parametrize("value", ["AUTO", "Auto"])
def test_kv_cache_dtype_auto_in_any_case(value):
    assert ga.CompileConfig(kv_cache_dtype=value).kv_cache_dtype == "auto"
    with pytest.raises(ga.ConfigError, match=r'got \'int8\' \(or "auto": the activation dtype\)'):
        ga.CompileConfig(kv_cache_dtype="int8")


def test_from_requests_takes_any_iterable_of_requests(engine):
    gen = (R([i + 1], 0, [i]) for i in range(2))
    assert ga.Batch.from_requests(gen).num_reqs == 2
    with pytest.raises(ga.InvalidBatchError, match=r"request 1 must be a ga\.Request, got tuple"):
        ga.Batch.from_requests([R([1], 0, [0]), ([1], 0, [1])])
    with pytest.raises(ga.InvalidBatchError, match=r"expected an iterable of ga\.Request, got int"):
        ga.Batch.from_requests(3)


def test_tensor_block_ids_and_uint64_tokens_are_named_right(engine):
    with pytest.raises(ga.InvalidBatchError, match="request 0: block_ids must be integers"):
        ga.Batch.from_requests([R([1], 0, torch.tensor([0.0]))])
    huge = torch.tensor([2**63 + 5], dtype=torch.uint64)
    with pytest.raises(ga.InvalidBatchError, match=f"token_ids holds {2**63 + 5}, outside"):
        ga.Batch.from_requests([R(huge, 0, [0])])


@pytest.mark.parametrize("field", ["num_heads", "head_size", "num_kv_heads"])
def test_attention_shape_arguments_refuse_bools(field):
    args = {"num_heads": 2, "head_size": 64, "num_kv_heads": 2} | {field: True}
    with pytest.raises(ga.ConfigError, match=f"{field} must be a positive int, got True"):
        ga.Attention(args["num_heads"], args["head_size"], 0.125, args["num_kv_heads"], prefix="x")


def test_attention_on_fewer_tokens_than_the_step_is_named():
    """TORCH_REF failed with an IndexError on a mask; more rows than tokens passed. A model
    that always drops one fails at start-up (the profile run counts the forward's tokens);
    one that drops tokens only on some steps fails at that step, before its layer writes."""

    class Dropping(TableAttentionModel):
        def forward(self, input_ids, positions):
            ids = input_ids[:-1]
            return self.attns[0](self.q[0][ids], self.k[ids], self.v[ids])

    with pytest.raises(ga.InvalidInputError, match="for 15 tokens; the step has 16"):
        eager_engine(Dropping(40, 4, 2, 64), num_blocks=8, max_model_len=96)

    class DroppingAtThree(TableAttentionModel):
        def forward(self, input_ids, positions):
            ids = input_ids[:-1] if input_ids.shape[0] == 3 else input_ids
            return self.attns[0](self.q[0][ids], self.k[ids], self.v[ids])

    engine = eager_engine(DroppingAtThree(40, 4, 2, 64), num_blocks=8, max_model_len=96)
    engine.kv_cache.allocate(1)
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidInputError, match="for 2 tokens; the step has 3"):
        engine.step(ga.Batch.from_requests([R([1, 2, 3], 0, [0])]))
    assert_unchanged(engine, snap)


def test_a_trace_error_keeps_the_underlying_message():
    """A reshape bug fails inside Dynamo as a fake-tensor error; the typed error names the
    real cause, not only Dynamo's first line."""

    class BadReshape(TableAttentionModel):
        def forward(self, input_ids, positions):
            k, v = self.k[input_ids], self.v[input_ids]
            return self.attns[0](self.q[0][input_ids].view(-1, 3, 7), k, v)

    with pytest.raises(ga.InvalidInputError, match=r"could not be traced .*invalid for input"):
        ga.compile(BadReshape(40, 4, 2, 64), compile_backend="eager", num_blocks=8,
                   max_model_len=96, cudagraph_mode="NONE")  # fmt: skip


def test_a_model_built_under_a_float64_default_dtype_compiles_once_converted():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = TableAttentionModel(40, 4, 2, 64)
    finally:
        torch.set_default_dtype(previous)
    engine = eager_engine(model.float(), num_blocks=8, max_model_len=96)
    engine.kv_cache.allocate(1)
    out = engine.step(ga.Batch.from_requests([R([1, 2, 3], 0, [0])]))
    assert out.dtype == torch.float32 and out.shape == (3, 256)


_FIELDS = ("token_ids", "query_lens", "num_computed_tokens", "block_table", "num_block_ids")
_ODD_INTS = [-1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1]


def _batch_or_error(build, requests):
    try:
        out = build(requests)
    except ga.InvalidBatchError as e:
        return f"error: {e}"
    arrays = [getattr(out, f) for f in _FIELDS] if isinstance(out, ga.Batch) else list(out)
    return [(a.dtype.str, a.shape, a.tolist()) for a in arrays]


@st.composite
def _request_values(draw):
    """Requests mostly of plain ints, with now and then what only the checked path takes or
    refuses: numpy values, bools, floats, ints beyond int32 / int64, ranges and tuples."""

    def one_value():
        return draw(
            st.one_of(
                st.integers(0, 400),
                st.integers(0, 400),
                st.sampled_from(_ODD_INTS),
                st.sampled_from([True, False, np.int64(3), np.int32(2), 1.0]),
            )
        )

    def values(min_size):
        n = draw(st.integers(min_size, 5))
        items = [
            one_value() if draw(st.integers(0, 5)) == 0 else draw(st.integers(0, 300))
            for _ in range(n)
        ]
        kind = draw(st.sampled_from(["list", "list", "tuple", "range", "array"]))
        if kind == "tuple":
            return tuple(items)
        if kind == "range":
            return range(draw(st.integers(0, 50)), draw(st.integers(0, 60)))
        if kind == "array" and all(type(v) is int and 0 <= v < 2**31 for v in items):
            return np.array(items, dtype=np.int64)
        return items

    return [
        R(
            values(0),
            one_value() if draw(st.integers(0, 4)) == 0 else draw(st.integers(0, 600)),
            values(0),
        )
        for _ in range(draw(st.integers(0, 4)))
    ]


@settings(max_examples=300)
@given(_request_values())
@example([R([1], 0, [3, 2**31])])  # each value the whole-batch path must step aside for
@example([R([1], 0, [0]), R([2], 0, [-(2**31) - 1])])
@example([R([1], 2**31, [0])])
@example([R([1], 0, [0]), R([1], -1, [0])])
@example([R([2**63], 0, [0])])
@example([R([1, True], 0, [0])])
@example([R([1], 0, [np.int64(4)])])
@example([R([1], 0, [1.0])])
def test_from_requests_fast_path_gives_the_checked_paths_batch_or_error(requests):
    # the whole-batch path (plain ints) and the per-request checks must agree on every batch:
    # the same arrays, dtypes and shapes, or the same error naming the same request
    from graphattn.batch import _checked_arrays

    assert _batch_or_error(ga.Batch.from_requests, requests) == _batch_or_error(
        _checked_arrays, requests
    )


def test_from_requests_takes_plain_int_batches_whole():
    from graphattn.batch import _plain_int_arrays

    plain = [R([5, 6], 512, list(range(33))), R((7,), 3, range(2, 4)), R([], 0, [])]
    arrays = _plain_int_arrays(plain)
    assert arrays is not None  # the fast path answers, so the comparison above tests it
    assert arrays[3].tolist()[1][:3] == [2, 3, -1] and arrays[3].shape == (3, 33)
    # and steps aside for what it does not check itself
    for odd in ([True], [np.int64(1)], [1.0], [2**31]):
        assert _plain_int_arrays([R([1], 0, odd)]) is None
    assert _plain_int_arrays([R([2**63], 0, [0])]) is None
    assert _plain_int_arrays([R([1], -1, [0])]) is None


@pytest.mark.parametrize(
    "request_, message",
    [
        # no order of their own: a step would read the wrong blocks or tokens, unannounced
        (R([1], 20, {0, 1}), "block_ids must be an ordered sequence of ints .* got set"),
        (R({5, 2}, 0, [0]), "token_ids must be an ordered sequence of ints .* got set"),
        (R({7: 0, 3: 0}, 0, [0]), "token_ids must be an ordered sequence .* got dict"),
        (R(b"\x01\x02", 0, [0]), "token_ids must be an ordered sequence .* got bytes"),
        (R([1], 20, frozenset({0, 1})), "got frozenset"),
        # a 2-D or 0-d array is not a list of ids, whatever it flattens to
        (R([1], 20, np.array([[0, 1]])), r"block_ids must be one-dimensional, got .* \[1, 2\]"),
        (R(torch.tensor([[5]]), 0, [0]), r"token_ids must be one-dimensional, got .* \[1, 1\]"),
        (R(torch.tensor(5), 0, [0]), r"token_ids must be one-dimensional, got .* \[\]"),
    ],
)
def test_requests_without_an_order_or_a_dimension_are_refused(engine, request_, message):
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidBatchError, match=message):
        engine.step(ga.Batch.from_requests([request_]))
    assert_unchanged(engine, snap)


@pytest.mark.parametrize(
    "requests",
    [[R([-1], 20, [0, 1])], [R([3, -2], 20, [0, 1])], [R([1], 20, [0, 1]), R([-5], 0, [2])]],
    ids=["decode", "mixed", "second request"],
)
def test_negative_token_ids_are_refused_without_a_vocabulary(requests):
    # with no vocab_size to check against, a negative id would still index the embedding
    # from its end (or trip a device-side assert on CUDA)
    model = TableAttentionModel(40, 4, 2, 64)
    del model.vocab_size
    eng = eager_engine(model, max_num_seqs=4, max_num_tokens=64, num_blocks=8, max_model_len=96)
    eng.kv_cache.allocate(3)
    eng.step(ga.Batch.from_requests([ga.Request(list(range(20)), 0, [0, 1])]))
    assert eng.runner.limits.vocab_size is None
    snap = snapshot(eng)
    with pytest.raises(ga.InvalidBatchError, match=r"request \d: token id -\d is negative"):
        eng.step(ga.Batch.from_requests(requests))
    assert_unchanged(eng, snap)
    eng.step(ga.Batch.from_requests([R([39], 20, [0, 1])]))  # any id >= 0 still passes


@pytest.mark.parametrize(
    "arrays, message",
    [
        (([5, 6], [1, 1], [20, 3], [[0, 1], [2]]), "block_table must be a rectangular integer"),
        (
            (torch.tensor([1.0], dtype=torch.bfloat16), [1], [0], [[0]]),
            "token_ids must hold integers, got a torch.bfloat16 tensor",
        ),
        (
            (torch.tensor([1.0], requires_grad=True), [1], [0], [[0]]),
            "token_ids must hold integers, got a torch.float32 tensor",
        ),
        (([1], torch.tensor([True]), [0], [[0]]), "query_lens must hold integers"),
    ],
)
def test_from_arrays_refuses_ragged_and_float_tensors_with_a_typed_error(arrays, message):
    with pytest.raises(ga.InvalidBatchError, match=message):
        ga.Batch.from_arrays(*arrays)


def _decode_batch(**changes):
    fields = dict(
        token_ids=np.array([5], np.int64),
        query_lens=np.array([1], np.int32),
        num_computed_tokens=np.array([20], np.int32),
        block_table=np.array([[0, 1]], np.int32),
        num_block_ids=np.array([2], np.int32),
    )
    fields.update(changes)
    return ga.Batch(**fields)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"token_ids": np.array([[5]], np.int64)}, r"token_ids must have 1 dimension"),
        ({"query_lens": np.array([[1]], np.int32)}, r"query_lens must have 1 dimension"),
        ({"num_block_ids": [2]}, r"num_block_ids must be a numpy integer array .*, got a list"),
        ({"num_block_ids": np.array([2.0])}, "num_block_ids must be a numpy integer array"),
    ],
)
def test_a_hand_built_decode_batch_gets_the_general_checks(engine, changes, message):
    # the decode fast path reads the arrays as it finds them; anything but the layout
    # Batch.from_arrays gives must take the checks that name the problem
    engine.step(_decode_batch())  # the unchanged batch passes
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidBatchError, match=message):
        engine.step(_decode_batch(**changes))
    assert_unchanged(engine, snap)


def test_freed_numpy_ids_come_back_as_ints(engine):
    (block,) = engine.kv_cache.allocate(1)
    engine.kv_cache.free([np.uint8(block)])
    (again,) = engine.kv_cache.allocate(1)
    assert again == block and type(again) is int


@pytest.mark.parametrize("clone", ["no", 0, None, np.bool_(False)])
def test_step_clone_must_be_a_bool(clone):
    """Any truthy value used to count as True and a falsy one as False, silently."""
    engine = eager_engine(TableAttentionModel(40, 4, 2, 64), num_blocks=8, max_model_len=96)
    engine.kv_cache.allocate(1)
    snap = snapshot(engine)
    with pytest.raises(ga.InvalidInputError, match=f"clone must be True or False, got {clone!r}"):
        engine.step(ga.Batch.from_requests([R([1, 2], 0, [0])]), clone=clone)
    assert_unchanged(engine, snap)


def test_debug_checks_every_used_block_is_allocated():
    """A serving loop's use after free: a table kept after ``free``, or an id never
    allocated. Only with debug=True (a caller may run its own allocator over the cache)."""
    model = TableAttentionModel(40, 4, 2, 64)
    loose = eager_engine(model, num_blocks=8, max_model_len=96)
    loose.kv_cache.allocate(1)
    loose.step(ga.Batch.from_requests([ga.Request([1, 2, 3], 0, [5])]))  # never allocated: runs
    engine = eager_engine(model, num_blocks=8, max_model_len=96, debug=True)
    # a loop with its own allocator (it never calls allocate) is not checked
    engine.step(ga.Batch.from_requests([ga.Request([1, 2, 3], 0, [5])]))
    blocks = engine.kv_cache.allocate(2)
    engine.step(ga.Batch.from_requests([ga.Request(list(range(20)), 0, blocks)]))
    engine.kv_cache.free(blocks[1:])
    snap = snapshot(engine)
    stale = ga.Batch.from_requests([ga.Request([7], 20, blocks)])  # reads block 1 after free
    with pytest.raises(
        ga.InvalidBatchError,
        match=r"request 0: block id 1 \(entry 1\) is not allocated \(debug=True checks",
    ):
        engine.step(stale)
    with pytest.raises(ga.InvalidBatchError, match=r"block id 6 \(entry 0\) is not allocated"):
        engine.step(ga.Batch.from_requests([ga.Request([1, 2], 0, [6])]))
    assert_unchanged(engine, snap)
    # entries past a request's blocks may hold anything: -1 or a freed id
    engine.step(
        ga.Batch.from_arrays(
            np.array([7]), np.array([1]), np.array([3]), np.array([blocks[:1] + [1]])
        )
    )


def test_debug_finds_a_stale_table_whose_blocks_went_to_another_request():
    """The use after free that the allocated-block check cannot see: the freed blocks were
    handed out again, so every id is allocated, but to another request at other entries."""
    model = TableAttentionModel(40, 4, 2, 64)
    engine = eager_engine(model, num_blocks=8, max_model_len=96, debug=True)
    a = engine.kv_cache.allocate(2)
    engine.step(ga.Batch.from_requests([ga.Request(list(range(20)), 0, a)]))
    engine.kv_cache.free(a)
    b = engine.kv_cache.allocate(3)  # A's two blocks and one more, for another sequence
    table = [b[1], b[2], b[0]]
    engine.step(ga.Batch.from_requests([ga.Request(list(range(5, 25)), 0, table)]))
    snap = snapshot(engine)
    with pytest.raises(
        ga.InvalidBatchError,
        match=r"request 0 uses block 1 as entry 1 of its block table, but the last step that "
        r"used it since its allocate had it at entry 0: one of the two tables is stale",
    ):
        engine.step(ga.Batch.from_requests([ga.Request([7], 20, a)]))  # A, kept after free
    with pytest.raises(
        ga.InvalidBatchError, match="requests 0 and 1 both use block 1 in this step, at entries"
    ):  # B's first block, written as its second by another request
        engine.step(
            ga.Batch.from_requests([ga.Request([7], 20, table), ga.Request([8], 17, [0, 1])])
        )
    assert_unchanged(engine, snap)
    engine.step(ga.Batch.from_requests([ga.Request([7], 20, table)]))  # B goes on


def test_debug_accepts_what_a_correct_serving_loop_does_with_its_blocks():
    """Patterns a serving-loop audit of round 43 found refused by a first version of the
    checks, which compared the blocks before each block: all of them keep every block at
    one entry."""
    model = TableAttentionModel(40, 4, 2, 64)
    plain = eager_engine(model, num_blocks=16, max_model_len=96)
    engine = eager_engine(model, num_blocks=16, max_model_len=96, debug=True)
    prompt = list(range(3, 35))

    def step(*requests):
        batch = ga.Batch.from_requests([ga.Request(*r) for r in requests])
        return engine.step(batch), plain.step(batch)

    # a prefix cache that finds blocks by content: identical prompts ran together, one in
    # chunks, so two blocks hold the prompt's second 16 tokens; a hit takes one from each
    a, c = engine.kv_cache.allocate(3), engine.kv_cache.allocate(3)
    step((prompt[:16], 0, a), (prompt, 0, c))
    step((prompt[16:], 16, a), ([11], 32, c))
    d = engine.kv_cache.allocate(1)
    got, want = step(([prompt[-1]], 31, [a[0], c[1], *d]))  # recomputes the last token
    torch.testing.assert_close(got, want)
    # copy-on-write: a request going back into a block it shares moves to a copy of it; its
    # later block keeps its entry behind the new id
    x, y = engine.kv_cache.allocate(2), engine.kv_cache.allocate(1)
    step((prompt, 0, x))
    step((list(range(10, 18)), 32, x + y))
    z = engine.kv_cache.allocate(1)[0]
    for e in (engine, plain):
        for t in e.kv_cache.tensors.values():  # [2, blocks, ...]: keys and values
            t[:, z] = t[:, x[1]]
    step(([5, 6], 20, [x[0], z]))
    got, want = step((list(range(20, 40)), 22, [x[0], z, *y]))
    torch.testing.assert_close(got, want)
    # a loop that runs its own allocator over the cache after a warm-up generate (which
    # gives back what it took and leaves the checks against the allocator off): block 7
    # moves from entry 0 to entry 1
    from graphattn.models import LlamaConfig, LlamaForCausalLM, init_random_weights

    llama = init_random_weights(LlamaForCausalLM(LlamaConfig.tiny()), seed=1)
    own = eager_engine(llama, num_blocks=16, max_model_len=96, debug=True)
    own.generate([[1, 2, 3]], 2)
    assert not own.kv_cache.allocator.handed_out
    own.step(ga.Batch.from_requests([ga.Request([1, 2, 3], 0, [7])]))
    own.step(ga.Batch.from_requests([ga.Request(list(range(20)), 0, [9, 7])]))
    own.kv_cache.allocate(1)
    own.generate([[1, 2, 3]], 2)
    assert own.kv_cache.allocator.handed_out  # the caller's own allocate still counts


def test_last_token_rows_are_the_rows_to_sample():
    batch = ga.Batch.from_requests(
        [ga.Request([1, 2, 3], 0, [0]), ga.Request([4], 5, [1]), ga.Request([5, 6], 0, [2])]
    )
    assert batch.last_token_rows().tolist() == [2, 3, 5]
    assert batch.last_token_rows().dtype == np.int64
