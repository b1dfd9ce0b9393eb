"""Algorithms on top of the communication layer: model averaging, joining uneven inputs."""

__all__ = ["ddp_comm_hooks", "join", "model_averaging"]
