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
import itertools
import textwrap
import types

import pytest
import torch
import triton
import triton.language as tl
from helpers import compiled_without_interpreter

from graphattn.envs import triton_interpret
from graphattn.kernels import argmax as argmax_module
from graphattn.kernels import gemv as gemv_module
from graphattn.kernels import pdl
from graphattn.kernels import prefetch as prefetch_module
from graphattn.kernels import prologue_gemv as prologue_module
from graphattn.kernels import split_kv as split_kv_module
from graphattn.kernels import unified_attention as attention_module
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
    PREFETCHED.clear()
    for module in (gemv_module, attention_module):  # the interpreter cannot run the PTX
        monkeypatch.setattr(module, "prefetch_l2", _record_prefetch)
    return monkeypatch


PREFETCHED: list[int] = []  # the addresses the kernels asked L2 for, under the interpreter


def _record_prefetch(ptrs):
    """Stands in for ``prefetch.prefetch_l2`` under the interpreter (a plain function runs
    there): notes the addresses instead of asking for them."""
    PREFETCHED.extend(int(a) for a in ptrs.handle.data.ravel())


@triton.jit
def _nothing():
    pass


def _with_pdl(patch, fn):
    modules = (gemv_module, prologue_module, attention_module, split_kv_module)
    for module in modules:
        patch.setattr(module, "launch_options", lambda device: {"launch_pdl": True})
    try:
        return fn()
    finally:
        for module in modules:
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


@pytest.mark.parametrize("num_splits, window", [(1, None), (3, None), (8, 5)])
def test_decode_attention_pdl_path_computes_what_the_normal_path_does(
    pdl_path_on_the_cpu, num_splits, window
):
    """The decode launch's PDL path (the metadata and slot read before the wait) against the
    normal launch: the same output and cache bits. A new token in the first key tile, in a
    later one, padding requests and empty splits."""
    from test_kernels import decode_with_new_kv, make_case

    shapes = [(0, 1), (15, 1), (40, 1), (70, 1), (7, 1)]
    case = make_case(
        shapes, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=1,
        pad_tokens=2, pad_reqs=2,
    )  # fmt: skip
    plan = case.plan(num_splits)
    run = lambda: decode_with_new_kv(case, plan, scale=0.125, seed=2, window=window)  # noqa: E731
    want = run()
    got = _with_pdl(pdl_path_on_the_cpu, run)
    for (out, caches), (out_want, caches_want) in zip(got, want):
        assert torch.equal(out[: case.num_tokens], out_want[: case.num_tokens])
        assert all(torch.equal(c, w) for c, w in zip(caches, caches_want))


