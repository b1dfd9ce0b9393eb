"""``tensorplay-hpc checkpoint`` (also ``python -m tensorplay_hpc.checkpoint``): inspect, list
and convert checkpoints to and from plain ``torch.save`` files."""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from tensorplay_hpc.comm.mpi import MPI
from tensorplay_hpc.distributed.optim.optimizer_class import check_optimizer_class

from . import format as fmt
from . import restore, snapshot, writer
from .files import checkpoints, latest
from .optimizers import class_name
from .reader import Reader

__all__ = ["DESCRIPTION", "InputError", "add_arguments", "export", "import_", "info", "listing",
           "resolve_optimizer_class", "run", "split_layout", "summary"]

DESCRIPTION = """\
Inspect, list and convert checkpoints. Not collective: run it as a plain command (under a
launcher only the first rank acts). Exit status 1 for a checkpoint that cannot be read (missing,
damaged, foreign), 2 for a bad argument or an input file that cannot be imported."""

_MODEL_KEYS = ("model", "model_state_dict", "state_dict")
_OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict")


class InputError(Exception):
    """A command's input cannot be used; the message says why (exit status 2)."""


def _model_dict(reader: Reader) -> Dict[str, torch.Tensor]:
    """The model; the average of the replicas when the file holds several."""
    sources = restore.prefixes(reader)
    return {key: restore.combine([reader.tensor(fmt.model_name(key, p)) for p in sources])
            for key in reader.names(f"{sources[0]}model")}


def _optimizer_dict(reader: Reader) -> Optional[Dict[str, Any]]:
    """The consolidated optimizer state (the replicas' average, as for the model)."""
    if reader.attribute("optimizer", "class") is None:
        return None
    sources = restore.prefixes(reader)
    shared = restore.state_prefix(reader, sources[0])
    sources = sources if shared else [""]
    state = {}
    for index in sorted(int(i) for i in reader.names(f"{sources[0]}optimizer/state")):
        node = fmt.state_node(index, sources[0])
        entry = dict(reader.decoded(node, default={}))
        for key in reader.names(node):
            entry[key] = restore.combine([reader.tensor(fmt.state_name(index, key, p))
                                          for p in sources])
        state[index] = entry
    return {"state": state, "param_groups": reader.decoded("optimizer", "param_groups")}


def _values(reader: Reader, names: List[str]) -> int:
    """How many values the tensors ``names`` hold (from the catalog, none read)."""
    return sum(math.prod(reader.describe(name)[0]) for name in names)


def summary(path: str) -> Dict[str, Any]:
    """What :func:`info` prints, as one JSON-ready dict, after verifying every checksum."""
    with Reader(path) as reader:
        meta = reader.metadata
        model_prefix = f"{restore.prefixes(reader)[0]}model"
        model_names = [f"{model_prefix}/{key}" for key in reader.names(model_prefix)]
        result: Dict[str, Any] = {
            "path": reader.path,
            "format_version": reader.version,
            "package_version": meta.get("package_version"),
            "torch_version": meta.get("torch_version"),
            "world_size": meta.get("world_size"),
            "step": meta.get("step"),
            "created": meta.get("created"),
            "replicas": len(restore.saved_replicas(reader)),
            "model": {"class": reader.attribute("model", "class"), "entries": len(model_names),
                      "values": _values(reader, model_names)},
            "optimizer": None,
        }
        if reader.attribute("optimizer", "class") is not None:
            state = f"{restore.state_prefix(reader, restore.prefixes(reader)[0])}optimizer/state"
            indices = reader.names(state)
            state_names = [f"{state}/{i}/{k}" for i in indices
                           for k in reader.names(f"{state}/{i}")]
            result["optimizer"] = {
                "class": reader.attribute("optimizer", "class"),
                "kind": reader.attribute("optimizer", "kind"),
                "param_groups": len(reader.decoded("optimizer", "param_groups", default=[])),
                "state_entries": len(indices), "values": _values(reader, state_names),
                "attributes": reader.decoded("optimizer", "attributes", default={})}
        result["extra_ranks"] = len(reader.names("extra"))
        result["extra_rank0"] = sorted({*reader.decoded("extra/rank0", default={}),
                                        *reader.names("extra/rank0")})
        result["tensors"] = reader.verify()
        result["tensor_bytes"] = reader.bytes_read
        result["bytes"] = os.path.getsize(reader.path)
        result["checksums_verified"] = True
    return result


def info(path: str) -> List[str]:
    """A readable summary of a checkpoint, after verifying every checksum."""
    s = summary(path)
    lines = [f"checkpoint {s['path']}"]
    lines += [f"  {key}: {s[key]}" for key in ("format_version", "package_version",
                                                "torch_version", "world_size", "step", "created",
                                                "replicas")]
    model = s["model"]
    lines.append(f"  model: {model['class'] or '-'}, {model['entries']} entries, "
                 f"{model['values']:,} values")
    optimizer = s["optimizer"]
    if optimizer is not None:
        lines.append(f"  optimizer: {optimizer['class']} ({optimizer['kind']}), "
                     f"{optimizer['param_groups']} param groups, state for "
                     f"{optimizer['state_entries']} parameters, {optimizer['values']:,} values")
        lines.append(f"  optimizer attributes: {optimizer['attributes']}")
    lines.append(f"  extra: saved by {s['extra_ranks']} ranks; rank 0: {s['extra_rank0']}")
    lines.append(f"  tensors: {s['tensors']:,}, {s['tensor_bytes']:,} bytes of values; "
                 f"file: {s['bytes']:,} bytes")
    lines.append("  checksums: all verified")
    return lines


