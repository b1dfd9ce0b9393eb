"""Hierarchical model averaging: groups of growing size averaging at growing periods."""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Dict, List, Optional

from tensorplay_hpc.comm.mpi import MPI

from tensorplay_hpc import comm
from tensorplay_hpc.comm.communicators import free, split
from tensorplay_hpc.comm.small_collectives import all_gather_object

from .averagers import PERIOD_ONE_WARNING, ModelAverager
from .utils import GRADIENTS_DIFFER, Params, average_on_communicator

__all__ = ["HierarchicalModelAverager"]


class HierarchicalModelAverager(ModelAverager):
    """Averages parameters in a hierarchy of groups (hierarchical SGD), as PyTorch does.

    ``period_group_size_dict`` maps a period to a group size, smallest first, e.g.
    ``OrderedDict([(2, 2), (4, 4)])``: groups of 2 contiguous ranks average every 2 steps and the
    whole group every 4. After ``warmup_steps``, at step ``s`` the last entry (in dict order)
    whose period divides ``s`` chooses the group that averages; no entry dividing ``s`` means no
    averaging. As in PyTorch, the period test is on ``s`` itself, not on ``s - warmup_steps``.

    Subgroups follow the nodes (:meth:`comm.NodeLayout.block`): when each node holds
    consecutive ranks (one node, or the default placement by slot) they are blocks of
    contiguous ranks, like ``torch.distributed.new_subgroups``; otherwise (``--map-by node``)
    a group size equal to the ranks per node gives the nodes themselves, a divisor of it splits
    each node, and a multiple of it joins whole nodes. Collective: construct it and call
    :meth:`average_parameters` on every rank of the group.

    Args:
        period_group_size_dict: ordered ``{period: group_size}``; the last size must be the size
            of ``process_group``.
        warmup_steps: steps before the first averaging.
        process_group: the whole group (``None`` is ``MPI.COMM_WORLD``).

    Attributes:
        period_process_group_dict: ``{period: communicator}`` of this rank's group per level.

    Raises:
        ValueError: an empty dict, a period below 1, a group size that is not positive or does
            not divide the group's size, a last size other than the group's size, a size that
            cannot follow nodes whose ranks are not consecutive (nodes of different sizes, or a
            size neither a divisor nor a multiple of the ranks per node), or
            ``warmup_steps < 0``. Every rank raises the same error.
    """

    def __init__(self, period_group_size_dict: Optional[Dict[int, int]] = None,
                 warmup_steps: int = 0, process_group: Optional[MPI.Comm] = None) -> None:
        rank = MPI.COMM_WORLD.Get_rank()
        if not period_group_size_dict:
            raise ValueError(f"Arg ``period_group_size_dict`` must not be empty "
                             f"(world rank {rank}).")
        periods: List[int] = list(period_group_size_dict.keys())
        sizes: List[int] = list(period_group_size_dict.values())
        bad_periods = [p for p in periods if p < 1]
        if bad_periods:
            raise ValueError(f"Periods in arg ``period_group_size_dict`` must be positive, got "
                             f"{bad_periods} (world rank {rank}).")
        if warmup_steps < 0:
            raise ValueError(f"Arg ``warmup_steps`` must be a non-negative number, got "
                             f"{warmup_steps} (world rank {rank}).")
        if periods[-1] == 1:
            warnings.warn(PERIOD_ONE_WARNING, stacklevel=2)
        super().__init__(process_group)
        self.warmup_steps = warmup_steps
        self._periods = periods
        self._subgroups: List[comm.ProcessGroup] = []
        self.period_process_group_dict: "OrderedDict[int, MPI.Comm]" = OrderedDict()
        self._mismatch: Dict[int, str] = {}   # per period: what a gradient mismatch says
        if self._group is None:   # outside the group: counts steps only
            return
        self._check_consistent(period_group_size_dict=list(period_group_size_dict.items()),
                               warmup_steps=warmup_steps)
        total = self._group.size
        if sizes[-1] != total:
            raise ValueError(f"The last value in arg ``period_group_size_dict`` ({sizes[-1]}) "
                             f"must be equal to the size of arg ``process_group`` ({total}) "
                             f"(world rank {rank}).")
        layout = comm.NodeLayout(self._group.comm)
        blocks = [layout.block(size) for size in sizes]   # all checked before any Split
        for period, size, block in zip(periods, sizes, blocks):
            self.period_process_group_dict[period] = self._level(period, size, block)

    def _level(self, period: int, size: int, block: int) -> MPI.Comm:
        """This rank's communicator among the groups of ``size`` ranks, in group ``block``.
        Collective."""
        if size == self._group.size:
            return self._group.comm
        blocked = split(self._group.comm, block, self._group.rank)
        owned = comm.ProcessGroup(blocked, owner="HierarchicalModelAverager")
        free(blocked)
        self._subgroups.append(owned)
        members = all_gather_object(self._group.rank, owned.comm)
        self._mismatch[period] = (
            f"{GRADIENTS_DIFFER} of the group averaging every {period} steps (process-group "
            f"ranks {members}, ranked 0 to {size - 1} below)")
        return owned.comm

    def _find_period(self) -> Optional[int]:
        """The last period dividing :attr:`step`, or ``None``."""
        return next((p for p in reversed(self._periods) if self.step % p == 0), None)

    def average_parameters(self, params: Params) -> None:
        """Average the parameters (or optimizer param groups) that have gradients in the group
        this step chooses, if any; advance the step counter either way. Collective."""
        self._check_open()
        if self.step >= self.warmup_steps:
            period = self._find_period()
            if period is not None:
                average_on_communicator(
                    params, self.period_process_group_dict.get(period, MPI.COMM_NULL),
                    self._buffers, self._mismatch.get(period, GRADIENTS_DIFFER))
        self.step += 1

    def close(self) -> None:
        """Free the private communicators; later averaging raises ``RuntimeError``.
        Collective over the process group; closing again does nothing."""
        for subgroup in self._subgroups:
            subgroup.close()
        super().close()
