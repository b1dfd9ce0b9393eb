"""ZeroRedundancyOptimizer: an optimizer whose state is sharded over the ranks of a group (ZeRO).

Each rank keeps a local optimizer (any ``torch.optim.Optimizer`` class) for the parameters it
owns, about ``1 / world_size`` of them, chosen by the sorted-greedy :class:`~.partition.Partition`
that PyTorch uses, so shards and checkpoints line up with PyTorch's. After the local step every
rank receives every updated parameter through ``all_gather_v`` per dtype and device, not one
broadcast per parameter (see :mod:`.shard_buffer`): with ``parameters_as_bucket_view`` one
in-place call on the parameters laid out rank by rank in a flat buffer; without it, in rounds
through a staging buffer of a few MiB, so no full-size copy of the parameters is kept.

Where this differs from PyTorch's class:

- parameters of different dtypes (float32 beside bfloat16) work, with bucket views too;
- without ``parameters_as_bucket_view`` the sync still moves one flat buffer per dtype: a
  persistent staging buffer the size of the trainable parameters of that dtype is kept;
- :meth:`ZeroRedundancyOptimizer.consolidate_state_dict` gathers flat state buffers on the
  target rank only (one gather per dtype, see :mod:`.state_gather`), keeping them on the host;
- :meth:`ZeroRedundancyOptimizer.load_state_dict` leaves the caller's dict untouched (its tensors
  are copied, never aliased) and accepts a state dict of a plain ``torch.optim`` optimizer or
  one consolidated at any world size;
- :attr:`state` shows this rank's shard of the state (other parameters read as empty);
- ranks that disagree (parameters, ``requires_grad``, param groups, the ``to`` of
  :meth:`~ZeroRedundancyOptimizer.consolidate_state_dict`, the loaded param groups) get the same
  ``ValueError`` on every rank instead of a hang or a truncated message; each check is one
  allgather of a digest, one per :meth:`~ZeroRedundancyOptimizer.step` too (``requires_grad``
  may change between steps), which makes ``load_state_dict`` collective;
- the join hook steps without announcing itself again, so ZeRO works alone in a :class:`Join`;
- ``overlap_with_ddp=True`` wraps any ``torch.optim`` class (no functional optimizer needed)
  and runs on any MPI communicator (see :mod:`.ddp_overlap`, ``ddp_comm_hooks.ddp_zero_hook``).

Checkpoints use the sharded-optimizer interface that ``DistributedOptimizer`` shares:
:meth:`~ZeroRedundancyOptimizer.owned_indices`, :meth:`~ZeroRedundancyOptimizer.owned_state`,
:meth:`~ZeroRedundancyOptimizer.indexed_param_groups` and
:meth:`~ZeroRedundancyOptimizer.load_owned_state`.

Internal API (stable within this package):

- ``zero.partition`` (:class:`~.partition.Partition`): ``partition.rank_of[i]`` is the rank
  owning the parameter of global index ``i`` (the ``state_dict`` numbering);
  ``partition.groups[g][r]`` lists the global indices rank ``r`` owns in param group ``g``
  (with ``overlap_with_ddp=True`` it follows DDP's buckets and exists once the hook is made);
- ``zero.params_by_index``: the parameters, by global index;
- ``zero.local_state_by_index()``: this rank's local optimizer state as
  ``{global index: {key: value}}`` (live objects, not copies);
- ``zero.load_state_dict`` reads only the ``state`` entries of the parameters this rank owns,
  so a dict holding just those (and all ``param_groups``) is enough to restore a shard.
"""
from __future__ import annotations

import copy
import hashlib
import warnings
from collections.abc import Mapping
from itertools import chain
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Type

import torch
from tensorplay_hpc.comm.mpi import MPI
from torch.optim import Optimizer

from tensorplay_hpc import comm
from tensorplay_hpc.comm import trace
from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.consistency import Item
from tensorplay_hpc.distributed.algorithms.join import Join, Joinable, JoinHook

from .bucket_assignment import assign
from .ddp_overlap import DDPOverlap
from .optimizer_class import check_optimizer_class
from .partition import Partition
from .shard_buffer import AnyShards, ShardBuffer, StagedShards
from .state_gather import gather_state

__all__ = ["ZeroRedundancyOptimizer"]

# Group entries that describe the parameters rather than how to optimize them.
_NOT_HYPERPARAMETERS = ("params", "param_names")


def _typename(value: Any) -> str:
    return torch.typename(value) if isinstance(value, torch.Tensor) else type(value).__name__


