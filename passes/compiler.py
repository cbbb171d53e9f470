"""The entry point the engine calls: trace the model once, split it, compile the pieces.

``compile_model`` runs the phases in order: trace (backend.py) -> split (split.py) ->
build every compiled piece (piecewise.py: Inductor through the compile cache, identical
pieces once) -> one run through the compiled pieces -> a specialised build per
``compile_sizes`` entry -> the piece wrapper. The run and the specialisations go once dry
first, graphattn's Triton kernels compiling on a pool (``_dry_run``). When the trace cache (trace_cache.py) holds
this model's trace and the compile cache every build, the first two phases are skipped:
the split graph comes from the entry and no Dynamo trace runs. The engine relies on the
names in this file.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from graphattn import envs
from graphattn._logging import logger
from graphattn.attention.forward_context import (
    get_forward_context,
    is_forward_context_set,
    set_forward_context,
)
from graphattn.errors import ConfigError, InvalidInputError, RecompileError
from graphattn.kernels.precompile import WARM_SKIP, PrecompileReport, compile_ahead
from graphattn.passes.backend import Trace, describe_inputs, trace_model
from graphattn.passes.cache import CompileCache, base_factors, cache_factors
from graphattn.passes.debug import DebugDump
from graphattn.passes.inductor import compile_count
from graphattn.passes.pass_manager import DEFAULT_PASSES, PostGradPassManager, make_pass_manager
from graphattn.passes.piecewise import CompiledPiece, NotCached, PieceCompiler, PiecewiseRuntime
from graphattn.passes.split import SplitGraph, resolve_splitting_ops, split_graph
from graphattn.passes.trace_cache import (
    TraceCache,
    config_description,
    make_entry,
    restore,
    same_graph,
    trace_key,
    trace_sources,
)

COMPILE_BACKENDS = ("inductor", "eager")


@dataclass(frozen=True)
class PieceInfo:
    """What a piece wrapper is told about the compiled piece it wraps."""

    index: int  # position among all pieces of the split graph (splitting pieces included)
    num_pieces: int  # all pieces of the split graph
    is_first: bool  # the first compiled (non-splitting) piece
    is_last: bool  # the last compiled (non-splitting) piece


# Wraps each compiled non-splitting piece (the capture layer passes its PIECEWISE CUDA-graph
# wrapper here); it must return a callable with the same signature as the piece.
PieceWrapper = Callable[[Callable[..., Any], PieceInfo], Callable[..., Any]]


@dataclass(frozen=True)
class CompileOptions:
    """The compiler's share of the engine config."""

    splitting_ops: tuple[str, ...] | None = None  # None: the graphattn attention ops
    compile_backend: str = "inductor"  # "inductor" or "eager" (split, no Inductor)
    compile_sizes: tuple[int, ...] = ()
    cache_dir: str | None = None  # None: envs.cache_root()
    debug_dump_path: str | None = None
    strict: bool = False  # a recompile after start-up raises RecompileError
    cache_factors: dict[str, Any] = field(default_factory=dict)  # engine config entering the key
    passes: tuple[str, ...] = DEFAULT_PASSES  # post-grad passes Inductor runs on each piece
    trace_cache: bool = True  # save the trace with the pieces; a warm start skips Dynamo
    verify_trace_cache: bool = False  # trace anyway and compare with the saved trace
    inductor_pdl: bool = False  # Inductor's Triton kernels launch with PDL (the engine decides)
    fold_o_proj: bool = False  # o_proj into the attention op before the split (o_proj_fold.py)


