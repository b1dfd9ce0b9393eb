"""DistributedDataParallel's constructor as a drop-in for PyTorch's: the same names, order and
defaults; each argument accepted with PyTorch's effect, or refused with an error naming it, the
same on every rank."""
import inspect
import warnings

import pytest
import torch
from mpi4py import MPI

from tensorplay_hpc.distributed.parallel import DistributedDataParallel


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 2))


def _parameters_of(cls):
    return [(p.name, p.default, p.kind)
            for p in inspect.signature(cls.__init__).parameters.values()]


def test_signature_is_pytorchs():
    assert _parameters_of(DistributedDataParallel) == _parameters_of(
        torch.nn.parallel.DistributedDataParallel)


def test_defaults(world):
    ddp = DistributedDataParallel(_model())
    assert ddp.device_ids is None and ddp.output_device is None
    assert ddp.dim == 0
    assert ddp.broadcast_buffers is True and ddp.forward_sync_buffers is True
    assert ddp.bucket_bytes_cap == 25 * 2**20
    assert ddp.device == torch.device("cpu") and ddp.device_type == "cpu"
    assert ddp.process_group is MPI.COMM_WORLD
    assert not ddp.find_unused_parameters and not ddp.gradient_as_bucket_view
    assert not ddp.static_graph and ddp.mixed_precision is None


def test_accepted_arguments(world):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddp = DistributedDataParallel(
            _model(), device_ids=None, output_device=None, dim=1, init_sync=True,
            process_group=world, bucket_cap_mb=1, find_unused_parameters=True,
            check_reduction=False, gradient_as_bucket_view=True, static_graph=False,
            delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
            mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
            bucket_cap_mb_list=None, batched_grad_copy=True, forward_sync_buffers=True)
    assert ddp.dim == 1 and ddp.bucket_bytes_cap == 2**20 and ddp.batched_grad_copy
    ddp(torch.ones(3, 4)).sum().backward()
    assert DistributedDataParallel(_model(), device_ids=[]).device_ids is None   # as PyTorch
    assert DistributedDataParallel(_model(), static_graph=True).static_graph is True


def _first_weight_everywhere(world, ddp):
    return world.allgather(ddp.module[0].weight.detach().clone())


def _running_means_everywhere(world, ddp):
    return world.allgather(ddp.module[1].running_mean.clone())


def _differ_by_rank(tensors):
    return all(not torch.equal(tensors[0], t) for t in tensors[1:])


@pytest.mark.mpi(min_size=2)
def test_init_sync_false_broadcasts_nothing(world):
    rank = world.Get_rank()
    ddp = DistributedDataParallel(_model(seed=rank), init_sync=False)
    assert _differ_by_rank(_first_weight_everywhere(world, ddp))
    assert torch.equal(ddp.module[0].weight, _model(seed=rank)[0].weight)


def _local_buffers(rank):
    model = _model(seed=0)
    model[1].running_mean.fill_(float(rank))
    return model


@pytest.mark.mpi(min_size=2)
def test_broadcast_buffers_false_warns_and_syncs_no_buffers(world):
    rank = world.Get_rank()
    with pytest.warns(FutureWarning, match=r"`broadcast_buffers` is deprecated"):
        ddp = DistributedDataParallel(_local_buffers(rank), broadcast_buffers=False)
    assert ddp.broadcast_buffers is False
    assert ddp.module[1].running_mean.tolist() == [float(rank)] * 8   # not synced at init
    ddp.eval()
    ddp(torch.ones(3, 4)).sum().backward()
    assert ddp.module[1].running_mean.tolist() == [float(rank)] * 8   # nor in forward


@pytest.mark.mpi(min_size=2)
def test_forward_sync_buffers_false_syncs_at_init_only(world):
    rank = world.Get_rank()
    default = DistributedDataParallel(_local_buffers(rank))   # synced before each forward
    default.module[1].running_mean.fill_(float(rank))
    default.eval()
    default(torch.ones(3, 4)).sum().backward()
    assert default.module[1].running_mean.tolist() == [0.0] * 8
    ddp = DistributedDataParallel(_local_buffers(rank), forward_sync_buffers=False)
    assert ddp.module[1].running_mean.tolist() == [0.0] * 8   # rank 0's, at init
    ddp.module[1].running_mean.fill_(float(rank))
    ddp.eval()
    ddp(torch.ones(3, 4)).sum().backward()
    assert ddp.module[1].running_mean.tolist() == [float(rank)] * 8
    with pytest.warns(FutureWarning, match=r"Both `broadcast_buffers` and "):
        DistributedDataParallel(_model(), broadcast_buffers=True, forward_sync_buffers=True)


def test_check_reduction_warns_as_pytorch(world):
    with pytest.warns(FutureWarning, match=r"The `check_reduction` argument in "
                                           r"`DistributedDataParallel` module is deprecated"):
        DistributedDataParallel(_model(), check_reduction=True)


class _Mesh:
    ndim = 1


class _Precision:
    param_dtype = torch.bfloat16


