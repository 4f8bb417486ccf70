"""A variational autoencoder trained the way hand-written loops are: an encoder and a
decoder called one after the other, the sample drawn between them, an Accelerate
loop, and a scheduler imported from transformers, first thing in the script.

SEED_CUT=1 detaches the encoder's hidden layer: its first Linear never learns.
"""

# ruff: noqa: I001  (the import order is what this script is about)

from transformers import get_linear_schedule_with_warmup  # before torch, as scripts do

import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

CUT = os.environ.get("SEED_CUT") == "1"
STEPS = int(os.environ.get("STEPS", "3"))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(12, 16)
        self.mu = nn.Linear(16, 4)
        self.log_var = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.hidden(x))
        if CUT:
            h = h.detach()  # the seeded cut
        return self.mu(h), self.log_var(h)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 12))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


def main() -> None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    encoder, decoder = Encoder(), Decoder()
    optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=1e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, STEPS)
    data = torch.utils.data.DataLoader(torch.randn(16 * STEPS, 12), batch_size=16)
    encoder, decoder, optimizer, data, scheduler = accelerator.prepare(
        encoder, decoder, optimizer, data, scheduler
    )
    for x in data:
        mu, log_var = encoder(x)
        z = mu + torch.exp(0.5 * log_var) * torch.randn_like(mu)
        recon = decoder(z)
        kl = -0.5 * torch.mean(1 + log_var - mu.pow(2) - log_var.exp())
        accelerator.backward(F.mse_loss(recon, x) + kl)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accelerator.print("trained", STEPS, "steps")


if __name__ == "__main__":
    main()
