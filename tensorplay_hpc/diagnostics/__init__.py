"""What the installation and the launch can do: the environment settings of the package, and
the report of ``tensorplay-hpc env``."""

__all__: list = []
