"""The part that test joinables share: a private group on the world, CPU tensors."""
import torch

from tensorplay_hpc import comm
from tensorplay_hpc.distributed.algorithms.join import Joinable


class CPUJoinable(Joinable):
    """A joinable on its own private duplicate of ``process_group`` (default world)."""

    def __init__(self, process_group=None):
        super().__init__()
        self.group = comm.ProcessGroup(process_group)

    @property
    def join_device(self):
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return self.group.parent
