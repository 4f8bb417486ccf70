"""DW502 on every form a rank-based decay rule takes in real training code, each
reported at the rank test's line: predicate objects holding a lambda or a function
(Megatron-LM's `ParamPredicate` / `ParamWithNamePredicate` overrides), overrides that
set `wd_mult` / `weight_decay` / `no_weight_decay` by rank, list, set and dict
comprehensions, and a rule split between a helper and its caller. Rank tests that
decide something else (a learning rate, a split of the QKV weight) in the same files
stay quiet, as do rules by name.

The fixtures are written in our own words after the shapes of real code; the real
files are linted too where they are installed (megatron-core) or vendored (nanoGPT,
in tests/linting/rules/test_lint_python_gpt.py).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import deadweight
from deadweight.findings import Severity
from tests.linting.helpers import lines_of, lint_source, marked

HEADER = """
import torch
from megatron.core.optimizer_param_scheduler import (
    ParamGroupOverride,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
)
"""

# Megatron-LM's overrides since 2026 (megatron/core/optimizer/__init__.py,
# get_standard_config_overrides) hold the rule in a predicate object whose lambda does
# the rank test; the override with wd_mult=0.0 is set two names further on. The two
# branches are two rules: only one is in force in a run.
PREDICATE_OBJECTS = """
def standard_overrides(config):
    overrides = {}
    if config.decay_qk_norm:
        vector_not_qk = ParamWithNamePredicate(
            name="vector_not_qk",
            fn=lambda param, name: (len(param.shape) == 1 or name.endswith(".bias"))  # DW502
            and "q_layernorm." not in name,
        )
        key = ParamKey(with_name_predicate=vector_not_qk)
    else:
        vector = ParamPredicate(name="vector", fn=lambda param: len(param.shape) == 1)  # DW502
        key = ParamKey(name="*.bias", predicate=vector)
    overrides[key] = ParamGroupOverride(wd_mult=0.0)
    return overrides
"""

# A named function handed to the predicate instead of a lambda.
PREDICATE_FUNCTION = """
def _is_vector(param):
    return param.ndim <= 1  # DW502


def vector_overrides():
    skip = ParamPredicate(name="vectors", fn=_is_vector)
    return {ParamKey(predicate=skip): ParamGroupOverride(wd_mult=0.0)}
"""

# Overrides written by rank, one parameter at a time, and the attribute tag.
OVERRIDES = """
def per_name_overrides(model):
    overrides = {}
    for name, p in model.named_parameters():
        if p.dim() < 2:  # DW502
            overrides[name] = dict(weight_decay=0.0)
    return overrides


def tag_vectors(model):
    for p in model.parameters():
        if len(p.size()) == 1:  # DW502
            p._no_weight_decay = True


def tag_with_setattr(model):
    for p in model.parameters():
        setattr(p, "no_weight_decay", p.ndim < 2)  # DW502
"""

# Comprehensions whose result reaches the groups a statement or two later.
COMPREHENSIONS = """
def grouped(model, wd):
    vectors = {id(p) for p in model.parameters() if p.ndim < 2}  # DW502
    rest = [p for p in model.parameters() if id(p) not in vectors]
    flat = [p for p in model.parameters() if id(p) in vectors]
    return [{"params": rest, "weight_decay": wd}, {"params": flat, "weight_decay": 0.0}]


def by_name(model, wd):
    groups = []
    flat = {n: p for n, p in model.named_parameters() if len(p.shape) == 1}  # DW502
    groups.append({"params": list(flat.values()), "weight_decay": 0.0})
    return groups


def multipliers(model):
    return {n: 0.0 if p.dim() <= 1 else 1.0 for n, p in model.named_parameters()}  # DW502


def configure(model):
    return {"wd_mult": multipliers(model)}


def tag(model):
    flat = [p for p in model.parameters() if p.dim() == 1]  # DW502
    for p in flat:
        p._no_weight_decay = True
"""

# A rule split across a helper and its caller, as a function and as a method.
HELPERS = """
def is_matrix(p):
    return p.dim() >= 2  # DW502


