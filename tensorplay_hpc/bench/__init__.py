"""Benchmarks: ``python -m tensorplay_hpc.bench NAME [NAME ...]`` under mpiexec.

Each NAME is a module of this package with a ``run(report)`` function; every case is measured
side by side with its baselines in the same run and reported as ratios.
"""

__all__: list = []
