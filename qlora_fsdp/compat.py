"""What differs between the torch versions we run on, asked in one place.

Each entry names the versions it was checked on. Code calls these instead of probing torch itself, so a version
difference shows here and nowhere else.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """Every rank's equal-sized `tensor`, concatenated into `output`.

    torch 2.13 names it `all_gather_single` and deprecates `all_gather_into_tensor` (a FutureWarning on every call);
    torch 2.11 has only the old name.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor)
