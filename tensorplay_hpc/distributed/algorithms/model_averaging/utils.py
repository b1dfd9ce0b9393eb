"""Averaging parameters across a process group with one flat allreduce."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from tensorplay_hpc import comm
from tensorplay_hpc.comm import trace
from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.consistency import Item
from tensorplay_hpc.comm.dtypes import reduce_dtype
from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.comm.private import private_comm

__all__ = ["average_parameters", "average_parameters_or_parameter_groups",
           "average_on_communicator", "get_params_to_average",
           "params_with_gradients"]

Params = Union[Iterable[torch.nn.Parameter], Iterable[Dict[str, object]]]
Labelled = List[Tuple[str, torch.Tensor]]

GRADIENTS_DIFFER = ("model averaging needs a gradient on the same parameters, of the same "
                    "shapes and dtypes, on every rank")
PARAMETERS_DIFFER = ("average_parameters needs the same number of parameters, of the same "
                     "shapes and dtypes, on every rank")


def _labelled(params: Params) -> Labelled:
    """Each parameter with the place it was given at: ``parameter i`` of a list, or
    ``param group g, parameter j`` of optimizer param-group dicts."""
    labelled: Labelled = []
    for i, item in enumerate(params):
        if isinstance(item, torch.Tensor):
            labelled.append((f"parameter {i}", item))
        elif isinstance(item, dict):
            labelled.extend((f"param group {i}, parameter {j}", p)
                            for j, p in enumerate(item["params"]))
        else:
            raise NotImplementedError(
                f"parameters to average must be tensors or param-group dicts, got "
                f"{type(item).__name__} at position {i}")
    return labelled


def get_params_to_average(params: Params) -> List[torch.Tensor]:
    """The parameters that have a gradient, from parameters or optimizer param-group dicts."""
    return [p for _, p in _labelled(params) if p.grad is not None]


def _checked(communicator: MPI.Intracomm, what: str,
             describe: Callable[[], Tuple[List[torch.Tensor], List[Item]]]) -> List[torch.Tensor]:
    """The tensors ``describe()`` selects, once every rank has described the same ones.
    Collective: one allgather of a digest. A difference, or an error on some ranks only, is a
    ``ValueError`` on every rank naming the ranks and the first parameter that differs; an
    error on every rank alike is raised again."""
    described: Tuple[List[torch.Tensor], List[Item]] = ([], [])
    with fail_together(communicator, what, catch=(NotImplementedError, TypeError),
                       valid_items=lambda: described[1]):
        described = describe()
    return described[0]


def params_with_gradients(communicator: MPI.Intracomm, params: Params,
                          what: str = GRADIENTS_DIFFER) -> List[torch.Tensor]:
    """The parameters of ``params`` that have a gradient, once every rank has the same ones
    (the check :func:`average_parameters_or_parameter_groups` makes before averaging). Collective:
    one allgather of a digest; a difference is a ``ValueError`` naming it on every rank."""
    return _checked(communicator, what, lambda: _with_gradients(params))


def _with_gradients(params: Params) -> Tuple[List[torch.Tensor], List[Item]]:
    labelled = _labelled(params)
    tensors = [p for _, p in labelled]
    signatures = comm.tensor_signature([label for label, _ in labelled], tensors)
    items = [(label, signature if p.grad is not None else "no gradient")
             for (label, signature), p in zip(signatures, tensors)]
    return [p for p in tensors if p.grad is not None], items


def _tensors(params: Iterable[torch.Tensor]) -> Tuple[List[torch.Tensor], List[Item]]:
    tensors = list(params)
    for i, p in enumerate(tensors):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"average_parameters takes tensors, got {type(p).__name__} at position {i} "
                "(for optimizer param groups, use average_parameters_or_parameter_groups)")
    return tensors, comm.tensor_signature([f"parameter {i}" for i in range(len(tensors))],
                                          tensors)


def _lives_in(flat: comm.FlatBuffer, params: List[torch.Tensor]) -> bool:
    """Whether ``params`` are the views of ``flat``'s buffer (re-pointed by an earlier call)."""
    return all(p.data_ptr() == view.data_ptr() for p, view in zip(params, flat.views))