@pytest.mark.parametrize("arguments, error, message", [
    ({"device_ids": [0]}, ValueError,
     r"DistributedDataParallel device_ids and output_device arguments only work with "
     r"single-device/multiple-device GPU modules or CPU modules, but got device_ids \[0\], "
     r"output_device None, and module parameters \{device\(type='cpu'\)\}\."),
    ({"output_device": 1}, ValueError, r"but got device_ids None, output_device 1"),
    ({"device_ids": [0, 1]}, ValueError,
     r"^device_ids can only be None or contain a single element\.$"),
    ({"device_ids": 0}, TypeError, r"device_ids must be None or a list of one device, got int"),
    ({"dim": 1.5}, TypeError, r"dim must be an int, got float 1.5"),
    ({"bucket_cap_mb": "25"}, TypeError, r"bucket_cap_mb must be a number \(MiB\) or None, got "
                                         r"str '25'"),
    ({"bucket_cap_mb": -1}, ValueError, r"bucket_cap_mb must not be negative, got -1"),
    ({"find_unused_parameters": "yes"}, TypeError,
     r"find_unused_parameters must be a bool, got str 'yes'"),
    ({"init_sync": 1}, TypeError, r"init_sync must be a bool, got int 1"),
    ({"broadcast_buffers": "no"}, TypeError, r"broadcast_buffers must be a bool, got str"),
    ({"device_mesh": _Mesh()}, NotImplementedError,
     r"device_mesh is not supported here: pass the data-parallel group as process_group"),
    ({"device_mesh": _Mesh(), "process_group": MPI.COMM_WORLD}, RuntimeError,
     r"^Cannot specify both process_group and device_mesh arguments\.$"),
    ({"mixed_precision": _Precision()}, NotImplementedError,
     r"mixed_precision is not supported here: convert the module"),
    ({"delay_all_reduce_named_params": "first"}, ValueError,
     r"^delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same "
     r"time\.$"),
    ({"delay_all_reduce_named_params": "first", "param_to_hook_all_reduce": "first"},
     NotImplementedError, r"delay_all_reduce_named_params is not supported here"),
    ({"skip_all_reduce_unused_params": True}, NotImplementedError,
     r"skip_all_reduce_unused_params=True is not supported here"),
    ({"bucket_cap_mb_list": [1, 25]}, NotImplementedError,
     r"bucket_cap_mb_list is not supported here"),
])
def test_refused_arguments_name_themselves(world, arguments, error, message):
    arguments = dict(arguments)
    model = _model()
    for key in ("delay_all_reduce_named_params", "param_to_hook_all_reduce"):
        if arguments.get(key) == "first":
            arguments[key] = ([("0.weight", model[0].weight)] if key.startswith("delay")
                              else model[0].weight)
    with pytest.raises(error, match=message):
        DistributedDataParallel(model, **arguments)


def test_refused_modules(world):
    with pytest.raises(TypeError, match=r"module must be a torch.nn.Module, got Tensor"):
        DistributedDataParallel(torch.ones(2))
    frozen = _model().requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"^DistributedDataParallel is not needed when a "
                                           r"module doesn't have any parameter that requires "
                                           r"a gradient\.$"):
        DistributedDataParallel(frozen)
    with pytest.raises(RuntimeError, match=r"Modules with uninitialized parameters can't be "
                                           r"used with `DistributedDataParallel`"):
        DistributedDataParallel(torch.nn.LazyLinear(2))


@pytest.mark.parametrize("arguments", [{"device_ids": [0]}, {"device_ids": [0, 1]},
                                       {"output_device": 1}, {"check_reduction": True}])
def test_pytorch_refuses_the_same(world, gloo, arguments):
    """Where PyTorch refuses an argument too (or warns), the error type and message (or the
    warning) are PyTorch's."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a warning is raised, to compare it too
        with pytest.raises(Exception) as theirs:
            torch.nn.parallel.DistributedDataParallel(_model(), **arguments)
        with pytest.raises(Exception) as ours:
            DistributedDataParallel(_model(), **arguments)
    assert (ours.type, str(ours.value)) == (theirs.type, str(theirs.value))


@pytest.mark.mpi(min_size=2)
def test_an_argument_refused_on_one_rank_only_is_an_error_on_every_rank(world):
    rank = world.Get_rank()
    with pytest.raises(ValueError, match=r"the arguments: ranks \[1\] differ from rank 0.*"
                                         r"rank 1 has \('outcome', \"TypeError: "
                                         r"DistributedDataParallel: dim must be an int"):
        DistributedDataParallel(_model(), dim="0" if rank == 1 else 0)
    with pytest.raises(ValueError, match=r"the arguments: ranks \[1\] differ from rank 0.*"
                                         r"\('init_sync', True\), rank 1 has \('init_sync', "
                                         r"False\)"):
        DistributedDataParallel(_model(), init_sync=rank != 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_device_ids(world):
    from tensorplay_hpc import comm
    device = comm.device_for_rank()
    torch.cuda.set_device(device)
    model = _model().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index])
    assert ddp.device_ids == [device.index] and ddp.output_device == device.index
    output = ddp(torch.ones(3, 4))   # a CPU input is moved to the module's device
    assert output.device == device
    other = (device.index + 1) % max(2, torch.cuda.device_count())
    with pytest.raises(ValueError, match=rf"device_ids\[0\] is cuda:{other}, but the module's "
                                         rf"parameters are on {device}"):
        DistributedDataParallel(model, device_ids=[other])
