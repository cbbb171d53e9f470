"""Per-piece runtime: each compiled piece runs its dynamic build, or the build specialised to
the step's exact token count when ``compile_sizes`` made one.

``PieceCompiler`` makes the builds (Inductor, or the piece's own FX code for the "eager"
backend), once per distinct piece graph and shape, through the compile cache.
``PiecewiseRuntime`` is one traced signature put together: the input binding, the split
graph, and the compiled pieces installed in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphattn._logging import logger
from graphattn.passes.backend import InputBinding, InputSignature
from graphattn.passes.cache import CompileCache
from graphattn.passes.debug import DebugDump
from graphattn.passes.fingerprint import graph_fingerprint
from graphattn.passes.inductor import compile_piece
from graphattn.passes.pass_manager import PostGradPassManager
from graphattn.passes.split import Piece, SplitGraph

Build = Callable[..., Any]


class NotCached(Exception):
    """A build the compile cache does not hold, asked of a compiler that may not compile
    (one whose pieces come from the trace cache and carry no shapes to compile from).
    """


class RunState:
    """Shared by the pieces of one compiled forward: the token count of the running step."""

    __slots__ = ("num_tokens",)

    def __init__(self) -> None:
        self.num_tokens = -1


class CompiledPiece:
    """One compiled (non-splitting) piece: the build for this step's exact token count if
    ``specialised`` has one, else the dynamic build.
    """

    __slots__ = ("dynamic", "piece", "specialised", "state")

    def __init__(self, piece: Piece, dynamic: Build, state: RunState) -> None:
        self.piece = piece
        self.dynamic = dynamic
        self.specialised: dict[int, Build] = {}
        self.state = state

    def __call__(self, *args: Any) -> Any:
        build = self.specialised.get(self.state.num_tokens)
        if build is None:
            return self.dynamic(*args)
        return build(*args)

    def __repr__(self) -> str:
        sizes = sorted(self.specialised)
        return f"CompiledPiece({self.piece.name}, specialised for {sizes})"


class PieceCompiler:
    """Builds pieces: each distinct (graph, shape) once per process, from the cache if it
    has it, else with Inductor (and then into the cache).
    """

    def __init__(
        self,
        backend: str,
        pass_manager: PostGradPassManager,
        cache: CompileCache | None,
        dump: DebugDump | None,
        *,
        inductor_pdl: bool = False,
    ) -> None:
        self.backend = backend
        self.pass_manager = pass_manager
        self.inductor_pdl = inductor_pdl  # Inductor's Triton kernels launch with PDL
        self.cache = cache
        self.dump = dump
        self.hits = 0
        self.misses = 0
        self.cached_only = False  # raise NotCached instead of compiling
        self._builds: dict[tuple[str, str], tuple[Build, str]] = {}
        self._fingerprints: dict[int, str] = {}

    def dynamic(self, piece: Piece) -> Build:
        """The build of ``piece`` for any token count."""
        if self.backend == "eager":
            return piece.module.forward

        def compile_dynamic(on_code: Any) -> Build:
            fakes = [n.meta["example_value"] for n in _placeholders(piece)]
            return self._inductor(piece, fakes, True, on_code)

        return self._build(piece, "dynamic", compile_dynamic)

    def specialised(self, piece: Piece, args: list[Any], num_tokens: int) -> Build:
        """The build of ``piece`` for exactly ``num_tokens`` tokens; ``args`` are real inputs
        of that size (their shapes and strides are what the build assumes).
        """
        shape = f"n{num_tokens}"
        return self._build(
            piece, shape, lambda on_code: self._inductor(piece, args, False, on_code)
        )

    def fingerprint(self, piece: Piece) -> str:
        key = id(piece.module)
        if key not in self._fingerprints:
            self._fingerprints[key] = graph_fingerprint(piece.module)
        return self._fingerprints[key]

    def set_fingerprint(self, piece: Piece, fingerprint: str) -> None:
        """Take ``fingerprint`` for ``piece`` as computed by an earlier trace (a piece from
        the trace cache has no shapes in its graph to compute it from).
        """
        self._fingerprints[id(piece.module)] = fingerprint

    @property
    def num_distinct_graphs(self) -> int:
        return len(set(self._fingerprints.values()))

    def _build(self, piece: Piece, shape: str, compile_fn: Callable[[Any], Build]) -> Build:
        fingerprint = self.fingerprint(piece)
        known = self._builds.get((fingerprint, shape))
        if known is not None:
            self._note(piece, shape, f"same graph as {known[1]}: shares its build\n")
            return known[0]
        name = f"{fingerprint[:32]}-{shape}"
        build = self.cache.load(name) if self.cache is not None else None
        if build is not None:
            self.hits += 1
            self._note(piece, shape, f"loaded from the compile cache: {self.cache.path(name)}\n")
            logger.debug("piece %s (%s): loaded from the compile cache", piece.name, shape)
        else:
            if self.cached_only:
                raise NotCached(f"piece {piece.name} ({shape}) is not in the compile cache")
            if self.cache is not None:
                self.misses += 1
            build = compile_fn(self._code_writer(piece, shape))
            if self.cache is not None:
                self.cache.store(name, build)
            logger.debug("piece %s (%s): compiled", piece.name, shape)
        self._builds[(fingerprint, shape)] = (build, piece.name)
        return build

    def _inductor(self, piece: Piece, inputs: list[Any], dynamic: bool, on_code) -> Build:
        return compile_piece(
            piece.module,
            inputs,
            dynamic=dynamic,
            pass_manager=self.pass_manager.for_piece(piece.module),
            on_output_code=on_code,
            pdl=self.inductor_pdl,
        )

    def _code_writer(self, piece: Piece, shape: str) -> Callable[[str], None] | None:
        if self.dump is None:
            return None
        return lambda code: self.dump.write(f"pieces/{piece.name}-{shape}.py", code)

    def _note(self, piece: Piece, shape: str, text: str) -> None:
        if self.dump is not None:
            self.dump.write(f"pieces/{piece.name}-{shape}.txt", text)


class PiecewiseRuntime:
    """``forward(input_ids, positions)`` for one traced signature: binds the step's inputs
    and runs the split graph, whose pieces are the compiled and splitting pieces.
    """

    def __init__(
        self,
        binding: InputBinding,
        signature: InputSignature,
        split: SplitGraph,
        compiler: PieceCompiler,
    ) -> None:
        self.signature = signature
        self.binding = binding
        self.split = split
        self.state = RunState()
        self.pieces = [
            CompiledPiece(p, compiler.dynamic(p), self.state) for p in split.compiled_pieces
        ]
        for piece in split.pieces:
            if piece.is_splitting:
                self._install(piece, piece.module.forward)
        for compiled in self.pieces:
            self._install(compiled.piece, compiled)
        self._forward = split.module.forward

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.state.num_tokens = input_ids.shape[0]
        return self._forward(*self.binding(input_ids, positions))[0]

    def specialise(
        self, compiler: PieceCompiler, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Build every piece for exactly ``len(input_ids)`` tokens, running the model once
        on those inputs (each piece is built from its real inputs, then runs its new build).
        """
        num_tokens = input_ids.shape[0]

        def build_and_run(compiled: CompiledPiece) -> Build:
            def run(*args: Any) -> Any:
                build = compiler.specialised(compiled.piece, list(args), num_tokens)
                compiled.specialised[num_tokens] = build
                return build(*args)

            return run

        for compiled in self.pieces:
            self._install(compiled.piece, build_and_run(compiled))
        try:
            self(input_ids, positions)
        finally:
            for compiled in self.pieces:
                self._install(compiled.piece, compiled)

    def install_wrapped(self, wrap: Callable[[CompiledPiece], Build]) -> None:
        """Put ``wrap(piece)`` in the split graph in place of each compiled piece."""
        for compiled in self.pieces:
            self._install(compiled.piece, wrap(compiled))

    def _install(self, piece: Piece, fn: Build) -> None:
        # The split graph's code calls ``self.<piece name>(...)``; an instance attribute
        # is found before the submodule, and calling it skips nn.Module.__call__.
        self.split.module.__dict__[piece.name] = fn


def _placeholders(piece: Piece) -> list[Any]:
    return [n for n in piece.module.graph.nodes if n.op == "placeholder"]
