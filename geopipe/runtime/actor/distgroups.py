"""The ``torch.distributed`` world of one site's stage replicas, as DeepSpeed needs it.

Joining and leaving the default group (gloo on CPU, NCCL on GPU) with DeepSpeed adopting it,
and the ``mpu`` object that tells DeepSpeed its data-parallel group is the stage's replica
group. Re-exported by :mod:`geopipe.runtime.actor.engine`.
"""

from __future__ import annotations

import importlib
import os
from datetime import timedelta
from typing import Any

import deepspeed
import deepspeed.comm
import torch
import torch.distributed as dist

__all__ = ["StageMPU", "destroy_process_group", "init_process_group"]


def _skip_shm_op_build() -> None:
    """Stop DeepSpeed compiling its shared-memory all-reduce op (~45 s) on CPU.

    The attribute must be replaced on the module object in ``sys.modules``:
    ``import deepspeed.comm.torch as m`` resolves to the ``torch`` package re-exported by
    ``deepspeed.comm`` and silently patches nothing.
    """
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def init_process_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    *,
    local_rank: int = 0,
) -> None:
    """Join the default process group and make ``deepspeed.comm`` adopt it.

    Gloo on CPU, NCCL when CUDA is available. The environment variables DeepSpeed reads are
    set too (``local_rank`` defaults to 0 because a Ray actor sees only its own device).
    ``timeout_s`` bounds every collective: a hung peer surfaces as an error after it, so choose
    it from the measured step time. Call again after :func:`destroy_process_group` to re-form
    a group with new ranks and a new port.
    """
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    _skip_shm_op_build()
    deepspeed.comm.init_distributed(dist_backend=backend, timeout=timeout)


def destroy_process_group() -> None:
    """Tear down the default group and every subgroup, and DeepSpeed's cached group handles."""
    if dist.is_initialized():
        deepspeed.comm.destroy_process_group()


class StageMPU:
    """The ``mpu`` DeepSpeed asks for: data parallel = this stage's replica group.

    "Model parallel" is a single-rank group: pipeline stages are not DeepSpeed's business (the
    caller moves activations), so gradient norms and reductions stay inside the stage.
    """

    def __init__(self, dp_group: Any, dp_ranks: list[int], mp_group: Any) -> None:
        self._dp_group, self._dp_ranks, self._mp_group = dp_group, dp_ranks, mp_group

    def get_data_parallel_group(self) -> Any:
        return self._dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._dp_ranks)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp_group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp_group)

    def get_model_parallel_group(self) -> Any:
        return self._mp_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1