def split(model, weight_decay):
    decay = [p for p in model.parameters() if is_matrix(p)]
    rest = [p for p in model.parameters() if not is_matrix(p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest}]


class Recipe:
    def _flat(self, p):
        if p.ndim == 1:  # DW502
            return True
        return False

    def optimizer(self, model):
        groups = {"decay": [], "no_decay": []}
        for p in model.parameters():
            groups["no_decay" if self._flat(p) else "decay"].append(p)
        return groups
"""

# Megatron-LM's 2022 and 2024 _get_param_groups decided in one line (reworded).
MEGATRON_2022 = """
def _get_param_groups(model_chunks, no_weight_decay_cond):
    groups = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if no_weight_decay_cond is not None:
                no_wd = no_weight_decay_cond(name, param)
            else:
                no_wd = name.endswith(".bias") or len(param.shape) == 1  # DW502
            groups.setdefault(no_wd, []).append(param)
    return [{"params": p, "wd_mult": 0.0 if k else 1.0} for k, p in groups.items()]
"""

# Rank tests in a file about decay that decide something else: Megatron's MuP overrides
# (a vector-like parameter keeps the base learning rate), its QKV split, weight
# initialisation through a helper, a flag handed to a step function beside the decay
# (timm's MARS), and a routing flag stored in the optimizer state that everything else
# reads too (timm's Muon), tensors grouped by rank for a factored
# second moment whose loop also decays (torch's Adafactor). The file's own decay rule is by name.
QUIET = """
def mup_overrides(config):
    def vector_like(param, name):
        if param.dim() <= 1:
            return True
        return False

    def scaled(param, name):
        return not vector_like(param, name)

    hidden = ParamWithNamePredicate(name="hidden", fn=scaled)
    return {ParamKey(with_name_predicate=hidden): {"max_lr": config.lr / 2}}


def bias_overrides():
    biases = ParamWithNamePredicate(name="biases", fn=lambda param, name: name.endswith(".bias"))
    return {ParamKey(with_name_predicate=biases): ParamGroupOverride(wd_mult=0.0)}


def split_qkv(model, shapes):
    for name, param in model.named_parameters():
        if "linear_qkv.weight" in name and len(param.shape) == 2:
            param.qkv_split_shapes = shapes


def _matrix(p):
    return p.dim() >= 2


def init_weights(model):
    for p in model.parameters():
        if _matrix(p):
            torch.nn.init.xavier_uniform_(p)
    return torch.optim.AdamW(model.parameters(), weight_decay=0.1)


def step(group, p, grad):
    wd = group["weight_decay"]
    is_2d = grad.ndim >= 2
    _single_tensor_step(p, grad, group["lr"], wd, is_2d=is_2d)


def _orthogonalizable(p):
    if p.ndim < 2:
        return False
    return True


def route(optimizer, p, group):
    state = optimizer.state[p]
    state["orthogonal"] = _orthogonalizable(p)
    if state["orthogonal"]:
        state["momentum"] = torch.zeros_like(p)
    state["steps"] = state.get("steps", 0) + 1
    return state.get("decay", group["weight_decay"])


def by_rank(tensors):
    out = {True: [], False: []}
    for t in tensors:
        out[t.dim() > 1].append(t)
    return out


def factored_step(params, grads, lr, weight_decay):
    for is_matrix, group in by_rank(grads).items():
        if is_matrix:
            factor_(group)
        torch._foreach_mul_(params, 1 - lr * weight_decay)
