"""How each torch dtype travels through MPI: the datatype for moving it and for reducing it.

MPI has no bfloat16 or float16, so those move as raw 16-bit words and are reduced in float32,
or, for sums asked to stay in 16 bits, with an operation of this module that adds them in their
own type (:func:`half_sum_op`). Booleans reduce with logical operations (sum and max are "or",
min and product are "and").
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Dict, Iterable, Tuple

import torch

from .mpi import MPI

__all__ = ["NATIVE", "ReduceOp", "half_sum_op", "is_half", "move_datatype", "reduce_dtype",
           "reduce_op"]


class _Table(dict):
    """A dict of MPI handles, filled at its first read (MPI handles exist once mpi4py.MPI is
    imported, which initializes MPI)."""

    def __init__(self, build: Callable[[], Iterable[Tuple[Any, Any]]]) -> None:
        super().__init__()
        self._build = build

    def _fill(self) -> None:
        self.update(self._build())
        self._build = None

    def __missing__(self, key: Any) -> Any:
        if self._build is None:
            raise KeyError(key)
        self._fill()
        return self[key]

    def get(self, key: Any, default: Any = None) -> Any:
        if self._build is not None:
            self._fill()
        return dict.get(self, key, default)


class ReduceOp(Enum):
    """Reductions with torch.distributed's names. ``AVG`` is a sum divided by the group size."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"

    __hash__ = object.__hash__   # members are singletons: hashed in C, as dict keys on every call


NATIVE = _Table(lambda: {   # the dtypes that MPI moves and reduces as they are
    torch.float64: MPI.DOUBLE,
    torch.float32: MPI.FLOAT,
    torch.int64: MPI.INT64_T,
    torch.int32: MPI.INT32_T,
    torch.int16: MPI.INT16_T,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.bool: MPI.C_BOOL,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}.items())
_HALF = (torch.float16, torch.bfloat16)
_half_sums: Dict[torch.dtype, MPI.Op] = {}
_reduce_ops: Dict[tuple, MPI.Op] = {}   # (dtype, ReduceOp): checked once, then looked up

_ARITHMETIC = _Table(lambda: {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVG: MPI.SUM,
    ReduceOp.PRODUCT: MPI.PROD,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
}.items())
_LOGICAL = _Table(lambda: {
    ReduceOp.SUM: MPI.LOR,
    ReduceOp.MAX: MPI.LOR,
    ReduceOp.PRODUCT: MPI.LAND,
    ReduceOp.MIN: MPI.LAND,
}.items())


def move_datatype(dtype: torch.dtype) -> MPI.Datatype:
    """The MPI datatype that carries ``dtype`` unchanged (broadcast, gather: no arithmetic)."""
    if dtype in _HALF:
        return MPI.UINT16_T
    try:
        return NATIVE[dtype]
    except KeyError:
        raise TypeError(f"tensors of dtype {dtype} cannot be communicated") from None


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` is computed in (float32 for the 16-bit floats)."""
    if dtype in _HALF:
        return torch.float32
    move_datatype(dtype)
    return dtype


def reduce_op(dtype: torch.dtype, op: ReduceOp) -> MPI.Op:
    """The MPI operation for reducing tensors of ``dtype`` (already in :func:`reduce_dtype`)."""
    try:
        return _reduce_ops[dtype, op]
    except KeyError:
        pass
    op = ReduceOp(op)
    if dtype == torch.bool:
        if op is ReduceOp.AVG:
            raise TypeError("ReduceOp.AVG is not defined for bool tensors")
        mpi_op = _LOGICAL[op]
    elif op is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"ReduceOp.AVG needs a floating point tensor, got {dtype}")
    elif dtype.is_complex and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"{op.name} is not defined for complex tensors")
    else:
        mpi_op = _ARITHMETIC[op]
    _reduce_ops[dtype, op] = mpi_op
    return mpi_op


def is_half(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the 16-bit floats MPI lacks."""
    return dtype in _HALF


def half_sum_op(dtype: torch.dtype) -> MPI.Op:
    """An MPI operation that adds tensors of the 16-bit float ``dtype`` moved as 16-bit words,
    in ``dtype`` (each partial sum rounded to 16 bits, as NCCL and gloo add them): half the
    bytes of a sum in float32. Made once per dtype; MPI frees it at finalization."""
    if dtype not in _half_sums:
        def add(inbuf: MPI.buffer, inoutbuf: MPI.buffer, datatype: MPI.Datatype) -> None:
            torch.frombuffer(inoutbuf, dtype=dtype).add_(torch.frombuffer(inbuf, dtype=dtype))
        _half_sums[dtype] = MPI.Op.Create(add, commute=True)
    return _half_sums[dtype]
