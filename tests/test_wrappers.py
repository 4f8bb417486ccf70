"""Looking through the wrappers frameworks hand back, with their real classes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deadweight
from deadweight import wrappers


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _train(model: nn.Module, opt: object, steps: int = 3) -> None:
    for _ in range(steps):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()  # type: ignore[attr-defined]
        opt.zero_grad()  # type: ignore[attr-defined]


def test_a_plain_optimizer_is_itself() -> None:
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert wrappers.torch_optimizer(opt) is opt


def test_accelerate_optimizer_is_looked_through() -> None:
    accelerate = pytest.importorskip("accelerate")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, wrapped = accelerate.Accelerator(cpu=True).prepare(model, opt)
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    assert "_optimizer_step_pre_hooks" not in vars(wrapped)  # why watch used to crash
    assert wrappers.torch_optimizer(wrapped) is opt
    with deadweight.watch(model, wrapped) as w:
        _train(model, wrapped)
    assert w.stats.steps == 3
    assert set(w.stats.params) == {n for n, _ in _model().named_parameters()}


def test_lightning_and_fabric_optimizers_are_looked_through() -> None:
    pytest.importorskip("lightning")
    from lightning.fabric import Fabric
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert wrappers.torch_optimizer(LightningOptimizer(opt)) is opt
    fabric = Fabric(accelerator="cpu", devices=1)
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    fmodel, fopt = fabric.setup(model, inner)
    assert isinstance(fopt, torch.optim.Optimizer)  # Fabric imitates the class
    assert wrappers.torch_optimizer(fopt) is inner
    assert wrappers.user_model(fmodel) is model
    with deadweight.watch(fmodel, fopt) as w:
        for _ in range(3):
            fabric.backward(fmodel(torch.randn(8, 4)).pow(2).mean())
            fopt.step()
            fopt.zero_grad()
    assert w.stats.steps == 3
    assert set(w.stats.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_any_object_holding_an_optimizer_is_looked_through() -> None:
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)

    class Engine:  # DeepSpeed's engine, transformers' Trainer: `.optimizer`
        def __init__(self) -> None:
            self.optimizer = opt

    class Outer:
        def __init__(self) -> None:
            self._optimizer = Engine()

    assert wrappers.torch_optimizer(Engine()) is opt
    assert wrappers.torch_optimizer(Outer()) is opt


def test_a_real_optimizer_wrapping_another_is_watched_itself() -> None:
    """A Lookahead runs Optimizer.__init__ and its step is the whole update."""
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)

    class Lookahead(torch.optim.Optimizer):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer
            super().__init__(optimizer.param_groups, {})

        def step(self, closure=None):  # type: ignore[no-untyped-def]
            return self.optimizer.step(closure)

    outer = Lookahead(base)
    assert wrappers.torch_optimizer(outer) is outer


def test_a_cycle_or_nothing_inside_is_none() -> None:
    class Loop:
        def __init__(self) -> None:
            self.optimizer = self

    class Ring:
        pass

    a, b = Ring(), Ring()
    a.optimizer, b.optimizer = b, a  # type: ignore[attr-defined]
    assert wrappers.torch_optimizer(Loop()) is None
    assert wrappers.torch_optimizer(a) is None
    assert wrappers.torch_optimizer(object()) is None


def test_watch_says_what_it_needs_for_a_non_optimizer() -> None:
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer or a framework.s wrapper"):
        deadweight.watch(_model(), object())


def test_a_trainer_after_create_optimizer_is_looked_through(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1
    )
    trainer = transformers.Trainer(model=model, args=args)
    trainer.create_optimizer()
    assert wrappers.torch_optimizer(trainer) is trainer.optimizer


def test_compiled_and_data_parallel_models_are_named_as_written() -> None:
    model = _model()
    compiled = torch.compile(model)  # not called: nothing is compiled
    assert next(n for n, _ in compiled.named_parameters()) == "_orig_mod.0.weight"
    assert wrappers.user_model(compiled) is model
    assert wrappers.user_model(nn.DataParallel(compiled)) is model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deadweight.watch(compiled, opt) as w:
        pass
    assert set(w.stats.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_pin_takes_a_compiled_models_own_names() -> None:
    model = _model()
    compiled = torch.compile(model)
    handle = deadweight.pin(compiled, "2.bias")
    assert handle.param is model[2].bias
    handle.remove()
    handle = deadweight.pin(compiled, "_orig_mod.2.bias")
    assert handle.param is model[2].bias
    handle.remove()
