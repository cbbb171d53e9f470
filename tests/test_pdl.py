"""Programmatic dependent launch in the GEMV kernels (graphattn/kernels/pdl.py).

On the CPU: when it is on (never on the CPU or the interpreter; ``GRAPHATTN_PDL=0`` turns it
off). On a Hopper GPU: the GEMV kernels launched with PDL, chained in a CUDA graph where each
reads the one before it, give the same bits as the normal launches, on replays that start
from outputs set to NaN (a kernel that read its input before the previous one wrote it would
carry NaN, or a stale value, to the end).
"""

from __future__ import annotations

import ast
import inspect
import itertools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from graphattn.envs import triton_interpret
from graphattn.kernels import gemv as gemv_module
from graphattn.kernels import pdl
from graphattn.kernels import prologue_gemv as prologue_module
from graphattn.kernels import split_kv as split_kv_module
from graphattn.kernels import unified_attention as attention_module
from graphattn.kernels.gemv import GemvConfig, gemv
from graphattn.kernels.prologue_gemv import Rotary, rms_norm_gemv, silu_mul_gemv


@pytest.fixture
def fresh_pdl(monkeypatch):
    pdl.use_pdl.cache_clear()
    yield monkeypatch
    pdl.use_pdl.cache_clear()


def test_pdl_is_off_on_the_cpu(fresh_pdl):
    fresh_pdl.setenv("GRAPHATTN_PDL", "1")
    assert not pdl.use_pdl(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {}
    assert pdl.describe(torch.device("cpu")) == "off: cpu is not a CUDA device"


@pytest.mark.parametrize(
    "capability, env, interpret, expected",
    [
        ((9, 0), "1", "0", "on (compute capability 9.0)"),
        ((10, 0), None, "0", "on (compute capability 10.0)"),
        ((8, 0), "1", "0", "off: needs compute capability 9.0 or later, the device has 8.0"),
        ((9, 0), "0", "0", "off: GRAPHATTN_PDL='0'"),
        ((9, 0), "1", "1", "off: the Triton interpreter runs the kernels (TRITON_INTERPRET)"),
    ],
)
def test_pdl_decision_and_its_reason(fresh_pdl, capability, env, interpret, expected):
    """Every branch of the decision, with the CUDA capability faked (no GPU needed)."""
    fresh_pdl.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    fresh_pdl.setattr(torch.version, "hip", None)
    if env is None:
        fresh_pdl.delenv("GRAPHATTN_PDL", raising=False)
    else:
        fresh_pdl.setenv("GRAPHATTN_PDL", env)
    fresh_pdl.setenv("TRITON_INTERPRET", interpret)
    cuda = torch.device("cuda", 0)
    assert pdl.describe(cuda) == expected
    assert pdl.use_pdl(cuda) == expected.startswith("on")
    assert pdl.launch_options(cuda) == ({"launch_pdl": True} if expected.startswith("on") else {})


@pytest.fixture
def pdl_path_on_the_cpu(monkeypatch):
    """The kernels' PDL code (the first tile peeled off the loop) under the interpreter: the
    launchers pass PDL=True, the launch option is dropped and ``gdc_*`` do nothing (the
    interpreter runs one program at a time, so there is nothing to wait for)."""
    if not triton_interpret():
        pytest.skip("needs TRITON_INTERPRET=1 (the CPU suite's setting)")
    monkeypatch.setattr(tl.extra.cuda, "gdc_wait", _nothing)
    monkeypatch.setattr(tl.extra.cuda, "gdc_launch_dependents", _nothing)
    return monkeypatch


@triton.jit
def _nothing():
    pass


def _with_pdl(patch, fn):
    modules = (gemv_module, prologue_module, attention_module, split_kv_module)
    for module in modules:
        patch.setattr(module, "launch_options", lambda device: {"launch_pdl": True})
    try:
        return fn()
    finally:
        for module in modules:
            patch.setattr(module, "launch_options", pdl.launch_options)


GEMV_CASES = [  # (M, N, K, config): uneven K, K under one tile, split K, several rows, dot
    (1, 50, 200, None),
    (1, 33, 1030, None),
    (1, 40, 8, None),
    (3, 40, 1030, None),
    (1, 64, 1000, GemvConfig(8, 128, 2, 2, 3, False)),  # a split past K: k_lo >= K
    (5, 32, 300, GemvConfig(16, 64, 4, 2, 2, True)),
]


@pytest.mark.parametrize("m, n, k, config", GEMV_CASES)
def test_gemv_pdl_path_computes_what_the_normal_path_does(pdl_path_on_the_cpu, m, n, k, config):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    want = gemv(x, w, config=config)
    got = _with_pdl(pdl_path_on_the_cpu, lambda: gemv(x, w, config=config))
    assert torch.equal(got, want)


@pytest.mark.parametrize("k", [8, 200, 1024, 1030])
def test_prologue_pdl_path_computes_what_the_normal_path_does(pdl_path_on_the_cpu, k):
    gen = torch.Generator().manual_seed(k)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.float16)

    x, residual, weight, norm_w = randn(1, k), randn(1, k), randn(66, k), randn(k)
    gate_up = randn(1, 2 * k)
    cos, sin = randn(1, 22).float().chunk(2, dim=-1)  # heads of 22 columns: 3 of the 66 rows
    rotary = Rotary(cos, sin, 22, 44)

    def calls():
        return [
            *rms_norm_gemv(x, weight, norm_w, 1e-5, residual),
            rms_norm_gemv(x, weight, norm_w, 1e-5)[0],
            *rms_norm_gemv(x, weight, norm_w, 1e-5, residual, epilogue="silu_mul"),
            *rms_norm_gemv(x, weight, norm_w, 1e-5, residual, epilogue="rope", rotary=rotary),
            silu_mul_gemv(gate_up, weight),
        ]

    want = calls()
    got = _with_pdl(pdl_path_on_the_cpu, calls)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("num_splits, window", [(1, None), (3, None), (8, 5)])
