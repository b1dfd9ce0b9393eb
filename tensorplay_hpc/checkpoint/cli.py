"""``python -m tensorplay_hpc.checkpoint``: inspect a checkpoint, or convert it to and from a
plain ``torch.save`` file of ``{"model": state_dict, "optimizer": state_dict}``."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

import torch
from mpi4py import MPI

from . import format as fmt
from . import restore, snapshot, writer
from .reader import Reader


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


def info(path: str) -> List[str]:
    """A readable summary of a checkpoint, after verifying every checksum."""
    with Reader(path) as reader:
        meta = reader.metadata
        model = _model_dict(reader)
        optimizer = _optimizer_dict(reader)
        lines = [f"checkpoint {reader.path}"]
        lines += [f"  {key}: {meta[key]}" for key in sorted(meta)]
        params = sum(t.numel() for t in model.values())
        lines.append(f"  model: {reader.attribute('model', 'class', '-')}, {len(model)} entries, "
                     f"{params:,} values")
        if optimizer is not None:
            state_values = sum(v.numel() for s in optimizer["state"].values() for v in s.values()
                               if isinstance(v, torch.Tensor))
            lines.append(f"  optimizer: {reader.attribute('optimizer', 'class')} "
                         f"({reader.attribute('optimizer', 'kind')}), "
                         f"{len(optimizer['param_groups'])} param groups, state for "
                         f"{len(optimizer['state'])} parameters, {state_values:,} values")
            lines.append(f"  optimizer attributes: {reader.decoded('optimizer', 'attributes', default={})}")
        ranks = [n for n in reader.names("extra")]
        lines.append(f"  extra: saved by {len(ranks)} ranks; rank 0: "
                     f"{sorted(reader.decoded('extra/rank0', default={}))}")
        lines.append("  checksums: all verified")
    return lines


def export(path: str, output: str) -> None:
    """Write ``{"model": ..., "optimizer": ...}`` with ``torch.save``."""
    with Reader(path) as reader:
        torch.save({"model": _model_dict(reader), "optimizer": _optimizer_dict(reader)}, output)


def import_(source: str, path: str, optimizer_class: Optional[str]) -> str:
    """Write the checkpoint of a ``torch.save`` file of ``{"model": ..., "optimizer": ...}``."""
    saved = torch.load(source, map_location="cpu", weights_only=True)
    snap = snapshot.Snapshot()
    if saved.get("model") is not None:
        snapshot.add_model(snap, saved["model"], 0, [0], "imported")
    if saved.get("optimizer") is not None:
        if not optimizer_class:
            raise SystemExit("the file holds optimizer state: name its class with "
                             "--optimizer-class (for example torch.optim.adam.Adam)")
        state = saved["optimizer"]
        snapshot.add_optimizer(snap, state["state"], 0, "local", optimizer_class,
                               state["param_groups"], {})
    snapshot.add_extra(snap, {}, 0)
    snapshot.add_metadata(snap, 0, 1, -1)
    return writer.write(path, snap, MPI.COMM_SELF)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorplay_hpc.checkpoint",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="summarize a checkpoint and verify its checksums")
    p.add_argument("file")
    p = sub.add_parser("export", help="write a torch.save file of model and optimizer state")
    p.add_argument("file")
    p.add_argument("output")
    p = sub.add_parser("import", help="make a checkpoint from a torch.save file")
    p.add_argument("source")
    p.add_argument("file")
    p.add_argument("--optimizer-class", help="qualified torch.optim class, e.g. torch.optim.adam.Adam")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            print("\n".join(info(args.file)))
        elif args.command == "export":
            export(args.file, args.output)
            print(f"wrote {args.output}")
        else:
            print(f"wrote {import_(args.source, args.file, args.optimizer_class)}")
    except fmt.CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
