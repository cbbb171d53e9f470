"""The docs hold: the example backend of docs/backends.md serves a model correctly, and every
relative link in the README and docs/ names a file that exists and, with a ``#``, a heading in it."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import torch
from helpers import TableAttentionModel, eager_engine, make_seqs, rel_err, run_with_prefixes

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINKED_DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation other than
    hyphens and underscores dropped, spaces made hyphens; a repeated one gets ``-1``, ``-2``."""
    anchors: set[str] = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"#{1,6} (.*)", line)
        if match:
            base = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            anchor, n = base, 0
            while anchor in anchors:
                n += 1
                anchor = f"{base}-{n}"
            anchors.add(anchor)
    return anchors


def broken_links(path: pathlib.Path) -> list[str]:
    """The relative links in ``path`` whose file or heading does not exist."""
    broken = []
    for target in _LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        name, _, anchor = target.partition("#")
        linked = (path.parent / name).resolve() if name else path
        if not linked.exists():
            broken.append(f"{target} (no file {linked})")
        elif anchor and anchor not in heading_anchors(linked.read_text()):
            broken.append(f"{target} (no heading with that anchor in {linked.name})")
    return broken


def test_heading_anchors_follow_github():
    text = "# Round 8: the SiLU-mul epilogue\n```\n# not a heading\n```\n## Host overhead\n## Host overhead\n"
    assert heading_anchors(text) == {
        "round-8-the-silu-mul-epilogue",
        "host-overhead",
        "host-overhead-1",
    }


@pytest.mark.parametrize("path", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_broken_links_finds_a_missing_file_and_heading(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text(
        "# Title\n[a](#no-such-heading) [b](missing.md) [c](#title) [d](https://x.org/y)\n"
    )
    assert len(broken_links(bad)) == 2


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


def test_the_settings_table_lists_every_variable_the_library_reads():
    """docs/modes.md's "Settings from the environment" names each GRAPHATTN_ variable that
    graphattn, its passes or its capture code read, and no other."""
    text = (DOCS / "modes.md").read_text()
    section = text.split("## Settings from the environment", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(GRAPHATTN_[A-Z_]+)`", section, flags=re.M))
    read = set()
    for folder in ("graphattn", "passes", "capture"):
        for path in (ROOT / folder).rglob("*.py"):
            read.update(re.findall(r"GRAPHATTN_[A-Z_]*[A-Z]", path.read_text()))
    assert "GRAPHATTN_FOLD_O_PROJ" in read and len(read) >= 9
    assert listed == read, (sorted(read - listed), sorted(listed - read))