# Errors of local checks leave out the rank: they are raised only once every rank is known to
# have raised the same one (see tensorplay_hpc.comm.agreement.fail_together).


def _check_dense_tensors(params: Iterable[Any]) -> None:
    for position, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"ZeroRedundancyOptimizer can only optimize tensors, but parameter "
                            f"{position} is a {_typename(param)}")
        if param.layout != torch.strided:
            raise ValueError(f"ZeroRedundancyOptimizer only supports dense parameters, but "
                             f"parameter {position} is {param.layout}")


def _param_groups(params: Any) -> List[Dict[str, Any]]:
    """Check ``params`` as PyTorch's class does and return new param-group dicts with lists."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params should be an iterable of tensors or of param-group dicts, but "
                        f"got a single {torch.typename(params)}")
    try:
        items = list(params)
    except TypeError:
        raise TypeError("params should be an iterable of tensors or of param-group dicts, but "
                        f"got {_typename(params)}") from None
    if not items:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if not all(isinstance(item, dict) for item in items):
        groups = [{"params": items}]
    else:
        groups = []
        for position, group in enumerate(items):
            if "params" not in group:
                raise ValueError(f"param group {position} has no 'params' key")
            group_params = group["params"]
            if isinstance(group_params, set):
                raise TypeError(f"param group {position} holds a set, whose order differs "
                                "between processes; use a list")
            if isinstance(group_params, torch.Tensor):
                group_params = [group_params]
            groups.append({**group, "params": list(group_params)})
    for group in groups:
        _check_dense_tensors(group["params"])
    return groups


def _hyperparameters(groups: List[Dict[str, Any]]) -> List[list]:
    return [sorted((k, repr(v)) for k, v in g.items() if k != "params") for g in groups]


def _group_items(groups: List[Dict[str, Any]], first: int) -> List[Item]:
    """What must match across ranks for ``groups``, whose parameters are numbered from ``first``:
    the hyperparameters, and each parameter's shape, dtype, device type and requires_grad."""
    params = [p for g in groups for p in g["params"]]
    names = (f"parameter {first + i}" for i in range(len(params)))
    return [("groups", _hyperparameters(groups)),
            *[(name, (*signature, f"requires_grad={param.requires_grad}"))
              for (name, signature), param in zip(comm.tensor_signature(names, params), params)]]


def _copy_hyperparameters(sources: List[dict], targets: List[dict]) -> None:
    for source, target in zip(sources, targets):
        for key, value in source.items():
            if key not in _NOT_HYPERPARAMETERS:
                target[key] = value


