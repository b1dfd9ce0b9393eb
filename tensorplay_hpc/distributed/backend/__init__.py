"""torch.distributed over MPI: the ``mpi4py`` backend.

Importing :mod:`tensorplay_hpc.distributed` registers it (without starting MPI), so that under
``mpiexec`` or ``srun``::

    import torch.distributed as dist
    import tensorplay_hpc.distributed
    dist.init_process_group("mpi4py")

runs PyTorch's own DDP, FSDP2, DTensor and distributed checkpoints on MPI: the ranks and the
store come from MPI (:mod:`.rendezvous`, :mod:`.store`), every group is an MPI communicator
(``new_group`` and DeviceMesh dimensions are made from the world's by ``MPI_Comm_create_group``)
and every operation runs on the comm layer (:mod:`.process_group`, :mod:`.work`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from tensorplay_hpc.comm.communicators import create_group, free
from tensorplay_hpc.comm.group import ProcessGroup
from tensorplay_hpc.comm.mpi import MPI

from . import rendezvous
from .process_group import BACKEND_NAME, MPIProcessGroup, UnsupportedOperation
from .store import MPIStore

__all__ = ["BACKEND_NAME", "MPIProcessGroup", "MPIStore", "UnsupportedOperation",
           "init_process_group", "register"]


def _world() -> MPI.Intracomm:
    """The communicator whose ranks are torch.distributed's global ranks: the default group's
    when it is ours, else ``MPI.COMM_WORLD`` (whose ranks must then be the default group's), or
    while it starts, the one :func:`init_process_group` was given."""
    if dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        if isinstance(default, MPIProcessGroup):
            return default.comm
        world = MPI.COMM_WORLD
        if (default.rank(), default.size()) != (world.Get_rank(), world.Get_size()):
            raise RuntimeError(
                f"new_group(backend={BACKEND_NAME!r}): the default group's rank {default.rank()}"
                f" of {default.size()} is not MPI's world rank {world.Get_rank()} of "
                f"{world.Get_size()}; start torch.distributed with the ranks MPI gives")
        return world
    return rendezvous.chosen_world()


def _create(options: Any, backend_options: Any) -> MPIProcessGroup:
    """c10d's creator for a group of the backend: called on the group's members only, so the
    communicator comes from ``MPI_Comm_create_group`` (collective over the members alone)."""
    world = _world()
    ranks = [int(r) for r in options.global_ranks_in_group]
    name = str(options.group_id)
    if not ranks and options.group_size != world.Get_size():
        raise ValueError(f"init_process_group({BACKEND_NAME!r}): world_size="
                         f"{options.group_size} but MPI started {world.Get_size()} ranks "
                         f"(rank {world.Get_rank()})")
    owner = f"torch.distributed group {name!r}"
    if not ranks or ranks == list(range(world.Get_size())):
        group = ProcessGroup(world, owner=owner)
    else:
        members = world.Get_group()
        chosen = members.Incl(ranks)
        created = create_group(world, chosen)
        members.Free()
        chosen.Free()
        group = ProcessGroup(created, owner=owner)
        free(created)
    if (group.rank, group.size) != (options.group_rank, options.group_size):
        raise RuntimeError(f"{BACKEND_NAME} group {name!r}: MPI made rank {group.rank} of "
                           f"{group.size}, torch.distributed expected {options.group_rank} of "
                           f"{options.group_size}")
    return MPIProcessGroup(group, name)


def init_process_group(comm: Optional[MPI.Intracomm] = None, **options: Any) -> None:
    """``dist.init_process_group("mpi4py")`` over the ranks of ``comm`` (default
    ``MPI.COMM_WORLD``): its ranks become torch.distributed's global ranks, so that a job can
    start torch.distributed again on the survivors of a lost rank. ``options`` go to
    ``dist.init_process_group``. Collective over ``comm``."""
    with rendezvous.world(comm):
        dist.init_process_group(BACKEND_NAME, init_method=f"{rendezvous.SCHEME}://", **options)


def register() -> None:
    """Make ``"mpi4py"`` a torch.distributed backend (for CPU and CUDA tensors) and MPI a
    rendezvous. Local; idempotent; does not start MPI."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    rendezvous.install()


register()
