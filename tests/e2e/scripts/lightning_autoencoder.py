"""An autoencoder as a LightningModule whose training_step calls its encoder and its
decoder in turn, trained with Trainer.fit on the CPU.

SEED_CUT=1 detaches the encoder's hidden layer: its first Linear never learns.
"""

import os

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

CUT = os.environ.get("SEED_CUT") == "1"
STEPS = int(os.environ.get("STEPS", "3"))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(12, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(x))
        if CUT:
            h = h.detach()  # the seeded cut
        return self.out(h)


class AutoEncoder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.decoder = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 12))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        z = self.encoder(batch)
        loss = F.mse_loss(self.decoder(z), batch)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    L.seed_everything(0)
    data = torch.utils.data.DataLoader(torch.randn(16 * STEPS, 12), batch_size=16)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(AutoEncoder(), data)
    print("trained", STEPS, "steps")


if __name__ == "__main__":
    main()