def test_decode_attention_pdl_path_computes_what_the_normal_path_does(
    pdl_path_on_the_cpu, num_splits, window
):
    """The decode launch's PDL path (the metadata and slot read before the wait) against the
    normal launch: the same output and cache bits. A new token in the first key tile, in a
    later one, padding requests and empty splits."""
    from test_kernels import decode_with_new_kv, make_case

    shapes = [(0, 1), (15, 1), (40, 1), (70, 1), (7, 1)]
    case = make_case(
        shapes, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=1,
        pad_tokens=2, pad_reqs=2,
    )  # fmt: skip
    plan = case.plan(num_splits)
    run = lambda: decode_with_new_kv(case, plan, scale=0.125, seed=2, window=window)  # noqa: E731
    want = run()
    got = _with_pdl(pdl_path_on_the_cpu, run)
    for (out, caches), (out_want, caches_want) in zip(got, want):
        assert torch.equal(out[: case.num_tokens], out_want[: case.num_tokens])
        assert all(torch.equal(c, w) for c, w in zip(caches, caches_want))


# What a kernel may read before its PDL wait (pdl.py): what no kernel of a step writes. The
# GEMVs: their weights. A decode attention launch (WRITE_KV): the step's metadata, copied in
# before its first kernel, and L2 prefetch hints for its first key tile (they return no data).
# Helpers named here read only those.
GEMV_EARLY = dict(pointers={"w_ptrs", "up_ptrs"}, helpers=set())
DECODE_ATTENTION_EARLY = dict(
    pointers={"query_start_loc_ptr", "seq_lens_ptr", "slot_ptr"},
    helpers={"_find_request", "_split_range", "_prefetch_tile"},  # metadata; L2 prefetch
)
NOTHING_EARLY = dict(pointers=set(), helpers=set())


