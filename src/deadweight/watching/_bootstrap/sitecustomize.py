"""Started by `deadweight run` in the script's interpreter (this folder is put first on
PYTHONPATH): watch every optimizer, then hand over to any sitecustomize that this one
shadows."""

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType


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


def _start() -> None:
    try:
        from deadweight.watching.zero_code import start

        start()
    except Exception as exc:  # never stop the user's script
        print(f"deadweight: could not start watching: {type(exc).__name__}: {exc}", file=sys.stderr)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Start watching right after the script's own `import torch` has finished.

    Importing torch here would cost every Python process of the run about a second,
    even ones that never train, and would run before the script sets torch's
    environment (OMP_NUM_THREADS and the like). Optimizers only exist after torch is
    imported, so nothing is missed.
    """

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _start()

        loader.exec_module = exec_module
        return spec


if os.environ.get("DEADWEIGHT_RUN_LOG"):
    if "torch" in sys.modules:  # imported by the shadowed sitecustomize
        _start()
    else:
        sys.meta_path.insert(0, _AfterTorch())
