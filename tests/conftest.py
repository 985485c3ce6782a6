"""Shared pytest setup."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches():
    """Drops each module's compiled programs when it ends: the whole suite compiles thousands of shapes,
    and XLA:CPU crashed compiling late in a long run (CI, 2026-11-29)."""
    yield
    jax.clear_caches()
