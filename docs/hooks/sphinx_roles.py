"""A griffe extension for the API reference: the package's docstrings write cross-references as
Sphinx roles (``:class:`~x.Y```, ``:meth:`close```); this turns each into a link to the object's
entry in the reference where the reference has one, and into inline code where it has none.

A target is resolved the way Sphinx resolves it: ``~`` shows only the last name, a leading dot
is relative to the docstring's package, and any other name is looked up from the innermost scope
(the class, its module, the package) outwards, then as a full path. A name that a package
exports lazily, through a module ``__getattr__``, is found in the package's modules
(``tensorplay_hpc.distributed.optim.ZeroRedundancyOptimizer``). The link is an optional
cross-reference, so an object left out of the reference gives inline code, not a broken link.
"""
from __future__ import annotations

import html
import re
from typing import Iterator, Optional

import griffe

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|exc|data|obj):`(~?)([^`<>]+)`")
_CALLABLE_ROLES = {"func", "meth"}
# reStructuredText's "::" ending the line before a literal block; Markdown needs only the indent.
_LITERAL_BLOCK = re.compile(r"(?<=\S)::$", re.MULTILINE)


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring of a package once the package is loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None:
                text = _LITERAL_BLOCK.sub(":", obj.docstring.value)
                obj.docstring.value = _ROLE.sub(
                    lambda match: _reference(match, obj, loader.modules_collection), text)


def _objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined in it (not the names it imports)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


def _reference(match: re.Match, obj: griffe.Object, collection: griffe.ModulesCollection) -> str:
    role, short, target = match.groups()
    name = target.lstrip(".")
    shown = name.rsplit(".", 1)[-1] if short else name
    if role in _CALLABLE_ROLES:
        shown += "()"
    path = _resolve(target, obj, collection)
    if path is None:
        return f"`{shown}`"
    return (f'<autoref optional identifier="{html.escape(path)}">'
            f"<code>{html.escape(shown)}</code></autoref>")


def _resolve(target: str, obj: griffe.Object,
             collection: griffe.ModulesCollection) -> Optional[str]:
    """The full path of the object ``target`` names in ``obj``'s docstring, or None."""
    module = obj.module
    if target.startswith("."):
        base: Optional[griffe.Object] = module if module.is_init_module else module.parent
        for _ in range(len(target) - len(target.lstrip(".")) - 1):
            base = base.parent if base is not None else None
        candidates = [f"{base.path}.{target.lstrip('.')}"] if base is not None else []
    else:
        scopes, scope = [], obj
        while scope is not None:
            scopes.append(scope)
            scope = scope.parent
        candidates = [f"{scope.path}.{target}" for scope in scopes] + [target]
    for candidate in candidates:
        found = _lookup(candidate, collection)
        if found is not None:
            return found
    return None


def _lookup(path: str, collection: griffe.ModulesCollection) -> Optional[str]:
    """The canonical path of the object at ``path``, or None if there is none. A package with a
    module ``__getattr__`` exports names lazily: a name it lacks is looked for in its modules."""
    head, *rest = path.split(".")
    if head not in collection.members:
        return None
    current = collection.members[head]
    for name in rest:
        member = current.members.get(name)
        if member is None and "__getattr__" in current.members:
            member = next((module.members[name] for module in current.modules.values()
                           if name in module.members), None)
        if member is None:
            return None
        try:
            current = member.final_target if member.is_alias else member
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    return current.path
