"""One watched path: the package calls mpi4py's collectives (and makes and frees communicators,
windows and MPI-IO files) only in ``tensorplay_hpc/comm/``, and there only inside a region the
watchdog watches, so that a rank that skips a collective is reported instead of hanging the job.
A scan of the source (ast)."""
import ast
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tensorplay_hpc"
COMM = PACKAGE / "comm"

BUFFER_COLLECTIVES = {
    "Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Alltoallw", "Barrier",
    "Bcast", "Exscan", "Gather", "Gatherv", "Reduce", "Reduce_scatter",
    "Reduce_scatter_block", "Scan", "Scatter", "Scatterv"}
RAW_CALLS = (BUFFER_COLLECTIVES | {"I" + name.lower() for name in BUFFER_COLLECTIVES}
             | {"Dup", "Split", "Split_type", "Create_group", "Ibarrier", "Allocate",
                "Allocate_shared", "Open", "Close", "Shrink", "Ishrink", "Agree", "Iagree"})
"""mpi4py methods that every rank of a communicator must call: buffer collectives, blocking
and not, ULFM's agreement and shrink, and those that make communicators, windows (``Win.Allocate``) and MPI-IO files
(``File.Open``, ``File.Close``)."""
WINDOW_MAKERS = {"Create", "Create_dynamic"}
"""Names that make a window when called on ``Win`` (``MPI.Win.Create``), and something local
elsewhere (``MPI.Info.Create``)."""
LOCAL_MAKERS = {"Get_group", "Get_failed", "Get_info", "Incl", "Excl", "Range_incl", "Range_excl", "Union",
                "Intersection", "Difference", "Create_contiguous", "Create_vector",
                "Create_hvector", "Create_indexed", "Create_hindexed", "Create_struct",
                "Create_subarray", "Create_resized"}
"""mpi4py calls that make local objects (groups, info, datatypes). ``Free`` is collective on a
communicator or a window, and counts as a raw call unless its receiver was made by one of these
(or by ``MPI.Info.Create``)."""
OBJECT_CALLS = {"allgather", "allreduce", "alltoall", "barrier", "bcast", "exscan", "gather",
                "reduce", "scan", "scatter"}
"""mpi4py's collectives on pickled objects; names that the package's own modules and classes
share (``comm.gather``, a torch process group's ``self.allgather``) are told apart by their
receiver: an imported module, or ``self``."""
NOT_LIBRARY = {"bench"}
"""Benchmarks time raw mpi4py calls on purpose: they are the baselines."""


def _sources(root: Path) -> Iterator[Path]:
    return (path for path in sorted(root.rglob("*.py")) if "__pycache__" not in path.parts)


def _modules(tree: ast.AST) -> Set[str]:
    """The names under which a file imports modules (``comm`` of ``from tensorplay_hpc import
    comm``): a call on one of them is a function of the package, not a method of mpi4py."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names
                         if alias.name[:1].islower())
    return names


def _name(node: ast.AST) -> str:
    """The last name of ``x`` or ``a.b.x``; ``""`` for anything else."""
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")


def _makes_local(call: ast.AST) -> bool:
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
        return False
    return call.func.attr in LOCAL_MAKERS or (
        call.func.attr == "Create" and _name(call.func.value) == "Info")


def _local_objects(tree: ast.AST) -> Set[str]:
    """The names (``x``, ``self.x``) that ``tree`` binds to local MPI objects."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = zip(target.elts, node.value.elts)
                else:
                    pairs = [(target, node.value)]
                names.update(_name(t) for t, value in pairs if _makes_local(value))
    return names


def raw_calls(path: Path) -> List[Tuple[ast.Call, List[ast.AST]]]:
    """Every raw mpi4py collective call in ``path``, with the nodes that enclose it."""
    tree = ast.parse(path.read_text(), str(path))
    modules, local = _modules(tree), _local_objects(tree)
    found = []

    def visit(node: ast.AST, enclosing: List[ast.AST]) -> None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, receiver = node.func.attr, node.func.value
            ours = isinstance(receiver, ast.Name) and (receiver.id in modules
                                                       or receiver.id == "self")
            if (name in RAW_CALLS or (name in OBJECT_CALLS and not ours)
                    or (name == "Free" and _name(receiver) not in local)
                    or (name in WINDOW_MAKERS and _name(receiver) == "Win")):
                found.append((node, enclosing))
        for child in ast.iter_child_nodes(node):
            visit(child, enclosing + [node])

    visit(tree, [])
    return found


def _where(path: Path, call: ast.Call) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{call.lineno}: .{call.func.attr}()"


def _is_watch(item: ast.withitem) -> bool:
    """Whether a ``with`` item enters the watchdog's region (``watched(...)``,
    ``watchdog.watched(...)``, a module's ``_watched(...)`` helper)."""
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return False
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    return name in ("watched", "_watched")


def test_no_raw_collective_outside_the_comm_layer():
    outside = [_where(path, call) for path in _sources(PACKAGE)
               if COMM not in path.parents and path.relative_to(PACKAGE).parts[0] not in NOT_LIBRARY
               for call, _ in raw_calls(path)]
    assert outside == [], ("mpi4py collectives called outside tensorplay_hpc/comm/ (use "
                           "comm.small_collectives, comm.communicators or comm.collectives):\n"
                           + "\n".join(outside))


def test_every_raw_collective_in_the_comm_layer_is_watched():
    unwatched = [_where(path, call) for path in _sources(COMM)
                 for call, enclosing in raw_calls(path)
                 if not any(isinstance(node, ast.With) and any(map(_is_watch, node.items))
                            for node in enclosing)]
    assert unwatched == [], ("mpi4py collectives in tensorplay_hpc/comm/ outside a watched "
                             "region (with watched(...)):\n" + "\n".join(unwatched))


@pytest.mark.parametrize("source, expected", [
    ("def f(c):\n    return c.allgather(1)\n", ["allgather"]),
    ("from tensorplay_hpc import comm\ndef f(t, g):\n    comm.gather(t, g)\n", []),
    ("def f(c):\n    c.Barrier()\n    c.Split(0, 1)\n    c.Iallreduce(1, 2)\n",
     ["Barrier", "Split", "Iallreduce"]),
    ("def f(t):\n    return t.split(2)\n", []),
    ("class G:\n    def f(self, o, i):\n        return self.allgather(o, i)\n", []),
    ("def f(c):\n    d = c.Dup()\n    d.Free()\n", ["Dup", "Free"]),
    ("def f(c):\n    g, w = c.Get_group(), W.Get_group()\n    i = MPI.Info.Create()\n"
     "    t = MPI.BYTE.Create_hindexed([1], [0])\n    g.Free()\n    w.Free()\n    i.Free()\n"
     "    t.Free()\n", []),
    ("def f(c, b):\n    w = MPI.Win.Create(b, comm=c)\n    self.win = MPI.Win.Allocate(8, "
     "comm=c)\n    self.win.Free()\n    MPI.Op.Create(g)\n", ["Create", "Allocate", "Free"]),
    ("def f(c, p):\n    h = MPI.File.Open(c, p)\n    h.Close()\n    open(p).close()\n",
     ["Open", "Close"]),
])
def test_the_scan_finds_raw_calls(tmp_path, source, expected):
    path = tmp_path / "sample.py"
    path.write_text(source)
    assert [call.func.attr for call, _ in raw_calls(path)] == expected
