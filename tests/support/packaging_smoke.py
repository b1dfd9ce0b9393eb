"""A 2-rank job against an installed wheel, run by tests/package/test_packaging.py with the new
environment's python, as a user would run it after ``pip install tensorplay-hpc``:

    packaging_smoke.py OUT_JSON CHECKPOINT_FILE

The optional packages (``isal``, ``tqdm``, ``matplotlib``) are made unimportable first, so the
job sees only the core dependencies. Rank 0 writes what it found to OUT_JSON.
"""
import json
import sys

for optional in ("isal", "tqdm", "matplotlib"):
    sys.modules[optional] = None  # `import NAME` now raises ImportError, as if not installed

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import tensorplay_hpc  # noqa: E402
from tensorplay_hpc import checkpoint  # noqa: E402
from tensorplay_hpc.checkpoint import format as checkpoint_format  # noqa: E402
from tensorplay_hpc.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(),
                               torch.nn.Linear(9, 2)).double()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """The same batches on every rank: ZeRO then owes a local optimizer's exact values."""
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 5, generator=g, dtype=torch.float64)
        y = torch.randn(16, 2, generator=g, dtype=torch.float64)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def main(out: str, checkpoint_file: str) -> None:
    world = MPI.COMM_WORLD
    zero_model, local_model = make_model(), make_model()
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), torch.optim.Adam, lr=0.01)
    train(zero_model, zero, 3)
    train(local_model, torch.optim.Adam(local_model.parameters(), lr=0.01), 3)
    zero_equals_local = all(torch.equal(p, q) for p, q in
                            zip(zero_model.parameters(), local_model.parameters()))

    # A checkpoint written and read back with zlib's CRC-32 (isal is not importable).
    checkpoint.save(checkpoint_file, model=zero_model, optimizer=zero, extra={"step": 3})
    loaded_model = make_model()
    loaded = ZeroRedundancyOptimizer(loaded_model.parameters(), torch.optim.Adam, lr=0.01)
    extra = checkpoint.load(checkpoint_file, model=loaded_model, optimizer=loaded)
    loaded_equals_saved = all(torch.equal(p, q) for p, q in
                              zip(loaded_model.parameters(), zero_model.parameters()))
    zero.consolidate_state_dict(to=0)
    loaded.consolidate_state_dict(to=0)

    # The training job says which extra it needs (usage error, status 2, on every rank).
    from tensorplay_hpc.__main__ import main as command
    train_status = command(["train", "--steps", "1"])

    found = {
        "version": tensorplay_hpc.__version__,
        "file": tensorplay_hpc.__file__,
        "size": world.Get_size(),
        "zero_equals_local": zero_equals_local,
        "loaded_equals_saved": loaded_equals_saved,
        "step": int(extra["step"]),
        "crc32_module": checkpoint_format.crc32.__module__,
        "train_status": train_status,
    }
    if world.Get_rank() == 0:
        saved_state, loaded_state = zero.state_dict(), loaded.state_dict()
        found["state_equal"] = all(
            torch.equal(value, loaded_state["state"][index][key])
            for index, state in saved_state["state"].items() for key, value in state.items())
    every = world.gather(found, root=0)
    if world.Get_rank() == 0:
        with open(out, "w") as file:
            json.dump(every, file)


if __name__ == "__main__":
    main(*sys.argv[1:])
