"""The constructor arguments of DistributedDataParallel: PyTorch's names and defaults, checked
on each rank, with a clear error for those that cannot apply over MPI."""
from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Tuple

import torch
from torch._utils import _get_device_index

__all__ = ["Arguments", "DEFAULT_BUCKET_CAP_MB", "Settings", "check_arguments"]

DEFAULT_BUCKET_CAP_MB = 25


@dataclass(frozen=True)
class Arguments:
    """DistributedDataParallel's constructor arguments as given, unchecked (PyTorch's names and
    defaults)."""

    module: Any
    device_ids: Any = None
    output_device: Any = None
    dim: Any = 0
    broadcast_buffers: Any = None
    init_sync: Any = True
    process_group: Any = None
    bucket_cap_mb: Any = None
    find_unused_parameters: Any = False
    check_reduction: Any = False
    gradient_as_bucket_view: Any = False
    static_graph: Any = False
    delay_all_reduce_named_params: Any = None
    param_to_hook_all_reduce: Any = None
    mixed_precision: Any = None
    device_mesh: Any = None
    skip_all_reduce_unused_params: Any = False
    bucket_cap_mb_list: Any = None
    batched_grad_copy: Any = False
    forward_sync_buffers: Any = None


class Settings(NamedTuple):
    """The checked arguments, as DistributedDataParallel uses them."""

    device_ids: Optional[List[int]]
    output_device: Optional[int]
    device: torch.device
    is_multi_device_module: bool
    forward_sync_buffers: bool
    init_sync_buffers: bool
    bucket_cap_mb: float


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"DistributedDataParallel: {name} must be a bool, got "
                        f"{type(value).__name__} {value!r}")


def _refuse(name: str, why: str) -> None:
    raise NotImplementedError(f"DistributedDataParallel: {name} is not supported here: {why}")


def _devices(device_ids: Any, output_device: Any, parameters: List[torch.nn.Parameter]
             ) -> Tuple[Optional[List[int]], Optional[int], torch.device, bool]:
    devices = {p.device for p in parameters}
    device_types = {d.type for d in devices}
    if len(device_types) != 1:
        raise ValueError("DistributedDataParallel's input module must be on the same type of "
                         f"devices, but input module parameters locate in {device_types}.")
    if device_ids is not None and not isinstance(device_ids, (list, tuple)):
        raise TypeError("DistributedDataParallel: device_ids must be None or a list of one "
                        f"device, got {type(device_ids).__name__} {device_ids!r}")
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    multi_device = len(devices) > 1
    device = parameters[0].device
    if not device_ids or device.type == "cpu" or multi_device:
        if device_ids or output_device:   # as PyTorch: output_device=0 passes
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                f"{device_ids}, output_device {output_device}, and module parameters "
                f"{devices}.")
        return None, None, device, multi_device
    index = _get_device_index(device_ids[0], True)
    if index != device.index:
        raise ValueError(f"DistributedDataParallel: device_ids[0] is {device.type}:{index}, but "
                         f"the module's parameters are on {device}; move the module there "
                         f"first (module.to({device.type}:{index}))")
    output = index if output_device is None else _get_device_index(output_device, True)
    return [index], output, device, multi_device