"""

FORMS = {
    "predicate objects": PREDICATE_OBJECTS,
    "predicate function": PREDICATE_FUNCTION,
    "overrides": OVERRIDES,
    "comprehensions": COMPREHENSIONS,
    "helpers": HELPERS,
    "megatron 2022": MEGATRON_2022,
}


@pytest.mark.parametrize("form", FORMS)
def test_dw502_fires_at_the_rank_test_of_each_form(tmp_path: Path, form: str) -> None:
    source = HEADER + FORMS[form]
    report = lint_source(tmp_path, source)
    assert lines_of(report, "DW502") == marked(source, "DW502")
    for finding in report.by_code("DW502"):
        assert finding.evidence["decay_words"], finding
        assert finding.severity is Severity.INFO  # nothing here creates a scalar parameter


def test_dw502_predicate_objects_name_the_words_that_tie_them_to_decay(tmp_path: Path) -> None:
    first, second = lint_source(tmp_path, HEADER + PREDICATE_OBJECTS).by_code("DW502")
    assert first.location.function == second.location.function == "standard_overrides"
    assert first.evidence["expression"] == second.evidence["expression"] == "len(param.shape) == 1"
    # two branches of an if/else are two rules, not one rule and its partner
    assert first.evidence["partners"] == second.evidence["partners"] == []
    assert "wd_mult" in second.evidence["decay_words"]


def test_dw502_helper_is_reported_in_the_helper(tmp_path: Path) -> None:
    source = HEADER + HELPERS
    first, second = lint_source(tmp_path, source).by_code("DW502")
    assert (first.location.function, second.location.function) == ("is_matrix", "Recipe._flat")
    assert "decay" in first.evidence["decay_words"]


def test_dw502_quiet_on_rank_tests_that_decide_something_else(tmp_path: Path) -> None:
    assert lint_source(tmp_path, HEADER + QUIET).by_code("DW502") == []


def test_dw502_scalar_in_sight_makes_a_predicate_rule_a_warning(tmp_path: Path) -> None:
    model = "import torch\n\nclass Block(torch.nn.Module):\n    def __init__(self):\n" \
        "        super().__init__()\n        self.layer_scalar = torch.nn.Parameter(torch.ones(1))\n"  # fmt: skip
    (tmp_path / "block.py").write_text(model, encoding="utf-8")
    source = HEADER + "import block\n" + PREDICATE_FUNCTION
    report = lint_source(tmp_path, source, name="optim.py")
    (finding,) = report.by_code("DW502")
    assert finding.severity is Severity.INFO  # block.py not linted: not in sight
    report = deadweight.lint_paths([tmp_path / "optim.py", tmp_path / "block.py"], config=None)
    (finding,) = report.by_code("DW502")
    assert finding.severity is Severity.WARNING
    assert finding.evidence["scalar_parameters"][0]["parameter"] == "self.layer_scalar"


# ------------------------------------------------------------------ the real code

MEGATRON_CORE = importlib.util.find_spec("megatron.core")


@pytest.mark.skipif(MEGATRON_CORE is None, reason="megatron-core is installed by .ci/run")
def test_dw502_on_megatron_core_optimizer_folder() -> None:
    """megatron-core 0.16.1's optimizer folder as installed (11 files): its
    get_standard_config_overrides holds the incident's rule twice, one per branch,
    and nothing else in the folder decides decay by rank."""
    assert MEGATRON_CORE is not None and MEGATRON_CORE.submodule_search_locations
    folder = Path(next(iter(MEGATRON_CORE.submodule_search_locations))) / "optimizer"
    text = (folder / "__init__.py").read_text(encoding="utf-8").splitlines()
    rank_lines = [
        n for n, line in enumerate(text, 1) if re.search(r"len\(param\.shape\) == 1", line)
    ]
    assert len(rank_lines) == 2
    report = deadweight.lint_paths([folder], config=None)
    findings = report.by_code("DW502")
    assert [(Path(f.location.file).name, f.location.line) for f in findings] == [
        ("__init__.py", line) for line in rank_lines
    ]
    assert {f.location.function for f in findings} == {"get_standard_config_overrides"}


def test_dw502_quiet_on_torch_optim_and_the_transformers_trainer() -> None:
    """torch.optim groups tensors by rank for other reasons (Adafactor's factored second
    moment, in a loop that also decays), and the Trainer decides decay by name."""
    import torch
    import transformers

    paths = [Path(torch.__file__).parent / "optim"]
    paths += [Path(transformers.__file__).parent / f for f in ("trainer.py", "trainer_pt_utils.py")]
    assert deadweight.lint_paths(paths, config=None).by_code("DW502") == []