def reads_before_the_wait(
    source: str, constants: dict, pointers: set[str], helpers: set[str]
) -> list[str]:
    """What a Triton kernel's source does before its first ``gdc_wait()`` on the path that
    ``constants`` (constexpr values) take, beyond what it may: a ``tl.load`` through a
    pointer not in ``pointers``, a ``tl.store`` or atomic, or a call of a helper function not
    in ``helpers`` (it may load). An ``if`` that ``constants`` decide follows its taken
    branch, any other both; methods of values (``x.to(...)``) and other ``tl`` functions
    touch no memory."""
    found: list[str] = []
    body = ast.parse(textwrap.dedent(source)).body[0].body
    if not _walk_to_the_wait(body, constants, pointers, helpers, found):
        raise AssertionError("the kernel never calls gdc_wait() on this path")
    return found


def _walk_to_the_wait(stmts, constants, pointers, helpers, found) -> bool:
    for stmt in stmts:
        if isinstance(stmt, ast.If):
            taken = _decide(stmt.test, constants)
            if taken is not None:
                if _walk_to_the_wait(
                    stmt.body if taken else stmt.orelse, constants, pointers, helpers, found
                ):
                    return True
                continue
        calls = sorted(
            (n for n in ast.walk(stmt) if isinstance(n, ast.Call)),
            key=lambda n: (n.lineno, n.col_offset),
        )
        for call in calls:
            name = ast.unparse(call.func)
            if name.endswith("gdc_wait"):
                return True
            if name == "tl.load":
                if _root(call.args[0]) not in pointers:
                    found.append(ast.unparse(call))
            elif name == "tl.store" or name.startswith("tl.atomic"):
                found.append(ast.unparse(call))
            elif isinstance(call.func, ast.Name) and name not in helpers:
                found.append(ast.unparse(call))  # a helper's call: it may load
    return False


def _decide(test: ast.expr, constants: dict) -> bool | None:
    """The value of an ``if`` test made of constexpr names only, else None."""
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    if not names or not names <= constants.keys():
        return None
    return bool(eval(compile(ast.Expression(test), "<test>", "eval"), {}, dict(constants)))


def _root(pointer: ast.expr) -> str | None:
    """The pointer argument a load's address starts from: ``p_ptr + i * s`` -> ``p_ptr``."""
    while isinstance(pointer, ast.BinOp):
        pointer = pointer.left
    return pointer.id if isinstance(pointer, ast.Name) else None


def test_pdl_kernels_read_before_the_wait_only_what_no_earlier_kernel_writes():
    """Every kernel launched with PDL, on each of its paths: the GEMVs read their first weight
    tile before the wait, decode attention its metadata and older keys; a mixed batch's
    attention and the split-KV reduction read nothing before it."""
    from graphattn.kernels import split_kv, unified_attention

    cases = [
        (gemv_module._gemv_kernel, {"PDL": True}, GEMV_EARLY),
        (prologue_module._prologue_gemv_kernel, {"PDL": True}, GEMV_EARLY),
        (unified_attention._attention_kernel, {"PDL": True, "WRITE_KV": True},
         DECODE_ATTENTION_EARLY),
        (unified_attention._attention_kernel, {"PDL": True, "WRITE_KV": False}, NOTHING_EARLY),
        (split_kv._reduce_kernel, {"PDL": True}, NOTHING_EARLY),
    ]  # fmt: skip
    for kernel, constants, early in cases:
        source = inspect.getsource(kernel.fn)
        assert reads_before_the_wait(source, constants, **early) == [], (kernel, constants)


