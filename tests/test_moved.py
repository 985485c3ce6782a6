"""The modules' former flat paths (`jaxkv.state`, `jaxkv.prefix_cache`, ...) keep working (`jaxkv._moved`): each
imports, in every form outside code writes, warns DeprecationWarning naming the new path at the importing line,
and gives the new module's objects. The public names (`jaxkv.__all__`, the public modules) stay as they were, with
no warning."""

import importlib
import pkgutil
import re
import subprocess
import sys

import pytest

import jaxkv

# The contract, written out rather than read from jaxkv._moved: former path -> path now.
MOVED = {
    "jaxkv.config": "jaxkv.planner.config",
    "jaxkv.hf_config": "jaxkv.planner.hf_config",
    "jaxkv.planning": "jaxkv.planner.planning",
    "jaxkv.specs": "jaxkv.planner.specs",
    "jaxkv.invariants": "jaxkv.core.invariants",
    "jaxkv.pool": "jaxkv.core.pool",
    "jaxkv.ranges": "jaxkv.core.ranges",
    "jaxkv.state": "jaxkv.core.state",
    "jaxkv.step": "jaxkv.core.step",
    "jaxkv.hashing": "jaxkv.prefix.hashing",
    "jaxkv.prefix_cache": "jaxkv.prefix.index",
    "jaxkv.prefix_rules": "jaxkv.prefix.rules",
    "jaxkv.prefix_state": "jaxkv.prefix.state",
    "jaxkv.prefix_tails": "jaxkv.prefix.tails",
    "jaxkv.layout": "jaxkv.memory.layout",
    "jaxkv.layout_html": "jaxkv.memory.layout_html",
}
PAIRS = sorted(MOVED.items())
SHORT = [old.removeprefix("jaxkv.") for old in sorted(MOVED)]


@pytest.fixture
def fresh(monkeypatch):
    """Forgets every old path (restored after the test), so that importing one runs, and warns, again."""
    for old in MOVED:
        monkeypatch.delitem(sys.modules, old, raising=False)
        monkeypatch.delitem(vars(jaxkv), old.removeprefix("jaxkv."), raising=False)  # not delattr: it would import


def test_every_module_in_a_subpackage_has_its_old_path():
    subpackages = ("jaxkv.planner", "jaxkv.core", "jaxkv.prefix", "jaxkv.memory")
    modules = {
        info.name
        for package in subpackages
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__, package + ".")
    }
    # Modules written after the move have no former flat path.
    engine = ("host", "host_calls", "host_convert", "host_index", "host_pool", "host_step", "host_tails", "host_types")
    written_after = {*(f"jaxkv.core.{name}" for name in (*engine, "step_batch")), "jaxkv.prefix.lookup"}
    assert modules == set(MOVED.values()) | written_after


@pytest.mark.parametrize("old, new", PAIRS)
def test_old_path_warns_and_is_the_new_module(fresh, old, new):
    message = rf"^{re.escape(old)} is deprecated: the module moved to {re.escape(new)}; import it from there"
    with pytest.warns(DeprecationWarning, match=message) as record:
        module = importlib.import_module(old)
    assert len(record) == 1
    assert record[0].filename == __file__  # the importing line (importlib.import_module's caller), not ours
    target = importlib.import_module(new)
    # The same module, so the same objects: from jaxkv.state import allocate gives jaxkv.core.state.allocate.
    assert module is target and sys.modules[old] is target and getattr(jaxkv, old.removeprefix("jaxkv.")) is target


@pytest.mark.parametrize("name", SHORT)
def test_every_import_form(fresh, name):
    new = importlib.import_module(MOVED[f"jaxkv.{name}"])
    some = next(
        n for n, v in vars(new).items() if not n.startswith("_") and getattr(v, "__module__", "") == new.__name__
    )
    forms = [
        f"from jaxkv import {name} as m; value = m.{some}",
        f"import jaxkv.{name}; value = jaxkv.{name}.{some}",
        f"import jaxkv.{name} as m; value = m.{some}",
        f"from jaxkv.{name} import {some} as value",
        f"import jaxkv; value = jaxkv.{name}.{some}",
        f"from jaxkv.{name} import *; value = {some}",
    ]
    for code in forms:
        sys.modules.pop(f"jaxkv.{name}", None)
        vars(jaxkv).pop(name, None)
        namespace = {}
        with pytest.warns(DeprecationWarning, match=f"jaxkv.{name} is deprecated") as record:
            exec(code, namespace)
        assert len(record) == 1, code  # once per import, not once per attribute read
        assert namespace["value"] is getattr(new, some), code


def test_warnings_point_at_the_importing_line(fresh):
    lines = []
    with pytest.warns(DeprecationWarning) as record:
        lines.append(sys._getframe().f_lineno + 1)
        from jaxkv import pool  # noqa: F401

        lines.append(sys._getframe().f_lineno + 1)
        from jaxkv.step import StepWork  # noqa: F401

        lines.append(sys._getframe().f_lineno + 1)
        import jaxkv.prefix_cache as old_index  # noqa: F401

        lines.append(sys._getframe().f_lineno + 1)
        jaxkv.layout  # noqa: B018
    assert [(w.filename, w.lineno) for w in record] == [(__file__, line) for line in lines]


def test_patching_through_old_path_patches_and_undoes(fresh, monkeypatch):
    with pytest.warns(DeprecationWarning):
        from jaxkv import state as old
    allocate, sentinel = jaxkv.core.state.allocate, object()
    monkeypatch.setattr(old, "allocate", sentinel)  # code that patched jaxkv.state patches the module in use
    assert jaxkv.core.state.allocate is sentinel
    monkeypatch.undo()
    assert jaxkv.core.state.allocate is allocate and old.allocate is allocate


def test_unknown_names_still_fail():
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        jaxkv.no_such_module  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("jaxkv.no_such_module")


def test_public_names_unchanged_and_silent():
    """`jaxkv.__all__`, DESIGN.md's public API and the public modules import with warnings as errors."""
    code = """if True:
        import jaxkv, jaxkv.core.state, jaxkv.core.step, jaxkv.manager, jaxkv.metadata
        from jaxkv import *
        from jaxkv.core.state import allocate, init_state, ManagerState
        from jaxkv.core.step import StepWork, allocate_step
        from jaxkv.manager import KVCacheManager
        from jaxkv.metadata import StepMetadata
        import jaxkv.planner.planning
        for name in jaxkv.__all__:
            getattr(jaxkv, name)
        assert callable(jaxkv.plan) and jaxkv.plan is jaxkv.planner.planning.plan  # the function, not a module
        assert KVCacheManager is jaxkv.KVCacheManager and ManagerState is jaxkv.ManagerState
        assert not any(m in sys.modules for m in {old!r}), [m for m in {old!r} if m in sys.modules]
    """.replace("{old!r}", repr(sorted(MOVED)))
    run = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", "import sys\n" + code],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
