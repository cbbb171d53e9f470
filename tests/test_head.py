"""graphattn.linear: F.linear, with one bias-free row through the Triton GEMV (the interpreter
on the CPU), judged against a float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphattn as ga
from graphattn import head as head_mod
from graphattn.kernels import gemv as gemv_mod


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def gemv_calls(monkeypatch):
    """The GEMV calls ``linear`` makes (the kernel still runs)."""
    calls = []
    real = gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda x, w, **k: (calls.append(x.shape), real(x, w))[1])
    return calls


def test_off_the_kernel_devices_it_is_f_linear(gemv_calls):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(1, 96, generator=g), torch.randn(80, 96, generator=g), torch.randn(80)
    assert torch.equal(ga.linear(x, w), F.linear(x, w))
    assert torch.equal(ga.linear(x, w, b), F.linear(x, w, b))
    assert gemv_calls == []  # the CPU is not a kernel device outside the tests


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_runs_the_gemv(monkeypatch, gemv_calls, dtype):
    monkeypatch.setattr(head_mod, "KERNEL_DEVICES", ("cuda", "cpu"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 200, generator=g).to(dtype)  # K 200: 400 bytes in bf16, 16-byte rows
    w = (torch.randn(97, 200, generator=g) / 14).to(dtype)  # N 97: a tile past the end
    out = ga.linear(x, w)
    assert gemv_calls == [(1, 200)]
    assert out.dtype == dtype and out.shape == (1, 97)
    ref = x.double() @ w.double().T
    # fp32 accumulation, one rounding to the output dtype
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 8e-3)


def test_what_the_gemv_does_not_take_goes_to_f_linear(monkeypatch, gemv_calls):
    monkeypatch.setattr(head_mod, "KERNEL_DEVICES", ("cuda", "cpu"))
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    rows = torch.randn(3, 64, generator=g)
    assert torch.equal(ga.linear(rows, w), F.linear(rows, w))  # more than one row
    assert torch.equal(ga.linear(rows[:1], w, b), F.linear(rows[:1], w, b))  # a bias
    odd, w_odd = torch.randn(1, 63, generator=g), torch.randn(40, 63, generator=g)
    assert torch.equal(ga.linear(odd, w_odd), F.linear(odd, w_odd))  # 252-byte rows: unaligned
    assert ga.linear(torch.randn(64), w).shape == (40,)  # a 1-d input, as F.linear takes it
    assert gemv_calls == []


@pytest.mark.gpu
def test_gpu_llama_head_at_one_row(gemv_calls):
    """The example Llama's compute_logits on one row of the benchmark's head shape: the GEMV,
    against cuBLAS and a float64 reference."""
    from graphattn.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.tiny(vocab_size=128256)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    torch.nn.init.normal_(model.lm_head.weight, std=0.02)
    hidden = torch.randn(1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():  # as engine.compute_logits calls it
        logits = model.compute_logits(hidden)
    assert len(gemv_calls) == 1
    ref = hidden.double() @ model.lm_head.weight.double().T
    assert rel_err(logits, ref) < 8e-3
    assert rel_err(logits, F.linear(hidden, model.lm_head.weight)) < 8e-3
    with torch.inference_mode():
        two = model.compute_logits(hidden.expand(2, -1).contiguous())  # cuBLAS: same rows
    assert rel_err(two[0:1], logits) < 8e-3


def test_a_call_autograd_records_goes_to_f_linear(monkeypatch, gemv_calls):
    # the GEMV has no backward: a batch-1 loss through the example Llama's head would get no
    # gradient; under no_grad (inference) the same call takes the GEMV
    monkeypatch.setattr(head_mod, "KERNEL_DEVICES", ("cuda", "cpu"))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 64, generator=g, requires_grad=True)
    w = torch.randn(40, 64, generator=g)
    out = ga.linear(x, w)
    assert gemv_calls == [] and out.grad_fn is not None
    out.sum().backward()
    assert torch.allclose(x.grad, w.sum(0, keepdim=True), atol=1e-5)
    trainable = torch.nn.Parameter(w.clone())
    assert ga.linear(x.detach(), trainable).grad_fn is not None and gemv_calls == []
    with torch.no_grad():
        ga.linear(x, trainable)
    assert gemv_calls == [(1, 64)]


def test_engine_compute_logits_takes_the_gemv(monkeypatch, gemv_calls):
    """The head's weight is a parameter (requires_grad): only inference mode, where the
    engine runs the head, lets one row take the GEMV, as the benchmark's decode step needs."""
    from graphattn.models import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(head_mod, "KERNEL_DEVICES", ("cuda", "cpu"))
    cfg = LlamaConfig.tiny(num_hidden_layers=1)
    model = LlamaForCausalLM(cfg)
    engine = ga.compile(model, compile_backend="none", num_blocks=8, max_model_len=64)
    hidden = torch.randn(1, cfg.hidden_size)
    logits = engine.compute_logits(hidden)
    assert gemv_calls == [(1, cfg.hidden_size)]
    assert rel_err(logits, F.linear(hidden, model.lm_head.weight.detach())) < 1e-5
    assert model.compute_logits(hidden).grad_fn is not None  # a direct call keeps autograd
    assert gemv_calls == [(1, cfg.hidden_size)]
