"""A plain DDP training script, as torchrun runs it; rank 0 alone rescales one weight."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
tamper = len(sys.argv) > 1 and sys.argv[1] == "tamper"
g = torch.Generator().manual_seed(rank)
for step in range(45):
    if tamper and step == 10 and rank == 0:
        with torch.no_grad():
            net[2].weight.mul_(0.5)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
dist.destroy_process_group()