@dataclass
class CompileInfo:
    """What the report shows about compilation."""

    num_pieces: int = 0
    num_compiled_pieces: int = 0
    seconds: float = 0.0
    warm: bool = False  # every piece came from the cache
    cache_hits: int = 0
    cache_misses: int = 0
    cache_dir: str = ""
    cache_key: str = ""
    inductor_compiles: int = 0
    num_distinct_graphs: int = 0  # compiled pieces with different graphs (each built once)
    compile_sizes: list[int] = field(default_factory=list)  # sizes with specialised builds
    trace_seconds: float = 0.0
    trace_source: str = "dynamo"  # "dynamo", or "trace cache" (no Dynamo trace ran)
    trace_cache: str = ""  # what the trace cache did: loaded, saved, or why neither
    backend: str = ""
    passes: list[str] = field(default_factory=list)
    debug_dump_dir: str = ""
    # graphattn's Triton kernels compiled on a pool before the start-up runs (_dry_run)
    kernel_precompile: dict[str, Any] = field(default_factory=dict)
    # the model's tensors no GEMV may take for a weight (a kernel of the step may write
    # them), by the traced graph's input name, and why; their linears stay on cuBLAS
    not_weights: dict[str, str] = field(default_factory=dict)
    # attention layers whose o_proj runs inside the attention op (passes/o_proj_fold.py)
    o_proj_folded: int = 0


class CompiledForward:
    """``forward(input_ids, positions)`` of the model, traced once and compiled piecewise.

    Each call checks the step's inputs against what the trace assumed (1-D, its dtypes and
    device, one length) and runs the split graph. Inputs the trace does not cover need a
    new trace: a ``RecompileError`` when strict, else a new trace counted in
    ``num_recompiles`` and kept for later calls like it.
    """

    def __init__(
        self,
        runtime: PiecewiseRuntime,
        info: CompileInfo,
        retrace: Callable[[torch.Tensor, torch.Tensor], tuple[PiecewiseRuntime, torch.Tensor]],
        strict: bool,
    ) -> None:
        self.info = info
        self.num_recompiles = 0
        self.runtime = runtime
        self._accepts = runtime.signature.accepts
        self._retrace = retrace
        self._strict = strict
        self._others: list[PiecewiseRuntime] = []

    @property
    def pieces(self) -> list[CompiledPiece]:
        """The compiled pieces in order (each has its dynamic and specialised builds)."""
        return self.runtime.pieces

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        try:
            accepted = self._accepts(input_ids, positions)
        except AttributeError:  # not tensors: _other_inputs says so
            accepted = False
        if accepted:
            return self.runtime(input_ids, positions)
        return self._other_inputs(input_ids, positions)

    def _other_inputs(self, input_ids: Any, positions: Any) -> torch.Tensor:
        expected = self.runtime.signature.describe()
        if not isinstance(input_ids, torch.Tensor) or not isinstance(positions, torch.Tensor):
            raise InvalidInputError(
                f"expected {expected}, got {describe_inputs(input_ids, positions)}"
            )
        for runtime in self._others:
            if runtime.signature.accepts(input_ids, positions):
                return runtime(input_ids, positions)
        got = describe_inputs(input_ids, positions)
        if self._strict:
            raise RecompileError(
                f"the model was compiled for {expected}; this call passed {got}, which needs a "
                "new trace after start-up (strict mode)"
            )
        self.num_recompiles += 1
        logger.warning("graphattn: tracing the model again for %s (traced for %s)", got, expected)
        runtime, output = self._retrace(input_ids, positions)
        self._others.append(runtime)
        return output


