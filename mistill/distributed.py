"""Processes of one pass launched by ``torchrun`` or ``accelerate launch``: who is who, what each
one does, and the few collectives the stages need.

Both launchers start one process per GPU and describe it in the environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); :func:`current_world` reads it.
Without them a stage is one process of a world of one, and nothing here starts a process group.

The sharding rule (:func:`shard`): the notes a pass still has to do, in the stage's order (the
corpus order), are dealt round-robin, the ``k``-th to rank ``k mod world size``. The list is the
notes not yet finished when the pass starts, as rank 0 read them from the run, so a pass that
resumes on another number of processes deals only what is missing.

Collectives go through ``torch.distributed``: NCCL between GPUs, gloo on CPUs (and in tests).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

ENV_TIMEOUT = "MISTILL_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0
"""How long a collective waits for a slow rank before failing the pass (the longest
note of a rank's shard must fit in it; ``$MISTILL_DIST_TIMEOUT_S`` overrides it)."""


@dataclass(frozen=True)
class World:
    """This process's place among the processes of one pass.

    rank: 0 .. size - 1 (rank 0 opens, aggregates and ends the run); size: the number of
    processes; local_rank: the process's index on its node (its GPU).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def leader(self) -> bool:
        """Rank 0: the process that owns the run (opens, aggregates and ends it)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def current_world() -> World:
    """The world described by the launcher's environment (a world of one without it).

    Raises ValueError on an inconsistent environment (a rank outside ``[0, WORLD_SIZE)``).
    """
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", "0") or 0)
    local = int(os.environ.get("LOCAL_RANK", str(rank)) or 0)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={size})")
    return World(rank=rank, size=size, local_rank=local)


def shard(items: Sequence[T], world: World) -> list[T]:
    """This rank's part of ``items``: the ``k``-th item goes to rank ``k mod world.size``."""
    return list(items[world.rank::world.size])


def rank_device(device: str, world: World) -> str:
    """The device this rank computes on: ``cuda`` becomes ``cuda:<local rank>`` in a world of
    several processes (one GPU each); any other value is kept."""
    if device == "cuda" and world.distributed:
        return f"cuda:{world.local_rank}"
    return device


def init_world(device: str = "cpu") -> World:
    """Join the launcher's process group (once per process) and return the world.

    Backend: ``nccl`` when ``device`` is a CUDA device, else ``gloo``. A world of one starts no
    group.
    """
    world = current_world()
    if not world.distributed:
        return world
    import torch  # deferred: torch is slow to import
    import torch.distributed as dist  # deferred: torch.distributed is slow to import

    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(world.local_rank)
        timeout = float(os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
        dist.init_process_group(backend=backend, rank=world.rank, world_size=world.size,
                                timeout=datetime.timedelta(seconds=timeout))
        atexit.register(_leave_group)
    return world


def leave_world() -> None:
    """Leave the process group once the work is done: the ranks meet at a barrier (no rank tears
    its side of the group down while another still works on it, rank 0 writing what it alone
    saves), the objects the work left unreachable (a sharded model's wrappers hold the group) are
    collected, and the group is destroyed, so that its communication threads stop while the
    interpreter is fully alive (a group left to the interpreter's teardown can abort the process
    with ``terminate called without an active exception``). Nothing in a world of one."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist  # deferred: only once the work has imported it (the check above)

    if dist.is_initialized():
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a rank already gone: leave all the same
            pass
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def _leave_group() -> None:
    """At exit, a group still joined (the entry point did not reach :func:`leave_world`): left as
    :func:`leave_world` leaves it on a normal exit; after an uncaught exception the rank leaves at
    once, without the barrier (the others may never arrive)."""
    import torch.distributed as dist  # deferred: torch.distributed is slow to import

    if not dist.is_initialized():
        return
    if getattr(sys, "last_value", None) is None and getattr(sys, "last_exc", None) is None:
        leave_world()
    else:
        dist.destroy_process_group()


def broadcast(obj: T, world: World) -> T:
    """Rank 0's ``obj`` on every rank (any picklable value); the value itself in a world of one."""
    if not world.distributed:
        return obj
    import torch.distributed as dist  # deferred: torch.distributed is slow to import

    box: list[Any] = [obj if world.leader else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: T, world: World) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not world.distributed:
        return [obj]
    import torch.distributed as dist  # deferred: torch.distributed is slow to import

    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def barrier(world: World) -> None:
    """Wait for every rank (a rank that died makes this raise, after the group's timeout at most)."""
    if world.distributed:
        import torch.distributed as dist  # deferred: torch.distributed is slow to import

        dist.barrier()


__all__ = ["World", "current_world", "shard", "rank_device", "init_world", "broadcast", "gather",
           "barrier", "ENV_TIMEOUT", "DEFAULT_TIMEOUT_S"]
