"""DistributedOptimizer: a ``torch.optim`` optimizer applied to remote parameters over MPI windows.

PyTorch builds this on its RPC framework: each owner runs the optimizer when asked. Here the
owner takes no part. A trainer's ``step`` takes an exclusive lock on the owner's windows, fetches
the parameter, its gradient (from the trainer's slot, see
:mod:`tensorplay_hpc.distributed.autograd`) and its optimizer state, runs the optimizer locally,
and puts parameter and state back before unlocking. The state therefore lives in the owner's
window memory, with a fixed layout per parameter learned at construction by running a second
instance of the optimizer once on a zero dummy: a flag "state exists" (so the optimizer
initializes its state on the very first step, as locally) followed by every state entry
(tensors, and Python numbers as float64). An optimizer whose step fails on the dummy still
constructs: its parameters get no state memory, and their steps run the optimizer on copies of
the real values and raise its error (or, if it works there, say that the layout is unknown),
changing nothing. Steps by any number of trainers continue one state, and steps on one owner are
serialized by the exclusive lock, so no update is lost and readers never see half of one.

Every parameter of any rank's references has a global index: its position in the sorted
``(owner, index)`` keys (:attr:`DistributedOptimizer.parameter_refs`). Checkpoints use it: each
owner reads and replaces the values and state of the parameters it owns from its own window
memory (:meth:`~DistributedOptimizer.owned_state`, :meth:`~DistributedOptimizer.load_owned`).
To survive a lost owner, that memory is copied whole to a partner rank at each commit
(:meth:`~DistributedOptimizer.owned_bytes`; see :mod:`.distributed_optimizer_copies`).

The state window has the transport of the shared tensors' windows
(:mod:`tensorplay_hpc.distributed.rma.transport`). Where that is shared memory (all ranks on one
node), a step under the same locks runs the optimizer directly on the owner's memory instead
(``Win.Shared_query`` views of parameter, gradient and state): no copies at all.
``TENSORPLAY_HPC_RMA_DIRECT=0`` turns that off. A step's three locks on an owner are always taken in one order (values, state,
gradients; owners ascending), and granted before they return, so trainers cannot deadlock.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Type

import torch

from tensorplay_hpc.comm import Closeable, trace
from tensorplay_hpc.comm.agreement import fail_together
from tensorplay_hpc.comm.small_collectives import all_gather_object, barrier
from tensorplay_hpc.comm.consistency import check_consistent
from tensorplay_hpc.comm.dtypes import reduce_dtype
from tensorplay_hpc.distributed import autograd
from tensorplay_hpc.distributed.optim.optimizer_class import check_optimizer_class
from tensorplay_hpc.distributed.rma import RemoteRef, by_owner
from tensorplay_hpc.distributed.rma.buffer_pool import empty
from tensorplay_hpc.distributed.rma.layout import Layout, Spec, view_at
from tensorplay_hpc.distributed.rma.transport import AnyWindow

__all__ = ["DIRECT_ENV", "DistributedOptimizer", "Held", "ParamKey", "StateEntry", "learn_state"]

DIRECT_ENV = "TENSORPLAY_HPC_RMA_DIRECT"
"""Set to ``0`` to make steps fetch and put back even where the windows are in shared memory."""
_NUMBER_TYPES = (bool, int, float)
_FLAG: Spec = ((), torch.int64)
ParamKey = Tuple[int, int]  # (owner, index) of a shared tensor
Held = List[List[torch.Tensor]]  # per parameter: its flag, then its state entries


class StateEntry:
    """One entry of an optimizer's per-parameter state: a tensor, or a Python number stored as a
    float64 scalar and given back as its type."""

    def __init__(self, key: str, value: Any) -> None:
        self.key = key
        if isinstance(value, torch.Tensor):
            self.kind, self.spec = torch.Tensor, (tuple(value.shape), value.dtype)
        elif isinstance(value, _NUMBER_TYPES):
            self.kind, self.spec = type(value), ((), torch.float64)
        else:
            raise TypeError(f"optimizer state entry {key!r} is a {type(value).__name__}; only "
                            "tensors and numbers can live in window memory")

    def signature(self) -> Tuple:
        return self.key, self.kind.__name__, self.spec[0], str(self.spec[1])

    def mismatch(self, value: Any) -> Optional[str]:
        """What ``value`` is instead of what this entry holds; ``None`` if it fits."""
        if self.kind is torch.Tensor:
            if (not isinstance(value, torch.Tensor) or tuple(value.shape) != self.spec[0]
                    or value.dtype != self.spec[1]):
                return (f"{_describe(value)}, not the {self.spec[1]} tensor of shape "
                        f"{self.spec[0]} learned at construction")
        elif not isinstance(value, _NUMBER_TYPES):
            return f"{_describe(value)}, not a number"
        return None

    def restore(self, buffer: torch.Tensor) -> Any:
        """The value for the optimizer from the fetched ``buffer``."""
        return buffer if self.kind is torch.Tensor else self.kind(buffer.item())

    def save(self, value: Any, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor to write back for the optimizer's ``value`` (``buffer`` holds numbers)."""
        problem = self.mismatch(value)
        if problem is not None:
            raise RuntimeError(f"state entry {self.key!r} became {problem}")
        if self.kind is torch.Tensor:
            return value.detach().to("cpu").contiguous()
        buffer.fill_(value)
        return buffer