def check_arguments(given: Arguments) -> Settings:
    """Check DistributedDataParallel's arguments ``given`` on this rank, as PyTorch does, and
    refuse those that cannot apply here. Local (no communication).

    Raises:
        TypeError: an argument of the wrong type (names it).
        ValueError: a value PyTorch refuses, or ``device_ids`` not matching the module.
        RuntimeError: no parameter requires a gradient, an uninitialized parameter, or both
            ``process_group`` and ``device_mesh``.
        NotImplementedError: ``device_mesh``, ``mixed_precision``,
            ``delay_all_reduce_named_params``/``param_to_hook_all_reduce``,
            ``skip_all_reduce_unused_params=True`` or ``bucket_cap_mb_list``.
    """
    if not isinstance(given.module, torch.nn.Module):
        raise TypeError("DistributedDataParallel: module must be a torch.nn.Module, got "
                        f"{type(given.module).__name__}")
    if (given.delay_all_reduce_named_params is None) != (given.param_to_hook_all_reduce is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be "
                         "set at the same time.")
    if given.process_group is not None and given.device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if given.device_mesh is not None:
        _refuse("device_mesh", "pass the data-parallel group as process_group (an mpi4py "
                "intracommunicator, e.g. from MPI.COMM_WORLD.Split)")
    if given.delay_all_reduce_named_params is not None:
        _refuse("delay_all_reduce_named_params", "every parameter's gradient is reduced in its "
                "bucket during the backward pass")
    if given.mixed_precision is not None:
        _refuse("mixed_precision", "convert the module to the precision you want to train in "
                "(module.to(torch.bfloat16)); gradients are reduced in the parameters' dtype")
    for name, value in [("init_sync", given.init_sync),
                        ("find_unused_parameters", given.find_unused_parameters),
                        ("check_reduction", given.check_reduction),
                        ("gradient_as_bucket_view", given.gradient_as_bucket_view),
                        ("static_graph", given.static_graph),
                        ("skip_all_reduce_unused_params", given.skip_all_reduce_unused_params),
                        ("batched_grad_copy", given.batched_grad_copy)]:
        _require_bool(name, value)
    for name, value in [("broadcast_buffers", given.broadcast_buffers),
                        ("forward_sync_buffers", given.forward_sync_buffers)]:
        if value is not None:
            _require_bool(name, value)
    if given.skip_all_reduce_unused_params:
        _refuse("skip_all_reduce_unused_params=True", "buckets are always reduced whole "
                "(unused parameters count as zeros with find_unused_parameters=True)")
    if given.bucket_cap_mb_list:
        _refuse("bucket_cap_mb_list", "give one size for every bucket with bucket_cap_mb")
    bucket_cap_mb = given.bucket_cap_mb
    if bucket_cap_mb is None:
        bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    elif not isinstance(bucket_cap_mb, numbers.Real) or isinstance(bucket_cap_mb, bool):
        raise TypeError("DistributedDataParallel: bucket_cap_mb must be a number (MiB) or None, "
                        f"got {type(bucket_cap_mb).__name__} {bucket_cap_mb!r}")
    elif bucket_cap_mb < 0:
        raise ValueError(f"DistributedDataParallel: bucket_cap_mb must not be negative, got "
                         f"{bucket_cap_mb}")
    if not isinstance(given.dim, int) or isinstance(given.dim, bool):
        raise TypeError(f"DistributedDataParallel: dim must be an int, got "
                        f"{type(given.dim).__name__} {given.dim!r}")
    parameters = list(given.module.parameters())
    if not any(p.requires_grad for p in parameters):
        raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any "
                           "parameter that requires a gradient.")
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in parameters):
        raise RuntimeError("Modules with uninitialized parameters can't be used with "
                           "`DistributedDataParallel`. Run a dummy forward pass to correctly "
                           "initialize the modules")
    ids, output, device, multi_device = _devices(given.device_ids, given.output_device, parameters)
    if given.broadcast_buffers is not None:
        if given.forward_sync_buffers is not None:
            warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                          "`broadcast_buffers` is deprecated and its value is ignored when "
                          "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
        else:
            warnings.warn("`broadcast_buffers` is deprecated. Use `forward_sync_buffers` "
                          "instead. IMPORTANT: unlike `broadcast_buffers=False`, "
                          "`forward_sync_buffers=False` still syncs buffers at init. If you rely "
                          "on buffers NOT being synced at init (e.g. rank-local buffers), keep "
                          "using `broadcast_buffers=False` until `init_sync_buffers` is "
                          "available.", FutureWarning, stacklevel=3)
    if given.check_reduction:
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                      "deprecated. Please avoid using it.", FutureWarning, stacklevel=3)
    if given.forward_sync_buffers is not None:
        forward_sync, init_sync_buffers = given.forward_sync_buffers, True
    else:
        forward_sync = init_sync_buffers = (True if given.broadcast_buffers is None
                                            else given.broadcast_buffers)
    return Settings(ids, output, device, multi_device, forward_sync, init_sync_buffers,
                    float(bucket_cap_mb))
