"""Algorithms on top of the communication layer: model averaging, joining uneven inputs."""