def learn_state(optimizer_class: Type[torch.optim.Optimizer], shape: Tuple[int, ...],
                dtype: torch.dtype, args: tuple,
                kwargs: dict) -> Tuple[List[StateEntry], Optional[str]]:
    """The state entries ``optimizer_class`` keeps for a parameter of ``shape`` and ``dtype``,
    found by one step on a zero dummy with a zero gradient; ``([], why)`` if that step fails."""
    dummy = torch.zeros(shape, dtype=dtype)
    dummy.grad = torch.zeros_like(dummy)
    optimizer = optimizer_class([dummy], *args, **kwargs)
    try:
        optimizer.step()
    except Exception as error:
        return [], f"{type(error).__name__}: {error}"
    return [StateEntry(key, value) for key, value in optimizer.state[dummy].items()
            if value is not None], None


class DistributedOptimizer(Closeable):
    """Apply ``optimizer_class`` to remote parameters with a context's gradients.

    Collective over the group the references were shared on: every rank constructs it (and
    :meth:`close` s it), each with its own references from one :func:`rma.share` call, possibly
    different subsets; the owners allocate state for the union. Afterwards :meth:`step` is called
    by any trainer alone. Parameters whose tensor did not require grad when shared are frozen:
    they get no gradient, so steps leave them unchanged.

    Args:
        optimizer_class: any ``torch.optim.Optimizer`` subclass.
        params_rref: references to the parameters this rank will step.
        *args, **kwargs: passed to ``optimizer_class`` (every rank must get a configuration
            with the same state layout).

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass.
        ValueError: no references, references from several ``rma.share()`` calls, or (on every
            rank) ranks whose configurations keep different state.
        RuntimeError: on every rank, if constructing the optimizer failed on any, or the
            references' ``SharedTensors`` is closed.
    """

    def __init__(self, optimizer_class: Type[torch.optim.Optimizer],
                 params_rref: Iterable[RemoteRef], *args: Any, **kwargs: Any) -> None:
        self._optimizer_class = check_optimizer_class(optimizer_class, "DistributedOptimizer")
        self._closed = False
        self._refs = list(params_rref)
        if not self._refs:
            raise ValueError("DistributedOptimizer needs at least one remote reference")
        self._shared = self._refs[0].shared
        rank = self._shared.rank
        if any(ref.shared is not self._shared for ref in self._refs):
            raise ValueError(f"DistributedOptimizer on rank {rank}: the references come from "
                             "different rma.share() calls; use references from one")
        self._shared.check_open()
        communicator = self._shared.communicator
        mine = sorted({(ref.owner(), ref.index) for ref in self._refs})
        union = sorted({key for keys in all_gather_object(mine, communicator) for key in keys})
        self._keys: List[ParamKey] = union  # a parameter's position is its global index
        by_rank = [self._shared.refs_of(owner) for owner in range(self._shared.size)]
        self._parameters = [by_rank[owner][index] for owner, index in union]
        self._proxies = {ref: torch.empty(ref.shape, dtype=ref.dtype) for ref in self._refs}
        self._optimizer = self._construct(args, kwargs)
        entries, unlearned = self._agree_on_entries(args, kwargs)
        # parameters whose layout is unknown (the dummy's step failed): why, for their steps
        self._unlearned: Dict[ParamKey, str] = {
            key: unlearned[(tuple(ref.shape), ref.dtype)]
            for key, ref in zip(union, self._parameters)
            if (tuple(ref.shape), ref.dtype) in unlearned}
        self._entries: Dict[ParamKey, List[StateEntry]] = {}
        self._offsets: Dict[ParamKey, List[int]] = {}  # flag, then one per entry
        layouts = [self._lay_out_state(owner, union, entries)
                   for owner in range(self._shared.size)]
        self._state = self._shared.new_window(layouts[rank].nbytes)
        self._state.local.zero_()  # no parameter has state yet
        direct = (self._shared.values.shared_memory and self._state.shared_memory
                  and os.environ.get(DIRECT_ENV, "1") != "0")
        self._access: _Access = _InPlace(self) if direct else _Fetched(self)
        barrier(communicator)  # every owner's flags are cleared before anyone steps

    def _construct(self, args: tuple, kwargs: dict) -> torch.optim.Optimizer:
        """The optimizer over this rank's stand-ins. Collective: a failure on any rank is raised
        on all."""
        with fail_together(self._shared.communicator,
                           f"constructing DistributedOptimizer({self._optimizer_class.__name__})"):
            optimizer = self._optimizer_class(list(self._proxies.values()), *args, **kwargs)
        return optimizer

    def _agree_on_entries(self, args: tuple,
                          kwargs: dict) -> Tuple[Dict[Spec, List[StateEntry]], Dict[Spec, str]]:
        """The state entries per parameter shape and dtype, learned on every rank and checked
        to agree, and why for those whose dummy step failed. Collective: a failure on any rank
        is raised on all."""
        name = self._optimizer_class.__name__
        communicator = self._shared.communicator
        entries: Dict[Spec, List[StateEntry]] = {}
        unlearned: Dict[Spec, str] = {}
        with fail_together(communicator, f"constructing DistributedOptimizer({name})"):
            for ref in self._parameters:
                spec = (tuple(ref.shape), ref.dtype)
                if spec not in entries:
                    entries[spec], why = learn_state(self._optimizer_class, *spec, args, kwargs)
                    if why is not None:
                        unlearned[spec] = why
        check_consistent(communicator, f"DistributedOptimizer: the state {name} keeps (give every "
                         "rank the same configuration)",
                         sorted((f"{spec[1]} {spec[0]}", "unknown: its step on a dummy failed"
                                 if spec in unlearned else [e.signature() for e in found])
                                for spec, found in entries.items()))
        return entries, unlearned

    def _lay_out_state(self, owner: int, union: List[ParamKey],
                       entries: Dict[Spec, List[StateEntry]]) -> Layout:
        """Where flag and state of each of ``owner``'s parameters lie in its state window."""
        keys = [key for key in union if key[0] == owner]
        specs, first = [], {}
        for key in keys:
            ref = self._shared.refs_of(owner)[key[1]]
            self._entries[key] = entries[(tuple(ref.shape), ref.dtype)]
            first[key] = len(specs)
            specs += self._specs(key)
        layout = Layout(specs)
        for key in keys:
            self._offsets[key] = layout.offsets[first[key]:first[key] + len(self._specs(key))]
        return layout

    @property
    def in_place(self) -> bool:
        """Whether steps run on the owners' shared memory directly instead of Get and Put."""
        return isinstance(self._access, _InPlace)

    @property
    def optimizer_class(self) -> Type[torch.optim.Optimizer]:
        """The ``torch.optim`` class applied to the parameters."""
        return self._optimizer_class

    @property
    def hyperparameters(self) -> Dict[str, Any]:
        """The optimizer's hyperparameters (its one param group without ``params``); fixed at
        construction."""
        return {k: v for k, v in self._optimizer.param_groups[0].items() if k != "params"}

    @property
    def parameter_refs(self) -> Tuple[RemoteRef, ...]:
        """References to every parameter of any rank's references, sorted by ``(owner(),
        index)``: the same on every rank. A parameter's position is its global index."""
        return tuple(self._parameters)

    def indexed_param_groups(self) -> List[Dict[str, Any]]:
        """The one param group in ``state_dict``'s structure: the hyperparameters, and
        ``params`` as the global indices of every parameter. Local."""
        return [{**self.hyperparameters, "params": list(range(len(self._parameters)))}]

    def owned_indices(self) -> List[int]:
        """The global indices of the parameters this rank owns."""
        rank = self._shared.rank
        return [i for i, (owner, _) in enumerate(self._keys) if owner == rank]

    def owned_parameters(self) -> Dict[int, torch.Tensor]:
        """Copies of the values of the parameters this rank owns, by global index, read from its
        window memory under a shared lock. Not collective."""
        self._check_open("owned_parameters()")
        with self._own_epoch(self._shared.values):
            return {i: self._value_view(i).clone() for i in self.owned_indices()}

    def owned_state(self) -> Dict[int, Dict[str, Any]]:
        """Copies of the optimizer state of the parameters this rank owns, by global index
        (parameters not stepped yet have none), read from its window memory under a shared
        lock. Not collective."""
        self._check_open("owned_state()")
        state = {}
        with self._own_epoch(self._state):
            for i in self.owned_indices():
                key = self._keys[i]
                flag, *views = self._state_views(key)
                if flag.item():
                    state[i] = {e.key: e.restore(view.clone())
                                for e, view in zip(self._entries[key], views)}
        return state

    def owned_bytes(self) -> torch.Tensor:
        """A copy of this rank's window memory: the values of the tensors it shared, then the
        optimizer state of those it owns here, as one flat ``uint8`` tensor (after 8 bytes
        giving the values' length), read under shared locks. :meth:`read_owned_bytes` reads it
        back on any rank of the group, with no pickling. Not collective."""
        self._check_open("owned_bytes()")
        values, state = self._shared.values, self._state
        with self._own_epoch(values), self._own_epoch(state):
            length = torch.tensor([values.local.numel()], dtype=torch.int64)
            return torch.cat([length.view(torch.uint8), values.local, state.local])

    def read_owned_bytes(self, owner: int,
                         payload: torch.Tensor) -> List[Tuple[torch.Tensor, Dict[str, Any]]]:
        """What rank ``owner``'s :meth:`owned_bytes` gave ``payload`` of: for each tensor it
        shared, in its order, a copy of the value (with the tensor's ``requires_grad``) and its
        optimizer state (``{}`` for one not stepped yet, or in no rank's references). Local.

        Raises:
            ValueError: ``payload`` does not have the size of ``owner``'s memory.
        """
        length = int(payload[:8].view(torch.int64)[0]) if payload.numel() >= 8 else 0
        values, state = payload[8:8 + length], payload[8 + length:]
        held = []
        try:
            for ref in self._shared.refs_of(owner):
                value = view_at(values, self._shared.value_offset(ref), ref.shape, ref.dtype)
                key = (owner, ref.index)
                entries: Dict[str, Any] = {}
                if key in self._offsets:
                    flag, *views = [view_at(state, offset, *spec)
                                    for offset, spec in zip(self._offsets[key], self._specs(key))]
                    if flag.item():
                        entries = {e.key: e.restore(view.clone())
                                   for e, view in zip(self._entries[key], views)}
                held.append((value.clone().requires_grad_(ref.requires_grad), entries))
        except RuntimeError as error:   # a view past the end
            raise ValueError(f"DistributedOptimizer.read_owned_bytes on rank {self._shared.rank}: "
                             f"{payload.numel()} bytes are not rank {owner}'s window memory "
                             f"({error})") from None
        return held

    def load_owned(self, parameters: Dict[int, torch.Tensor],
                   state: Dict[int, Dict[str, Any]]) -> None:
        """Replace the values and optimizer state of the parameters this rank owns, by global
        index, in its window memory under exclusive locks; owned parameters absent from
        ``state`` have none afterwards (their next step starts it). Everything is checked before
        anything is written. Not collective; no trainer should step meanwhile.

        Raises:
            ValueError: naming the rank and the parameter, for a missing or foreign index, a value
                or state entry of another shape or dtype, or other state keys.
        """
        self._check_open("load_owned()")
        rank, owned = self._shared.rank, self.owned_indices()
        foreign = sorted((set(parameters) | set(state)) - set(owned))
        missing = [i for i in owned if i not in parameters]
        if foreign or missing:
            raise ValueError(f"DistributedOptimizer.load_owned on rank {rank}: "
                             + (f"parameters {foreign} are not this rank's" if foreign
                                else f"no value given for parameters {missing}"))
        for i in owned:
            self._check_loadable(i, parameters[i], state.get(i))
        held, saved = [], []
        with self._own_epoch(self._shared.values, exclusive=True), \
                self._own_epoch(self._state, exclusive=True):
            for i in owned:
                self._value_view(i).copy_(parameters[i])
                flag, *views = self._state_views(self._keys[i])
                if i in state:
                    held.append([flag, *views])
                    saved.append([e.save(state[i][e.key], view)
                                  for e, view in zip(self._entries[self._keys[i]], views)])
                else:
                    flag.fill_(0)
            _store_in_place(held, saved)

    def _check_loadable(self, index: int, value: torch.Tensor,
                        state: Optional[Dict[str, Any]]) -> None:
        """Raise ValueError unless ``value`` and ``state`` fit parameter ``index`` (global)."""
        key, ref = self._keys[index], self._parameters[index]
        where = (f"DistributedOptimizer.load_owned on rank {self._shared.rank}: parameter "
                 f"{index} (tensor {key[1]} of rank {key[0]})")
        if (not isinstance(value, torch.Tensor) or value.shape != ref.shape
                or value.dtype != ref.dtype):
            raise ValueError(f"{where} is a {ref.dtype} tensor of shape {tuple(ref.shape)}; "
                             f"the value given is {_describe(value)}")
        if state is None:
            return
        entries = self._entries[key]
        expected = [e.key for e in entries]
        if sorted(state) != sorted(expected):
            raise ValueError(f"{where}: {self._optimizer_class.__name__} keeps state "
                             f"{sorted(expected)}, the state given has {sorted(state)}")
        for entry in entries:
            problem = entry.mismatch(state[entry.key])
            if problem is not None:
                raise ValueError(f"{where}: state entry {entry.key!r} given is {problem}")

    @contextmanager
    def _own_epoch(self, window: AnyWindow, exclusive: bool = False) -> Iterator[None]:
        """An epoch on this rank's own part of ``window``, in which its memory is read and
        written directly."""
        with window.locked(self._shared.rank, exclusive):
            window.sync()
            yield
            window.sync()

    def _value_view(self, index: int) -> torch.Tensor:
        """The window memory of parameter ``index`` (global), which this rank owns."""
        ref = self._parameters[index]
        return self._shared.values.view(self._shared.value_offset(ref), ref.shape, ref.dtype)

    def _state_views(self, key: ParamKey) -> List[torch.Tensor]:
        """Views of the flag and state entries of parameter ``key`` in its owner's memory (this
        rank's, or any in a shared-memory window)."""
        return [self._state.view(offset, *spec, rank=key[0])
                for offset, spec in zip(self._offsets[key], self._specs(key))]

    def _buffers(self, ref: RemoteRef) -> List[torch.Tensor]:
        """Local tensors to fetch ``ref``'s flag and state entries into."""
        entries = self._entries[(ref.owner(), ref.index)]
        return ([torch.zeros((), dtype=torch.int64)]
                + [empty(e.spec[0], e.spec[1]) for e in entries])

    def _get_state(self, ref: RemoteRef, buffers: List[torch.Tensor]) -> List[torch.Tensor]:
        """Start fetching ``ref``'s flag and state into ``buffers`` (inside an epoch on the
        state window)."""
        for buffer, offset in zip(buffers, self._offsets[(ref.owner(), ref.index)]):
            self._state.get(buffer, ref.owner(), offset)
        return buffers

    def step(self, context_id: int) -> None:
        """Update every parameter with a gradient in context ``context_id``; the others are left
        unchanged. Not collective: the owners take no part.

        Raises:
            ValueError: ``context_id`` is not an open context of this rank.
            RuntimeError: the optimizer failed (for an owner in shared memory, whose parameters
                it updates in place, the update may be incomplete; otherwise nothing changed),
                or this optimizer or its ``SharedTensors`` is closed.
        """
        self._check_open("step()")
        ctx = autograd.retrieve_context(context_id)
        stepped = [ref for ref in self._refs if ctx.has_gradient(ref)]
        for owner, refs in by_owner(stepped).items():
            unlearned = [ref for ref in refs if (owner, ref.index) in self._unlearned]
            if unlearned:
                self._step_unlearned(owner, unlearned, context_id)  # raises
            with trace.caller(f"DistributedOptimizer step on rank {owner}"):
                self._step_owner(owner, refs, context_id)

    def _step_unlearned(self, owner: int, refs: List[RemoteRef], context_id: int) -> None:
        """Run the optimizer on copies of ``refs``, whose state layout is unknown, and raise its
        error, or, if it works on the real values, that the layout is unknown. Writes nothing."""
        grads = self._shared.fetch_gradients(refs)
        for proxy in self._proxies.values():
            proxy.grad = None
        for ref in refs:
            proxy = self._proxies[ref]
            proxy.data, proxy.grad = self._shared.fetch(ref), grads[ref]
            self._optimizer.state.pop(proxy, None)
        try:
            self._optimizer.step()
        except Exception as error:
            raise self._failed(owner, refs, context_id, "they were left unchanged",
                               error) from error
        finally:
            for ref in refs:
                self._proxies[ref].grad = None
                self._optimizer.state.pop(self._proxies[ref], None)
        why = self._unlearned[(owner, refs[0].index)]
        raise RuntimeError(
            f"DistributedOptimizer.step(context {context_id}) on rank {self._shared.rank}: "
            f"parameters {[ref.index for ref in refs]} of rank {owner} were left unchanged: their "
            f"state layout is unknown, since {self._optimizer_class.__name__}'s step on a zero "
            f"dummy parameter failed at construction ({why})")

    def _failed(self, owner: int, refs: List[RemoteRef], context_id: int, outcome: str,
                error: Exception) -> RuntimeError:
        """The error a step raises when the optimizer failed on ``refs`` of ``owner``."""
        return RuntimeError(
            f"DistributedOptimizer.step(context {context_id}) on rank {self._shared.rank}: "
            f"{self._optimizer_class.__name__} failed on parameters "
            f"{[ref.index for ref in refs]} of rank {owner} ({outcome}): {error}")

    def _step_owner(self, owner: int, refs: List[RemoteRef], context_id: int) -> None:
        shared, state = self._shared, self._state
        with shared.values.locked(owner, exclusive=True), state.locked(owner, exclusive=True), \
                shared.gradients.locked(owner):
            grads, held = self._access.take(owner, refs)
            saved = self._run(owner, refs, grads, held, context_id)
            self._access.give_back(owner, refs, held, saved)
        for ref in refs:  # the state lives in the window only
            self._proxies[ref].grad = None
            self._optimizer.state.pop(self._proxies[ref], None)

    def _specs(self, key: ParamKey) -> List[Spec]:
        return [_FLAG] + [e.spec for e in self._entries[key]]

    def _run(self, owner: int, refs: List[RemoteRef], grads: List[torch.Tensor],
             held: List[List[torch.Tensor]], context_id: int) -> List[List[torch.Tensor]]:
        """Run the optimizer on the stand-ins; the state tensors to keep, per parameter."""
        optimizer = self._optimizer
        for proxy in self._proxies.values():
            proxy.grad = None
        for ref, grad, (flag, *buffers) in zip(refs, grads, held):
            proxy = self._proxies[ref]
            proxy.grad = grad.to(ref.dtype)
            entries = self._entries[(owner, ref.index)]
            optimizer.state[proxy] = ({e.key: e.restore(b) for e, b in zip(entries, buffers)}
                                      if flag.item() else {})
        try:
            optimizer.step()
            return [self._saved(ref, buffers) for ref, (_, *buffers) in zip(refs, held)]
        except Exception as error:
            raise self._failed(owner, refs, context_id, self._access.failed_outcome,
                               error) from error

    def _saved(self, ref: RemoteRef, buffers: List[torch.Tensor]) -> List[torch.Tensor]:
        """The tensors to write back for ``ref``'s state after a step."""
        state = self._optimizer.state[self._proxies[ref]]
        entries = self._entries[(ref.owner(), ref.index)]
        unknown = set(state) - {e.key for e in entries}
        if unknown:
            raise RuntimeError(f"state entries {sorted(unknown)} appeared that were not there "
                               "when the layout was learned")
        return [e.save(state.get(e.key), b) for e, b in zip(entries, buffers)]

    def state_of(self, ref: RemoteRef) -> Dict[str, Any]:
        """``ref``'s optimizer state, fetched from its owner under a shared lock (``{}`` before
        its first step). Not collective."""
        self._check_open("state_of()")
        key = (ref.owner(), ref.index)
        if key not in self._offsets:
            raise KeyError(f"{ref} is not a parameter of this DistributedOptimizer")
        with self._state.locked(ref.owner()):
            flag, *buffers = self._get_state(ref, self._buffers(ref))
        if not flag.item():
            return {}
        return {e.key: e.restore(b) for e, b in zip(self._entries[key], buffers)}

    def _check_open(self, call: str) -> None:
        """Raise ``RuntimeError`` if this optimizer or its ``SharedTensors`` is closed."""
        if self._closed:
            raise RuntimeError(f"DistributedOptimizer is closed (rank {self._shared.rank}): "
                               f"{call} cannot be used after close(), which freed its state")
        self._shared.check_open()

    def abandon(self) -> None:
        """After a lost rank, instead of :meth:`close`: leave the state window and those of the
        references' ``SharedTensors`` to ``MPI_Finalize``, stopping their threads
        (:meth:`~tensorplay_hpc.distributed.rma.SharedTensors.abandon`). Local."""
        self._closed = True
        self._state.abandon()
        self._shared.abandon()

    def close(self) -> None:
        """Free the state window. Collective. Closing again does nothing; afterwards the
        methods that read or step parameters raise ``RuntimeError``."""
        if self._closed:
            return
        self._closed = True
        for proxy in self._proxies.values():
            proxy.data = torch.empty(0, dtype=proxy.dtype)  # let go of window memory
        self._state.free()