def _average(selected: List[torch.Tensor], communicator: MPI.Intracomm,
             buffers: Optional[Dict[tuple, comm.FlatBuffer]]) -> None:
    """Average ``selected`` in place, per dtype and device: streamed a piece at a time, or, with
    ``buffers``, as one flat buffer kept there that the parameters are re-pointed into.
    Collective."""
    with trace.caller("model averaging"):
        for (dtype, device), indices in comm.group_by_dtype_device(selected).items():
            group = [selected[i].detach() for i in indices]
            if buffers is None or reduce_dtype(dtype) != dtype:
                comm.all_reduce_coalesced(group, communicator, comm.ReduceOp.AVG)
                continue
            shapes = tuple(t.shape for t in group)
            flat = buffers.get((dtype, device, shapes))
            if flat is None or not _lives_in(flat, group):
                flat = buffers[dtype, device, shapes] = comm.FlatBuffer(shapes, dtype, device)
                flat.copy_from(group)
                for i, view in zip(indices, flat.views):
                    selected[i].data = view
            comm.all_reduce(flat.buffer, communicator, comm.ReduceOp.AVG)


def average_on_communicator(params: Params, communicator: MPI.Comm,
                            buffers: Optional[Dict[tuple, comm.FlatBuffer]] = None,
                            what: str = GRADIENTS_DIFFER) -> None:
    """Average the parameters that have a gradient over ``communicator`` exactly as given (the
    caller owns it, e.g. an averager's private duplicate), as
    :func:`average_parameters_or_parameter_groups` does. Collective over ``communicator``;
    a no-op on a rank holding ``MPI.COMM_NULL``.

    The ranks first check that they have gradients on the same parameters (one allgather of a
    40-byte digest); otherwise every rank raises the same ``ValueError`` naming the ranks and
    the first parameter that differs, after ``what``.

    Without ``buffers`` the parameters are averaged as :func:`average_parameters` does (in
    their own memory, or packed a piece at a time). With ``buffers`` (a dict the caller keeps,
    keyed by dtype, device and shapes) the parameters are re-pointed (``p.data``) into a flat
    buffer kept there, as PyTorch does at every averaging; later averagings of the same
    parameters then reduce the buffer in place, without copying. 16-bit floats are never
    re-pointed (they are reduced in float32).
    """
    if communicator == MPI.COMM_NULL:
        return
    _average(params_with_gradients(communicator, params, what),
             communicator, buffers)


def average_parameters(params: Iterable[torch.Tensor],
                       process_group: Optional[MPI.Comm] = None) -> None:
    """Average all the given parameters across ``process_group`` (``None`` is
    ``MPI.COMM_WORLD``), in place, with or without gradients, as PyTorch does.

    They stream through MPI in cache-sized pieces (:func:`tensorplay_hpc.comm.
    all_reduce_coalesced`): a large parameter is averaged in its own memory, small ones are
    packed a piece at a time (16-bit floats as float32). Unlike PyTorch, the parameters keep
    their own storage and no copy of the whole model is made (the averagers re-point the
    parameters into one flat buffer once, as PyTorch does, and then average it in place).
    Traffic goes over a private duplicate of ``process_group``, made on the first call and
    cached on the communicator.

    Collective over ``process_group``. The ranks first check that they pass parameters of the
    same shapes and dtypes (one allgather of a 40-byte digest); otherwise every rank raises the
    same ``ValueError`` naming the ranks and the first parameter that differs. A rank where the
    group is ``MPI.COMM_NULL`` (outside a ``Split``) keeps its values.

    Raises:
        TypeError: something other than a tensor among ``params`` (param-group dicts go to
            :func:`average_parameters_or_parameter_groups`).
    """
    communicator = private_comm(process_group)
    if communicator == MPI.COMM_NULL:
        return
    _average(_checked(communicator, PARAMETERS_DIFFER, lambda: _tensors(params)),
             communicator, None)


def average_parameters_or_parameter_groups(params: Params,
                                           process_group: Optional[MPI.Comm]) -> None:
    """Average the parameters of a model, or of an optimizer's param groups, that have a
    gradient (:func:`get_params_to_average`) across ``process_group``, in place. Collective;
    the ranks must have gradients on the same parameters (checked as in
    :func:`average_on_communicator`)."""
    average_on_communicator(params, private_comm(process_group))
