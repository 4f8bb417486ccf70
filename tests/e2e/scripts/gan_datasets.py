"""A GAN on a 2-D ring, started with torchrun: the real samples come from a datasets
Dataset (imported before torch), the generator and the discriminator each have an
optimizer, and the discriminator sees the generator's samples detached.

SEED_CUT=1 detaches the generator's first layer: it never learns.
"""

# ruff: noqa: I001  (the import order is what this script is about)

import datasets  # before torch: its config probes for torch first

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

CUT = os.environ.get("SEED_CUT") == "1"
STEPS = int(os.environ.get("STEPS", "3"))


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(noise))
        if CUT:
            h = h.detach()  # the seeded cut
        return self.out(h)


def ring(n: int) -> datasets.Dataset:
    angles = torch.rand(n) * 2 * math.pi
    points = torch.stack([angles.cos(), angles.sin()], 1) + 0.05 * torch.randn(n, 2)
    return datasets.Dataset.from_dict({"x": points.tolist()}).with_format("torch")


def main() -> None:
    torch.manual_seed(int(os.environ.get("RANK", "0")))
    G = Generator()
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    loader = torch.utils.data.DataLoader(ring(32 * STEPS), batch_size=32)
    for batch in loader:
        real = batch["x"]
        fake = G(torch.randn(len(real), 4))
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        opt_d.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(D(real), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        F.binary_cross_entropy_with_logits(D(fake), ones).backward()
        opt_g.step()
    print("trained", STEPS, "steps on rank", os.environ.get("RANK"))


if __name__ == "__main__":
    main()
