"""What an assignment statement writes, for the tests that check which module writes which fields."""

from __future__ import annotations

import ast


def assigned(node: ast.AST) -> list[ast.expr]:
    """The targets ``node`` assigns (``=``, ``+=`` and the like, annotated), tuples unpacked; [] for any other
    node."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    return [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
