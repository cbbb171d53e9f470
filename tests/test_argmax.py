"""graphattn.kernels.argmax against torch.argmax (the Triton interpreter on the CPU, small
chunks so that rows span many of them): the first maximal index, NaN the largest."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphattn.kernels.argmax import argmax

BLOCK = 64  # small chunks: a row of a few hundred entries crosses several


def _special_rows(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen).to(dtype)
    logits[1, 7 % vocab] = logits[1, max(vocab - 3, 0)] = logits[1, vocab // 2] = 100.0  # ties
    logits[2] = 0.0  # all equal: index 0
    logits[3] = float("-inf")  # index 0, as torch
    logits[4, vocab - 1] = 1000.0  # the last entry
    logits[5, vocab // 2] = logits[5, vocab - 1] = float("nan")  # the first NaN wins
    logits[6, vocab - 1] = float("inf")
    logits[6, 0] = float("-inf")
    logits[7, (BLOCK - 1) % vocab] = logits[7, BLOCK % vocab] = 50.0  # a tie across a border
    return logits


@pytest.mark.parametrize("vocab", [1, 5, BLOCK, BLOCK + 1, 300, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_matches_torch(vocab, dtype):
    logits = _special_rows(vocab, dtype)
    got = argmax(logits, block=BLOCK)
    assert got.dtype == torch.int64 and got.shape == (8,)
    assert torch.equal(got, logits.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1, 300, 2048, 2049, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_matches_torch_on_the_gpu(vocab, dtype):
    logits = _special_rows(vocab, dtype).cuda()
    for block in (BLOCK, 2048):  # many chunks, and the default
        assert torch.equal(argmax(logits, block=block), logits.argmax(-1))


SPECIALS = torch.tensor([float("nan"), float("inf"), float("-inf")])


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 3 * BLOCK + 7),
    levels=st.integers(1, 6),  # few distinct values: many ties
    specials=st.integers(0, 4),  # NaN / inf / -inf entries dropped in at random places
    seed=st.integers(0, 2**16),
)
def test_argmax_on_random_ties_and_specials(rows, vocab, levels, specials, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).float()
    where = torch.randint(0, rows * vocab, (specials,), generator=gen)
    logits.view(-1)[where] = SPECIALS[torch.randint(0, 3, (specials,), generator=gen)]
    logits = logits.to(torch.bfloat16)
    assert torch.equal(argmax(logits, block=BLOCK), logits.argmax(-1))


def test_row_strides_and_bad_input():
    wide = torch.randn(3, 2 * 200)
    view = wide[:, 50:250]  # rows 400 apart, unit stride along the vocabulary
    assert torch.equal(argmax(view, block=BLOCK), view.argmax(-1))
    assert argmax(torch.randn(0, 10)).shape == (0,)
    with pytest.raises(ValueError, match="unit stride"):
        argmax(wide.t())
    with pytest.raises(TypeError, match="logits must have dtype"):
        argmax(torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"vocabulary of 1 to 2\*\*31 - 1, got shape \[2, 0\]"):
        argmax(torch.randn(2, 0))
    with pytest.raises(ValueError, match="block must be a power of two, got 48"):
        argmax(torch.randn(2, 100), block=48)
    with pytest.raises(ValueError, match=r"logits must be \[num_tokens, vocab\]"):
        argmax(torch.randn(8))
