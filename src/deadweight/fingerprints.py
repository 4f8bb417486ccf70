"""A checksum of a tensor's raw bits: how the watch tells whether a parameter moved at
all, and how the ranks compare their copies of one (distributed/replicas.py)."""

from __future__ import annotations

import torch

_FOLD = 1009  # a prime: elements are summed per position modulo it


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted int64 checksum of the raw bits.

    Any change of one element changes it, and so does swapping two elements whose
    positions differ modulo _FOLD (a plain sum would miss permutations).
    """
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    bits = t.detach().reshape(-1).view(view)
    whole = bits.numel() - bits.numel() % _FOLD
    columns = torch.sum(bits[:whole].reshape(-1, _FOLD), dim=0, dtype=torch.int64)
    weights = torch.arange(1, _FOLD + 1, dtype=torch.int64, device=t.device)
    rest = bits[whole:].to(torch.int64) * weights[: bits.numel() - whole]
    return (columns * weights).sum() + rest.sum()