def test_decode_attention_prefetches_the_rows_of_its_first_key_tile(pdl_path_on_the_cpu):
    """The decode PDL path's prefetch addresses, recorded under the interpreter: with one
    split and every sequence within one key tile, exactly the lines of every request's key
    and value rows, plus block 0's rows for the masked lanes; padding requests without
    tokens (their query start is past the slots' end) ask for nothing else."""
    from test_kernels import make_case, new_kv_inputs

    shapes = [(0, 1), (15, 1), (20, 1), (7, 1)]
    case = make_case(
        shapes, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seed=5, pad_reqs=2
    )
    assert case.plan(1).tiles.tile_n > max(c + n for c, n in shapes)  # one tile each
    key, value, slots = new_kv_inputs(case, seed=3)
    out = torch.empty_like(case.query)
    _with_pdl(
        pdl_path_on_the_cpu,
        lambda: attention_module.unified_attention(
            case.query, case.key_cache, case.value_cache, out, case.block_table,
            case.query_start_loc, case.seq_lens, case.plan(1), scale=0.1,
            new_kv=(key, value, slots),
        ),
    )  # fmt: skip
    bs, hkv, d = case.key_cache.shape[1:]
    size = case.key_cache.element_size()
    lines = range(0, d * size, 128)  # fp32 rows of 64: two lines each

    def row_lines(cache, slot, head):
        start = cache.data_ptr() + ((slot * hkv + head) * d) * size
        return {start + line for line in lines}

    want, block0 = set(), set()
    for cache in (case.key_cache, case.value_cache):
        for head in range(hkv):
            for i, (computed, new) in enumerate(shapes):
                for pos in range(computed + new):
                    slot = int(case.block_table[i, pos // bs]) * bs + pos % bs
                    want |= row_lines(cache, slot, head)
            block0 |= {a for s in range(bs) for a in row_lines(cache, s, head)}
    got = set(PREFETCHED)
    assert want <= got <= want | block0


def test_gemv_prefetch_asks_for_the_lines_of_the_prefix(pdl_path_on_the_cpu):
    """The GEMV's prefetch addresses, recorded under the interpreter: each line of the first
    ``prefetch_bytes`` of the tensor (rounded up to a line) once or more, nothing past it."""
    x = torch.randn(1, 256).to(torch.bfloat16)
    w = torch.randn(40, 256).to(torch.bfloat16)
    nxt = torch.randn(96, 256).to(torch.bfloat16)
    config = gemv_module.choose_gemv_config(1, 40, 256, gemv_module.CPU_NUM_SMS)
    programs = -(-40 // config.block_n) * config.split_k
    for nbytes, cap in ((1, None), (3000, None), (96 * 256 * 2, None), (10**9, None), (10**9, 4)):
        if cap:  # each program asks for at most `cap` lines: the prefix is cut there
            pdl_path_on_the_cpu.setattr(gemv_module, "MAX_PREFETCH_LINES", cap)
        PREFETCHED.clear()
        got = _with_pdl(
            pdl_path_on_the_cpu, lambda n=nbytes: gemv(x, w, prefetch=nxt, prefetch_bytes=n)
        )
        assert torch.equal(got, gemv(x, w))
        covered = -(-min(nbytes, nxt.numel() * 2) // 128)
        if cap:
            covered = min(covered, programs * cap)
        assert set(PREFETCHED) == {nxt.data_ptr() + 128 * i for i in range(covered)}, nbytes


# What a kernel may read before its PDL wait (pdl.py): what no kernel of a step writes, since
# with kernels that signal at their start several kernels before it may still run. The GEMVs:
# their weights. A decode attention launch (WRITE_KV): the step's metadata, copied in before
# its first kernel. Prefetch hints (prefetch.prefetch_l2) return no data and are allowed.
GEMV_EARLY = {"w_ptr"}
DECODE_ATTENTION_EARLY = {"query_start_loc_ptr", "seq_lens_ptr", "slot_ptr", "block_table_ptr"}
PURE_BUILTINS = {"range", "min", "max", "int", "float", "len"}
MEMORY_OPS = ("load", "store", "atomic", "inline_asm", "descriptor")  # tl.* names that touch memory


def reads_before_the_wait(kernel, constants: dict, pointers: set[str], source: str | None = None):
    """What a Triton kernel does before its ``gdc_wait()`` on the path that ``constants``
    (constexpr values) take, beyond reading through ``pointers``: a load through any other
    pointer, a store, an atomic, inline assembly or a descriptor (helpers are followed into,
    their parameters standing for the arguments given), a return, or a wait that not every
    program reaches (under a runtime condition, in a loop or a ``with``). An ``if`` that
    ``constants`` decide follows its taken branch, any other both. A name assigned from an
    expression stands for every pointer in it (through both branches of an undecided ``if``);
    a load's address may only involve allowed pointers. ``source`` replaces the kernel's
    own (for the controls)."""
    walk = _EarlyReads(kernel.fn.__globals__, constants, pointers, _params(kernel.fn))
    tree = ast.parse(textwrap.dedent(source or inspect.getsource(kernel.fn)))
    if not walk.block(tree.body[0].body, certain=True):
        raise AssertionError("the kernel never reaches gdc_wait() on this path")
    return list(walk.found)


def _params(fn) -> list[str]:
    return [a.arg for a in ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].args.args]


class _EarlyReads:
    def __init__(self, namespace, constants, pointers, params, depth: int = 0):
        self.namespace, self.constants, self.pointers = namespace, constants, pointers
        # every name that may hold a pointer -> the parameters it may come from
        self.aliases: dict[str, set[str]] = {p: {p} for p in params if p.endswith("_ptr")}
        self.aliases |= {p: {p} for p in pointers}
        self.found = _Findings()
        self.depth = depth

    def block(self, stmts, certain: bool) -> bool:
        """Walk ``stmts``; True once a wait every program reaches is found."""
        for stmt in stmts:
            if isinstance(stmt, ast.If):
                taken = _decide(stmt.test, self.constants)
                if taken is not None:
                    if self.block(stmt.body if taken else stmt.orelse, certain):
                        return True
                    continue
                self.calls(stmt.test, certain)
                before = {k: set(v) for k, v in self.aliases.items()}
                self.block(stmt.body, certain=False)
                after_body, self.aliases = self.aliases, before
                self.block(stmt.orelse, certain=False)
                for name, roots in after_body.items():  # either branch may have run
                    self.aliases[name] = self.aliases.get(name, set()) | roots
                continue
            if isinstance(stmt, (ast.For, ast.While)):
                self.calls(stmt.iter if isinstance(stmt, ast.For) else stmt.test, certain)
                self.block(stmt.body, certain=False)  # may run no trip
                self.block(stmt.body, certain=False)  # a second trip sees the first's names
                continue
            if isinstance(stmt, (ast.With, ast.Try)):
                self.block(stmt.body, certain=False)
                continue
            if isinstance(stmt, ast.Return):
                if self.depth == 0:
                    self.found.append("return before the wait")
                if stmt.value is not None:
                    self.calls(stmt.value, certain)
                continue
            self.assign(stmt)
            if self.calls(stmt, certain):
                return True
        return False

    def assign(self, stmt) -> None:
        """Names bound by ``stmt`` stand for every pointer its value involves."""
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            return
        roots = self.roots(value)
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        for name in names:
            kept = self.aliases.get(name, set()) if isinstance(stmt, ast.AugAssign) else set()
            if roots or kept:
                self.aliases[name] = roots | kept
            else:
                self.aliases.pop(name, None)

    def calls(self, node, certain: bool) -> bool:
        """Check the calls in ``node`` in source order; True at a wait every program reaches."""
        calls = sorted(
            (n for n in ast.walk(node) if isinstance(n, ast.Call)),
            key=lambda n: (n.lineno, n.col_offset),
        )
        for call in calls:
            name = ast.unparse(call.func)
            target = self.resolve(call.func)
            if name.endswith("gdc_wait"):
                if certain:
                    return True
                self.found.append("gdc_wait() that not every program reaches")
            elif target is prefetch_module.prefetch_l2:
                continue  # a hint: no data comes back
            elif name in ("tl.load", "tl.core.load"):
                pointer = call.args[0] if call.args else _keyword(call, "pointer")
                roots = self.roots(pointer)
                if not roots or not roots <= self.pointers:
                    self.found.append(ast.unparse(call))
            elif name.startswith("tl.") and any(op in name.rsplit(".", 1)[-1] for op in MEMORY_OPS):
                self.found.append(ast.unparse(call))
            elif getattr(target, "fn", None) is not None:
                self.helper(call, name, target.fn)
            elif isinstance(call.func, ast.Name) and name not in PURE_BUILTINS:
                self.found.append(ast.unparse(call))  # not a Triton helper we can read
            elif (
                isinstance(call.func, ast.Attribute)
                and not name.startswith("tl.")
                and any(call.func.attr.startswith(op) for op in MEMORY_OPS)
            ):
                self.found.append(ast.unparse(call))  # a descriptor's or block's load
        return False

    def resolve(self, func):
        """The object a called name or ``module.name`` refers to in the kernel's module."""
        if isinstance(func, ast.Name):
            return self.namespace.get(func.id)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = self.namespace.get(func.value.id)
            if isinstance(base, types.ModuleType):
                return getattr(base, func.attr, None)
        return None

    def helper(self, call: ast.Call, name: str, fn) -> None:
        """Follow a helper with its parameters bound to what the call passes."""
        if self.depth > 4:
            self.found.append(ast.unparse(call))
            return
        params = _params(fn)
        bound = list(zip(params, call.args)) + [(k.arg, k.value) for k in call.keywords]
        allowed = {p for p, arg in bound if (r := self.roots(arg)) and r <= self.pointers}
        inner = _EarlyReads(fn.__globals__, self.constants, allowed, params, self.depth + 1)
        for p, arg in bound:  # a parameter given a pointer stands for it, allowed or not
            if self.roots(arg):
                inner.aliases[p] = {p}
        inner.block(ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body, certain=False)
        self.found += [f"{name}: {f}" for f in inner.found]

    def roots(self, expr) -> set[str]:
        """Every parameter pointer ``expr`` may involve."""
        if expr is None:
            return set()
        names = [n.id for n in ast.walk(expr) if isinstance(n, ast.Name)]
        return set().union(*(self.aliases.get(n, set()) for n in names))


class _Findings(list):
    """Findings in the order met, each once (loops are walked twice)."""

    def append(self, item: str) -> None:
        if item not in self:
            super().append(item)

    def __iadd__(self, items):
        for item in items:
            self.append(item)
        return self


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _decide(test: ast.expr, constants: dict) -> bool | None:
    """The value of an ``if`` test made of constexpr names (and literals) only, else None."""
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    if not names <= constants.keys():
        return None
    return bool(eval(compile(ast.Expression(test), "<test>", "eval"), {}, dict(constants)))


def _pdl_kernels() -> set[str]:
    """Every Triton kernel in graphattn.kernels that takes a PDL constexpr (one launched with
    programmatic dependent launch where it is on)."""
    import importlib
    import pkgutil

    import graphattn.kernels as package

    found = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"graphattn.kernels.{info.name}")
        for value in vars(module).values():
            fn = getattr(value, "fn", None)
            if fn is not None and fn.__module__ == module.__name__ and "PDL" in _params(fn):
                found.add(f"{info.name}.{fn.__name__}")
    return found


def test_pdl_kernels_read_before_the_wait_only_what_no_earlier_kernel_writes():
    """Every kernel launched with PDL, on each of its paths: the GEMVs read their first weight
    tile before the wait, decode attention its metadata, the reduction with o_proj folded in
    its weight tile, the batch's end and (at one token) its sequence length; a mixed batch's
    attention, the split-KV reduction
    and the argmax's two passes read nothing before it; hints are allowed everywhere."""
    attention = attention_module._attention_kernel
    cases = [
        (gemv_module._gemv_kernel, {"PDL": True}, GEMV_EARLY),
        (prologue_module._prologue_gemv_kernel, {"PDL": True}, GEMV_EARLY),
        (attention, {"PDL": True, "WRITE_KV": True}, DECODE_ATTENTION_EARLY),
        (attention, {"PDL": True, "WRITE_KV": False}, set()),
        (split_kv_module._reduce_kernel, {"PDL": True}, set()),
        # the folded o_proj: its weight tile, the batch's end and, at one token, its sequence
        # length (metadata)
        (
            split_kv_module._reduce_o_proj_kernel,
            {"PDL": True, "ONE_TOKEN": True},
            {"w_ptr", "query_start_loc_ptr", "seq_lens_ptr"},
        ),
        (
            split_kv_module._reduce_o_proj_kernel,
            {"PDL": True, "ONE_TOKEN": False},
            {"w_ptr", "query_start_loc_ptr"},
        ),
        (argmax_module._chunk_argmax_kernel, {"PDL": True}, set()),
        (argmax_module._row_argmax_kernel, {"PDL": True}, set()),
    ]
    checked = set()
    for kernel, constants, early in cases:
        assert reads_before_the_wait(kernel, constants, early) == [], (kernel, constants)
        checked.add(f"{kernel.fn.__module__.rsplit('.', 1)[1]}.{kernel.fn.__name__}")
    assert checked == _pdl_kernels()  # a new PDL kernel needs its case here


def test_the_pdl_check_finds_early_reads():
    """The controls: loads, stores, returns, helpers and conditional waits moved before a
    wait are found."""
    prologue = prologue_module._prologue_gemv_kernel
    moved = inspect.getsource(prologue.fn).replace(
        "        tl.extra.cuda.gdc_wait()\n",
        "        cos = tl.load(cos_ptr + pairs % HALF)\n        tl.extra.cuda.gdc_wait()\n",
        1,
    )
    assert reads_before_the_wait(prologue, {"PDL": True}, GEMV_EARLY, moved) == [
        "tl.load(cos_ptr + pairs % HALF)"
    ]
    kernel = gemv_module._gemv_kernel
    gemv_source = inspect.getsource(kernel.fn)
    first_tile = "        w = tl.load(w_ptrs, mask=k_ok, other=0.0)\n        if PF_PAD > 0:"
    assert gemv_source.count(first_tile) == 1
    for lines, want in [
        # a pointer chosen under a runtime condition: either may be loaded through
        (["if M > 1:", "    w_ptrs = x_ptrs"], "tl.load(w_ptrs, mask=k_ok, other=0.0)"),
        (["w_ptrs = tl.where(M > 0, x_ptrs, w_ptrs)"], "tl.load(w_ptrs, mask=k_ok, other=0.0)"),
        (["w_ptrs, k_ok = (x_ptrs, k_ok)"], "tl.load(w_ptrs, mask=k_ok, other=0.0)"),
        (["w_ptrs += x_ptrs - w_ptrs"], "tl.load(w_ptrs, mask=k_ok, other=0.0)"),
        (["a = tl.load(w_ptr + (x_ptr - w_ptr))"], "tl.load(w_ptr + (x_ptr - w_ptr))"),
        (["d = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [1, 16])"],
         "tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [1, 16])"),
        (["v = d.load([0, 0])"], "d.load([0, 0])"),
    ]:  # fmt: skip
        moved = gemv_source.replace(
            first_tile, "".join(f"        {x}\n" for x in lines) + first_tile
        )
        assert want in reads_before_the_wait(kernel, {"PDL": True}, GEMV_EARLY, moved), lines
    attention = attention_module._attention_kernel
    source = inspect.getsource(attention.fn)
    wait = "        if PDL:  # q and the new key and value come from the kernel before\n"
    assert source.count(wait) == 1
    decode = {"PDL": True, "WRITE_KV": True}
    for line, want in [
        ("q0 = tl.load(q_ptr + q_start)", "tl.load(q_ptr + q_start)"),
        ("q0 = tl.load(pointer=q_ptr)", "tl.load(pointer=q_ptr)"),
        ("k0 = tl.load(new_k_ptr + q_start)", "tl.load(new_k_ptr + q_start)"),
        ("tl.store(k_cache_ptr + slot, q_start)", "tl.store(k_cache_ptr + slot, q_start)"),
        ("slot_ptr = q_ptr", "tl.load(slot_ptr + tl.where(has_tile, q_start, 0))"),
        ("r = _find_request(q_ptr, num_reqs, tile_id, BLOCK_Q)",
         "_find_request: tl.load(query_start_loc_ptr + mid)"),
        ("k0 = tl.load(k_cache_ptr + bt_row)", "tl.load(k_cache_ptr + bt_row)"),
        ("if first >= q_len:\n            return", "return before the wait"),
        # a helper called through its module is followed: its store is found
        ("split_kv.store_partial(part_out_ptr, part_lse_ptr, q, q, token, head, row_ok, "
         "row_ok, dims, 0, 1, 1, HEAD_SIZE)",
         "split_kv.store_partial: tl.store(part_lse_ptr + row, lse, mask=row_ok)"),
    ]:  # fmt: skip
        if line.startswith("slot_ptr"):  # a rebinding before the slot's load
            moved = source.replace(
                "    if WRITE_KV:  # decodes:", f"    {line}\n    if WRITE_KV:  # decodes:", 1
            )
        else:
            moved = source.replace(wait, f"        {line}\n{wait}")
        assert want in reads_before_the_wait(attention, decode, DECODE_ATTENTION_EARLY, moved)
    # a wait under a runtime condition: programs without a tile would not wait
    conditional = source.replace(wait, "        if has_tile:\n", 1)
    with pytest.raises(AssertionError, match="never reaches"):
        reads_before_the_wait(attention, decode, DECODE_ATTENTION_EARLY, conditional)
    # the mixed batch's wait moved after the request search: the search is found
    mixed_wait = (
        "    if PDL and not WRITE_KV:  # a mixed batch: the cache may come from the write "
        "kernel before\n        tl.extra.cuda.gdc_wait()\n"
    )
    search = (
        "    req, q_start, q_len, first, seq_len = query_tile(\n"
        "        query_start_loc_ptr, seq_lens_ptr, num_reqs, tile_id, BLOCK_Q\n"
        "    )\n"
    )
    assert source.count(mixed_wait) == 1 and source.count(search) == 1
    late = source.replace(mixed_wait, "").replace(search, search + mixed_wait)
    found = reads_before_the_wait(attention, {"PDL": True, "WRITE_KV": False}, set(), late)
    assert found == [  # the search and the tile's metadata, through both helpers
        "query_tile: _find_request: tl.load(query_start_loc_ptr + mid)",
        "query_tile: tl.load(query_start_loc_ptr + req)",
        "query_tile: tl.load(query_start_loc_ptr + req + 1)",
        "query_tile: tl.load(seq_lens_ptr + req)",
    ]


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
            dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=512, EVEN_K=False, DOT=False, PF_PAD=0),
        ),
        "gemv, one row, L2 prefetch of the next weight": (
            gemv._gemv_kernel,
            dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=512, EVEN_K=False, DOT=False, PF_PAD=8),
        ),
    }
    results = []
    for label, (kernel, constants) in launches.items():
        for n in (None, 1):
            consts = {**constants, "STAGES": 3, "PDL": True}
            if kernel is gemv._gemv_kernel:
                consts |= {"DOT_PRECISION": "tf32", "DOT_FP32": False, "PF_LINE": 64}
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
            wait = ptx.find("griddepcontrol.wait")
            prefetch = ptx.find("prefetch.global.L2")
            results.append(
                dict(
                    case=f"{label}, N={n or 'arg'}",
                    wait=wait >= 0,
                    signal="griddepcontrol.launch_dependents" in ptx,
                    prefetch=None if prefetch < 0 else prefetch < wait,  # True: before the wait
                    wants_prefetch=consts.get("PF_PAD", 0) > 0,
                )
            )
    return results


