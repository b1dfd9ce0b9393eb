"""The package's layers import downwards only (docs/developers.md, "Layers").

Every ``import`` and ``from ... import`` of the package's source is read with ``ast`` (at module
level, inside functions and under ``TYPE_CHECKING`` alike), resolved to the module it names,
and checked against the order below; a failure names each offending import by file and line.
Modules loaded by a name computed at run time (``importlib.import_module``) are not seen: the
package does that only for its own area's modules loaded on first use (optimizers, benchmarks)
and for an optimizer class named on the command line.
"""
import ast
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

import tensorplay_hpc

PACKAGE = "tensorplay_hpc"
SOURCE = Path(tensorplay_hpc.__file__).parent

LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("package",),   # tensorplay_hpc itself: its version only
    ("comm",),
    ("distributed.algorithms", "distributed.rma", "distributed.autograd", "distributed.backend",
     "distributed"),   # the last: the package tensorplay_hpc.distributed itself
    ("distributed.optim", "distributed.parallel"),
    ("checkpoint",),
    ("train", "bench", "diagnostics", "command line"),
)
"""The layers, lowest first. A module may import from its own area and from lower layers."""

SIDEWAYS = {("distributed.autograd", "distributed.rma"), ("distributed", "distributed.backend")}
"""Imports allowed within one layer: distributed autograd is built on remote references (rma
offers ``register_fetch_hook`` for it instead of importing it); model averaging and hooks
(algorithms) and torch.distributed's backend use none of the others, and optim and parallel
import neither each other. Importing ``tensorplay_hpc.distributed`` registers the backend."""

TOP = LAYERS[-1]
"""The programs on top (training job, benchmarks, diagnostics, command lines) may import one
another: the command line dispatches to each."""

LEVEL = {area: level for level, areas in enumerate(LAYERS) for area in areas}


def module_name(path: Path, root: Path) -> str:
    """``pkg.sub.mod`` for ``root/sub/mod.py`` (``pkg.sub`` for ``sub/__init__.py``)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def area(module: str) -> str:
    """The area of the layer table that ``module`` belongs to."""
    parts = module.split(".")[1:]
    if parts and parts[-1] in ("__main__", "cli"):
        return "command line"
    if not parts:
        return "package"
    return ".".join(parts[:2]) if parts[0] == "distributed" else parts[0]


def imports(path: Path, root: Path) -> Iterator[Tuple[int, str]]:
    """``(line, module)`` for every import of ``root``'s package in the file at ``path``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` where there is one.
            targets = [f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}", root) else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target == root.name or target.startswith(root.name + "."):
                yield node.lineno, target


def is_module(name: str, root: Path) -> bool:
    """Whether ``name`` is a module or package of ``root``'s package."""
    relative = Path(*name.split(".")[1:]) if "." in name else Path()
    return (root / relative).with_suffix(".py").is_file() or (root / relative / "__init__.py").is_file()


def violations(root: Path) -> List[str]:
    """Every import of ``root``'s package that breaks the layer order, as readable lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = module_name(path, root)
        here = area(source)
        if here not in LEVEL:
            found.append(f"{path.relative_to(root.parent)}: area {here!r} is in no layer of "
                         "tests/package/test_layers.py (place it there and in docs/developers.md)")
            continue
        for line, target in imports(path, root):
            there = area(target)
            if there == here or (here in TOP and there in TOP) or (here, there) in SIDEWAYS:
                continue
            if there not in LEVEL or LEVEL[there] >= LEVEL[here]:
                found.append(f"{path.relative_to(root.parent)}:{line}: {source} ({here}) imports "
                             f"{target} ({there}), which is not below it")
    return found


def test_the_package_imports_downwards_only():
    assert violations(SOURCE) == []


def _write(root: Path, files: Dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / PACKAGE / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / PACKAGE


def test_upward_sideways_and_late_imports_are_named(tmp_path):
    root = _write(tmp_path, {
        "__init__.py": "",
        "comm/__init__.py": "from tensorplay_hpc.comm.group import x\n",
        "comm/group.py": "def f():\n    from ..checkpoint import save\n",
        "distributed/__init__.py": "",
        "distributed/rma/__init__.py": "from tensorplay_hpc.distributed import autograd\n",
        "distributed/autograd.py": "from tensorplay_hpc.distributed.rma import share\n",
        "distributed/optim/__init__.py": "from .. import parallel\n",
        "distributed/parallel/__init__.py": "from typing import TYPE_CHECKING\n"
                                             "if TYPE_CHECKING:\n"
                                             "    from ..optim import zero\n",
        "distributed/optim/zero.py": "import tensorplay_hpc.comm.group\n",
        "checkpoint/__init__.py": "from tensorplay_hpc.distributed.optim import zero\n",
        "checkpoint/cli.py": "from tensorplay_hpc.train import loop\n",
        "train/loop.py": "from tensorplay_hpc.bench import timing\n",
    })
    assert violations(root) == [
        "tensorplay_hpc/comm/group.py:2: tensorplay_hpc.comm.group (comm) imports "
        "tensorplay_hpc.checkpoint (checkpoint), which is not below it",
        "tensorplay_hpc/distributed/optim/__init__.py:1: tensorplay_hpc.distributed.optim "
        "(distributed.optim) imports tensorplay_hpc.distributed.parallel (distributed.parallel), "
        "which is not below it",
        "tensorplay_hpc/distributed/parallel/__init__.py:3: tensorplay_hpc.distributed.parallel "
        "(distributed.parallel) imports tensorplay_hpc.distributed.optim.zero "
        "(distributed.optim), which is not below it",
        "tensorplay_hpc/distributed/rma/__init__.py:1: tensorplay_hpc.distributed.rma "
        "(distributed.rma) imports tensorplay_hpc.distributed.autograd (distributed.autograd), "
        "which is not below it",
    ]


def test_an_area_outside_the_layers_is_named(tmp_path):
    root = _write(tmp_path, {"__init__.py": "", "plugins/extra.py": ""})
    assert violations(root) == ["tensorplay_hpc/plugins/extra.py: area 'plugins' is in no layer "
                                "of tests/package/test_layers.py (place it there and in docs/developers.md)"]


@pytest.mark.parametrize("module, expected", [
    ("tensorplay_hpc", "package"), ("tensorplay_hpc.distributed", "distributed"),
    ("tensorplay_hpc.comm.staging", "comm"), ("tensorplay_hpc.checkpoint.cli", "command line"),
    ("tensorplay_hpc.__main__", "command line"),
    ("tensorplay_hpc.distributed.algorithms.model_averaging.utils", "distributed.algorithms"),
    ("tensorplay_hpc.distributed.autograd", "distributed.autograd"),
])
def test_areas(module: str, expected: str):
    assert area(module) == expected
