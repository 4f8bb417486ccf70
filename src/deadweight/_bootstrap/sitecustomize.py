"""Started by `deadweight run` in the script's interpreter (this folder is put first on
PYTHONPATH): watch every optimizer, then hand over to any sitecustomize that this one
shadows."""

import os
import sys


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
if os.environ.get("DEADWEIGHT_RUN_LOG"):
    try:
        from deadweight.zero_code import start

        start()
    except Exception as exc:  # never stop the user's script
        print(f"deadweight: could not start watching: {type(exc).__name__}: {exc}", file=sys.stderr)
