"""``tensorplay-hpc train``: a real training run over MPI, with checkpoints, preemption, resume.

One concept per module: :mod:`.config` (settings), :mod:`.data` (the corpus and batches),
:mod:`.model` (the transformer), :mod:`.strategy` (DDP, ZeRO, post-local SGD or plain),
:mod:`.preemption` (signals and the agreement to stop), :mod:`.history`, :mod:`.plot` and
:mod:`.progress` (what a user sees), :mod:`.loop` (the run) and :mod:`.cli` (the options).
"""

__all__: list = []