def export(path: str, output: str) -> None:
    """Write ``{"model": ..., "optimizer": ...}`` with ``torch.save``."""
    with Reader(path) as reader:
        torch.save({"model": _model_dict(reader), "optimizer": _optimizer_dict(reader)}, output)


def resolve_optimizer_class(name: str) -> str:
    """The class name checkpoints record for the optimizer class ``name``: ``torch.optim.AdamW``
    and ``AdamW`` (looked up in ``torch.optim``) both give ``torch.optim.adamw.AdamW``.

    Raises:
        InputError: if ``name`` names nothing importable or no ``torch.optim.Optimizer`` subclass.
    """
    parts = name.split(".") if "." in name else ["torch", "optim", name]
    found: Any = None
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute, None)
        break
    if found is None:
        raise InputError(f"--optimizer-class {name}: no such class (give it as a module path, "
                         "e.g. torch.optim.AdamW)")
    try:
        return class_name(check_optimizer_class(found, f"--optimizer-class {name}"))
    except TypeError as error:
        raise InputError(str(error)) from None


def _load_source(source: str) -> Any:
    if not os.path.exists(source):
        raise InputError(f"{source}: no such file")
    if os.path.isdir(source):
        raise InputError(f"{source}: is a folder, not a torch.save file")
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as error:     # torch.load fails in many ways on a foreign or torn file
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = next((line for line in lines if "Unsupported global" in line),
                      f"{type(error).__name__}: {lines[0] if lines else ''}")
        raise InputError(f"{source}: cannot read it as a torch.save file: {reason}") from None


def _is_tensor_dict(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values())


def split_layout(saved: Any, source: str) -> Tuple[Optional[Dict[str, torch.Tensor]],
                                                   Optional[Dict[str, Any]], Dict[str, Any]]:
    """The model state, optimizer state and other top-level values of a loaded file.

    Accepted: ``{"model": ..., "optimizer": ...}`` (what :func:`export` writes),
    ``{"model_state_dict": ..., "optimizer_state_dict": ...}`` (PyTorch's tutorials),
    ``{"state_dict": ...}``, each with any further values (epoch, loss...), and a bare model
    ``state_dict()``.
    """
    if not isinstance(saved, dict):
        raise InputError(f"{source}: holds a {type(saved).__name__}, not a dict of state dicts")
    keys = [str(k) for k in saved]
    model_keys = [k for k in _MODEL_KEYS if k in saved]
    optimizer_keys = [k for k in _OPTIMIZER_KEYS if k in saved]
    if not model_keys and not optimizer_keys:
        if saved and _is_tensor_dict(saved):
            return dict(saved), None, {}
        raise InputError(f"{source}: unknown layout, keys found: {keys}; expected 'model' and "
                         "'optimizer', 'model_state_dict' and 'optimizer_state_dict', "
                         "'state_dict', or a model state_dict (every value a tensor)")
    if len(model_keys) > 1 or len(optimizer_keys) > 1:
        raise InputError(f"{source}: ambiguous layout, keys found: {keys} (several model or "
                         "optimizer entries)")
    model = saved[model_keys[0]] if model_keys else None
    if model is not None and not _is_tensor_dict(model):
        others = [str(k) for k, v in model.items() if not isinstance(v, torch.Tensor)] \
            if isinstance(model, dict) else []
        raise InputError(f"{source}: {model_keys[0]!r} is not a model state_dict "
                         + (f"(not tensors: {others[:5]})" if others
                            else f"(a {type(model).__name__})"))
    optimizer = saved[optimizer_keys[0]] if optimizer_keys else None
    if optimizer is not None and not (isinstance(optimizer, dict) and "state" in optimizer
                                      and "param_groups" in optimizer):
        found = (sorted(map(str, optimizer)) if isinstance(optimizer, dict)
                 else type(optimizer).__name__)
        raise InputError(f"{source}: {optimizer_keys[0]!r} is not an optimizer state_dict "
                         f"(expected 'state' and 'param_groups', found {found})")
    extra = {str(k): v for k, v in saved.items() if k not in model_keys + optimizer_keys}
    return model, optimizer, extra


