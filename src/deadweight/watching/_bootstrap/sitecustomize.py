"""Started by `deadweight run` in the script's interpreter (this folder is put first on
PYTHONPATH): watch every optimizer once torch is imported, then hand over to any
sitecustomize that this one shadows. At exit a process that imported torch tells
`deadweight run` what it saw (`deadweight.watching.run_status`)."""

import atexit
import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        candidate = os.path.join(entry or os.curdir, "sitecustomize.py")
        if os.path.isfile(candidate):
            import importlib.util

            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


# The shadowed sitecustomize first: it may set up the environment (threads, devices)
# that must be in place before deadweight imports torch. Python itself reports a
# failing sitecustomize this way and goes on.
try:
    _chain()
except Exception as exc:
    print(
        f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}",
        file=sys.stderr,
    )

# Whether watching started in this process, why not where it failed, and whether
# torch's own module is executing through a loader this file wrapped.
_attach: dict[str, Any] = {"started": False, "error": None, "torch_executing": False}


def _start(how: str) -> None:
    if _attach["started"]:
        return
    _attach["started"] = True
    try:
        from deadweight.watching.run_in_script import start

        start(how)
    except Exception as exc:  # never stop the user's script
        _attach["error"] = f"{type(exc).__name__}: {exc}"
        print(f"deadweight: could not start watching: {_attach['error']}", file=sys.stderr)


def _torch_ready() -> bool:
    """torch is in sys.modules and has finished executing: not a lazy module yet to
    load, not a module half-way through its own import (the import system marks its
    spec `_initializing`; a LazyLoader does not, hence the flag of our own)."""
    module = sys.modules.get("torch")
    if module is None or type(module).__name__ == "_LazyModule":  # touching it would load it
        return False
    if _attach["torch_executing"] or "torch.optim" not in sys.modules:
        return False
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


class _AttachAfterTorch(importlib.abc.MetaPathFinder):
    """Start watching right after torch has really been imported, however that happens.

    Importing torch here would cost every Python process of the run about a second,
    even ones that never train, and would run before the script sets torch's
    environment (OMP_NUM_THREADS and the like). Optimizers only exist after torch is
    imported, so nothing is missed.

    The finder stays first on sys.meta_path until watching has started: a probe such as
    `importlib.util.find_spec("torch")` (transformers' and datasets' availability
    checks), or a spec handed to `importlib.util.LazyLoader`, gets a spec whose loader
    starts watching once torch's module has executed, and the next lookup finds it
    again. Should torch come in some way this finder never sees (another finder ahead of
    it, a module loaded by hand), the next module imported after it starts watching
    once it has loaded.
    """

    def __init__(self) -> None:
        self._inside = threading.local()  # our own lookups through the other finders

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if _attach["started"]:
            self._leave()
            return None
        if getattr(self._inside, "busy", False):
            return None
        if name == "torch":
            how = "import torch"
        elif _torch_ready() and name.partition(".")[0] != "torch":
            how = f"import {name} (torch was imported without passing this hook)"
        else:
            return None
        self._inside.busy = True
        try:
            spec = self._others(name, path, target)
        finally:
            self._inside.busy = False
        if spec is not None:
            _start_after_exec(spec, how)
        return spec

    def _others(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec the rest of sys.meta_path gives, as the import system would ask."""
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(name, path, target)
            if spec is not None:
                return spec
        return None

    def _leave(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)


def _start_after_exec(spec: importlib.machinery.ModuleSpec, how: str) -> None:
    """Make this spec's loader start watching after the module has executed. Each spec
    of a file module has a loader of its own; a class used as a loader (built-in and
    frozen modules) is shared, and is never changed."""
    loader = spec.loader
    if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
        return
    original = loader.exec_module
    is_torch = spec.name == "torch"

    def exec_module(module: ModuleType) -> None:
        if is_torch:
            _attach["torch_executing"] = True
        try:
            original(module)
        finally:
            if is_torch:
                _attach["torch_executing"] = False
        # torch itself has just executed (its spec is still marked initializing until
        # this returns); any other module only counts once torch is complete.
        if is_torch or _torch_ready():
            _start(how)

    # A loader with __slots__ cannot take it: the next lookup tries again.
    with contextlib.suppress(AttributeError, TypeError):
        loader.exec_module = exec_module  # type: ignore[method-assign]


def _tell_run_at_exit() -> None:
    """A process that imported torch but never started watching says so (one that
    started says it from `run_in_script`); a process without torch says nothing."""
    if _attach["started"] and _attach["error"] is None:
        return
    if "torch" not in sys.modules:
        return
    try:
        from deadweight.watching import run_status

        run_status.not_attached(_attach["error"], list(sys.meta_path))
    except Exception:  # at exit: nothing left to tell
        pass


if os.environ.get("DEADWEIGHT_RUN_LOG"):
    atexit.register(_tell_run_at_exit)  # first registered: runs after the watch closed
    if _torch_ready():  # imported by the shadowed sitecustomize or a .pth file
        _start("torch imported before the script")
    else:
        sys.meta_path.insert(0, _AttachAfterTorch())
