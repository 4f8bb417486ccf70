"""The two seeded bugs, made the way a user's edit would make them, on a tiny
random-initialised Llama of transformers' real code, and the optimizer groups of
the usual recipe (no weight decay for tensors of fewer than 2 dimensions)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.tiny_transformers import llama_config

VOCAB = 100
SEQ = 16


def tiny_llama(seed: int = 0) -> Any:
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config()).train()


def detach_first_layer(model: Any) -> set[str]:
    """Layer 0's output is detached: it and the embedding never get a gradient.
    Returns the names that are then cut off."""

    def detached(_module: nn.Module, _inputs: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return output.detach()
        return (output[0].detach(), *output[1:])

    model.model.layers[0].register_forward_hook(detached)
    return {
        n
        for n, _ in model.named_parameters()
        if n.startswith(("model.embed_tokens.", "model.layers.0."))
    }


def scalar_before_final_norm(model: Any) -> str:
    """A shape-[1] scalar multiplies the hidden state right before the final RMSNorm,
    which cancels it (the second incident). Returns its name."""
    model.model.scale = nn.Parameter(torch.ones(1))

    def scaled(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * model.model.scale, *args[1:])

    model.model.norm.register_forward_pre_hook(scaled)
    return "model.scale"


def decay_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """The common recipe: decay matrices, not vectors or scalars (a shape rule)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def batches(count: int, batch: int = 4, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=gen) for _ in range(count)]


def assert_detached_layer_found(check: Any, report: Any, cut: set[str]) -> None:
    """check names the cut-off parameters (DW101) and watch sees them never move (DW301)."""
    no_grad = [f for f in check.findings if f.code == "DW101"]
    assert len(no_grad) == 1 and set(no_grad[0].params) == cut, check
    never = [f for f in report.findings if f.code == "DW301"]
    assert len(never) == 1 and set(never[0].params) == cut, report


def assert_cancelled_scalar_found(check: Any, name: str) -> None:
    """At step 0: cancelled by the norm (DW104), left undecayed by the shape rule (DW203),
    and an adaptive optimizer will drift it (DW204)."""
    for code in ("DW104", "DW203", "DW204"):
        hits = [f for f in check.findings if f.code == code]
        assert hits and name in hits[0].params, (code, check)


class SeededBugs:
    """The three runs every framework's loop gets: healthy (at each of its precisions),
    a detached layer, a cancelled scalar. A subclass provides `loop(model, precision)`
    returning the step-0 check's report and the watch's report."""

    precisions: tuple[str, ...] = ()

    def loop(self, model: Any, precision: str) -> tuple[Any, Any]:
        raise NotImplementedError

    def test_a_healthy_loop_has_no_findings(self) -> None:
        for precision in self.precisions:
            check, report = self.loop(tiny_llama(), precision)
            assert not check.findings and not report.findings, (precision, check, report)

    def test_a_detached_layer_is_named_by_check_and_watch(self) -> None:
        model = tiny_llama()
        cut = detach_first_layer(model)
        check, report = self.loop(model, self.precisions[0])
        assert_detached_layer_found(check, report, cut)

    def test_a_cancelled_scalar_is_caught_at_step_0(self) -> None:
        model = tiny_llama()
        name = scalar_before_final_norm(model)
        check, _ = self.loop(model, self.precisions[0])
        assert_cancelled_scalar_found(check, name)
