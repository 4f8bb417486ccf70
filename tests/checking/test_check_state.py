"""`deadweight.check` leaves everything as it found it, also when `loss_fn` raises.

Every guarantee is tested on its own, on a model with Dropout and BatchNorm whose
forward also draws from Python's `random` and NumPy's global RNG and runs a custom
`autograd.Function`, both for a healthy loss and for a loss function that raises
half-way through the forward (after BatchNorm has updated its statistics and
Dropout has drawn its mask).
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

import deadweight


class Boom(RuntimeError):
    pass


class _Scale(torch.autograd.Function):
    """A trivial custom Function, so that check has to wrap `Function.apply`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2.0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 3)
        self.explode = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.fc1(x))))
        # stands for data-dependent noise / augmentation drawn from the other RNGs
        h = h + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        h = _Scale.apply(h)
        if self.explode:
            raise Boom("exploded mid-forward")
        return self.fc2(h)


SCENARIOS = ["healthy", "raises"]


def _setup(scenario: str) -> tuple[Net, Callable[[], torch.Tensor]]:
    model = Net().train()
    model.explode = scenario == "raises"
    x = torch.randn(6, 8)
    y = torch.randint(0, 3, (6,))
    return model, lambda: F.cross_entropy(model(x), y)


def _run(model: nn.Module, loss_fn: Callable[[], torch.Tensor], scenario: str) -> None:
    if scenario == "raises":
        with pytest.raises(deadweight.LossFnError) as info:
            deadweight.check(model, loss_fn)
        assert isinstance(info.value.__cause__, Boom)
    else:
        report = deadweight.check(model, loss_fn)
        assert not report.by_code("DW101")


