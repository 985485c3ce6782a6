"""The modules' former flat paths (`jaxkv.state`, `jaxkv.prefix_cache`, ...), kept working with a warning.

`install()` (called by `jaxkv/__init__.py`) puts a finder on `sys.meta_path` that serves each old path. Its
loader warns (`DeprecationWarning`, naming the new path, pointing at the line that imported the old one) and
then stands the module at the new path in for the old one (in `sys.modules` and as `jaxkv.<old name>`), so
every attribute access, read or write, reaches the module the code uses: `from jaxkv.state import allocate`
gives `jaxkv.core.state.allocate` itself, and `monkeypatch.setattr(jaxkv.state, ...)` patches it and undoes
cleanly. (A separate forwarding module cannot: pytest's undo restores what the stand-in's own `__dict__`
held, so it would delete the real attribute.) The warning comes once per process, at the first import;
`jaxkv.state` as an attribute of `jaxkv` goes through the same import (`jaxkv.__getattr__`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
import warnings

# Former name under jaxkv -> the module's path now.
MOVED = {
    "config": "jaxkv.planner.config",
    "hf_config": "jaxkv.planner.hf_config",
    "planning": "jaxkv.planner.planning",
    "specs": "jaxkv.planner.specs",
    "invariants": "jaxkv.core.invariants",
    "pool": "jaxkv.core.pool",
    "ranges": "jaxkv.core.ranges",
    "state": "jaxkv.core.state",
    "step": "jaxkv.core.step",
    "hashing": "jaxkv.prefix.hashing",
    "prefix_cache": "jaxkv.prefix.index",
    "prefix_rules": "jaxkv.prefix.rules",
    "prefix_state": "jaxkv.prefix.state",
    "prefix_tails": "jaxkv.prefix.tails",
    "layout": "jaxkv.memory.layout",
    "layout_html": "jaxkv.memory.layout_html",
}
PUBLIC = ("jaxkv.core.state", "jaxkv.core.step")  # the warning points users of the others at jaxkv's names

# Frames between the importing line and the warning: ours, and importlib's `import_module`. (warnings
# itself skips importlib's bootstrap frames when it counts a stacklevel.)
_OWN_FILES = (
    os.path.normcase(__file__),
    os.path.normcase(os.path.join(os.path.dirname(__file__), "__init__.py")),
    os.path.normcase(importlib.__file__),
)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads `jaxkv.<old name>`; every other name is left to the next finder."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != "jaxkv" or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None  # a plain placeholder, replaced by the new module in exec_module

    def exec_module(self, module):
        target = MOVED[module.__name__.rpartition(".")[2]]
        internal = "" if target in PUBLIC else " (an internal module: prefer the names jaxkv exports)"
        warnings.warn(
            f"{module.__name__} is deprecated: the module moved to {target}; import it from there{internal}",
            DeprecationWarning,
            stacklevel=_importer_stacklevel(),
        )
        # The import system returns (and binds as the package's attribute) what sys.modules holds after
        # exec_module: a module may replace itself there.
        sys.modules[module.__name__] = importlib.import_module(target)


def _importer_stacklevel() -> int:
    """The stacklevel, for a warning raised in `exec_module`, of the line that imported the old path.

    Counts as `warnings.warn` does (from the caller of `exec_module`'s `warn`, importlib's bootstrap frames
    skipped), passing this module's frames, `jaxkv.__getattr__` and `importlib.import_module`."""
    frame, level = sys._getframe(1), 1  # exec_module: stacklevel 1
    while frame is not None and os.path.normcase(frame.f_code.co_filename) in _OWN_FILES:
        frame = frame.f_back
        while frame is not None and _is_bootstrap(frame):
            frame = frame.f_back
        level += 1
    return level


def _is_bootstrap(frame) -> bool:
    filename = frame.f_code.co_filename
    return "importlib" in filename and "_bootstrap" in filename  # warnings' own test for these frames


def install() -> None:
    """Serves the old paths from now on (once per process, whatever the number of calls)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())


def load(name: str) -> types.ModuleType:
    """`jaxkv.<name>` for a former module name (imported, so it warns, once)."""
    return importlib.import_module(f"jaxkv.{name}")
