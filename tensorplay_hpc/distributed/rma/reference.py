"""Remote references: a handle on one tensor that a rank exposes in an MPI window."""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Tuple

import torch

if TYPE_CHECKING:
    from .shared import SharedTensors

__all__ = ["FetchHook", "RemoteRef", "by_owner", "register_fetch_hook"]

FetchHook = Callable[["RemoteRef", torch.Tensor], torch.Tensor]
"""``hook(ref, value)`` -> the value :meth:`RemoteRef.to_here` returns."""

_fetch_hooks: List[FetchHook] = []


def register_fetch_hook(hook: FetchHook) -> None:
    """Pass every value :meth:`RemoteRef.to_here` fetches through ``hook``, in the order hooks
    were registered; registering a hook again changes nothing. Not collective.

    This is how a layer above remote references (distributed autograd records the fetched
    leaves of its open context) sees fetches without this module importing it.
    """
    if hook not in _fetch_hooks:
        _fetch_hooks.append(hook)


class RemoteRef:
    """Reference to tensor ``index`` of rank ``owner`` in a :class:`SharedTensors`.

    Like ``torch.distributed.rpc.RRef``, but the owner never serves requests: readers fetch the
    value with one-sided ``MPI.Win.Get`` under a shared lock, so they never see a half-written
    update (updates hold the exclusive lock). ``requires_grad`` is the owner's tensor's flag when
    it was shared: a reference to a tensor that does not require grad is frozen.
    """

    def __init__(self, shared: "SharedTensors", owner: int, index: int,
                 shape: Tuple[int, ...], dtype: torch.dtype, requires_grad: bool) -> None:
        self.shared = shared
        self.index = index
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.requires_grad = requires_grad
        self._owner = owner

    def owner(self) -> int:
        """The owner's rank in the group the tensors were shared over."""
        return self._owner

    def is_owner(self) -> bool:
        """Whether this rank owns the tensor."""
        return self._owner == self.shared.rank

    def local_value(self) -> torch.Tensor:
        """The owner's tensor itself (its memory is the window). Only on the owner.

        Reading it takes no lock: an update by another rank may be in progress. Use
        :meth:`to_here` for a consistent snapshot.
        """
        if not self.is_owner():
            raise RuntimeError(f"local_value() of {self} called on rank {self.shared.rank}, "
                               "which does not own it; use to_here()")
        return self.shared.local_tensor(self.index)

    def to_here(self) -> torch.Tensor:
        """A local copy of the current value, fetched with ``MPI.Win.Get``. Not collective.

        Inside :func:`tensorplay_hpc.distributed.autograd.context` the copy of a tensor that
        requires grad (:attr:`requires_grad`) is a leaf that requires grad, and :func:`~tensorplay_hpc.distributed.autograd.backward` sends its
        gradient to the owner.
        """
        value = self.shared.fetch(self)
        for hook in _fetch_hooks:
            value = hook(self, value)
        return value

    def __repr__(self) -> str:
        return (f"RemoteRef(owner={self._owner}, index={self.index}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype})")


def by_owner(refs: Iterable[RemoteRef]) -> Dict[int, List[RemoteRef]]:
    """``refs`` grouped by owner, owners in ascending order (the order locks are taken in)."""
    groups: Dict[int, List[RemoteRef]] = defaultdict(list)
    for ref in refs:
        groups[ref.owner()].append(ref)
    return dict(sorted(groups.items()))
