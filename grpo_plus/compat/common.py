"""What the compat seams share: reading TRL's own source (to detect what a release does), an attribute set for one
block.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "args_fields",
    "attribute_set",
    "is_self",
    "method_tree",
    "self_attributes",
]


@contextmanager
def attribute_set(owner, name: str, value) -> Iterator[None]:
    """`owner.name` is `value` inside this block, what it was after it."""
    was = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, was)


def method_tree(function) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def self_attributes(tree: ast.AST) -> set[str]:
    """Names read as `self.<name>` in `tree`."""
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_self(node.value)}


def args_fields(tree: ast.AST) -> set[str]:
    """Names read as `args.<name>` or `self.args.<name>` in `tree`."""
    fields = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value = node.value
            if isinstance(value, ast.Name) and value.id == "args":
                fields.add(node.attr)
            elif isinstance(value, ast.Attribute) and value.attr == "args" and is_self(value.value):
                fields.add(node.attr)
    return fields
