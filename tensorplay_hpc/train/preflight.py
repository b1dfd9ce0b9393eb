"""The checks of a launch against the machine, made before any heavy work: the folders can be
written, ``--context`` fits the corpus, a new run does not write over an earlier one and
``--resume`` has a checkpoint it can continue. Rank 0 checks; every rank raises the same
:class:`~.config.UsageError`, so the job ends with a usage error rather than an abort."""
from __future__ import annotations

from typing import List, Union

from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.small_collectives import broadcast_object

from .config import TrainConfig, UsageError
from .data import check_context
from .run_folder import check_unused, check_writable, resumable

__all__ = ["check_launch"]


def check_launch(config: TrainConfig, world: MPI.Intracomm) -> List[str]:
    """Check ``config`` against the file system and the corpus before anything is written.
    Collective over ``world``.

    Returns:
        The checkpoints ``--resume`` may continue from, oldest first (see
        :func:`~.run_folder.resumable`).

    Raises:
        UsageError: on every rank, when any check fails on rank 0.
    """
    found: Union[List[str], UsageError, None] = None
    if world.Get_rank() == 0:
        try:
            check_writable(config)
            check_context(config.context)
            check_unused(config)
            found = resumable(config)
        except UsageError as error:
            found = error
    found = broadcast_object(found, world)
    if isinstance(found, UsageError):
        raise found
    return found
