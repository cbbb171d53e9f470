"""The code in docs/ runs: the example backend of docs/backends.md serves a model correctly."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import torch
from helpers import TableAttentionModel, eager_engine, make_seqs, rel_err, run_with_prefixes

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def _tested_block(path: pathlib.Path, name: str) -> str:
    text = path.read_text()
    match = re.search(rf"<!-- tested: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"{path.name} has no tested block {name!r}"
    return match.group(1)


@pytest.mark.parametrize("kv_cache_dtype, tol", [("auto", 1e-5), ("bfloat16", 2e-2)])
def test_example_backend_matches_dense_attention(kv_cache_dtype, tol):
    # the selection lets a backend take a cache dtype other than the model's (the base
    # class's supports_kv_cache_dtype): the example must serve it, not fail at its first step
    exec(compile(_tested_block(DOCS / "backends.md", "docs-backend"), "backends.md", "exec"), {})
    model = TableAttentionModel(64, 4, 2, 64, seed=4, backend="SDPA_EXAMPLE")
    engine = eager_engine(
        model,
        cudagraph_mode="NONE",
        num_blocks=32,
        max_model_len=128,
        kv_cache_dtype=kv_cache_dtype,
    )
    assert engine.report.layers[0].backend == "SDPA_EXAMPLE"
    assert engine.kv_cache.tensors["layers.0.attn"].dtype == (
        torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32
    )
    seqs = make_seqs(np.random.default_rng(0), [(0, 9), (20, 1), (7, 5)], 64, 16, 32)
    out = run_with_prefixes(engine, seqs)
    expected = torch.cat([model.expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])
    assert rel_err(out, expected) < tol
