"""Fixtures of the example tests."""

import pytest
from decode_runs import COMPILATION_CACHE, run_decode


@pytest.fixture(autouse=True, scope="session")
def _shared_compilation_cache(tmp_path_factory):
    COMPILATION_CACHE.append(str(tmp_path_factory.mktemp("jax-compilation-cache")))
    yield
    COMPILATION_CACHE.clear()


@pytest.fixture(scope="session")
def one_device() -> str:
    """The tiny run on one device, shared by every test that compares its tokens with it."""
    return run_decode()