def _hook_state() -> tuple[int, ...]:
    return (
        len(nn_module._global_forward_pre_hooks),
        len(nn_module._global_forward_hooks),
        len(getattr(nn_module, "_global_forward_hooks_always_called", {})),
        len(getattr(nn_module, "_global_forward_hooks_with_kwargs", {})),
    )


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_parameters_bitwise_unchanged(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    _run(model, loss_fn, scenario)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (obj, values) in before.items():
        assert after[name] is obj, name
        assert torch.equal(after[name].detach(), values), name
        assert after[name].requires_grad


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_none_grads_stay_none(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    assert all(p.grad is None for p in model.parameters())
    _run(model, loss_fn, scenario)
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_preexisting_grads_keep_identity_and_values(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    # one parameter without grad among those with one
    model.fc2.bias.grad = None
    before = {
        n: (p.grad, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()
    }
    _run(model, loss_fn, scenario)
    for name, p in model.named_parameters():
        obj, values = before[name]
        assert p.grad is obj, name
        if values is not None:
            assert torch.equal(p.grad, values), f"backward accumulated into {name}.grad"


def test_preexisting_grads_do_not_change_the_verdict() -> None:
    model, loss_fn = _setup("healthy")
    model.unused = nn.Linear(2, 2)  # never called: DW101
    clean = deadweight.check(model, loss_fn)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    dirty = deadweight.check(model, loss_fn)
    names = {p for f in clean.by_code("DW101") for p in f.params}
    assert names == {"unused.weight", "unused.bias"}
    assert {p for f in dirty.by_code("DW101") for p in f.params} == names
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_batchnorm_buffers_restored(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
        model.bn.num_batches_tracked.fill_(7)
    before = {n: (b, b.clone()) for n, b in model.named_buffers()}
    assert set(before) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    _run(model, loss_fn, scenario)
    after = dict(model.named_buffers())
    assert after.keys() == before.keys()
    for name, (obj, values) in before.items():
        assert after[name] is obj, name
        assert torch.equal(after[name], values), name


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_forward_does_change_buffers_so_restoring_is_not_vacuous(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    before = {n: b.clone() for n, b in model.named_buffers()}
    with contextlib.suppress(Boom):
        loss_fn()
    assert not torch.equal(model.bn.running_mean, before["bn.running_mean"])
    assert int(model.bn.num_batches_tracked) == 1


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_train_eval_flags_restored(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    model.train()
    model.drop.eval()  # a mixed configuration must come back exactly
    before = {n: m.training for n, m in model.named_modules()}
    _run(model, loss_fn, scenario)
    assert {n: m.training for n, m in model.named_modules()} == before


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_eval_model_flags_restored(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    model.eval()
    model.bn.train()
    before = {n: m.training for n, m in model.named_modules()}
    _run(model, loss_fn, scenario)
    assert {n: m.training for n, m in model.named_modules()} == before


class TogglingNet(Net):
    """A forward that switches a submodule to eval itself (a common 'freeze BN' hack)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.bn.eval()
        self.drop.train(False)
        return super().forward(x)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_forward_that_toggles_a_submodule_to_eval_is_restored(scenario: str) -> None:
    model = TogglingNet().train()
    model.explode = scenario == "raises"
    x = torch.randn(6, 8)
    y = torch.randint(0, 3, (6,))
    assert model.bn.training and model.drop.training
    _run(model, lambda: F.cross_entropy(model(x), y), scenario)
    assert model.bn.training
    assert model.drop.training
    assert all(m.training for m in model.modules())


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_torch_rng_restored(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    state = torch.get_rng_state()
    _run(model, loss_fn, scenario)
    assert torch.equal(torch.get_rng_state(), state)
    # and the next draw is the one the caller would have got
    g = torch.Generator()
    g.set_state(state)
    assert torch.equal(torch.rand(5), torch.rand(5, generator=g))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_python_random_restored(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    random.seed(1234)
    state = random.getstate()
    _run(model, loss_fn, scenario)
    assert random.getstate() == state


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_numpy_rng_restored(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    np.random.seed(1234)
    expected = np.random.rand(3)
    np.random.seed(1234)
    _run(model, loss_fn, scenario)
    np.testing.assert_array_equal(np.random.rand(3), expected)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_forward_does_consume_every_rng_so_restoring_is_not_vacuous(scenario: str) -> None:
    _, loss_fn = _setup(scenario)
    t, p, n = torch.get_rng_state(), random.getstate(), np.random.get_state()
    with contextlib.suppress(Boom):
        loss_fn()
    assert not torch.equal(torch.get_rng_state(), t)
    assert random.getstate() != p
    after = np.random.get_state()
    assert not (np.array_equal(after[1], n[1]) and after[2] == n[2])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_global_module_hooks_left(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    pre = dict(nn_module._global_forward_pre_hooks)
    post = dict(nn_module._global_forward_hooks)
    counts = _hook_state()
    _run(model, loss_fn, scenario)
    assert dict(nn_module._global_forward_pre_hooks) == pre
    assert dict(nn_module._global_forward_hooks) == post
    assert _hook_state() == counts


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_user_global_hooks_survive_and_still_fire(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    seen: list[str] = []
    handle = nn_module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    try:
        _run(model, loss_fn, scenario)
        assert "Linear" in seen  # the user's hook ran during the check
        seen.clear()
        model.explode = False
        model(torch.randn(4, 8))
        assert "Linear" in seen  # and is still installed afterwards
    finally:
        handle.remove()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_torch_function_mode_left(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    depth = torch._C._len_torch_function_stack()
    _run(model, loss_fn, scenario)
    assert torch._C._len_torch_function_stack() == depth


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_torch_function_mode_left_when_caller_has_one(scenario: str) -> None:
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    model, loss_fn = _setup(scenario)
    with Counting():
        depth = torch._C._len_torch_function_stack()
        _run(model, loss_fn, scenario)
        assert torch._C._len_torch_function_stack() == depth
        Counting.calls = 0
        torch.ones(1) + 1
        assert Counting.calls > 0  # the caller's mode is still the active one


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_function_apply_restored(scenario: str) -> None:
    original = torch.autograd.Function.__dict__["apply"]
    model, loss_fn = _setup(scenario)
    _run(model, loss_fn, scenario)
    assert torch.autograd.Function.__dict__["apply"] is original
    assert "apply" not in _Scale.__dict__
    x = torch.ones(2, requires_grad=True)
    _Scale.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 2.0))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_grad_mode_restored(scenario: str) -> None:
    model, loss_fn = _setup(scenario)
    with torch.no_grad():
        _run(model, loss_fn, scenario)
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


def test_check_is_repeatable() -> None:
    model, loss_fn = _setup("healthy")
    first = deadweight.check(model, loss_fn).to_dict()
    second = deadweight.check(model, loss_fn).to_dict()
    assert first == second


def test_parameters_unchanged_when_forward_writes_weights_in_place() -> None:
    emb = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        emb.weight.mul_(5.0)  # rows with norm > 1 get renormalised by the lookup
    model = nn.Sequential(emb, nn.Linear(4, 1))
    ids = torch.tensor([1, 2, 3])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    deadweight.check(model, lambda: model(ids).sum())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


class Rebinding(nn.Module):
    """A forward that rebinds a buffer to a new tensor instead of updating it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return self.fc(x)


def test_rebound_buffer_gets_the_users_tensor_back() -> None:
    model = Rebinding()
    steps = model.steps
    report = deadweight.check(model, lambda: model(torch.randn(3, 4)).sum())
    assert not report.findings
    assert model.steps is steps
    assert float(model.steps) == 0.0


def test_inputs_that_require_grad_get_no_grad() -> None:
    model, _ = _setup("healthy")
    x = torch.randn(6, 8, requires_grad=True)
    y = torch.randint(0, 3, (6,))
    extra = torch.zeros(3, requires_grad=True)  # a leaf outside the model, used by the loss
    report = deadweight.check(model, lambda: F.cross_entropy(model(x) + extra, y))
    assert not report.by_code("DW101")
    assert x.grad is None
    assert extra.grad is None


def test_loss_fn_that_zeroes_grads_does_not_lose_the_users_grads() -> None:
    model, loss_fn = _setup("healthy")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    before = {n: p.grad for n, p in model.named_parameters()}

    def closure() -> torch.Tensor:
        opt.zero_grad()  # set_to_none=True by default
        return loss_fn()

    report = deadweight.check(model, closure, opt)
    assert not report.by_code("DW101")
    for name, p in model.named_parameters():
        assert p.grad is before[name], name
        assert torch.equal(p.grad, torch.full_like(p, 3.0)), name


class _Failing(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        raise Boom("inside Function.forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def test_raising_inside_autograd_function_forward_restores_everything() -> None:
    model, _ = _setup("healthy")
    x = torch.randn(6, 8)
    original = torch.autograd.Function.__dict__["apply"]
    depth = torch._C._len_torch_function_stack()
    hooks = _hook_state()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()

    with pytest.raises(deadweight.LossFnError) as info:
        deadweight.check(model, lambda: _Failing.apply(model(x)).sum())
    assert isinstance(info.value.__cause__, Boom)
    assert torch.autograd.Function.__dict__["apply"] is original
    assert torch._C._len_torch_function_stack() == depth
    assert _hook_state() == hooks
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


class Checkpointed(nn.Module):
    """BatchNorm and Dropout inside reentrant checkpointing run again during backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # requires grad, so reentrant checkpointing is fine
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        return self.out(h)


def test_state_restored_when_backward_recomputes_the_forward() -> None:
    model = Checkpointed().train()
    x = torch.randn(5, 8)
    buffers = {n: (b, b.clone()) for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    report = deadweight.check(model, lambda: model(x).pow(2).mean())
    assert not report.by_code("DW101")
    for name, b in model.named_buffers():
        assert b is buffers[name][0]
        assert torch.equal(b, buffers[name][1]), name
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


def test_checking_a_submodule_leaves_the_other_modules_grads_alone() -> None:
    encoder, head = nn.Linear(4, 4), nn.Linear(4, 1)
    x = torch.randn(3, 4, requires_grad=True)
    x.grad = torch.full_like(x, 5.0)
    head.weight.grad = torch.ones_like(head.weight)
    grad = head.weight.grad
    report = deadweight.check(encoder, lambda: head(torch.relu(encoder(x))).sum())
    assert report.findings == ()
    assert head.weight.grad is grad
    assert torch.equal(head.weight.grad, torch.ones_like(head.weight))
    assert head.bias.grad is None
    assert torch.equal(x.grad, torch.full_like(x, 5.0))


def test_checking_a_submodule_with_the_rest_under_reentrant_checkpoint() -> None:
    encoder, head = nn.Linear(4, 4), nn.Linear(4, 1)
    x = torch.randn(3, 4)
    head.weight.grad = torch.ones_like(head.weight)

    def loss_fn() -> torch.Tensor:
        h = encoder(x)
        return torch.utils.checkpoint.checkpoint(head, h, use_reentrant=True).sum()

    report = deadweight.check(encoder, loss_fn)
    assert report.findings == ()
    assert torch.equal(head.weight.grad, torch.ones_like(head.weight))
    assert head.bias.grad is None


def _optimizer_in_backward(model: nn.Module) -> None:
    """The fused optimizer-step-in-backward pattern from the PyTorch tutorials."""
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def hook(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)


def test_parameters_unchanged_with_optimizer_step_in_backward_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    _optimizer_in_backward(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(3, 4)
    deadweight.check(model, lambda: model(x).pow(2).mean())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name


# -- autograd version counters, requires_grad and the other invisible state --------


def _tensor_state(model: nn.Module) -> dict[str, tuple[Any, ...]]:
    state: dict[str, tuple[Any, ...]] = {}
    for n, p in model.named_parameters():
        state["p:" + n] = (p._version, p.requires_grad, p.data_ptr(), p.dtype, tuple(p.shape))
    for n, b in model.named_buffers():
        state["b:" + n] = (b._version, b.data_ptr())
    return state


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_version_counters_and_requires_grad_unchanged(scenario: str) -> None:
    # BatchNorm's running stats are updated by the forward and restored in place: the
    # restore must not leave their version counters bumped (a graph that saved them
    # would refuse to backward).
    model, loss_fn = _setup(scenario)
    model.fc2.bias.requires_grad_(False)
    before = _tensor_state(model)
    _run(model, loss_fn, scenario)
    assert _tensor_state(model) == before


def test_version_counters_unchanged_after_probes() -> None:
    from deadweight.demos import layer_scalar_drift

    setup = layer_scalar_drift.make()
    before = _tensor_state(setup.model)
    values = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    report = deadweight.check(setup.model, setup.loss, setup.optimizer)
    assert report.by_code("DW104")  # the probes did scale the scalar
    assert _tensor_state(setup.model) == before
    for n, p in setup.model.named_parameters():
        assert torch.equal(p.detach(), values[n]), n


def test_everything_unchanged_in_one_go() -> None:
    """Values, requires_grad, .grad, training modes, RNG state and _version together."""
    model, loss_fn = _setup("healthy")
    model.fc1.weight.grad = torch.full_like(model.fc1.weight, 0.5)
    grad = model.fc1.weight.grad
    model.drop.eval()
    values = {n: t.detach().clone() for n, t in model.state_dict(keep_vars=True).items()}
    state = _tensor_state(model)
    modes = {n: m.training for n, m in model.named_modules()}
    rng = torch.get_rng_state()
    deadweight.check(model, loss_fn)
    assert _tensor_state(model) == state
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.fc1.weight.grad is grad and torch.equal(grad, torch.full_like(grad, 0.5))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "fc1.weight")
    for n, t in model.state_dict(keep_vars=True).items():
        assert torch.equal(t.detach(), values[n]), n


def test_embedding_max_norm_restore_keeps_version() -> None:
    emb = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        emb.weight.mul_(5.0)
    model = nn.Sequential(emb, nn.Linear(4, 1))
    ids = torch.tensor([1, 2, 3])
    before = _tensor_state(model)
    report = deadweight.check(model, lambda: model(ids).sum())
    assert _tensor_state(model) == before
    # a documented in-place renormalisation, not a bug: no DW109
    assert not report.by_code("DW109")


def test_a_version_counter_that_cannot_be_put_back_is_said_in_the_subject(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from deadweight.checking import state

    model, loss_fn = _setup("healthy")
    monkeypatch.setattr(state, "_SET_VERSION", None)  # a torch without the call
    report = deadweight.check(model, loss_fn)
    # BatchNorm's three buffers, at least, were restored in place
    note = report.subject["state_note"]
    assert re.search(r"version counters of ([3-9]|\d\d+) tensor\(s\) could not be put back", note)
    monkeypatch.undo()
    assert "state_note" not in deadweight.check(model, loss_fn).subject


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex128]
)
def test_a_write_no_tracer_sees_is_caught_in_every_dtype(dtype: torch.dtype) -> None:
    """The checksums at entry and at the end read the parameters' memory through integer
    views made once: a write between them, even one torch never sees (raw memory, as an
    extension kernel writes), must show in every dtype, including complex128 (two int64
    per element) in a transposed, non-contiguous layout."""
    import ctypes

    from deadweight.checking.state import ParamGuard

    base = torch.randn(3, 5).to(dtype)
    written = nn.Parameter(base.t())  # non-contiguous
    kept = nn.Parameter(torch.randn(4).to(dtype))
    guard = ParamGuard([("written", written), ("kept", kept)])
    ctypes.memset(written.data_ptr(), 0, written.element_size())  # one element, untraced
    writes = guard.writes()
    assert [(w.name, w.how, w.restored) for w in writes] == [("written", "unseen", False)]


def test_a_forward_that_rebinds_a_parameter_or_replaces_a_module_is_read_after_it() -> None:
    """The module cuts and the roles read the model as the forward left it: a
    parameter registered afresh inside the forward (FSDP2's root does so when no
    backward runs) is found where it now is, and a parameter whose module the forward
    replaced, which nothing in the model owns any more, does not stop the check."""

    class Rebinding(nn.Module):
        def __init__(self, replace: bool) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))
            self.aux = nn.Linear(4, 4)
            self.replace = replace

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.scale = nn.Parameter(self.scale.detach().clone())
            if self.replace:
                self.aux = nn.Identity()
            return (self.fc(x) * self.scale).sum() + (0 if self.replace else self.aux(x).sum())

    for replace in (False, True):
        torch.manual_seed(0)
        model, x = Rebinding(replace), torch.randn(2, 4)
        report = deadweight.check(model, lambda model=model, x=x: model(x))
        found = {f.code: f for f in report.findings}
        assert found["DW101"].params == ("scale",), report
        assert found["DW102"].params == ("scale",), report
