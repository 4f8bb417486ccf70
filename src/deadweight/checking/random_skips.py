"""Did a module sit out the checked forward by chance? Redraw the random state and see.

LayerDrop (wav2vec2, HuBERT, BART-family `encoder_layerdrop`) and stochastic depth
skip whole layers at random in train mode: in one forward a layer may not run, so
its parameters get no gradient, and in the next it runs. A check that measured one
draw would call that "no gradient" at random. When some module never ran, the
forward is re-run under no_grad with up to `MAX_REDRAWS` other random states,
noting which modules take part:

- a module that runs in some draw was skipped at random: if a redraw ran more of
  the model, the whole measurement is repeated on that draw, so a real cut inside
  a skipped layer is still found;
- a module that runs in no draw is skipped by the data or the code (an expert no
  token is routed to, an unused head): it stays a "never ran" cut.

Costs nothing unless a module never ran; then one no-grad forward per redraw (it
stops at the first draw in which every module runs) and, when one helps, a second
measurement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from deadweight.checking import module_trace
from deadweight.checking.check_stats import GradFlowStats, RandomSkip
from deadweight.checking.state import preserved, seeded

# Three redraws: with LayerDrop p = 0.1 on 12 layers (wav2vec2-base) a draw runs
# every layer with probability 0.9^12 = 0.28, so one of three does with 0.63; and a
# given layer skipped at random sits out all four draws with probability 1e-4.
MAX_REDRAWS = 3
_SEED_BASE = 0x5EED  # fixed, so a check is reproducible
# Where models keep their skip probability (transformers configs, timm, torchvision).
_OPTIONS = (
    "layerdrop",
    "encoder_layerdrop",
    "decoder_layerdrop",
    "layer_drop",
    "drop_path_rate",
    "drop_path_prob",
    "stochastic_depth_prob",
    "stochastic_depth_rate",
)
_SUBCONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")


def sat_out(stats: GradFlowStats) -> frozenset[str]:
    """The outermost modules that never ran in the measured forward (and hold a
    parameter left without gradient)."""
    missing = {p.name for p in stats.no_grad_params}
    return frozenset(
        c.module for c in stats.cuts if c.kind == "never-ran" and c.module and c.params & missing
    )


def measure_over_draws(
    measure: Callable[[], GradFlowStats], model: nn.Module, loss_fn: Callable[[], Any]
) -> GradFlowStats:
    """`measure()`, and when a module sat out, the redraws above; the stats returned
    carry `random_skips`, and their never-ran cuts of randomly skipped modules have
    the kind "skipped-at-random"."""
    stats = measure()
    first = sat_out(stats)
    if not first:
        return stats
    draws = _redraw(model, loss_fn)
    best = min(draws, key=lambda d: len(d[1]), default=None)
    final = stats
    if best is not None and len(best[1]) < len(first):
        with seeded(best[0]):
            final = measure()
    # A re-measurement repeats a redraw (same seed): it is not another draw.
    sets = [first, *(missing for _, missing in draws)]
    skips: dict[str, RandomSkip] = {}
    still = sat_out(final)
    modules = dict(model.named_modules())
    for path in sorted(first | still):
        ran = sum(not _inside(path, missing) for missing in sets)
        if ran == 0:
            continue  # the data or the code skips it: a real "never ran"
        module = modules.get(path)
        skips[path] = RandomSkip(
            module=path,
            module_type=type(module).__name__ if module is not None else "",
            params=tuple(sorted(_params_under(model, path))),
            ran=ran,
            draws=len(sets),
            in_measured=path in still,
            option=option_of(model, path),
        )
    final.random_skips = skips
    final.cuts = [
        replace(c, kind="skipped-at-random")
        if c.kind == "never-ran" and c.module in skips and skips[c.module].in_measured
        else c
        for c in final.cuts
    ]
    return final


def _redraw(model: nn.Module, loss_fn: Callable[[], Any]) -> list[tuple[int, frozenset[str]]]:
    """(seed, the outermost parameter-holding modules that sat out) per redraw; stops
    at the first draw in which every module ran, or when `loss_fn` raises."""
    names = {id(m): n for n, m in model.named_modules()}
    holders = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters())]
    out: list[tuple[int, frozenset[str]]] = []
    ran: set[str] = set()

    def note(module: nn.Module, args: tuple) -> None:
        name = names.get(id(module))
        if name:
            ran.add(name)

    handle = register_module_forward_pre_hook(note)
    # values, buffers, grads and the random state go back
    with preserved(model), handle:  # a RemovableHandle removes itself on exit
        for k in range(MAX_REDRAWS):
            seed = _SEED_BASE + k
            ran.clear()
            try:
                with seeded(seed), torch.no_grad():
                    loss_fn()
            except Exception:
                break  # the check's own forward already ran: this one tells nothing
            took_part = module_trace.took_part(ran)
            missing = _outermost(h for h in holders if h not in took_part)
            out.append((seed, missing))
            if not missing:
                break
    return out


def option_of(model: nn.Module, path: str) -> str | None:
    """The setting that skips `path` at random, as the user would write it
    ("layerdrop=0.1", "encoder_layerdrop=0.2"), when the model keeps one by a
    known name: on the module or one of its ancestors, else in the model's config."""
    modules = dict(model.named_modules())
    parts = path.split(".")
    for i in range(len(parts), -1, -1):
        found = _nonzero_option(modules.get(".".join(parts[:i])), path)
        if found is not None:
            return found
    config = getattr(model, "config", None)
    for holder in [config, *(getattr(config, k, None) for k in _SUBCONFIGS)]:
        found = _nonzero_option(holder, path)
        if found is not None:
            return found
    return None


def _nonzero_option(holder: object, path: str) -> str | None:
    if holder is None:
        return None
    # An encoder's layer is skipped by encoder_layerdrop, a decoder's by decoder_layerdrop.
    side = next((s for s in ("encoder", "decoder") if s in path.split(".")), None)
    names = sorted(_OPTIONS, key=lambda n: not (side and n.startswith(side)))
    for name in names:
        value = getattr(holder, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return f"{name}={value:g}"
    return None


def _inside(path: str, modules: Iterable[str]) -> bool:
    return any(path == m or path.startswith(m + ".") for m in modules)


def _outermost(paths: Iterable[str]) -> frozenset[str]:
    ordered = sorted(paths, key=lambda p: p.count("."))
    kept: list[str] = []
    for p in ordered:
        if not _inside(p, kept):
            kept.append(p)
    return frozenset(kept)


def _params_under(model: nn.Module, path: str) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and n.startswith(path + ".")]
