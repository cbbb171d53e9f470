"""Debug dumps: one folder per compile under ``debug_dump_path``.

    dynamo/            Dynamo's bytecode decompiled by depyf (original and transformed)
    graph_before_split.py
    graph_after_split.py   the split graph, then every piece
    pieces/<piece>-<shape>.py   Inductor's output code of each build (or where it came from)

depyf is imported only here and only when a dump is asked for: the GPU machine does not
have it, and a missing depyf is written into the dump and logged, never an error.
"""

from __future__ import annotations

import itertools
import os
import time
import types

from graphattn._logging import logger

_counter = itertools.count()


class DebugDump:
    """Writes the files of one compile's dump folder."""

    def __init__(self, root: str) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.dir = os.path.join(root, f"compile-{stamp}-pid{os.getpid()}-{next(_counter)}")
        os.makedirs(self.dir, exist_ok=True)
        self._decompile = _load_depyf(self)

    def write(self, relpath: str, text: str) -> None:
        path = os.path.join(self.dir, relpath)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def bytecode_hook(self, old: types.CodeType, new: types.CodeType) -> None:
        """Dynamo's bytecode hook: decompile the traced frame before and after Dynamo."""
        if self._decompile is None:
            return
        name = old.co_name
        for kind, code in (("original", old), ("transformed", new)):
            try:
                text = self._decompile(code)
            except Exception as e:  # depyf does not know every bytecode; the dump is best effort
                text = f"# depyf could not decompile this code: {type(e).__name__}: {e}\n"
            self.write(f"dynamo/{kind}_{name}.py", text)


def _load_depyf(dump: DebugDump):
    try:
        import depyf
    except ImportError:
        why = "depyf is not installed, so Dynamo's bytecode is not decompiled (pip install depyf)"
        dump.write("dynamo/DEPYF_MISSING.txt", why + "\n")
        logger.warning("debug dump: %s", why)
        return None
    return depyf.decompile
