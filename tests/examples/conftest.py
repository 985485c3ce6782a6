"""Fixtures of the example tests."""

import pytest
from decode_runs import run_decode


@pytest.fixture(scope="session")
def one_device() -> str:
    """The tiny run on one device, shared by every test that compares its tokens with it."""
    return run_decode()
