"""The package-dir mapping: passes/ and capture/ work only as graphattn.passes / graphattn.capture."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_installed_names_import():
    import graphattn.capture
    import graphattn.passes

    assert graphattn.capture.__name__ == "graphattn.capture"
    assert graphattn.passes.__file__.startswith(str(ROOT / "passes"))


@pytest.mark.parametrize("name", ["passes", "capture"])
def test_other_names_fail_clearly(name):
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {name}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"only works as 'graphattn.{name}'" in proc.stderr


def test_public_surface():
    import graphattn as ga

    assert set(ga.__all__) <= set(dir(ga))
    assert issubclass(ga.FallbackWarning, UserWarning)
    assert issubclass(ga.InvalidBatchError, ga.GraphAttnError)
