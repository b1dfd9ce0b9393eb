"""Averaging parameters across a process group with one flat allreduce."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Union

import torch
from mpi4py import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.comm.dtypes import reduce_dtype
from tensorplay_hpc.comm.private import private_comm

__all__ = ["average_parameters", "average_parameters_or_parameter_groups",
           "average_on_communicator", "get_params_to_average"]

Params = Union[Iterable[torch.nn.Parameter], Iterable[Dict[str, object]]]


def get_params_to_average(params: Params) -> List[torch.Tensor]:
    """The parameters that have a gradient, from parameters or optimizer param-group dicts."""
    selected: List[torch.Tensor] = []
    for item in params:
        if isinstance(item, torch.Tensor):
            candidates = [item]
        elif isinstance(item, dict):
            candidates = list(item["params"])
        else:
            raise NotImplementedError(
                f"parameters to average must be tensors or param-group dicts, got "
                f"{type(item).__name__} (world rank {MPI.COMM_WORLD.Get_rank()})")
        selected.extend(p for p in candidates if p.grad is not None)
    return selected


def _lives_in(flat: comm.FlatBuffer, params: List[torch.Tensor]) -> bool:
    """Whether ``params`` are the views of ``flat``'s buffer (re-pointed by an earlier call)."""
    return flat.buffer.dtype == params[0].dtype and all(
        p.data_ptr() == view.data_ptr() for p, view in zip(params, flat.views))


def average_on_communicator(params: Params, communicator: MPI.Comm,
                            buffers: Optional[Dict[tuple, comm.FlatBuffer]] = None) -> None:
    """Average the parameters that have a gradient over ``communicator`` exactly as given (the
    caller owns it, e.g. an averager's private duplicate). Collective over ``communicator``;
    a no-op on a rank holding ``MPI.COMM_NULL``.

    Without ``buffers`` the parameters are packed into a new flat buffer and the averages
    copied back. With ``buffers`` (a dict the caller keeps, keyed by dtype, device and shapes)
    the flat buffer is kept and the parameters are re-pointed into it (``p.data``), as PyTorch
    does at every averaging; later averagings of the same parameters then reduce the buffer in
    place, without copying. 16-bit floats are always copied (they are reduced in float32).
    """
    if communicator == MPI.COMM_NULL:
        return
    selected = get_params_to_average(params)
    for (dtype, device), indices in comm.group_by_dtype_device(selected).items():
        group = [selected[i].detach() for i in indices]
        key = (dtype, device, tuple(t.shape for t in group))
        flat = buffers.get(key) if buffers is not None else None
        if flat is not None and _lives_in(flat, group):
            comm.all_reduce(flat.buffer, communicator, comm.ReduceOp.AVG)
            continue
        if flat is None:
            flat = comm.FlatBuffer(key[2], reduce_dtype(dtype), device)
            if buffers is not None:
                buffers[key] = flat
        flat.copy_from(group)
        comm.all_reduce(flat.buffer, communicator, comm.ReduceOp.AVG)
        if buffers is not None and flat.buffer.dtype == dtype:
            for i, view in zip(indices, flat.views):
                selected[i].data = view
        else:
            flat.copy_to(group)


def average_parameters(params: Params, process_group: Optional[MPI.Comm] = None) -> None:
    """Average the parameters (or optimizer param groups) that have a gradient across
    ``process_group`` (``None`` is ``MPI.COMM_WORLD``), in place.

    All of them travel in one flat buffer per dtype (16-bit floats packed as float32), reduced
    in cache-sized pieces (:mod:`tensorplay_hpc.comm.chunking`). Unlike PyTorch, the parameters
    keep their own storage: the averages are copied back rather than the parameters being
    re-pointed into the flat buffer (the averagers re-point them once and then average without
    copying). Traffic goes over a private duplicate of ``process_group``, made on the first call
    and cached on the communicator.

    Collective over ``process_group``; every rank must pass parameters of the same shapes with
    gradients. A rank where the group is ``MPI.COMM_NULL`` (outside a ``Split``) keeps its values.
    """
    average_on_communicator(params, private_comm(process_group))


def average_parameters_or_parameter_groups(params: Params,
                                           process_group: Optional[MPI.Comm]) -> None:
    """PyTorch's name for :func:`average_parameters`."""
    average_parameters(params, process_group)
