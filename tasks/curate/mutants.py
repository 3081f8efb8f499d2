"""Deterministic mutants of a Python solution: tests that check something fail on some of them.

A mutant changes one site of the program's syntax tree the way a careless edit would: a
comparison negated or moved off by one (``<`` to ``>=`` or ``<=``), an arithmetic operator
swapped (``+`` to ``-``, ``*`` to ``+`` ...), an integer constant plus one, a boolean or an
``and`` / ``or`` flipped, a ``not`` dropped. Only sites inside function bodies are mutated
(module-level code is scaffolding) and never a docstring. When there are more sites than
mutants asked for, a shuffle seeded by (seed, key) picks them, so a row's mutants are the same
on every run. A mutant whose code is the original's again (``ast.unparse`` equal) is skipped.
"""
from __future__ import annotations

import ast
import random

_COMPARE_SWAPS: dict[type, tuple[type, ...]] = {
    ast.Lt: (ast.GtE, ast.LtE), ast.LtE: (ast.Gt, ast.Lt), ast.Gt: (ast.LtE, ast.GtE), ast.GtE: (ast.Lt, ast.Gt),
    ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,), ast.In: (ast.NotIn,), ast.NotIn: (ast.In,),
    ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,),
}
_ARITHMETIC_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
    ast.LShift: ast.RShift, ast.RShift: ast.LShift,
}
Site = tuple[int, str, int]   # (preorder index of the node, what to change, which alternative)


def _preorder(tree: ast.AST) -> list[ast.AST]:
    """Nodes in the order ``ast.NodeTransformer`` visits them (fields in order, depth first)."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    return out


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _in_function_bodies(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in fn.body:
                if not _is_docstring(stmt):
                    inside.update(id(n) for n in ast.walk(stmt))
    return inside


def mutation_sites(tree: ast.AST) -> list[Site]:
    """Every change this module knows how to make to ``tree``, in tree order."""
    inside, sites = _in_function_bodies(tree), []
    for index, node in enumerate(_preorder(tree)):
        if id(node) not in inside:
            continue
        if isinstance(node, ast.Compare):
            sites += [(index, "compare", k * 2 + alt) for k, op in enumerate(node.ops)
                      for alt in range(len(_COMPARE_SWAPS.get(type(op), ())))]
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _ARITHMETIC_SWAPS:
            sites.append((index, "arithmetic", 0))
        elif isinstance(node, ast.BoolOp):
            sites.append((index, "bool_op", 0))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            sites.append((index, "drop_not", 0))
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            sites.append((index, "flip_bool", 0))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            sites.append((index, "int_plus_one", 0))
    return sites


def _changed(node: ast.AST, what: str, alt: int) -> ast.AST:
    if what == "compare":
        k, which = divmod(alt, 2)
        node.ops[k] = _COMPARE_SWAPS[type(node.ops[k])][which]()
    elif what == "arithmetic":
        node.op = _ARITHMETIC_SWAPS[type(node.op)]()
    elif what == "bool_op":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif what == "drop_not":
        return node.operand
    elif what == "flip_bool":
        node.value = not node.value
    elif what == "int_plus_one":
        node.value += 1
    return node


class _Apply(ast.NodeTransformer):
    """Changes the node at one preorder index (counted as ``_preorder`` counts)."""

    def __init__(self, site: Site):
        self.index, self.what, self.alt = site
        self.seen = -1

    def visit(self, node: ast.AST) -> ast.AST:
        self.seen += 1
        if self.seen == self.index:
            return _changed(node, self.what, self.alt)
        return self.generic_visit(node) if self.seen < self.index else node


def mutate(source: str, site: Site) -> str:
    tree = _Apply(site).visit(ast.parse(source))
    return ast.unparse(ast.fix_missing_locations(tree))


def mutants(source: str, limit: int, seed: int, key: str) -> list[str]:
    """Up to ``limit`` distinct mutants of ``source`` (each compiles and differs from it); [] when
    the source does not parse or has nothing to mutate."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    original = ast.unparse(tree)
    sites = mutation_sites(tree)
    random.Random(f"{seed}:{key}").shuffle(sites)
    out: list[str] = []
    for site in sites:
        if len(out) == limit:
            break
        try:
            code = mutate(source, site)
            compile(code, "mutant", "exec")
        except (SyntaxError, ValueError, TypeError, KeyError, IndexError):
            continue
        if code != original and code not in out:
            out.append(code)
    return out
