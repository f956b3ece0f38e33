"""Data parallelism from outside the model: joining torchrun's process group (DDP over ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from lisa.training.cache import dist_env


def init_distributed() -> int:
    """Under torchrun: join the process group (nccl on GPU, gloo on CPU). Returns this process's rank."""
    rank, world_size = dist_env()
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return rank