def _store_in_place(held: Held, saved: Held) -> None:
    """Write state the optimizer made anew into the owner's views; mark it present."""
    for (flag, *views), tensors in zip(held, saved):
        for view, tensor in zip(views, tensors):
            if tensor.data_ptr() != view.data_ptr():
                view.copy_(tensor)
        flag.fill_(1)


class _Access:
    """How a step reaches an owner's parameters, gradients and state, inside the step's epochs
    on the three windows: :meth:`take` them for the optimizer's stand-ins, run the optimizer,
    :meth:`give_back` what it made."""

    failed_outcome = ""
    """What a failed optimizer left on the owner, as the step's error says it."""

    def __init__(self, optimizer: DistributedOptimizer) -> None:
        self.optimizer = optimizer

    def take(self, owner: int, refs: List[RemoteRef]) -> Tuple[List[torch.Tensor], Held]:
        """Point ``refs``' stand-ins at their values; their gradients, flags and state."""
        raise NotImplementedError

    def give_back(self, owner: int, refs: List[RemoteRef], held: Held, saved: Held) -> None:
        """Leave the stepped values and the ``saved`` state on the owner."""
        raise NotImplementedError


class _InPlace(_Access):
    """The optimizer runs on the owner's memory itself (windows in shared memory): views of its
    parameters, gradients, flags and state, nothing copied."""

    failed_outcome = "the update may be incomplete"

    def _sync(self) -> None:
        shared = self.optimizer._shared
        for window in (shared.values, self.optimizer._state, shared.gradients):
            window.sync()

    def take(self, owner: int, refs: List[RemoteRef]) -> Tuple[List[torch.Tensor], Held]:
        self._sync()
        o, shared = self.optimizer, self.optimizer._shared
        grads, held = [], []
        for ref in refs:
            o._proxies[ref].data = shared.values.view(shared.value_offset(ref), ref.shape,
                                                      ref.dtype, rank=owner)
            grads.append(shared.gradients.view(shared.gradient_offset(ref, shared.rank),
                                               ref.shape, reduce_dtype(ref.dtype), rank=owner))
            held.append(o._state_views((owner, ref.index)))
        return grads, held

    def give_back(self, owner: int, refs: List[RemoteRef], held: Held, saved: Held) -> None:
        _store_in_place(held, saved)
        self._sync()


