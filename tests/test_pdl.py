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
    for module in (gemv_module, prologue_module):
        patch.setattr(module, "launch_options", lambda device: {"launch_pdl": True})
    try:
        return fn()
    finally:
        for module in (gemv_module, prologue_module):
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


# Before its PDL wait a kernel may read only weights (pdl.py): no kernel of a step writes them.
WEIGHT_POINTERS = {"w_ptrs", "up_ptrs"}


def reads_before_the_wait(source: str) -> list[str]:
    """What a Triton kernel's source does before its first ``gdc_wait()`` that may read or
    write memory a kernel before it writes: a ``tl.load`` of anything but a weight tile, a
    ``tl.store`` or atomic, or a call of a helper function (which may load); methods of
    values (``x.to(...)``) and other ``tl`` functions touch no memory. In source order: the
    kernels are straight-line code up to the wait."""
    tree = ast.parse(textwrap.dedent(source))
    calls = sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Call)),
        key=lambda n: (n.lineno, n.col_offset),
    )
    found = []
    for call in calls:
        name = ast.unparse(call.func)
        if name.endswith("gdc_wait"):
            return found
        if name == "tl.load":
            pointer = call.args[0]
            if not (isinstance(pointer, ast.Name) and pointer.id in WEIGHT_POINTERS):
                found.append(ast.unparse(call))
        elif name == "tl.store" or name.startswith("tl.atomic") or isinstance(call.func, ast.Name):
            found.append(ast.unparse(call))  # a store, or a helper's call (it may load)
    raise AssertionError("the kernel never calls gdc_wait()")


def test_pdl_kernels_read_only_weights_before_the_wait():
    """Every kernel launched with PDL: nothing but its first weight tile before the wait,
    so the rotary tables, activations, metadata and caches are read after it."""
    from graphattn.kernels import split_kv, unified_attention

    kernels = (
        gemv_module._gemv_kernel,
        prologue_module._prologue_gemv_kernel,
        unified_attention._attention_kernel,
        split_kv._reduce_kernel,
    )
    for kernel in kernels:
        assert reads_before_the_wait(inspect.getsource(kernel.fn)) == [], kernel.fn.__name__
    # the control: the rope tables loaded before the wait are found
    moved = inspect.getsource(prologue_module._prologue_gemv_kernel.fn).replace(
        "        tl.extra.cuda.gdc_wait()\n",
        "        cos = tl.load(cos_ptr + pairs % HALF)\n        tl.extra.cuda.gdc_wait()\n",
        1,
    )
    assert reads_before_the_wait(moved) == ["tl.load(cos_ptr + pairs % HALF)"]
    early = "def k(x_ptr, w_ptrs):\n    w = tl.load(w_ptrs)\n    a = _prologue(x_ptr)\n    tl.extra.cuda.gdc_wait()\n"
    assert reads_before_the_wait(early) == ["_prologue(x_ptr)"]


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
