"""Shared pytest setup.

The tests mirror the package: tests/planner, core, prefix and memory hold the tests of jaxkv's folders of those
names; tests/ itself those of the top-level modules (manager, metadata, cli), of the README and of the style, with
the helpers several folders share (model_reference, tiny_configs, configs/). The four mirror folders are packages
(an empty-but-docstring __init__.py) so that a module name can repeat across them (core/test_state.py,
prefix/test_state.py import as core.test_state and prefix.test_state); pytest's default import mode puts the first
folder above them without an __init__.py, tests/, on sys.path, so every test imports the shared helpers by their
plain names. tests/pallas_kernels and tests/examples are not packages: their helpers (kernel_cases, decode_runs)
are found in their own folder."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches():
    """Drops each module's compiled programs when it ends: the whole suite compiles thousands of shapes,
    and XLA:CPU crashed compiling late in a long run (CI, 2026-11-29)."""
    yield
    jax.clear_caches()
