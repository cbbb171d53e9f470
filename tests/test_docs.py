"""The code in docs/ runs: the example backend of docs/backends.md serves a model correctly."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import torch
from helpers import TableAttentionModel, eager_engine, make_seqs, rel_err, run_with_prefixes

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def _tested_block(path: pathlib.Path, name: str) -> str:
    text = path.read_text()
    match = re.search(rf"<!-- tested: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"{path.name} has no tested block {name!r}"
    return match.group(1)


def test_example_backend_matches_dense_attention():
    exec(compile(_tested_block(DOCS / "backends.md", "docs-backend"), "backends.md", "exec"), {})
    model = TableAttentionModel(64, 4, 2, 64, seed=4, backend="SDPA_EXAMPLE")
    engine = eager_engine(model, cudagraph_mode="NONE", num_blocks=32, max_model_len=128)
    assert engine.report.layers[0].backend == "SDPA_EXAMPLE"
    seqs = make_seqs(np.random.default_rng(0), [(0, 9), (20, 1), (7, 5)], 64, 16, 32)
    out = run_with_prefixes(engine, seqs)
    expected = torch.cat([model.expected(s.ids, len(s.ids) - s.num_computed) for s in seqs])
    assert rel_err(out, expected) < 1e-5
