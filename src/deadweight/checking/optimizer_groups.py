"""What an optimizer will do with each parameter: its group, learning rate, decay, rule.

Works for any `torch.optim.Optimizer` subclass: only `param_groups` is read (a
tensor there may be a parameter's main copy, `wrappers.main_copy`, and counts as the
parameter). The
update rule is recognised from the group's hyper-parameters, so optimizers from
other libraries that follow Adam's conventions are understood too.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from deadweight import wrappers
from deadweight.checking.check_stats import GroupInfo, OptimizerFacts


def optimizer_facts(model: nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerFacts:
    names = {id(p): n for n, p in model.named_parameters()}  # tied parameters appear once
    # megatron-core's mixed-precision optimizers step fp32 main copies of the parameters
    for n, p in model.named_parameters():
        copy = wrappers.main_copy(p)
        if copy is not None:
            names.setdefault(id(copy), n)
    seen = Counter(id(p) for g in optimizer.param_groups for p in g["params"])
    groups = []
    group_of: dict[str, int] = {}
    foreign = []
    for index, group in enumerate(optimizer.param_groups):
        members = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                foreign.append({"group": index, "shape": list(p.shape), "dtype": str(p.dtype)})
                continue
            if name not in group_of:
                group_of[name] = index
                members.append(name)
        groups.append(_group_info(optimizer, index, group, tuple(members)))
    by_name = dict(model.named_parameters())
    return OptimizerFacts(
        name=type(optimizer).__name__,
        groups=groups,
        group_of=group_of,
        not_in_optimizer=[n for n, p in by_name.items() if p.requires_grad and n not in group_of],
        frozen_in_optimizer=[n for n in group_of if not by_name[n].requires_grad],
        foreign=foreign,
        duplicates=[names[i] for i, count in seen.items() if count > 1 and i in names],
    )


def _group_info(
    optimizer: torch.optim.Optimizer, index: int, group: dict[str, Any], names: tuple[str, ...]
) -> GroupInfo:
    betas = group.get("betas")
    eps = group.get("eps")
    if betas is not None and eps is not None:
        rule = "adam"
    elif "alpha" in group and eps is not None:
        rule = "rmsprop"
    elif "lr_decay" in group and eps is not None:
        rule = "adagrad"
    elif "momentum" in group and eps is None:
        rule = "sgd"
    else:
        rule = "unknown"
    lr = group.get("lr")
    return GroupInfo(
        index=index,
        lr=float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None,
        initial_lr=float(group["initial_lr"]) if "initial_lr" in group else None,
        weight_decay=float(group.get("weight_decay", 0.0) or 0.0),
        decoupled=isinstance(optimizer, torch.optim.AdamW)
        or bool(group.get("decoupled_weight_decay")),
        rule=rule,
        betas=(float(betas[0]), float(betas[1])) if betas is not None else None,
        eps=float(eps) if eps is not None else None,
        names=names,
    )
