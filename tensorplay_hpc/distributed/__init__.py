"""The tensorplay.distributed API over MPI: ``optim``, ``parallel``, ``algorithms``, ``rma`` and
``autograd``. Process groups are mpi4py intracommunicators (``None`` is ``MPI.COMM_WORLD``)."""
