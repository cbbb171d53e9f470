"""The compile cache: Inductor artifacts of pieces on disk, keyed by everything they depend on.

Layout: ``<cache_dir>/<key>/factors.json`` (what the key hashes, for a person to read)
and ``<cache_dir>/<key>/pieces/<graph fingerprint>-<shape>.bin`` (one compiled piece
build each). The key hashes the engine's cache factors, the source of the traced model
files, the torch/triton/python versions, the post-grad pass uuids and graphattn's
compiler source; a piece's file name hashes its graph, so identical pieces share a file.

Every entry is written to a temporary file and renamed into place (two processes may
share a cache), and it carries a SHA-256 of its payload: a corrupt or half-written entry
is reported, removed and compiled again, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import re
import sys
import tempfile
import uuid
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

from graphattn._logging import logger

_MAGIC = b"GAPIECE1"
_DIGEST_BYTES = 32
_KEY_CHARS = 24


class CompileCache:
    """One cache entry folder: load and store compiled piece builds by name."""

    def __init__(self, root: str, factors: dict[str, Any]) -> None:
        self.factors = factors
        self.key = hash_factors(factors)
        self.root = root
        self.dir = os.path.join(root, self.key)
        self.pieces_dir = os.path.join(self.dir, "pieces")
        os.makedirs(self.pieces_dir, exist_ok=True)
        factors_path = os.path.join(self.dir, "factors.json")
        if not os.path.exists(factors_path):
            write_atomic(factors_path, json.dumps(factors, indent=2, sort_keys=True).encode())

    def path(self, name: str) -> str:
        return os.path.join(self.pieces_dir, f"{name}.bin")

    def load(self, name: str) -> Any | None:
        """The compiled build stored as ``name``, or None (a miss, or a bad entry removed)."""
        path = self.path(name)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        payload = unpack(blob)
        if payload is None:
            return self._discard(path, "its checksum does not match (corrupt or half-written)")
        try:
            return _load_artifact(payload, self.pieces_dir)
        except Exception as e:  # any failure to load means: compile it again
            return self._discard(path, f"loading it failed ({type(e).__name__}: {e})")

    def store(self, name: str, artifact: Any) -> bool:
        """Write ``artifact`` (a ``CompiledArtifact``) as ``name``; False when it cannot be
        saved (the build still runs; it is just compiled again next time).
        """
        try:
            write_atomic(self.path(name), pack(_save_artifact(artifact, self.pieces_dir)))
        except Exception as e:  # unsaveable graph, full disk, read-only folder: all alike
            logger.warning(
                "compile cache: cannot save piece %s (%s: %s)", name, type(e).__name__, e
            )
            return False
        return True

    def _discard(self, path: str, why: str) -> None:
        logger.warning("compile cache: %s: %s; compiling it again", path, why)
        with contextlib.suppress(OSError):
            os.remove(path)
        return None


def hash_factors(factors: dict[str, Any]) -> str:
    text = json.dumps(factors, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:_KEY_CHARS]


def base_factors(
    engine_factors: dict[str, Any], pass_uuid: str, compiler_settings: dict[str, Any]
) -> dict[str, Any]:
    """What the compiled pieces depend on besides the model's source: JSON-able values."""
    return {
        "engine": engine_factors,
        "compiler": compiler_settings,
        "graphattn_compiler_source": compiler_source_hashes(),
        "post_grad_passes": pass_uuid,
        # Inductor lowers some ops differently under deterministic algorithms, and its CPU
        # code is built for this machine's vector ISA (a shared folder may serve others)
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cpu_isa": _cpu_isa(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": sys.version.split()[0],
    }


def cache_factors(base: dict[str, Any], model: torch.nn.Module, gm: fx.GraphModule) -> dict:
    """Everything the compiled pieces depend on: ``base`` and the traced model's sources."""
    return base | {"model_sources": source_hashes(model_source_files(model, gm))}


def model_source_files(model: torch.nn.Module, gm: fx.GraphModule) -> list[str]:
    """Source files of the model's module classes and of every frame the trace went through
    (from the graph's stack traces), torch's own files excepted (its version is a factor).
    """
    files = set()
    for module in model.modules():
        with contextlib.suppress(TypeError, OSError):
            files.add(inspect.getsourcefile(type(module)))
    for node in gm.graph.nodes:
        files.update(re.findall(r'File "([^"]+)"', node.meta.get("stack_trace") or ""))
    torch_dir = os.path.dirname(torch.__file__)
    return sorted(f for f in files if f and os.path.isfile(f) and not f.startswith(torch_dir))


def source_hashes(paths: Iterable[str]) -> list[str]:
    """``["name.py:sha256-prefix", ...]``: file contents, not locations, enter the key."""
    return sorted(f"{os.path.basename(p)}:{file_digest(p)[:16]}" for p in paths)


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


# -- entry format -------------------------------------------------------------------------


def pack(payload: bytes, magic: bytes = _MAGIC) -> bytes:
    """``magic``, the payload's SHA-256, the payload."""
    return magic + hashlib.sha256(payload).digest() + payload


def unpack(blob: bytes, magic: bytes = _MAGIC) -> bytes | None:
    """The payload of a ``pack`` blob, or None when its magic or checksum is wrong."""
    head = len(magic) + _DIGEST_BYTES
    if len(blob) < head or not blob.startswith(magic):
        return None
    digest, payload = blob[len(magic) : head], blob[head:]
    return payload if hashlib.sha256(payload).digest() == digest else None


def _save_artifact(artifact: Any, folder: str) -> bytes:
    path = os.path.join(folder, f".tmp-save-{uuid.uuid4().hex}.part")
    try:
        artifact.save(path=path, format="binary")
        with open(path, "rb") as f:
            return f.read()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _load_artifact(payload: bytes, folder: str) -> Any:
    from torch._inductor import CompiledArtifact

    path = os.path.join(folder, f".tmp-load-{uuid.uuid4().hex}.part")
    try:
        with open(path, "wb") as f:
            f.write(payload)
        return CompiledArtifact.load(path=path, format="binary")
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def compiler_source_hashes() -> list[str]:
    """The hashes of graphattn's compiler sources (``passes/*.py``)."""
    return source_hashes(_compiler_files())


def _cpu_isa() -> str:
    """ATen's CPU capability (DEFAULT, AVX2, AVX512, ...): what Inductor's CPU code may use
    differs with it. Asking Inductor itself would compile a probe (seconds at each start)."""
    return torch.backends.cpu.get_cpu_capability()


def _compiler_files() -> list[str]:
    folder = os.path.dirname(os.path.abspath(__file__))
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py"))


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", None)