class _Fetched(_Access):
    """Parameters, gradients, flags and state got from the owner into local buffers (reused
    by every step), and put back after the step."""

    failed_outcome = "they were left unchanged"

    def __init__(self, optimizer: DistributedOptimizer) -> None:
        super().__init__(optimizer)
        self._grads = {ref: torch.empty(ref.shape, dtype=reduce_dtype(ref.dtype))
                       for ref in optimizer._refs}
        self._fetched = {ref: optimizer._buffers(ref) for ref in optimizer._refs}

    def take(self, owner: int, refs: List[RemoteRef]) -> Tuple[List[torch.Tensor], Held]:
        o, shared = self.optimizer, self.optimizer._shared
        grads = [shared.get_gradient(ref, self._grads[ref]) for ref in refs]
        held = []
        for ref in refs:
            shared.values.get(o._proxies[ref], owner, shared.value_offset(ref))
            held.append(o._get_state(ref, self._fetched[ref]))
        for window in (shared.values, o._state, shared.gradients):
            window.flush(owner)
        return grads, held

    def give_back(self, owner: int, refs: List[RemoteRef], held: Held, saved: Held) -> None:
        o, shared = self.optimizer, self.optimizer._shared
        for ref, (flag, *_), tensors in zip(refs, held, saved):
            shared.values.put(o._proxies[ref], owner, shared.value_offset(ref))
            flag.fill_(1)
            for tensor, offset in zip([flag, *tensors], o._offsets[(owner, ref.index)]):
                o._state.put(tensor, owner, offset)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