def test_gemv_kernels_compile_for_hopper_with_pdl():
    """CI has no GPU: the PDL variants compile for sm_90 and carry both instructions."""
    results = compiled_without_interpreter("test_pdl", "compile_gemvs_for_hopper")
    assert len(results) == 10
    for r in results:
        assert r["wait"] and r["signal"], r
        assert r["prefetch"] is (True if r["wants_prefetch"] else None), r


def compile_argmax_for_hopper() -> list[dict]:
    """Compile the argmax's two passes as launched with PDL on an sm_90 GPU, without one.
    Runs in a process without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from graphattn.kernels import argmax

    launches = {
        "chunk pass": (argmax._chunk_argmax_kernel, dict(BLOCK=2048, PDL=True), "*bf16"),
        "row pass": (argmax._row_argmax_kernel, dict(BLOCK_C=64, PDL=True), None),
    }
    pointers = {"val_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i8", "out_ptr": "*i64"}
    results = []
    for label, (kernel, consts, x_type) in launches.items():
        sig = {}
        for name in kernel.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name == "x_ptr":
                sig[name] = x_type
            else:
                sig[name] = pointers.get(name, "i32")
        ptx = triton.compile(
            ASTSource(kernel, sig, consts),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4},
        ).asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        signal = ptx.find("griddepcontrol.launch_dependents")
        first_load = ptx.find("ld.global")
        results.append(
            dict(case=label, wait=wait, signal=signal, first_load=first_load, loads=first_load >= 0)
        )
    return results


def test_argmax_passes_compile_for_hopper_with_pdl():
    """Each pass signals, then waits, and loads nothing from global memory before the wait."""
    results = compiled_without_interpreter("test_pdl", "compile_argmax_for_hopper")
    assert [r["case"] for r in results] == ["chunk pass", "row pass"]
    for r in results:
        assert 0 <= r["signal"] < r["wait"], r
        assert r["loads"] and r["first_load"] > r["wait"], r


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


@pytest.mark.gpu
@pytest.mark.parametrize("fused_merge", [False, True])
@pytest.mark.parametrize("batch", [1, 8])
def test_pdl_decode_attention_after_a_gemv_in_a_cuda_graph(fresh_pdl, batch, fused_merge):
    """Two layers of qkv GEMV -> decode attention (the new key and value written inside the
    launch; split-KV) -> o GEMV, in one CUDA graph of PDL launches, Llama-3.2-1B's heads.
    The attention reads its metadata and slots (and prefetches its first key tile) before its wait, q and the
    new key and value, the GEMV's output just before it, after: every replay, from fresh
    inputs and with the GEMV and attention outputs set to NaN, must give the bits of the
    same chain launched normally outside a graph, and so must the caches. ``fused_merge``:
    the splits merged by attention's last split program instead of the reduction kernel
    (its merge order is fixed, so the bits must match too)."""
    from graphattn.kernels.attention_plan import choose_num_splits, plan_attention
    from graphattn.kernels.split_kv import SplitScratch
    from graphattn.kernels.unified_attention import unified_attention

    device = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(device)[0] < pdl.MIN_CAPABILITY:
        pytest.skip("PDL needs compute capability 9.0")
    gen = torch.Generator(device=device).manual_seed(batch)
    hq, hkv, d, bs, layers = 32, 8, 64, 16, 2
    hidden = hq * d

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).bfloat16()

    weights = [
        (randn(hidden + 2 * hkv * d, hidden) / 45, randn(hidden, hidden) / 45)
        for _ in range(layers)
    ]
    ctx = torch.randint(100, 600, (batch,), generator=gen, device=device)
    need = (ctx // bs + 1).tolist()
    num_blocks = sum(need) + 4
    caches = [(randn(num_blocks, bs, hkv, d), randn(num_blocks, bs, hkv, d)) for _ in range(layers)]
    ids = torch.randperm(num_blocks, generator=gen, device=device).int()
    table = torch.zeros(batch, max(need), dtype=torch.int32, device=device)
    for i, (n, start) in enumerate(zip(need, [0, *itertools.accumulate(need)])):
        table[i, :n] = ids[start : start + n]
    slots = (table.gather(1, (ctx // bs)[:, None].int()).squeeze(1).long() * bs + ctx % bs).long()
    seq_lens = (ctx + 1).int()
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    plan = plan_attention(
        batch, batch, num_heads=hq, num_kv_heads=hkv, head_size=d, dtype=torch.bfloat16,
        device_type="cuda", num_splits=choose_num_splits(batch, hkv, num_sms), uniform_decode=True,
    )  # fmt: skip
    assert plan.num_splits > 1
    scratch = SplitScratch.allocate(batch, hkv, d, device)

    def chain(x):
        outs = []
        for (w_qkv, w_o), (k_cache, v_cache) in zip(weights, caches):
            qkv = gemv(x, w_qkv)  # [B, (Hq + 2 Hkv) D]
            outs.append(qkv)
            q = qkv[:, :hidden].view(batch, hq, d)
            k = qkv[:, hidden : hidden + hkv * d].view(batch, hkv, d)
            v = qkv[:, hidden + hkv * d :].view(batch, hkv, d)
            out = torch.empty_like(q)
            unified_attention(
                q, k_cache, v_cache, out, table, starts, seq_lens, plan, scale=d**-0.5,
                scratch=scratch, new_kv=(k, v, slots), fused_merge=fused_merge,
            )  # fmt: skip
            outs.append(out)
            x = gemv(out.view(batch, hidden), w_o)
        return [*outs, x]

    x = randn(batch, hidden)
    fresh_pdl.setenv("GRAPHATTN_PDL", "1")
    assert pdl.use_pdl(device)
    chain(x)  # compile outside the graph
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(x)
    replays = []
    for _ in range(4):
        x.copy_(randn(batch, hidden))
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        replays.append((x.clone(), [t.clone() for t in captured]))
    torch.cuda.synchronize(device)
    after_graph = [(k.clone(), v.clone()) for k, v in caches]
    pdl.use_pdl.cache_clear()
    fresh_pdl.setenv("GRAPHATTN_PDL", "0")
    assert not pdl.use_pdl(device)
    for x_in, got in replays:
        want = chain(x_in)
        assert not any(t.isnan().any() for t in got)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    for (k, v), (k_graph, v_graph) in zip(caches, after_graph):
        assert torch.equal(k, k_graph) and torch.equal(v, v_graph)