def test_the_pdl_check_finds_early_reads():
    """The controls: loads, stores and helpers moved before a wait are found."""
    from graphattn.kernels import unified_attention

    moved = inspect.getsource(prologue_module._prologue_gemv_kernel.fn).replace(
        "        tl.extra.cuda.gdc_wait()\n",
        "        cos = tl.load(cos_ptr + pairs % HALF)\n        tl.extra.cuda.gdc_wait()\n",
        1,
    )
    assert reads_before_the_wait(moved, {"PDL": True}, **GEMV_EARLY) == [
        "tl.load(cos_ptr + pairs % HALF)"
    ]
    early = "def k(x_ptr, w_ptrs):\n    w = tl.load(w_ptrs)\n    a = _prologue(x_ptr)\n    tl.extra.cuda.gdc_wait()\n"
    assert reads_before_the_wait(early, {}, **GEMV_EARLY) == ["_prologue(x_ptr)"]
    attention = inspect.getsource(unified_attention._attention_kernel.fn)
    wait = "        if PDL:  # q and the new key and value come from the kernel before\n"
    assert attention.count(wait) == 1
    for line, want in [
        ("q0 = tl.load(q_ptr + q_start)", "tl.load(q_ptr + q_start)"),
        (
            "k0 = tl.load(new_k_ptr + q_start * stride_kt)",
            "tl.load(new_k_ptr + q_start * stride_kt)",
        ),
        ("tl.store(k_cache_ptr + slot, q_start)", "tl.store(k_cache_ptr + slot, q_start)"),
    ]:
        moved = attention.replace(wait, f"        {line}\n{wait}")
        decode = {"PDL": True, "WRITE_KV": True}
        assert reads_before_the_wait(moved, decode, **DECODE_ATTENTION_EARLY) == [want]
    # a mixed batch's launch, its wait moved after the request search: found
    mixed_wait = "    if PDL and not WRITE_KV:  # a mixed batch: the cache may come from the write kernel before\n        tl.extra.cuda.gdc_wait()\n"
    search = "    req = _find_request(query_start_loc_ptr, num_reqs, tile_id, BLOCK_Q)\n"
    assert attention.count(mixed_wait) == 1 and attention.count(search) == 1
    late = attention.replace(mixed_wait, "").replace(search, search + mixed_wait)
    mixed = {"PDL": True, "WRITE_KV": False}
    assert reads_before_the_wait(late, mixed, **NOTHING_EARLY) == [search.strip()[6:]]


def compile_gemvs_for_hopper() -> list[dict]:
    """Compile the GEMV kernels as launched with PDL on an sm_90 GPU, without one: N as an
    argument and as the constexpr 1 Triton makes of an int argument equal to 1. Runs in a
    process without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from graphattn.kernels import gemv, prologue_gemv

    prologue = prologue_gemv._prologue_gemv_kernel
    tiles = dict(HALF=1, BLOCK_N=4, BLOCK_K=512)  # HALF matters to the rope epilogue only
    launches = {
        "prologue, norm + silu_mul": (
            prologue,
            tiles | dict(PROLOGUE=0, HAS_RESIDUAL=True, EPILOGUE=1, EVEN_K=False),
        ),
        "prologue, norm + rope": (
            prologue,
            tiles | dict(PROLOGUE=0, HAS_RESIDUAL=True, EPILOGUE=2, HALF=32, EVEN_K=True),
        ),
        "prologue, silu_mul in": (
            prologue,
            tiles | dict(PROLOGUE=1, HAS_RESIDUAL=False, EPILOGUE=0, EVEN_K=True),
        ),
        "gemv, one row": (
            gemv._gemv_kernel,
            dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=512, EVEN_K=False, DOT=False),
        ),
    }
    results = []
    for label, (kernel, constants) in launches.items():
        for n in (None, 1):
            consts = {**constants, "STAGES": 3, "PDL": True}
            if kernel is gemv._gemv_kernel:
                consts |= {"DOT_PRECISION": "tf32", "DOT_FP32": False}
            if n is not None:
                consts["N"] = n
            sig = {}
            for name in kernel.arg_names:
                if name in consts:
                    sig[name] = "constexpr"
                elif name.endswith("_ptr"):
                    sig[name] = "*bf16"
                else:
                    sig[name] = "fp32" if name == "eps" else "i32"
            compiled = triton.compile(
                ASTSource(kernel, sig, consts),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": 2, "num_stages": 3},
            )
            ptx = compiled.asm["ptx"]
            results.append(
                dict(
                    case=f"{label}, N={n or 'arg'}",
                    wait="griddepcontrol.wait" in ptx,
                    signal="griddepcontrol.launch_dependents" in ptx,
                )
            )
    return results


def test_gemv_kernels_compile_for_hopper_with_pdl():
    """CI has no GPU: the PDL variants compile for sm_90 and carry both instructions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json, test_pdl; print(json.dumps(test_pdl.compile_gemvs_for_hopper()))"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(__file__),
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 8
    for r in results:
        assert r["wait"] and r["signal"], r


