"""graphattn.greedy: the same tokens as torch.argmax, through the Triton kernel where it
applies (on the CPU under the interpreter, with "cpu" added to its devices) and through
torch.argmax elsewhere."""

from __future__ import annotations

import pytest
import torch

import graphattn as ga
from graphattn import sampling
from graphattn.kernels import argmax as argmax_module


@pytest.fixture
def kernel_calls(monkeypatch):
    """Let greedy run the kernel on the CPU, and count the rows it ran."""
    monkeypatch.setattr(sampling, "KERNEL_DEVICES", ("cuda", "cpu"))
    calls = []
    launch = argmax_module.argmax

    def counting(logits, *args, **kwargs):
        calls.append(logits.shape[0])
        return launch(logits, *args, **kwargs)

    monkeypatch.setattr(argmax_module, "argmax", counting)
    return calls


@pytest.mark.parametrize("vocab", [4099, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_runs_the_kernel_and_matches_argmax(kernel_calls, vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    # ties: the first maximal index wins, across the kernel's 2048-wide chunks and within one
    logits[1, 7] = logits[1, vocab - 3] = logits[1, vocab // 2] = 100.0
    logits[2, 1:3] = 100.0
    logits[3] = 0.0
    logits[4, vocab - 1] = 1000.0  # the last entry
    got = ga.greedy(logits)
    assert kernel_calls == [5]
    assert torch.equal(got, logits.argmax(-1))
    assert got[1] == 7 and got[2] == 1


def test_greedy_falls_back_to_torch_where_the_kernel_does_not_apply(kernel_calls):
    wide = torch.randn(4, 2 * 300)
    view = wide[:, 10:310]  # rows 600 apart, unit stride: the kernel takes it
    assert torch.equal(ga.greedy(view), view.argmax(-1)) and kernel_calls == [4]
    kernel_calls.clear()
    column = wide.t()[:300]  # stride 600 along the vocabulary: torch.argmax
    assert torch.equal(ga.greedy(column), column.argmax(-1))
    assert ga.greedy(torch.randn(0, 300)).shape == (0,)  # no rows: torch.argmax
    assert kernel_calls == []


def test_greedy_without_the_kernel_and_bad_input():
    logits = torch.randn(3, 50)
    assert torch.equal(ga.greedy(logits), logits.argmax(-1))  # the CPU: torch.argmax
    with pytest.raises(ga.InvalidInputError, match="floating-point logits"):
        ga.greedy(torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ga.InvalidInputError, match=r"shape \[8\]"):
        ga.greedy(torch.randn(8))
    with pytest.raises(ga.InvalidInputError, match=r"vocab >= 1.*shape \[2, 0\]"):
        ga.greedy(torch.zeros(2, 0))
    with pytest.raises(ga.InvalidInputError, match="a tensor of logits, got list"):
        ga.greedy([[0.5, 1.0]])


@pytest.mark.gpu
def test_gpu_greedy_is_argmax_and_faster():
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 8, 128):
        logits = torch.randn(rows, 128256, generator=gen).to("cuda", torch.bfloat16)
        logits[0, 5] = logits[0, 100000] = 50.0  # a tie across chunks
        if rows > 1:
            logits[-1, 70000] = logits[-1, 90000] = float("nan")  # the first NaN
        assert torch.equal(ga.greedy(logits), logits.argmax(-1))
    wide = torch.randn(4, 2 * 128256, device="cuda")
    assert torch.equal(ga.greedy(wide[:, 5:128261]), wide[:, 5:128261].argmax(-1))
    logits = torch.randn(1, 128256, device="cuda", dtype=torch.bfloat16)

    def time_us(fn) -> float:
        graph = torch.cuda.CUDAGraph()
        fn()
        with torch.cuda.graph(graph):
            for _ in range(100):
                fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 10  # us per call

    fast, plain = time_us(lambda: ga.greedy(logits)), time_us(lambda: logits.argmax(-1))
    print(f"greedy {fast:.1f} us, argmax {plain:.1f} us at [1, 128256] bf16")
    assert fast < plain
