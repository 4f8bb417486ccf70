"""Runs a script (or `-m module`) with torch imported first: the import order under
which `deadweight run` always attached. `python torch_first.py SCRIPT ARGS...`"""

import runpy
import sys

import torch  # noqa: F401  (first, before anything the script imports)

if sys.argv[1] == "-m":
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