@pytest.mark.gpu
def test_pdl_follows_the_device_and_the_environment(fresh_pdl):
    device = torch.device("cuda", torch.cuda.current_device())
    hopper = torch.cuda.get_device_capability(device)[0] >= pdl.MIN_CAPABILITY
    fresh_pdl.setenv("GRAPHATTN_PDL", "1")
    assert pdl.use_pdl(device) == hopper
    assert pdl.launch_options(device) == ({"launch_pdl": True} if hopper else {})
    pdl.use_pdl.cache_clear()
    fresh_pdl.setenv("GRAPHATTN_PDL", "0")
    assert not pdl.use_pdl(device) and pdl.launch_options(device) == {}


TABLE_TILES = GemvConfig(block_n=4, block_k=256)


def _chain(x, residual, norm_w, weights, table_w):
    """One layer's GEMVs, each reading the last: a GEMV of the layer's input makes the
    rotary table, add + norm -> qkv-like with the rotary epilogue (cos and sin from that
    table), gemv, add + norm -> gate_up with the SiLU-mul epilogue, gemv (down); then
    again, from the new residual. The table comes from the PDL launch just before the qkv
    GEMV, so a table load moved before the PDL wait would read a stale table."""
    for qkv, o, gate_up, down in weights:
        table = gemv(x, table_w, config=TABLE_TILES)  # one launch, no split-K sum after it
        cos, sin = table.chunk(2, dim=-1)
        rotary = Rotary(cos, sin, 2 * cos.shape[-1], 2 * o.shape[1])  # q and k of [q | k | v]
        a, residual = rms_norm_gemv(x, qkv, norm_w, 1e-5, residual, epilogue="rope", rotary=rotary)
        b = gemv(a[:, : o.shape[1]], o)
        c, residual = rms_norm_gemv(b, gate_up, norm_w, 1e-5, residual, epilogue="silu_mul")
        x = gemv(c, down)
    return x, residual


