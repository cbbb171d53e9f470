"""Test settings: the gpu marker, hypothesis profiles, shared fixtures."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without CUDA the Triton kernels run under the interpreter; the variable must be set before
# any kernel module is imported (Triton reads it when a kernel is decorated).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor compiles in this process: worker pools cost more than they save on a small CI box.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "gpu",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
