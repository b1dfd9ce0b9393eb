"""Messages between two ranks: a tensor sent by one rank and received by another, nonblocking.

Messages longer than the chunk limit (:mod:`.chunking`) travel as several MPI messages with the
same tag, which MPI delivers in order between one pair of ranks.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import trace
from .chunking import chunks
from .mpi import MPI
from .staging import Staged
from .watchdog import watched
from .work import Work

__all__ = ["receive", "send"]


def _check_peer(what: str, comm: MPI.Intracomm, peer: int) -> None:
    if not 0 <= peer < comm.Get_size():
        raise ValueError(f"{what}: rank {peer} is not in a group of {comm.Get_size()} ranks "
                         f"(rank {comm.Get_rank()})")


def send(tensor: torch.Tensor, comm: MPI.Intracomm, dest: int, tag: int = 0) -> Work:
    """Start sending ``tensor`` to rank ``dest``; the handle completes once its memory may be
    reused. The receiving rank calls :func:`receive` with the same tag."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"send: expected a torch.Tensor, got {type(tensor).__name__} "
                        f"(rank {comm.Get_rank()})")
    _check_peer("send", comm, dest)
    staged = Staged(tensor)
    record = trace.collective("send", comm, tensor.nbytes, True)
    requests = [comm.Isend(staged.buf(start, n), dest, tag) for start, n in chunks(staged.count)]
    return Work(requests, keep=[staged], operation=f"send to rank {dest}", comm=comm,
                record=record)


def receive(tensor: torch.Tensor, comm: MPI.Intracomm, source: Optional[int] = None,
            tag: int = 0) -> Work:
    """Start receiving a message from rank ``source`` (any rank when ``None``: the rank is
    found first, waiting under the watchdog) into ``tensor``. The handle's ``source`` says who
    sent it."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"receive: expected a torch.Tensor, got {type(tensor).__name__} "
                        f"(rank {comm.Get_rank()})")
    if source is None:
        status = MPI.Status()
        with watched("receive from any rank", comm):
            comm.Probe(MPI.ANY_SOURCE, tag, status)
        source = status.Get_source()
    _check_peer("receive", comm, source)
    staged = Staged(tensor, copy_in=False)
    record = trace.collective("receive", comm, tensor.nbytes, True)
    requests = [comm.Irecv(staged.buf(start, n), source, tag) for start, n in chunks(staged.count)]
    return Work(requests, staged.finish, operation=f"receive from rank {source}", comm=comm,
                record=record, source=source)