@pytest.mark.gpu
def test_pdl_chain_in_a_cuda_graph_matches_normal_launches(fresh_pdl):
    """Each replay gets fresh inputs and starts from NaN outputs; its results must equal the
    same chain launched normally outside a graph. A kernel that read its input before the
    kernel before it had written it would read the last replay's values (or NaN)."""
    device = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(device)[0] < pdl.MIN_CAPABILITY:
        pytest.skip("PDL needs compute capability 9.0")
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return (torch.randn(*shape, generator=gen, device=device) / shape[-1] ** 0.5).bfloat16()

    k, inner = 1024, 2048  # ~40 MB of weights, past half of L2: the GEMVs stream
    weights = [
        (randn(3 * k, k), randn(k, k), randn(2 * inner, k), randn(k, inner)) for _ in range(4)
    ]
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).bfloat16()
    table_w = randn(128, k)  # each layer's rotary table: a GEMV of its input (see _chain)
    x, residual = randn(1, k), randn(1, k)  # the graph's inputs, refilled before each replay
    fresh_pdl.setenv("GRAPHATTN_PDL", "1")
    assert pdl.use_pdl(device)
    _chain(x, residual, norm_w, weights, table_w)  # compile outside the graph
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = _chain(x, residual, norm_w, weights, table_w)
    replays = []
    for _ in range(4):
        x.copy_(randn(1, k))
        residual.copy_(randn(1, k))
        out.fill_(float("nan"))
        res.fill_(float("nan"))
        graph.replay()
        replays.append((x.clone(), residual.clone(), out.clone(), res.clone()))
    torch.cuda.synchronize(device)
    pdl.use_pdl.cache_clear()
    fresh_pdl.setenv("GRAPHATTN_PDL", "0")
    assert not pdl.use_pdl(device)
    for x_in, res_in, got, got_res in replays:
        want, want_res = _chain(x_in, res_in, norm_w, weights, table_w)
        assert not got.isnan().any()
        assert torch.equal(got, want) and torch.equal(got_res, want_res)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_pdl_decode_attention_after_a_gemv_in_a_cuda_graph(fresh_pdl, batch):
    """Two layers of qkv GEMV -> decode attention (the new key and value written inside the
    launch; split-KV) -> o GEMV, in one CUDA graph of PDL launches, Llama-3.2-1B's heads.
    The attention reads its metadata and slots (and prefetches its first key tile) before its wait, q and the
    new key and value, the GEMV's output just before it, after: every replay, from fresh
    inputs and with the GEMV and attention outputs set to NaN, must give the bits of the
    same chain launched normally outside a graph, and so must the caches."""
    from graphattn.kernels.attention_plan import choose_num_splits, plan_attention
    from graphattn.kernels.split_kv import SplitScratch
    from graphattn.kernels.unified_attention import unified_attention

    device = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(device)[0] < pdl.MIN_CAPABILITY:
        pytest.skip("PDL needs compute capability 9.0")
    gen = torch.Generator(device=device).manual_seed(batch)
    hq, hkv, d, bs, layers = 32, 8, 64, 16, 2
    hidden = hq * d

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).bfloat16()

    weights = [
        (randn(hidden + 2 * hkv * d, hidden) / 45, randn(hidden, hidden) / 45)
        for _ in range(layers)
    ]
    ctx = torch.randint(100, 600, (batch,), generator=gen, device=device)
    need = (ctx // bs + 1).tolist()
    num_blocks = sum(need) + 4
    caches = [(randn(num_blocks, bs, hkv, d), randn(num_blocks, bs, hkv, d)) for _ in range(layers)]
    ids = torch.randperm(num_blocks, generator=gen, device=device).int()
    table = torch.zeros(batch, max(need), dtype=torch.int32, device=device)
    for i, (n, start) in enumerate(zip(need, [0, *itertools.accumulate(need)])):
        table[i, :n] = ids[start : start + n]
    slots = (table.gather(1, (ctx // bs)[:, None].int()).squeeze(1).long() * bs + ctx % bs).long()
    seq_lens = (ctx + 1).int()
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    plan = plan_attention(
        batch, batch, num_heads=hq, num_kv_heads=hkv, head_size=d, dtype=torch.bfloat16,
        device_type="cuda", num_splits=choose_num_splits(batch, hkv, num_sms), uniform_decode=True,
    )  # fmt: skip
    assert plan.num_splits > 1
    scratch = SplitScratch.allocate(batch, hkv, d, device)

    def chain(x):
        outs = []
        for (w_qkv, w_o), (k_cache, v_cache) in zip(weights, caches):
            qkv = gemv(x, w_qkv)  # [B, (Hq + 2 Hkv) D]
            outs.append(qkv)
            q = qkv[:, :hidden].view(batch, hq, d)
            k = qkv[:, hidden : hidden + hkv * d].view(batch, hkv, d)
            v = qkv[:, hidden + hkv * d :].view(batch, hkv, d)
            out = torch.empty_like(q)
            unified_attention(
                q, k_cache, v_cache, out, table, starts, seq_lens, plan, scale=d**-0.5,
                scratch=scratch, new_kv=(k, v, slots),
            )  # fmt: skip
            outs.append(out)
            x = gemv(out.view(batch, hidden), w_o)
        return [*outs, x]

    x = randn(batch, hidden)
    fresh_pdl.setenv("GRAPHATTN_PDL", "1")
    assert pdl.use_pdl(device)
    chain(x)  # compile outside the graph
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    replays = []
    for _ in range(4):
        x.copy_(randn(batch, hidden))
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        replays.append((x.clone(), [t.clone() for t in captured]))
    torch.cuda.synchronize(device)
    after_graph = [(k.clone(), v.clone()) for k, v in caches]
    pdl.use_pdl.cache_clear()
    fresh_pdl.setenv("GRAPHATTN_PDL", "0")
    assert not pdl.use_pdl(device)
    for x_in, got in replays:
        want = chain(x_in)
        assert not any(t.isnan().any() for t in got)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    for (k, v), (k_graph, v_graph) in zip(caches, after_graph):
        assert torch.equal(k, k_graph) and torch.equal(v, v_graph)
