"""Seeds a cut into transformers' GPT-2 for the end-to-end runs of HF's run_clm.py,
which stays unmodified: once `transformers.models.gpt2.modeling_gpt2` has loaded,
`gpt2_cut.seed` patches it. Put this folder on PYTHONPATH (deadweight's bootstrap runs
it first, as Python would)."""

import importlib.abc
import sys

TARGET = "transformers.models.gpt2.modeling_gpt2"


class _SeedGPT2(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def seeded(module):
            exec_module(module)
            from gpt2_cut import seed

            seed(module)

        spec.loader.exec_module = seeded
        return spec


sys.meta_path.insert(0, _SeedGPT2())
