"""The public API is marked: every public module says what it exports (``__all__``), every name
it lists exists, the documented import paths work with their documented arguments, and the
tests and benchmarks use public names of the package, never its private ones."""
import ast
import importlib
import inspect
from pathlib import Path
from typing import List

import pytest

import tensorplay_hpc

SOURCE = Path(tensorplay_hpc.__file__).parent
REPO = SOURCE.parent


def public_modules() -> List[str]:
    """Every module of the package whose name has no leading underscore (``__init__`` files
    stand for their package; ``__main__`` files are entry points, not modules to import)."""
    names = []
    for path in sorted(SOURCE.rglob("*.py")):
        parts = [SOURCE.name, *path.relative_to(SOURCE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        if not any(part.startswith("_") for part in parts):
            names.append(".".join(parts))
    return names


def declared_all(path: Path):
    """The literal ``__all__`` assigned at the top level of the file, or None."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return node.value
    return None


def module_path(name: str) -> Path:
    relative = Path(*name.split(".")[1:])
    package = SOURCE / relative / "__init__.py"
    return package if package.is_file() else (SOURCE / relative).with_suffix(".py")


def test_every_public_module_declares_all():
    missing = [name for name in public_modules() if declared_all(module_path(name)) is None]
    assert missing == [], ("give each of these modules an __all__ listing its public names "
                           "(docs/developers.md)")


@pytest.mark.parametrize("name", public_modules())
def test_every_exported_name_exists(name):
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), f"{name}.__all__ repeats a name"
    absent = []
    for item in exported:
        if hasattr(module, item):
            continue
        try:   # a package may export its submodules
            importlib.import_module(f"{name}.{item}")
        except ModuleNotFoundError:
            absent.append(item)
    assert absent == [], f"{name}.__all__ lists names it does not have"


def test_the_documented_public_api_imports_with_its_documented_arguments():
    # The "Public API" of the design notes, verbatim.
    from mpi4py import MPI  # noqa: F401
    from tensorplay_hpc.distributed.optim import (
        ZeroRedundancyOptimizer, PostLocalSGDOptimizer, DistributedOptimizer)
    from tensorplay_hpc.distributed.algorithms.model_averaging import averagers
    from tensorplay_hpc.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager)
    from tensorplay_hpc.distributed.algorithms.model_averaging.utils import average_parameters
    from tensorplay_hpc.distributed.parallel import DistributedDataParallel
    from tensorplay_hpc.distributed import rma
    from tensorplay_hpc.distributed import autograd
    from tensorplay_hpc import checkpoint

    def parameters(function, count):
        return [(p.name, p.default) for p in
                list(inspect.signature(function).parameters.values())[:count]]

    empty = inspect.Parameter.empty
    assert all(inspect.isclass(c) for c in (ZeroRedundancyOptimizer, PostLocalSGDOptimizer,
                                            DistributedOptimizer, DistributedDataParallel))
    assert issubclass(averagers.PeriodicModelAverager, averagers.ModelAverager)
    assert parameters(averagers.PeriodicModelAverager, 3) == [
        ("period", empty), ("warmup_steps", 0), ("process_group", None)]
    assert parameters(HierarchicalModelAverager, 3) == [
        ("period_group_size_dict", None), ("warmup_steps", 0), ("process_group", None)]
    assert callable(average_parameters)
    assert parameters(rma.share, 2) == [("tensors", empty), ("process_group", None)]
    assert parameters(autograd.backward, 2) == [("context_id", empty), ("roots", empty)]
    assert callable(autograd.context) and callable(autograd.get_gradients)
    assert parameters(checkpoint.save, 1) == parameters(checkpoint.load, 1) == [("path", empty)]


def test_comm_exports_its_interface_not_its_internals():
    from tensorplay_hpc import comm
    for internal in ("Staged", "memory", "chunks", "chunk_elements", "piece_elements",
                     "pack_by_dtype_device", "private_comm"):
        assert internal not in comm.__all__ and not hasattr(comm, internal), internal


PRIVATE_SEAMS = ("_write_own", "_buffers", "_overlap", "_checkpointers", "_agree_on_pass")
"""Private attributes that tests and benchmarks once reached into; each has a public seam."""


def private_uses(path: Path) -> List[str]:
    """Where the file imports a private name of the package, reads a private attribute of one of
    its modules, or names one of :data:`PRIVATE_SEAMS` on any object but ``self``."""
    tree = ast.parse(path.read_text())
    modules = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tensorplay_hpc"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno}: imports {node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names
                           if a.name.startswith("tensorplay_hpc"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if owner in modules or (node.attr in PRIVATE_SEAMS and owner != "self"):
                found.append(f"{path.name}:{node.lineno}: {owner}.{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("tensorplay_hpc.") \
                and any(part.startswith("_") and not part.startswith("__")
                        for part in node.value.split(".")):
            found.append(f"{path.name}:{node.lineno}: {node.value}")
    return sorted(found, key=lambda use: int(use.split(":")[1]))


def test_tests_and_benchmarks_use_public_names():
    files = sorted((REPO / "tests").rglob("*.py")) + sorted((SOURCE / "bench").rglob("*.py"))
    found = [use for path in files for use in private_uses(path)]
    assert found == []


def test_a_private_use_is_named(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from tensorplay_hpc.checkpoint import writer, _checkpointers\n"
                      "import tensorplay_hpc.checkpoint as checkpoint\n"
                      "writer._write_own = None\n"
                      "checkpoint._hidden()\n"
                      "self._overlap = zero._overlap\n"
                      "patch('tensorplay_hpc.checkpoint.writer._write_own')\n")
    assert private_uses(sample) == [
        "sample.py:1: imports tensorplay_hpc.checkpoint._checkpointers",
        "sample.py:3: writer._write_own", "sample.py:4: checkpoint._hidden",
        "sample.py:5: zero._overlap",
        "sample.py:6: tensorplay_hpc.checkpoint.writer._write_own"]
