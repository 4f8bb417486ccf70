"""Measure whether optimizer steps are taken with mode-dependent modules in eval mode.

The loop that runs a validation pass (`model.eval()`) and forgets `model.train()`
trains on: dropout is off, BatchNorm normalises with its running statistics and stops
updating them, LayerDrop keeps every layer. Nothing raises.

At attach time the modules whose forward depends on `training` are listed once:
dropout with p > 0 (`nn.Dropout*`, and modules holding a float `dropout`/`layerdrop`
rate they apply with `training=self.training`, as transformers' attention does),
BatchNorm and InstanceNorm that track running statistics. Each optimizer step then reads
their `training` flags in one C-level pass (`all(map(attrgetter("training"), ...))`):
no Python call per module, nothing on the device.

When some are in eval mode, which of them matter is decided once per episode:

1. a module inside a frozen part put in eval on purpose is left out: the largest
   subtree in eval mode that contains it holds no trainable parameter (a frozen
   backbone, a frozen perceptual-loss network, a teacher inside the model);
2. normalization layers in eval while their model's root module trains are left out:
   statistics frozen one by one on purpose (mmdetection's `norm_eval`, detection
   fine-tuning);
3. of the rest, a module counts once a forward with gradients enabled shows that
   something trainable is upstream of it or inside it (its input requires grad, or its
   own parameters are trainable): a one-shot forward hook on those modules only,
   removed once it has run.

The episode is reported (an `eval_mode` event, from the first step it was seen) at the
next step when modules still in eval count, and closed (`train_mode`) when they all
train again.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

Emit = Callable[[dict[str, Any]], None]

# Attributes through which a module applies dropout itself (`F.dropout(x, self.dropout,
# training=self.training)`): transformers' attention and encoder layers, LayerDrop.
_RATE_ATTRIBUTES = ("dropout", "attention_dropout", "activation_dropout", "attn_dropout",
                    "hidden_dropout", "dropout_p", "layerdrop", "drop_prob")  # fmt: skip
# Episodes reported per optimizer: a loop that flips modes every step says it early.
MAX_EPISODES = 16
# Modules named in one event.
MAX_NAMES = 64

_training = operator.attrgetter("training")


def mode_kind(module: nn.Module) -> str | None:
    """What in `module`'s forward depends on `training`, or None."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return "dropout" if module.p > 0 else None
    if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)):
        return "norm" if module.track_running_stats else None
    for attr in _RATE_ATTRIBUTES:
        rate = vars(module).get(attr)
        if isinstance(rate, float) and rate > 0:
            return "layerdrop" if attr == "layerdrop" else "dropout"
    return None


class _Entry:
    __slots__ = ("chain", "kind", "module", "name", "root")

    def __init__(
        self, name: str, module: nn.Module, kind: str, root: nn.Module, chain: list[nn.Module]
    ) -> None:
        self.name, self.module, self.kind, self.root = name, module, kind, root
        self.chain = chain  # root ... parent: the modules that contain it


class TrainingMode:
    """The check for one optimizer over the models that own its parameters."""

    def __init__(self, index: int, models: Sequence[tuple[str, nn.Module]], emit: Emit) -> None:
        """`models`: (name prefix, root module) pairs."""
        self.index = index
        self.emit = emit
        self.entries: list[_Entry] = []
        for prefix, root in models:
            parents: dict[str, nn.Module] = {}
            for name, module in root.named_modules(remove_duplicate=True):
                parents[name] = module
                kind = mode_kind(module)
                if kind is None:
                    continue
                chain = [root] + [
                    parents[".".join(name.split(".")[:k])]
                    for k in range(1, name.count(".") + 1)
                    if ".".join(name.split(".")[:k]) in parents
                ]
                self.entries.append(_Entry(prefix + (name or "(root)"), module, kind, root, chain))
        self.modules = [e.module for e in self.entries]
        self.episode: _Episode | None = None
        self.episodes = 0

    def before_step(self, step: int) -> None:
        if all(map(_training, self.modules)):  # the every-step path: C-level, no call per module
            if self.episode is not None:
                self._end(step)
            return
        if self.episode is None:
            if self.episodes >= MAX_EPISODES:
                return
            self.episodes += 1
            self.episode = _Episode(step, self.entries)
        episode = self.episode
        if episode.reported:
            return
        counted = episode.counted()
        if counted is not None and counted:
            episode.reported = True
            names = [self.entries[i].name for i in counted]
            self.emit(
                {
                    "event": "eval_mode",
                    "optimizer": self.index,
                    "step": episode.start,
                    "seen_at": step,
                    "modules": names[:MAX_NAMES],
                    "module_count": len(names),
                    "kinds": sorted({self.entries[i].kind for i in counted}),
                }
            )

    def _end(self, step: int) -> None:
        episode, self.episode = self.episode, None
        if episode is None:
            return
        episode.close()
        if episode.reported:
            self.emit({"event": "train_mode", "optimizer": self.index, "step": step})

    def close(self) -> None:
        if self.episode is not None:
            self.episode.close()


class _Episode:
    """Modules seen in eval mode from `start` on, and what a forward showed about them."""

    def __init__(self, start: int, entries: list[_Entry]) -> None:
        self.start = start
        self.entries = entries
        self.reported = False
        self.upstream: dict[int, bool] = {}  # position -> something trainable upstream/inside
        self.handles: dict[int, RemovableHandle] = {}
        trainable: dict[int, bool] = {}  # id(subtree) -> holds a trainable parameter
        self.candidates: list[int] = []
        for i, e in enumerate(entries):
            if e.module.training:
                continue
            top = e.module
            for parent in reversed(e.chain):  # the largest subtree in eval mode holding it
                if parent.training:
                    break
                top = parent
            key = id(top)
            if key not in trainable:
                trainable[key] = any(p.requires_grad for p in top.parameters())
            if not trainable[key]:
                continue  # a frozen part in eval on purpose
            if e.kind == "norm" and e.root.training:
                continue  # statistics frozen one by one while the model trains
            self.candidates.append(i)
            with contextlib.suppress(Exception):
                self.handles[i] = e.module.register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or i in self.upstream:
                return
            with contextlib.suppress(Exception):
                self.upstream[i] = any(
                    isinstance(a, torch.Tensor) and a.requires_grad for a in args
                ) or any(p.requires_grad for p in module.parameters())
                handle = self.handles.pop(i, None)
                if handle is not None:
                    handle.remove()

        return hook

    def counted(self) -> list[int] | None:
        """The modules still in eval that count; None while no forward has decided any."""
        still = [i for i in self.candidates if not self.entries[i].module.training]
        decided = [i for i in still if i in self.upstream]
        if not decided:
            return None
        return [i for i in decided if self.upstream[i]]

    def close(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()