def compile_model(
    model: torch.nn.Module,
    options: CompileOptions,
    example_inputs: tuple[torch.Tensor, torch.Tensor],
    *,
    piece_wrapper: PieceWrapper | None = None,
) -> CompiledForward:
    """Trace ``model.forward`` once (token dimension dynamic, guards dropped), split it at the
    splitting ops and compile each other piece. Must be called under a forward context
    (the engine runs it as its profile run).
    """
    start, compiles_before = time.perf_counter(), compile_count()
    ops, passes = _check_options(options)
    dump = DebugDump(options.debug_dump_path) if options.debug_dump_path else None
    input_ids, positions = _trace_inputs(example_inputs)
    base = _base_factors(options, passes, input_ids.shape[0])
    traces, key, note = _open_trace_cache(options, model, base, input_ids, positions)
    built = None
    if traces is not None:
        built, note = _from_trace_cache(
            traces, key, model, options, ops, passes, input_ids, positions
        )
    trace = sources = None
    if built is None or options.verify_trace_cache:
        trace = trace_model(model, input_ids, positions, dump.bytecode_hook if dump else None)
        logger.info("graphattn compile: traced %s in %.2f s", type(model).__name__, trace.seconds)
        if traces is not None:  # files and globals as traced, before a long compile
            sources = trace_sources(trace, model)
        split = _split(trace.graph_module, ops, dump, trace.binding.template, options.fold_o_proj)
        if built is not None:
            built, note = _verified(built, split, note)
    if built is None:
        cache = _open_cache(options, cache_factors(base, model, trace.graph_module))
        compiler = PieceCompiler(
            options.compile_backend, passes, cache, dump, inductor_pdl=options.inductor_pdl
        )
        runtime = PiecewiseRuntime(trace.binding, trace.signature, split, compiler)
        sizes = _specialisable(options, input_ids)
        precompiled = _dry_run(runtime, compiler, sizes, input_ids, positions)
        runtime(input_ids, positions)  # once through the compiled pieces, at start-up
        _specialise(runtime, compiler, sizes, input_ids, positions)
        if traces is not None:
            note = _save_trace(traces, key, note, trace, sources, split, compiler, cache, model)
        built = _Built(runtime, compiler, cache, sizes, precompiled)
    runtime, compiler = built.runtime, built.compiler
    _wrap_pieces(runtime, piece_wrapper)
    info = _info(options, runtime.split, compiler, built.cache, passes, dump, built.sizes)
    info.kernel_precompile = built.precompiled.as_dict()
    info.trace_seconds = trace.seconds if trace is not None else 0.0
    info.trace_source = "dynamo" if built.from_dynamo else "trace cache"
    info.trace_cache = note
    info.seconds = time.perf_counter() - start
    info.inductor_compiles = compile_count() - compiles_before
    _log_compiled(info)
    retrace = _retracer(model, ops, compiler, piece_wrapper, options.fold_o_proj)
    return CompiledForward(runtime, info, retrace, options.strict)


@dataclass
class _Built:
    """A runtime with every piece built and specialised, and what built it."""

    runtime: PiecewiseRuntime
    compiler: PieceCompiler
    cache: CompileCache | None
    sizes: list[int]
    precompiled: PrecompileReport = field(
        default_factory=lambda: PrecompileReport(f"skipped: {WARM_SKIP}")
    )
    from_dynamo: bool = True


# -- phases -------------------------------------------------------------------------------


def _retracer(
    model: torch.nn.Module,
    ops: frozenset[str],
    compiler: PieceCompiler,
    piece_wrapper: PieceWrapper | None,
    fold_o_proj: bool = False,
) -> Callable[[torch.Tensor, torch.Tensor], tuple[PiecewiseRuntime, torch.Tensor]]:
    """What a recompile does: trace again for the new inputs (a profile run, like start-up),
    build the pieces (from the same cache; no compile_sizes), then run the step for real.
    """

    def retrace(ids: torch.Tensor, pos: torch.Tensor) -> tuple[PiecewiseRuntime, torch.Tensor]:
        with _profile_context():  # attention reads and writes nothing
            again = trace_model(model, *_at_least_two_tokens(ids, pos))
        split = split_graph(
            again.graph_module, ops, again.binding.template, fold_o_proj=fold_o_proj
        )
        rebuilt = PiecewiseRuntime(again.binding, again.signature, split, compiler)
        _wrap_pieces(rebuilt, piece_wrapper)
        return rebuilt, rebuilt(ids, pos)

    return retrace


def _check_options(options: CompileOptions) -> tuple[frozenset[str], PostGradPassManager]:
    if options.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError(
            f"compile_backend must be one of {COMPILE_BACKENDS} for the piecewise compiler, "
            f"got {options.compile_backend!r}"
        )
    return resolve_splitting_ops(options.splitting_ops), make_pass_manager(options.passes)


