"""Shared pytest setup.

The tests mirror the package: tests/planner, core, prefix and memory hold the tests of jaxkv's folders of those
names; tests/ itself those of the top-level modules (manager, metadata, cli), of the README and of the style, with
the helpers several folders share (model_reference, tiny_configs, configs/). The four mirror folders are packages
(an empty-but-docstring __init__.py) so that a module name can repeat across them (core/test_state.py,
prefix/test_state.py import as core.test_state and prefix.test_state); pytest's default import mode puts the first
folder above them without an __init__.py, tests/, on sys.path, so every test imports the shared helpers by their
plain names. tests/pallas_kernels and tests/examples are not packages: their helpers (kernel_cases, decode_runs)
are found in their own folder.

XLA compiles the tests' programs with its backend optimizations off (`TEST_XLA_FLAGS`, set before jax is imported,
inherited by the example runs): most of the suite's time is compilation of programs that then run once or a few
times on tiny inputs. A tiny config's full allocation program with prefix caching then compiles in 5.7 s instead
of 11.7 s (jax 0.10.2; 4.6 s instead of 6.7 s on jax 0.12), and the example's tiny run takes 52 s instead of 79 s.
The programs compute the same results; benchmarks run with XLA's defaults.

One persistent compilation cache serves the whole run (`RUN_COMPILATION_CACHE`, a fresh folder removed when the run
ends, set before jax is imported and so inherited by every example child process): a program that one test module
or child process compiled is read back, not compiled again, by every later module (`jax.clear_caches()` below drops
only the in-memory copies) and every later child. Every program is stored, however fast it compiled
(`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0`): at XLA's lowest optimization level most compile in under jax's
default threshold of one second, and the example's tiny run then takes 9 s with a warm cache against 30 s cold."""

import os
import shutil
import tempfile
from importlib.metadata import version

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if tuple(int(part) for part in version("jaxlib").split(".")[:2]) < (0, 11):
    # XLA:CPU's older emitters compile in about half the time of its fusion emitters (the manager's 19 programs
    # of two tests: 4.3 s against 8.3 s on jaxlib 0.10.2). jaxlib 0.12.1's XLA has no such flag and aborts on
    # an unknown one, so the flag is set only where it was measured.
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
RUN_COMPILATION_CACHE = tempfile.mkdtemp(prefix="jaxkv-tests-compilation-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = RUN_COMPILATION_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches():
    """Drops each module's compiled programs when it ends: the whole suite compiles thousands of shapes,
    and XLA:CPU crashed compiling late in a long run (CI, 2026-11-29)."""
    yield
    jax.clear_caches()


def pytest_unconfigure(config):
    shutil.rmtree(RUN_COMPILATION_CACHE, ignore_errors=True)
