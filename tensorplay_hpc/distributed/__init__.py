"""The tensorplay.distributed API over MPI: ``optim``, ``parallel``, ``algorithms``, ``rma`` and
``autograd``. Process groups are mpi4py intracommunicators (``None`` is ``MPI.COMM_WORLD``).

Importing this package also registers the ``mpi4py`` backend of torch.distributed
(:mod:`.backend`), so that ``dist.init_process_group("mpi4py")`` runs PyTorch's own distributed
stack on MPI."""
from . import backend  # noqa: F401  (registers the backend; starts no MPI)

__all__ = ["algorithms", "autograd", "backend", "optim", "parallel", "rma"]