def import_(source: str, path: str, optimizer_class: Optional[str]) -> str:
    """Write the checkpoint of a ``torch.save`` file in one of the layouts of
    :func:`split_layout`; its further values become rank 0's extras. Returns the path written.

    Raises:
        InputError: the file is missing, unreadable or of an unknown layout, or the optimizer
            class is missing (for a file with optimizer state) or not an optimizer class.
    """
    resolved = resolve_optimizer_class(optimizer_class) if optimizer_class else None
    model, optimizer, extra = split_layout(_load_source(source), source)
    if optimizer is not None and not optimizer_class:
        raise InputError(f"{source}: holds optimizer state: name its class with "
                         "--optimizer-class (for example torch.optim.AdamW)")
    if optimizer is None and optimizer_class:
        raise InputError(f"{source}: --optimizer-class {optimizer_class} given, but the file "
                         "holds no optimizer state")
    snap = snapshot.Snapshot()
    if model is not None:
        snapshot.add_model(snap, model, 0, [0], "imported")
    if optimizer is not None:
        snapshot.add_optimizer(snap, optimizer["state"], 0, "local", resolved,
                               optimizer["param_groups"], {})
    snapshot.add_extra(snap, extra, 0)
    step = extra.get("step")
    snapshot.add_metadata(snap, 0, 1, step if isinstance(step, int) else -1)
    return writer.write(path, snap, MPI.COMM_SELF)


def _size(nbytes: float) -> str:
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            break
        nbytes /= 1024
    return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes:.1f} {unit}"


def listing(folder: str) -> List[str]:
    """A table of ``folder``'s checkpoints, oldest first (the order ``checkpoint.latest`` and
    ``keep`` use), marking the newest whose checksums verify and the newer ones that do not."""
    if not os.path.isdir(folder):
        raise InputError(f"{folder}: no such folder")
    found = checkpoints(folder)
    if not found:
        return [f"no checkpoints in {folder}"]
    newest = latest(folder)
    good = found.index(newest) if newest is not None else -1
    rows = [("STEP", "CREATED", "SIZE", "FILE", "")]
    for position, path in enumerate(found):
        with Reader(path) as reader:
            meta = reader.metadata
        mark = ("<- latest" if position == good
                else "(checksums do not verify)" if position > good else "")
        rows.append((str(meta.get("step")), str(meta.get("created")),
                     _size(os.path.getsize(path)), os.path.basename(path), mark))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return [f"{step:>{widths[0]}}  {created:<{widths[1]}}  {size:>{widths[2]}}  "
            f"{name:<{widths[3]}}  {mark}".rstrip()
            for step, created, size, name, mark in rows]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The actions of ``checkpoint`` and their arguments."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = actions.add_parser(
        "info", help="summarize a checkpoint after verifying every checksum",
        description="Print a checkpoint's format version, world size, step, creation time, model "
                    "and optimizer contents, tensor count and size, after verifying every "
                    "checksum.")
    p.add_argument("file", metavar="CHECKPOINT", help="the checkpoint file (.h5) to read")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p = actions.add_parser(
        "list", help="a folder's checkpoints, oldest first, marking the newest good one",
        description="List the checkpoints of FOLDER oldest first (by recorded creation time, "
                    "then step) with step, creation time and size; the newest whose checksums "
                    "verify (what checkpoint.latest gives, and --resume uses) is marked.")
    p.add_argument("folder", metavar="FOLDER", help="a folder of checkpoints")
    p = actions.add_parser(
        "export", help="write a torch.save file of the model and optimizer state",
        description="Read CHECKPOINT and write OUTPUT with torch.save: {'model': state_dict, "
                    "'optimizer': state_dict or None}, which torch.load(weights_only=True), "
                    "Module.load_state_dict and torch.optim load directly.")
    p.add_argument("file", metavar="CHECKPOINT", help="the checkpoint file (.h5) to read")
    p.add_argument("output", metavar="OUTPUT", help="the torch.save file (.pt) to write")
    p = actions.add_parser(
        "import", help="make a checkpoint of a torch.save file",
        description="Read SOURCE with torch.load(weights_only=True) and write the checkpoint "
                    "CHECKPOINT. SOURCE holds {'model': ..., 'optimizer': ...} (as export "
                    "writes), {'model_state_dict': ..., 'optimizer_state_dict': ...} (PyTorch's "
                    "tutorials), {'state_dict': ...}, or a bare model state_dict(); further "
                    "values (epoch, loss...) become the extras checkpoint.load returns.")
    p.add_argument("source", metavar="SOURCE", help="the torch.save file (.pt) to read")
    p.add_argument("file", metavar="CHECKPOINT", help="the checkpoint file (.h5) to write")
    p.add_argument("--optimizer-class", metavar="CLASS",
                   help="the torch.optim class of the optimizer state, e.g. torch.optim.AdamW "
                        "(required when SOURCE holds optimizer state)")


def run(args: argparse.Namespace) -> int:
    """Run the action of ``args`` on the first rank only; returns the exit status."""
    if MPI.COMM_WORLD.Get_rank() != 0:
        return 0
    try:
        if args.action == "info":
            print(json.dumps(summary(args.file)) if args.json else "\n".join(info(args.file)))
        elif args.action == "list":
            print("\n".join(listing(args.folder)))
        elif args.action == "export":
            export(args.file, args.output)
            print(f"wrote {args.output}")
        else:
            print(f"wrote {import_(args.source, args.file, args.optimizer_class)}")
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except fmt.CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
