"""Fixtures of the host tier."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    """One folder of emulation builds (tests/host/simt) for the whole run: a kernel source built
    with one define set serves every test module that runs it, the kernels' own tests and the
    whole-model ones alike."""
    return tmp_path_factory.mktemp("simt")