def _copied(value: Any, device: torch.device) -> Any:
    """A copy of a state value that shares no memory with it (tensors on ``device``)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value.clone()
        return value.to(device, copy=True)
    return copy.deepcopy(value)


class _ShardState(Mapping):
    """This rank's local optimizer state, keyed by parameter; others' parameters read as ``{}``.
    Read through the local optimizer each time, whose ``load_state_dict`` replaces its dict."""

    def __init__(self, local: Optimizer) -> None:
        self._optimizer = local

    def __getitem__(self, param: torch.Tensor) -> Dict[Any, Any]:
        local = self._optimizer.state
        return local[param] if param in local else {}

    def __contains__(self, param: object) -> bool:
        return param in self._optimizer.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._optimizer.state)

    def __len__(self) -> int:
        return len(self._optimizer.state)


class _ZeROJoinHook(JoinHook):
    """Steps a rank that ran out of inputs, so its shard is updated and sent as usual."""

    def __init__(self, zero: "ZeroRedundancyOptimizer") -> None:
        self.zero = zero

    def main_hook(self) -> None:
        if not self.zero._overlap_with_ddp:  # overlapped, the step is in DDP's backward pass
            self.zero._step(None, notify=False)


class ZeroRedundancyOptimizer(Optimizer, Joinable, comm.Closeable):
    """Wrap an optimizer class and shard its state over the ranks of a group (ZeRO).

    Constructing it is collective over the group. Every rank must pass the same parameters in
    the same order.

    Args:
        params: an iterable (a generator too) of tensors, or of param-group dicts.
        optimizer_class: the ``torch.optim.Optimizer`` subclass of the local optimizers.
        process_group: an mpi4py intracommunicator; ``None`` is ``MPI.COMM_WORLD``.
        parameters_as_bucket_view: make the parameters views into one flat buffer per dtype and
            device (their ``.data`` is replaced), so the sync after a step copies nothing.
        overlap_with_ddp: step each rank's shard during DDP's backward pass, once the
            gradient buckets it owns are reduced (see :mod:`.ddp_overlap`): register
            ``hook_with_zero_step(allreduce_hook, ddp, zero)`` as the DDP communication hook
            and do not call :meth:`step`; the first two backward passes do not step, as in
            PyTorch. One param group only.
        **defaults: hyperparameters passed to the local optimizers.

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass; ``params`` is
            a single tensor, not iterable, or holds something else than tensors or param-group
            dicts.
        ValueError: ``params`` is empty, a group lacks ``'params'``, a parameter is sparse, or
            several param groups are given with ``overlap_with_ddp=True``; on every rank, if
            the ranks' arguments differ (parameters, their shapes, dtypes or ``requires_grad``,
            param groups, the optimizer class) or only some ranks hit one of the errors above.
    """

    def __init__(self, params: Any, optimizer_class: Type[Optimizer],
                 process_group: Optional[MPI.Intracomm] = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any) -> None:
        check_optimizer_class(optimizer_class, "ZeroRedundancyOptimizer")
        self._initialized = False
        self._group = comm.ProcessGroup(process_group, owner="ZeroRedundancyOptimizer")
        self.process_group = self._group.parent
        self.rank: int = self._group.rank
        self.world_size: int = self._group.size
        try:
            with fail_together(
                    self._group.comm, "ZeroRedundancyOptimizer needs the same arguments on every "
                    "rank", items=[
                        ("optimizer",
                         f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"),
                        ("parameters_as_bucket_view", bool(parameters_as_bucket_view)),
                        ("overlap_with_ddp", bool(overlap_with_ddp))],
                    valid_items=lambda: _group_items(self.param_groups, 0)):
                groups = _param_groups(params)
                if overlap_with_ddp and len(groups) != 1:
                    raise ValueError("ZeroRedundancyOptimizer with overlap_with_ddp=True supports "
                                     f"a single parameter group, got {len(groups)}")
                Optimizer.__init__(self, groups, defaults)
        except Exception:
            self._group.close()   # every rank raises: free the duplicate now
            raise
        Joinable.__init__(self)
        if overlap_with_ddp and parameters_as_bucket_view:
            warnings.warn("parameters_as_bucket_view=True is ignored with overlap_with_ddp=True: "
                          "parameters become views into one buffer per DDP bucket instead",
                          stacklevel=2)
            parameters_as_bucket_view = False
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._optimizer_class = optimizer_class
        self._local_defaults = defaults
        self.params_by_index: List[torch.Tensor] = list(
            chain.from_iterable(g["params"] for g in self.param_groups))
        self._index_of = {param: index for index, param in enumerate(self.params_by_index)}
        self._trainable = self._trainable_mask()
        self._buffers: List[AnyShards] = []
        self._consolidated: Optional[Dict[int, Dict[Any, Any]]] = None
        self._overlap: Optional[DDPOverlap] = None
        self._overlap_with_ddp = overlap_with_ddp
        if not overlap_with_ddp:  # else the partition follows DDP's buckets (ddp_overlap)
            self._init_local_optimizer(Partition(
                [[p.numel() for p in g["params"]] for g in self.param_groups], self.world_size))
            self._build_buffers()
        self._initialized = True

    def close(self) -> None:
        """Free the private communicator; a later step, consolidation or load raises
        ``RuntimeError``. Collective over the process group; closing again does nothing. (Not in
        PyTorch, whose process groups live until ``destroy_process_group``.)"""
        self._group.close()

    def _init_local_optimizer(self, partition: Partition) -> None:
        self.partition = partition
        self.optim: Optimizer = self._optimizer_class(
            [self._local_group(g) for g in range(len(self.param_groups))], **self._local_defaults)
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self.state = _ShardState(self.optim)

    def overlap_with(self, ddp: Any, shard_buckets: bool = False) -> DDPOverlap:
        """Follow ``ddp``'s gradient buckets (``overlap_with_ddp=True``): plan which rank steps
        which parameters of each bucket, build the partition and the local optimizer from that
        plan, and return the stepper whose hooks the ``ddp_zero_hook`` functions register.
        Local; call it on every rank before the first backward pass.

        Raises:
            ValueError: built without ``overlap_with_ddp=True``, or a parameter of ``ddp``'s
                buckets is not one of this optimizer's.
            RuntimeError: already overlapped with a model.
        """
        if not self._overlap_with_ddp:
            raise ValueError("ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp"
                             f"=True` to use this hook properly (rank {self.rank})")
        if self._overlap is not None:
            raise RuntimeError("this ZeroRedundancyOptimizer is already overlapped with a "
                               f"DistributedDataParallel model (rank {self.rank})")
        shards, rank_of = assign([b.parameters() for b in ddp.buckets], self._index_of,
                                 self.world_size, shard_buckets, self.rank)
        self._init_local_optimizer(Partition.assigned(
            rank_of, self.world_size, [p.numel() for p in self.params_by_index]))
        self._overlap = DDPOverlap(self, ddp, shards)
        return self._overlap

    def _require_local_optimizer(self, what: str) -> None:
        if self._overlap_with_ddp and self._overlap is None:
            raise RuntimeError(
                f"{what} needs the local optimizer, which overlap_with_ddp=True builds when the "
                "DDP hook is made: call ddp.register_comm_hook(None, hook_with_zero_step("
                f"allreduce_hook, ddp, zero)) first (rank {self.rank})")

    # -- partition and buffers -------------------------------------------------------------

    def _local_group(self, g: int) -> Dict[str, Any]:
        group = self.param_groups[g]
        local = {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}
        local["params"] = [self.params_by_index[i] for i in self.partition.groups[g][self.rank]]
        return local

    def _trainable_mask(self) -> bytes:
        """``requires_grad`` of each parameter, one byte each."""
        return bytes([param.requires_grad for param in self.params_by_index])

    def _check_trainable(self, trainable: bytes) -> None:
        """Raise ``ValueError`` on every rank unless all ranks train the same parameters (else
        their shards' sizes would differ). Collective: one allgather of a digest; the parameters
        are compared one by one only when the digests differ."""
        digests = comm.gather_digests(self._group.comm, hashlib.sha1(trainable).digest())
        if len(set(digests)) > 1:
            comm.check_consistent(
                self._group.comm, "ZeroRedundancyOptimizer.step: requires_grad must be the same "
                "on every rank (freeze a parameter on all ranks or none)",
                [(f"parameter {i}", f"requires_grad={bool(flag)}")
                 for i, flag in enumerate(trainable)])

    def _build_buffers(self) -> None:
        """One :class:`ShardBuffer` (with ``parameters_as_bucket_view``) or
        :class:`StagedShards` per dtype and device of the trainable parameters."""
        for buffer in self._buffers:
            buffer.release()
        per_key: Dict[tuple, List[List[torch.Tensor]]] = {}
        for param in self.params_by_index:
            if param.requires_grad:
                per_key.setdefault((param.dtype, param.device),
                                   [[] for _ in range(self.world_size)])
        for rank in range(self.world_size):
            for index in chain.from_iterable(self.partition.owned(rank)):
                param = self.params_by_index[index]
                if param.requires_grad:
                    per_key[(param.dtype, param.device)][rank].append(param)
        self._buffers = [ShardBuffer(params_per_rank) if self.parameters_as_bucket_view
                         else StagedShards(params_per_rank, self.rank)
                         for params_per_rank in per_key.values()]

    def _sync_params(self) -> None:
        """Every rank gets every rank's updated shard. Collective."""
        with trace.caller("ZeRO parameter sync"):
            for buffer in self._buffers:
                buffer.sync(self._group.comm)

    # -- the optimizer API -----------------------------------------------------------------

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group; its parameters are partitioned after the existing ones (which
        stay where they are). Collective: call it on every rank with the same group.

        Raises:
            ValueError: on every rank, if the ranks' groups differ (hyperparameters, number,
                shapes, dtypes or ``requires_grad`` of the parameters).
        """
        if not self._initialized:
            super().add_param_group(param_group)
            return
        if self._overlap_with_ddp:
            raise RuntimeError("ZeroRedundancyOptimizer with overlap_with_ddp=True supports a "
                               f"single parameter group (rank {self.rank})")
        count = len(self.param_groups)
        try:
            with fail_together(self._group.comm, "ZeroRedundancyOptimizer.add_param_group needs "
                               "the same group on every rank", valid_items=lambda: _group_items(
                                   self.param_groups[-1:], len(self.params_by_index))):
                super().add_param_group(param_group)
                _check_dense_tensors(self.param_groups[-1]["params"])
        except Exception:
            del self.param_groups[count:]
            raise
        new_params = self.param_groups[-1]["params"]
        for param in new_params:
            self._index_of[param] = len(self.params_by_index)
            self.params_by_index.append(param)
        self.partition.add_group([p.numel() for p in new_params])
        self.optim.add_param_group(self._local_group(len(self.param_groups) - 1))
        _copy_hyperparameters(self.optim.param_groups[-1:], self.param_groups[-1:])
        self._trainable = self._trainable_mask()
        self._build_buffers()

    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any) -> Optional[float]:
        """Step this rank's shard with the local optimizer, then give every rank every updated
        parameter. Collective.

        Args:
            closure: re-evaluates the model and returns the loss (optional for most optimizers).
            **kwargs: passed to the local optimizer's ``step``.

        Returns:
            The loss the local optimizer returns, if any. With ``overlap_with_ddp=True`` the
            step happens in the backward pass: this warns and returns ``None``.
        """
        if self._overlap_with_ddp:
            warnings.warn("step() does nothing with overlap_with_ddp=True: the DDP hook made by "
                          "hook_with_zero_step steps during the backward pass", stacklevel=2)
            return None
        return self._step(closure, notify=True, **kwargs)

    def _step(self, closure: Optional[Callable[[], float]], notify: bool,
              **kwargs: Any) -> Optional[float]:
        if notify:
            Join.notify_join_context(self)
        trainable = self._trainable_mask()
        self._check_trainable(trainable)
        if trainable != self._trainable:
            self._trainable = trainable
            self._build_buffers()
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            loss = self.optim.step(closure=closure, **kwargs)
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._sync_params()
        return loss

    def _step_with_gradients(self, params: List[torch.Tensor],
                             grads: List[torch.Tensor]) -> None:
        """Step only ``params`` (owned by this rank), with ``grads`` as their gradients."""
        owned = [p for group in self.optim.param_groups for p in group["params"]]
        saved = [p.grad for p in owned]
        for param in owned:
            param.grad = None
        for param, grad in zip(params, grads):
            param.grad = grad
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        try:
            self.optim.step()
        finally:
            for param, grad in zip(owned, saved):
                param.grad = grad
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)

    def local_state_by_index(self) -> Dict[int, Dict[Any, Any]]:
        """This rank's local optimizer state keyed by global parameter index (live, not copied)."""
        self._require_local_optimizer("local_state_by_index()")
        return {self._index_of[param]: state for param, state in self.optim.state.items()}

    # -- the sharded-optimizer interface of checkpoints ----------------------------------

    def owned_indices(self) -> List[int]:
        """The global indices of the parameters this rank owns. Local."""
        return [i for i, owner in enumerate(self.partition.rank_of) if owner == self.rank]

    def owned_state(self) -> Dict[int, Dict[Any, Any]]:
        """The state of the parameters this rank owns, by global index: new dicts holding the
        optimizer's own tensors (which the next step changes: copy them to keep them). Local."""
        return {index: dict(state) for index, state in self.local_state_by_index().items()}

    def indexed_param_groups(self) -> List[Dict[str, Any]]:
        """The param groups in ``state_dict``'s structure: the hyperparameters, and ``params``
        as global indices. Local."""
        groups, first = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(first, first + len(group["params"])))
            first += len(group["params"])
            groups.append(packed)
        return groups

    def load_owned_state(self, state: Dict[int, Dict[Any, Any]],
                         param_groups: List[Dict[str, Any]]) -> None:
        """Load the state of the parameters this rank owns (by global index; entries of other
        parameters are ignored) and the hyperparameters of ``param_groups``, keeping the given
        tensors rather than copies. Collective, as :meth:`load_state_dict`."""
        self._load_state_dict({"state": state, "param_groups": param_groups}, copies=False)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` (on the host), for :meth:`state_dict`.

        Collective. The other ranks drop any state consolidated before.

        Raises:
            ValueError: on every rank, if the ranks pass different ``to`` or ``to`` is not a
                rank of the group.
        """
        comm.check_consistent(self._group.comm, "ZeroRedundancyOptimizer.consolidate_state_dict "
                              "needs the same target rank on every rank", [("to", to)])
        if not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict: to={to} is not a rank of this group of "
                             f"{self.world_size} (rank {self.rank})")
        self._require_local_optimizer("consolidate_state_dict()")
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        self._consolidated = None
        self._consolidated = gather_state(self.local_state_by_index(), self._group.comm, to)

    def state_dict(self) -> Dict[str, Any]:
        """The state last consolidated on this rank, in ``torch.optim.Optimizer.state_dict``'s
        structure with global parameter indices. Not collective.

        Raises:
            RuntimeError: no :meth:`consolidate_state_dict` to this rank came before.
        """
        if self._consolidated is None:
            raise RuntimeError(
                f"The optimizer state has not been consolidated on rank {self.rank}: call "
                f"consolidate_state_dict(to={self.rank}) on all ranks first, then state_dict() "
                f"on rank {self.rank}.")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = {index: dict(self._consolidated[index]) for index in sorted(self._consolidated)}
        state_dict = {"state": state, "param_groups": self.indexed_param_groups()}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load this rank's part of a whole optimizer state: one consolidated by this class at any
        world size, or a plain ``torch.optim`` optimizer's. Collective (one allgather of a
        digest), so that a state dict that does not fit on some rank fails on every rank. The
        caller's dict is neither modified nor shared: the tensors this rank keeps are copies.

        Raises:
            ValueError: on every rank, if the numbers of groups or of parameters in a group differ
                from the optimizer's, or the ranks' param groups differ.
        """
        self._load_state_dict(state_dict, copies=True)

    def _load_state_dict(self, state_dict: Dict[str, Any], copies: bool) -> None:
        self._require_local_optimizer("load_state_dict()")
        saved_groups, local = [], {}
        with fail_together(self._group.comm, "ZeroRedundancyOptimizer.load_state_dict needs a "
                           "state dict that fits every rank",
                           valid_items=lambda: [("param_groups", _hyperparameters(saved_groups))]):
            state_dict = dict(state_dict)
            for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
                result = pre_hook(self, state_dict)
                if result is not None:
                    state_dict = result
            saved_groups = state_dict["param_groups"]
            local = self._local_state_dict(saved_groups, state_dict["state"], copies)
        self.optim.load_state_dict(local)
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _local_state_dict(self, saved_groups: List[Dict[str, Any]], saved_state: Mapping,
                          copies: bool) -> Dict[str, Any]:
        """The local optimizer's part of a whole state dict: the parameters this rank owns,
        numbered as the local optimizer holds them, with their state (copies, if ``copies``)."""
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, the "
                             f"optimizer {len(self.param_groups)}")
        for g, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"loaded state dict's parameter group {g} has "
                                 f"{len(saved['params'])} parameters, the optimizer's "
                                 f"{len(group['params'])}")
        saved_ids = list(chain.from_iterable(g["params"] for g in saved_groups))
        local_state, local_groups, local_id = {}, [], 0
        for saved, owned in zip(saved_groups, self.partition.owned(self.rank)):
            local = {k: copy.deepcopy(v) for k, v in saved.items() if k not in _NOT_HYPERPARAMETERS}
            # A range, not a list: torch's load_state_dict looks every state value's parameter
            # up in its group's "params", which a range answers at once.
            local["params"] = range(local_id, local_id + len(owned))
            local_groups.append(local)
            for index in owned:
                if saved_ids[index] in saved_state:
                    device = self.params_by_index[index].device
                    values = saved_state[saved_ids[index]]
                    local_state[local_id] = ({key: _copied(value, device)
                                              for key, value in values.items()}
                                             if copies else dict(values))
                local_id += 1
        return {"state": local_state, "param_groups": local_groups}

    # -- uneven inputs ---------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that lets a rank out of inputs keep stepping (and syncing) its shard.

        Gradients must be set properly (e.g. by a data-parallel wrapper's own join hook, which
        must come before this optimizer in the :class:`Join`) before it runs. No keyword
        arguments are used.
        """
        return _ZeROJoinHook(self)

    @property
    def shard_buffers(self) -> List[AnyShards]:
        """The buffers that gather the updated parameters, one per dtype and device: a
        :class:`~.shard_buffer.ShardBuffer` (``parameters_as_bucket_view``) or
        :class:`~.shard_buffer.StagedShards`. Empty with ``overlap_with_ddp``."""
        return list(self._buffers)

    @property
    def ddp_overlap(self) -> Optional[DDPOverlap]:
        """The step overlapped with DDP's backward pass (``overlap_with_ddp=True``), once
        DDP's communication hook has made it; otherwise None."""
        return self._overlap

    @property
    def join_device(self) -> torch.device:
        """The device of the first parameter."""
        return self.params_by_index[0].device

    @property
    def join_process_group(self) -> MPI.Intracomm:
        """The process group this optimizer was built on."""
        return self.process_group
