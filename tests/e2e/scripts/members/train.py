"""A Sequential's members called one by one (to log each member's activations), a
loss module at the end, torch imported inside main(); started as
`python -m members.train`.

SEED_CUT=1 detaches the output of the first member's hidden layer: it never learns.
"""

import os

CUT = os.environ.get("SEED_CUT") == "1"
STEPS = int(os.environ.get("STEPS", "3"))


def main() -> None:
    import torch
    from torch import nn

    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = nn.Linear(8, 32)
            self.out = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.hidden(x))
            if CUT:
                h = h.detach()  # the seeded cut
            return self.out(h)

    torch.manual_seed(0)
    model = nn.Sequential(Stem(), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(STEPS):
        x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
        h = x
        for member in model:
            h = member(h)
            print("activation rms", h.detach().pow(2).mean().sqrt().item())
        loss = criterion(h, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("trained", STEPS, "steps")


if __name__ == "__main__":
    main()
