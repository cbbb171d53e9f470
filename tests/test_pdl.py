"""Programmatic dependent launch in the GEMV kernels (graphattn/kernels/pdl.py).

On the CPU: when it is on (never on the CPU or the interpreter; ``GRAPHATTN_PDL=0`` turns it
off). On a Hopper GPU: the GEMV kernels launched with PDL, chained in a CUDA graph where each
reads the one before it, give the same bits as the normal launches, on replays that start
from outputs set to NaN (a kernel that read its input before the previous one wrote it would
carry NaN, or a stale value, to the end).
"""

from __future__ import annotations

import pytest
import torch

from graphattn.kernels import pdl
from graphattn.kernels.gemv import gemv
from graphattn.kernels.prologue_gemv import rms_norm_gemv


@pytest.fixture
def fresh_pdl(monkeypatch):
    pdl.use_pdl.cache_clear()
    yield monkeypatch
    pdl.use_pdl.cache_clear()


def test_pdl_is_off_on_the_cpu(fresh_pdl):
    fresh_pdl.setenv("GRAPHATTN_PDL", "1")
    assert not pdl.use_pdl(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {}


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


def _chain(x, residual, norm_w, weights):
    """One layer's GEMVs, each reading the last: add + norm -> qkv-like, gemv, add + norm ->
    gate_up with the SiLU-mul epilogue, gemv (down); then again, from the new residual."""
    for qkv, o, gate_up, down in weights:
        a, residual = rms_norm_gemv(x, qkv, norm_w, 1e-5, residual)
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
    x, residual = randn(1, k), randn(1, k)  # the graph's inputs, refilled before each replay
    fresh_pdl.setenv("GRAPHATTN_PDL", "1")
    assert pdl.use_pdl(device)
    _chain(x, residual, norm_w, weights)  # compile outside the graph
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = _chain(x, residual, norm_w, weights)
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
        want, want_res = _chain(x_in, res_in, norm_w, weights)
        assert not got.isnan().any()
        assert torch.equal(got, want) and torch.equal(got_res, want_res)