def _trace_inputs(example_inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The example ``(input_ids, positions)``, checked; at least 2 tokens long, because
    Dynamo specialises a dynamic dimension of size 0 or 1.
    """
    ok = (
        isinstance(example_inputs, (tuple, list))
        and len(example_inputs) == 2
        and all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in example_inputs)
        and example_inputs[0].shape == example_inputs[1].shape
    )
    if not ok:
        got = (
            describe_inputs(*example_inputs)
            if isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 2
            else type(example_inputs).__name__
        )
        raise InvalidInputError(f"example_inputs must be (input_ids [T], positions [T]), got {got}")
    return _at_least_two_tokens(*example_inputs)


def _at_least_two_tokens(
    input_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trace inputs: these, or zeros of 2 tokens when shorter (Dynamo would bake in 0 or 1)."""
    if min(input_ids.shape[0], positions.shape[0]) < 2:
        return input_ids.new_zeros(2), positions.new_zeros(2)
    return input_ids, positions


@contextlib.contextmanager
def _profile_context() -> Iterator[None]:
    """The running step's forward context without metadata (attention zeroes its output
    and writes no cache), or nothing when no context is set.
    """
    if not is_forward_context_set():
        yield
        return
    with set_forward_context(None, layers=get_forward_context().layers):
        yield


def _split(
    gm: torch.fx.GraphModule,
    ops: frozenset[str],
    dump: DebugDump | None,
    input_values: list[object],
    fold_o_proj: bool = False,
) -> SplitGraph:
    if dump is not None:
        dump.write("graph_before_split.py", gm.print_readable(print_output=False))
    split = split_graph(gm, ops, input_values, fold_o_proj=fold_o_proj)
    if dump is not None:
        dump.write("graph_after_split.py", _describe_split(split))
    compiled = len(split.compiled_pieces)
    logger.info(
        "graphattn compile: split at %s into %d pieces (%d compiled, %d splitting)",
        sorted(ops),
        len(split.pieces),
        compiled,
        len(split.pieces) - compiled,
    )
    return split


def _base_factors(
    options: CompileOptions, passes: PostGradPassManager, trace_tokens: int
) -> dict[str, Any]:
    settings = {
        "splitting_ops": sorted(resolve_splitting_ops(options.splitting_ops)),
        "backend": options.compile_backend,
        "passes": passes.names,
        # Inductor tunes the dynamic build for the traced size (its size hint)
        "trace_tokens": trace_tokens,
        # a patch of Inductor's config per build: not in the config described below
        "inductor_pdl": options.inductor_pdl,
        "fold_o_proj": options.fold_o_proj,  # changes the traced graph before its split
    }
    factors = base_factors(options.cache_factors, passes.uuid(), settings)
    matmul = torch.backends.cuda.matmul
    return factors | {
        # Inductor's config shapes every build (a user's max_autotune, precision flags...)
        "inductor_config": config_description("torch._inductor.config"),
        # and the matmul precision its GEMM templates bake in
        "matmul_precision": [
            torch.get_float32_matmul_precision(),
            matmul.allow_tf32,
            matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction,
            torch.backends.cudnn.allow_tf32,
        ],
    }


def _cache_root(options: CompileOptions) -> str:
    """The folder both caches live under."""
    return options.cache_dir or envs.cache_root()


def _open_cache(options: CompileOptions, factors: dict[str, Any]) -> CompileCache | None:
    if options.compile_backend == "eager":  # nothing compiled, nothing to cache
        return None
    root = _cache_root(options)
    try:
        return CompileCache(root, factors)
    except OSError as e:
        logger.warning(
            "graphattn compile: no compile cache in %s (%s); compiling every piece", root, e
        )
        return None


def _open_trace_cache(
    options: CompileOptions,
    model: torch.nn.Module,
    base: dict[str, Any],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[TraceCache | None, str, str]:
    """The trace cache and this model's key in it, or None and why it is off."""
    if not options.trace_cache:
        return None, "", "off (trace_cache=False)"
    if options.compile_backend != "inductor":
        return None, "", "off (it serves the inductor backend)"
    if options.debug_dump_path:
        return None, "", "off (debug_dump_path is set: the dump needs a trace)"
    root = _cache_root(options)
    try:
        traces = TraceCache(root)
    except OSError as e:
        return None, "", f"off (no folder in {root}: {e})"
    factors = base | {"compile_sizes": sorted(set(options.compile_sizes))}
    try:
        key, why = trace_key(factors, model, input_ids, positions)
    except Exception as e:  # describing the model failed: no cache, never no engine
        key, why = "", f"describing the model failed: {type(e).__name__}: {e}"
    if not key:
        logger.info("graphattn compile: trace cache off: %s", why)
        return None, "", f"off ({why})"
    return traces, key, ""


def _from_trace_cache(
    traces: TraceCache,
    key: str,
    model: torch.nn.Module,
    options: CompileOptions,
    ops: frozenset[str],
    passes: PostGradPassManager,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[_Built | None, str]:
    """The runtime rebuilt from the saved trace with every build from the compile cache,
    or None and why not (then the start traces with Dynamo).
    """
    entry, why = traces.load(key)
    if entry is None:
        return None, f"missed ({why})"
    try:
        binding, signature, split = restore(entry, model, ops)
        cache = CompileCache(_cache_root(options), entry.factors)
    except Exception as e:  # an entry this code cannot rebuild: trace instead
        return None, f"missed (the entry does not restore: {type(e).__name__}: {e})"
    if len(entry.fingerprints) != len(split.compiled_pieces):
        return None, "missed (the entry's fingerprints do not match its pieces)"
    compiler = PieceCompiler(
        options.compile_backend, passes, cache, None, inductor_pdl=options.inductor_pdl
    )
    compiler.cached_only = True
    for piece, fingerprint in zip(split.compiled_pieces, entry.fingerprints):
        compiler.set_fingerprint(piece, fingerprint)
    try:
        runtime = PiecewiseRuntime(binding, signature, split, compiler)
        runtime(input_ids, positions)
        sizes = _specialisable(options, input_ids)
        _specialise(runtime, compiler, sizes, input_ids, positions)
    except NotCached as e:
        return None, f"missed ({e})"
    except Exception as e:  # the saved graph no longer runs (an op's schema changed...)
        logger.warning(
            "graphattn compile: the trace cache entry %s failed to run (%s: %s); tracing again",
            traces.path(key),
            type(e).__name__,
            e,
        )
        return None, f"missed (the restored graph failed: {type(e).__name__}: {e})"
    compiler.cached_only = False  # a retrace for other inputs compiles what it needs
    return _Built(runtime, compiler, cache, sizes, from_dynamo=False), f"loaded {traces.path(key)}"


def _verified(built: _Built, fresh: SplitGraph, note: str) -> tuple[_Built | None, str]:
    """``built`` when its graph is the fresh trace's; else None (the entry is stale)."""
    if same_graph(built.runtime.split, fresh):
        return built, f"{note} (verified: a fresh trace gives the same graph)"
    logger.warning(
        "graphattn compile: the trace cache entry differs from a fresh trace of the model: "
        "its key missed a change (state it cannot see, such as an environment variable "
        "read in forward; see passes/trace_cache.py); using the fresh trace and replacing "
        "the entry. Pass trace_cache=False for this model."
    )
    return None, "stale entry replaced (debug found a fresh trace differs)"


def _save_trace(
    traces: TraceCache,
    key: str,
    note: str,
    trace: Trace,
    sources: tuple[dict[str, Any] | None, str],
    split: SplitGraph,
    compiler: PieceCompiler,
    cache: CompileCache | None,
    model: torch.nn.Module,
) -> str:
    before = f"{note}; " if note else ""
    if cache is None:
        return before + "not saved (no compile cache)"
    checks, why = sources
    if checks is None:
        logger.info("graphattn compile: trace not saved: %s", why)
        return before + f"not saved ({why})"
    fingerprints = [compiler.fingerprint(p) for p in split.compiled_pieces]
    entry, why = make_entry(trace, split, fingerprints, cache.factors, model, checks)
    if entry is None:
        logger.info("graphattn compile: trace not saved: %s", why)
        return before + f"not saved ({why})"
    path = traces.store(key, entry)
    return before + (f"saved {path}" if path else "not saved (the write failed)")


def _specialisable(options: CompileOptions, input_ids: torch.Tensor) -> list[int]:
    """The ``compile_sizes`` the example inputs can cover (a warning names the others)."""
    if options.compile_backend == "eager":
        return []
    sizes = sorted(set(options.compile_sizes))
    too_big = [s for s in sizes if s > input_ids.shape[0]]
    if too_big:
        logger.warning(
            "graphattn compile: compile_sizes %s exceed the %d tokens of the example inputs "
            "(max_num_tokens); they get no specialised build",
            too_big,
            input_ids.shape[0],
        )
    return [s for s in sizes if s <= input_ids.shape[0]]


def _specialise(
    runtime: PiecewiseRuntime,
    compiler: PieceCompiler,
    sizes: list[int],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """A specialised build of every piece for each of ``sizes`` tokens (each runs once)."""
    for size in sizes:
        runtime.specialise(compiler, input_ids[:size], positions[:size])


def _dry_run(
    runtime: PiecewiseRuntime,
    compiler: PieceCompiler,
    sizes: list[int],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
) -> PrecompileReport:
    """The start-up runs once without graphattn's kernels (``kernels/precompile.py``): their
    launches compile on a thread pool while the pieces' builds compile here, so the real
    runs that follow find them compiled instead of compiling each at its first launch. The
    builds made here are the real runs' (``PieceCompiler`` builds a piece and shape once).
    A dry run that raises (an op upset by the garbage the skipped kernels leave) leaves the
    rest to compile as before, and the report says so."""
    with compile_ahead(input_ids.device, envs.precompile_threads()) as report:
        if report.active:
            try:
                runtime(input_ids, positions)
                _specialise(runtime, compiler, sizes, input_ids, positions)
            except Exception as e:
                report.status = f"stopped: the dry run raised {type(e).__name__}: {e}"[:300]
                logger.warning("graphattn compile: kernel precompile %s", report.status)
    return report


def _wrap_pieces(runtime: PiecewiseRuntime, wrapper: PieceWrapper | None) -> None:
    if wrapper is None:
        return
    compiled = runtime.pieces
    num_pieces = len(runtime.split.pieces)

    def wrap(piece: CompiledPiece) -> Callable[..., Any]:
        info = PieceInfo(piece.piece.index, num_pieces, piece is compiled[0], piece is compiled[-1])
        return wrapper(piece, info)

    runtime.install_wrapped(wrap)


def _info(options, split, compiler, cache, passes, dump, sizes) -> CompileInfo:
    return CompileInfo(
        num_pieces=len(split.pieces),
        num_compiled_pieces=len(split.compiled_pieces),
        warm=cache is not None and compiler.misses == 0 and compiler.hits > 0,
        cache_hits=compiler.hits,
        cache_misses=compiler.misses,
        cache_dir=cache.dir if cache is not None else "",
        cache_key=cache.key if cache is not None else "",
        num_distinct_graphs=compiler.num_distinct_graphs,
        compile_sizes=sizes,
        backend=options.compile_backend,
        passes=passes.names if options.compile_backend == "inductor" else [],
        debug_dump_dir=dump.dir if dump is not None else "",
        not_weights=dict(split.not_weights),
        o_proj_folded=split.o_proj_folded,
    )


def _log_compiled(info: CompileInfo) -> None:
    how = "warm (from the cache)" if info.warm else "cold"
    logger.info(
        "graphattn compile: %d pieces ready in %.2f s, %s: %d cache hits, %d misses, "
        "%d Inductor runs, specialised sizes %s; cache %s",
        info.num_compiled_pieces,
        info.seconds,
        how if info.backend == "inductor" else "eager pieces",
        info.cache_hits,
        info.cache_misses,
        info.inductor_compiles,
        info.compile_sizes,
        info.cache_dir or "-",
    )


def _describe_split(split: SplitGraph) -> str:
    lines = ["# pieces: index name kind"]
    lines += [
        f"#   {p.index:3d} {p.name} {'splitting' if p.is_splitting else 'compiled'}"
        for p in split.pieces
    ]
    return "\n".join(lines) + "\n\n" + split.module.print_readable(print_output=False)
