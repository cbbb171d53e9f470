"""benchmarks/l2_prefetch.py: its kernels compile for sm_90 with the instructions each head
is for (CPU, no GPU needed), and on the GPU every head and amount is timed."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_main_needs_cuda, compiled_without_interpreter

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import l2_prefetch  # noqa: E402


def compile_heads_for_hopper() -> dict:
    """Each head kernel mode and the streaming kernel compiled for sm_90 (through ptxas):
    how many prefetches, evict_last prefetches and global loads each PTX holds. Runs in a
    process without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def ptx(kernel, sig, consts):
        compiled = triton.compile(
            ASTSource(kernel, sig, consts),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4},
        )
        return compiled.asm["ptx"]

    def count(text, prefix):  # instructions (maybe predicated), not names in debug lines
        return sum(
            re.sub(r"^@!?%p\d+\s+", "", line.strip()).startswith(prefix)
            for line in text.splitlines()
        )

    def counts(text):
        return {
            "prefetch": count(text, "prefetch.global.L2"),
            "evict_last": count(text, "prefetch.global.L2::evict_last"),
            "loads": count(text, "ld.global"),
        }

    head_sig = {"w_ptr": "*bf16", "out_ptr": "*fp32", "num_lines": "i32"}
    head_sig |= {"LINES": "constexpr", "MODE": "constexpr"}
    out = {
        name: counts(ptx(l2_prefetch._head_kernel, head_sig, {"LINES": 64, "MODE": mode}))
        for name, mode in l2_prefetch._MODE.items()
    }
    stream_sig = {"w_ptr": "*bf16", "out_ptr": "*fp32", "CHUNK": "constexpr", "BLOCK": "constexpr"}
    out["stream"] = counts(
        ptx(l2_prefetch._stream_kernel, stream_sig, {"CHUNK": 65536, "BLOCK": 2048})
    )
    return out


def test_the_heads_compile_for_hopper_with_their_instructions():
    got = compiled_without_interpreter("test_benchmark_l2_prefetch", "compile_heads_for_hopper")
    plain, last = got["prefetch"], got["prefetch_evict_last"]
    assert plain["prefetch"] > 0 and plain["evict_last"] == 0 and plain["loads"] == 0
    assert last["evict_last"] == last["prefetch"] == plain["prefetch"] and last["loads"] == 0
    # four sectors a line: more requests than one a line, each a plain prefetch
    sectors = got["prefetch_sectors"]
    assert sectors["prefetch"] > plain["prefetch"] and sectors["evict_last"] == 0
    assert got["load"]["prefetch"] == 0 and got["load"]["loads"] > 0
    assert got["stream"]["loads"] > 0 and got["stream"]["prefetch"] == 0


def test_without_cuda_it_says_so(capsys):
    assert_main_needs_cuda(l2_prefetch.main, capsys)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_head_and_amount_is_timed(tmp_path):
    out = tmp_path / "l2.json"
    args = ["--weight-mib", "16", "--mib", "4,8", "--flush-mib", "128", "--rounds", "3"]
    assert l2_prefetch.main([*args, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["none_us"] > 0 and data["read_tb_per_s"] > 0
    got = {(r["head"], r["mib"]) for r in data["rows"]}
    assert got == {(h, m) for h in l2_prefetch.HEADS[1:] for m in (4, 8)}
    assert all(r["us"] > 0 and r["ideal_us"] > 0 for r in data["rows"])
