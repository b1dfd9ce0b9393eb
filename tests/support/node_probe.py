"""What one rank sees of the cluster it runs on, as one JSON line (run by test_simulated_nodes)."""
import json
import socket

from mpi4py import MPI

world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED)
try:
    window = MPI.Win.Allocate_shared(8, 8, comm=world)
    window.Free()
    shared_across_world = True
except MPI.Exception:
    shared_across_world = False
seen = world.gather({"rank": world.rank, "node_size": node.Get_size(),
                     "processor": MPI.Get_processor_name(), "hostname": socket.gethostname(),
                     "shared_window_over_world": shared_across_world})
if world.rank == 0:
    print(json.dumps(seen))
