"""graphattn.greedy: the same tokens as torch.argmax, on every path it takes."""

from __future__ import annotations

import pytest
import torch

import graphattn as ga


@pytest.mark.parametrize("vocab", [128256, 4099, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(
    vocab, dtype
):  # on the CPU: torch.argmax (tests/test_argmax.py: the kernel)
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    # ties: the first maximal index wins, across chunks and within one
    logits[1, 7] = logits[1, vocab - 3] = logits[1, vocab // 2] = 100.0
    logits[2, 1:3] = 100.0
    logits[3] = 0.0
    logits[4, vocab - 1] = 1000.0  # the last entry
    assert torch.equal(ga.greedy(logits), logits.argmax(-1))
    assert ga.greedy(logits)[1] == 7 and ga.greedy(logits)[2] == 1


def test_greedy_takes_views_empty_batches_and_rejects_bad_input():
    logits = torch.randn(4, 2 * 4096)
    view = logits[:, :4096]  # not contiguous: the plain argmax
    assert torch.equal(ga.greedy(view), view.argmax(-1))
    assert ga.greedy(torch.randn(0, 4096)).shape == (0,)
    with pytest.raises(ga.InvalidInputError, match="floating-point logits"):
        ga.greedy(torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ga.InvalidInputError, match=r"shape \[8\]"):
        ga.greedy(torch.randn(8))


@pytest.mark.gpu
def test_gpu_greedy_is_argmax_and_faster():
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 8, 128):
        logits = torch.randn(rows, 128256, generator=gen).to("cuda", torch.bfloat16)
        logits[0, 5] = logits[0, 100000] = 50.0  # a tie across chunks
        logits[-1, 70000] = logits[-1, 90000] = float("nan")  # the first NaN (rows 8, 128)
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
