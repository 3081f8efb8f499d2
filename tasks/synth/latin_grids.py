"""Latin-square grid puzzles: sudoku, futoshiki, skyscraper, calcudoko.

Each is generated from a random solution, then givens are revealed (or, for sudoku, cells
removed) until the backtracking solver below finds exactly one solution. Verifiers check the
rules, not equality with the gold grid, so any valid solution scores 1.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import Any

from tasks.synth.base import (
    LevelParams,
    SynthTask,
    TaskInstance,
    format_grid,
    parse_grid,
    uniqueness_check,
)

Grid = list[list[int]]
ExtraCheck = Callable[[Grid, int, int], bool]


@uniqueness_check
def count_latin_solutions(n: int, givens: Grid, extra_ok: ExtraCheck | None = None,
                          box: tuple[int, int] | None = None, limit: int = 2) -> int:
    """Solutions of an n x n Latin square (values 1..n) with givens (0 = empty).

    ``box=(h, w)`` adds sudoku boxes; ``extra_ok(grid, r, c)`` is called after each placement
    and may reject the partial grid. Minimum-remaining-values order with bitmasks.
    """
    grid = [row[:] for row in givens]
    full = (1 << (n + 1)) - 2
    rows = [0] * n
    cols = [0] * n
    boxes: dict[tuple[int, int], int] = {}

    def box_of(r: int, c: int) -> tuple[int, int]:
        return (r // box[0], c // box[1]) if box else (0, 0)

    for r in range(n):
        for c in range(n):
            v = grid[r][c]
            if v:
                bit = 1 << v
                b = box_of(r, c)
                if rows[r] & bit or cols[c] & bit or (box and boxes.get(b, 0) & bit):
                    return 0
                rows[r] |= bit
                cols[c] |= bit
                boxes[b] = boxes.get(b, 0) | bit
    if extra_ok is not None:
        for r in range(n):
            for c in range(n):
                if grid[r][c] and not extra_ok(grid, r, c):
                    return 0
    empties = [(r, c) for r in range(n) for c in range(n) if not grid[r][c]]
    count = 0

    def candidates(r: int, c: int) -> int:
        used = rows[r] | cols[c] | (boxes.get(box_of(r, c), 0) if box else 0)
        return full & ~used

    def search(remaining: int) -> None:
        nonlocal count
        if count >= limit:
            return
        if remaining == 0:
            count += 1
            return
        best, best_mask, best_n = None, 0, n + 1
        for r, c in empties:
            if grid[r][c]:
                continue
            mask = candidates(r, c)
            k = (mask).bit_count()
            if k < best_n:
                best, best_mask, best_n = (r, c), mask, k
                if k <= 1:
                    break
        if best_n == 0:
            return
        r, c = best
        b = box_of(r, c)
        for v in range(1, n + 1):
            bit = 1 << v
            if not best_mask & bit:
                continue
            grid[r][c] = v
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] = boxes.get(b, 0) | bit
            if extra_ok is None or extra_ok(grid, r, c):
                search(remaining - 1)
            grid[r][c] = 0
            rows[r] &= ~bit
            cols[c] &= ~bit
            boxes[b] &= ~bit

    search(len(empties))
    return count


def random_latin_square(rng: random.Random, n: int, box: tuple[int, int] | None = None) -> Grid:
    """A shuffled cyclic Latin square; with ``box=(h, w)`` a valid sudoku solution."""
    if box:
        h, w = box
        base = [[(w * (r % h) + r // h + c) % n + 1 for c in range(n)] for r in range(n)]
        bands = list(range(n // h))
        rng.shuffle(bands)
        row_order = [b * h + i for b in bands for i in rng.sample(range(h), h)]
        stacks = list(range(n // w))
        rng.shuffle(stacks)
        col_order = [s * w + i for s in stacks for i in rng.sample(range(w), w)]
    else:
        base = [[(r + c) % n + 1 for c in range(n)] for r in range(n)]
        row_order = rng.sample(range(n), n)
        col_order = rng.sample(range(n), n)
    symbols = rng.sample(range(1, n + 1), n)
    return [[symbols[base[r][c] - 1] for c in col_order] for r in row_order]


def reveal_until_unique(rng: random.Random, solution: Grid, givens: Grid, solve_count,
                        start: int = 0) -> Grid:
    """Copy solution cells into ``givens`` in random order until ``solve_count`` says 1.

    ``start`` cells are revealed before the first count: proving uniqueness of a nearly
    empty 6x6 grid is an exhaustive search over millions of Latin squares.
    """
    n = len(solution)
    givens = [row[:] for row in givens]
    cells = [(r, c) for r in range(n) for c in range(n) if not givens[r][c]]
    rng.shuffle(cells)
    for _ in range(min(start, len(cells))):
        r, c = cells.pop()
        givens[r][c] = solution[r][c]
    while solve_count(givens) > 1:
        r, c = cells.pop()
        givens[r][c] = solution[r][c]
    return givens


def is_latin(grid: Grid, n: int) -> bool:
    want = list(range(1, n + 1))
    return all(sorted(row) == want for row in grid) and all(
        sorted(grid[r][c] for r in range(n)) == want for c in range(n))


def respects_givens(grid: Grid, givens: Grid) -> bool:
    return all(g == 0 or g == v for grow, row in zip(givens, grid) for g, v in zip(grow, row))


GRID_FORMAT = "Give the completed grid: one row per line, numbers separated by spaces."


# --- sudoku ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class SudokuParams(LevelParams):
    size: int
    box_h: int
    box_w: int
    holes: int


class Sudoku(SynthTask):
    name = "sudoku"
    family = "grid"
    answer_example = "1 2\n2 1"
    levels = (
        SudokuParams(4, 2, 2, 6), SudokuParams(4, 2, 2, 10), SudokuParams(6, 2, 3, 16),
        SudokuParams(6, 2, 3, 22), SudokuParams(9, 3, 3, 40), SudokuParams(9, 3, 3, 50),
    )

    def build(self, rng: random.Random, p: SudokuParams) -> tuple[str, str, dict[str, Any]]:
        n, box = p.size, (p.box_h, p.box_w)
        solution = random_latin_square(rng, n, box)
        puzzle = [row[:] for row in solution]
        cells = [(r, c) for r in range(n) for c in range(n)]
        rng.shuffle(cells)
        holes = 0
        for r, c in cells:
            if holes >= p.holes:
                break
            keep = puzzle[r][c]
            puzzle[r][c] = 0
            if count_latin_solutions(n, puzzle, box=box) == 1:
                holes += 1
            else:
                puzzle[r][c] = keep
        question = (
            f"Solve this {n}x{n} sudoku: fill the blanks (_) with 1-{n} so that every row, every "
            f"column and every {p.box_h}x{p.box_w} box holds each number once.\n"
            f"{format_grid(puzzle, blank=0)}\n{GRID_FORMAT}"
        )
        return question, format_grid(solution), {"puzzle": puzzle, "box": [p.box_h, p.box_w]}

    def check(self, instance: TaskInstance, answer: str) -> float:
        puzzle = instance.metadata["puzzle"]
        h, w = instance.metadata["box"]
        n = len(puzzle)
        grid = parse_grid(answer, n, n)
        if grid is None or not is_latin(grid, n) or not respects_givens(grid, puzzle):
            return 0.0
        for br in range(0, n, h):
            for bc in range(0, n, w):
                cells = sorted(grid[r][c] for r in range(br, br + h) for c in range(bc, bc + w))
                if cells != list(range(1, n + 1)):
                    return 0.0
        return 1.0


# --- futoshiki -------------------------------------------------------------------------------

@dataclass(frozen=True)
class FutoshikiParams(LevelParams):
    size: int
    inequalities: int
    start_givens: int = 0


def _inequalities_hold(grid: Grid, ineqs: list[list[int]], complete_only: bool) -> bool:
    for r1, c1, r2, c2 in ineqs:   # cell (r1, c1) < cell (r2, c2)
        a, b = grid[r1][c1], grid[r2][c2]
        if a and b:
            if not a < b:
                return False
        elif complete_only:
            return False
    return True


class Futoshiki(SynthTask):
    name = "futoshiki"
    family = "grid"
    answer_example = "1 2\n2 1"
    levels = (
        FutoshikiParams(4, 4), FutoshikiParams(4, 6), FutoshikiParams(5, 6),
        FutoshikiParams(5, 9), FutoshikiParams(6, 10, 10), FutoshikiParams(6, 14, 8),
    )

    def build(self, rng: random.Random, p: FutoshikiParams) -> tuple[str, str, dict[str, Any]]:
        n = p.size
        solution = random_latin_square(rng, n)
        pairs = [(r, c, r, c + 1) for r in range(n) for c in range(n - 1)]
        pairs += [(r, c, r + 1, c) for r in range(n - 1) for c in range(n)]
        ineqs = []
        for r1, c1, r2, c2 in rng.sample(pairs, p.inequalities):
            if solution[r1][c1] < solution[r2][c2]:
                ineqs.append([r1, c1, r2, c2])
            else:
                ineqs.append([r2, c2, r1, c1])
        ineqs.sort()

        touching: dict[tuple[int, int], list[list[int]]] = {}
        for ineq in ineqs:
            touching.setdefault((ineq[0], ineq[1]), []).append(ineq)
            touching.setdefault((ineq[2], ineq[3]), []).append(ineq)

        def extra(grid: Grid, r: int, c: int) -> bool:
            return _inequalities_hold(grid, touching.get((r, c), []), complete_only=False)

        givens = reveal_until_unique(rng, solution, [[0] * n for _ in range(n)],
                                     lambda g: count_latin_solutions(n, g, extra), p.start_givens)
        constraints = "\n".join(f"R{a + 1}C{b + 1} < R{c + 1}C{d + 1}" for a, b, c, d in ineqs)
        question = (
            f"Solve this {n}x{n} futoshiki: fill the blanks (_) with 1-{n} so that every row and "
            f"column holds each number once and these inequalities hold (R = row, C = column):\n"
            f"{constraints}\nGrid:\n{format_grid(givens, blank=0)}\n{GRID_FORMAT}"
        )
        return question, format_grid(solution), {"givens": givens, "inequalities": ineqs}

    def check(self, instance: TaskInstance, answer: str) -> float:
        givens = instance.metadata["givens"]
        n = len(givens)
        grid = parse_grid(answer, n, n)
        ok = (grid is not None and is_latin(grid, n) and respects_givens(grid, givens)
              and _inequalities_hold(grid, instance.metadata["inequalities"], complete_only=True))
        return 1.0 if ok else 0.0


# --- skyscraper ------------------------------------------------------------------------------

def visible_count(heights: list[int]) -> int:
    seen, tallest = 0, 0
    for h in heights:
        if h > tallest:
            seen, tallest = seen + 1, h
    return seen


def line_may_match(line: list[int], clue: int, n: int) -> bool:
    """Whether a partly filled line (0 = empty) can still show ``clue`` buildings from its start."""
    if not clue:
        return True
    prefix = []
    for v in line:
        if not v:
            break
        prefix.append(v)
    seen = visible_count(prefix)
    if seen > clue:
        return False
    # once the tallest building stands, nothing behind it can be seen
    return seen == clue if n in prefix else True


def skyscraper_clues(grid: Grid) -> dict[str, list[int]]:
    n = len(grid)
    cols = [[grid[r][c] for r in range(n)] for c in range(n)]
    return {
        "top": [visible_count(col) for col in cols],
        "bottom": [visible_count(col[::-1]) for col in cols],
        "left": [visible_count(row) for row in grid],
        "right": [visible_count(row[::-1]) for row in grid],
    }


@dataclass(frozen=True)
class SkyscraperParams(LevelParams):
    size: int
    hidden_clues: int
    start_givens: int = 0


class Skyscraper(SynthTask):
    name = "skyscraper"
    family = "grid"
    answer_example = "1 2\n2 1"
    levels = (
        SkyscraperParams(3, 0), SkyscraperParams(4, 0), SkyscraperParams(4, 4),
        SkyscraperParams(5, 4), SkyscraperParams(5, 8), SkyscraperParams(6, 10, 8),
    )

    def build(self, rng: random.Random, p: SkyscraperParams) -> tuple[str, str, dict[str, Any]]:
        n = p.size
        solution = random_latin_square(rng, n)
        clues = skyscraper_clues(solution)
        slots = [(side, i) for side in ("top", "bottom", "left", "right") for i in range(n)]
        for side, i in rng.sample(slots, p.hidden_clues):
            clues[side][i] = 0   # 0 = no clue on that side

        def extra(grid: Grid, r: int, c: int) -> bool:
            row = grid[r]
            col = [grid[i][c] for i in range(n)]
            return (line_may_match(row, clues["left"][r], n)
                    and line_may_match(row[::-1], clues["right"][r], n)
                    and line_may_match(col, clues["top"][c], n)
                    and line_may_match(col[::-1], clues["bottom"][c], n))

        givens = reveal_until_unique(rng, solution, [[0] * n for _ in range(n)],
                                     lambda g: count_latin_solutions(n, g, extra), p.start_givens)

        def show(values: list[int]) -> str:
            return " ".join(str(v) if v else "-" for v in values)

        question = (
            f"Skyscrapers puzzle on a {n}x{n} grid: place buildings of heights 1-{n} so that each "
            f"row and column holds each height once. A clue is how many buildings are visible "
            f"from that side (taller ones hide shorter ones behind them); '-' means no clue.\n"
            f"Top (left to right): {show(clues['top'])}\n"
            f"Bottom (left to right): {show(clues['bottom'])}\n"
            f"Left (top to bottom): {show(clues['left'])}\n"
            f"Right (top to bottom): {show(clues['right'])}\n"
            f"Grid (_ = empty):\n{format_grid(givens, blank=0)}\n{GRID_FORMAT}"
        )
        return question, format_grid(solution), {"clues": clues, "givens": givens}

    def check(self, instance: TaskInstance, answer: str) -> float:
        givens, clues = instance.metadata["givens"], instance.metadata["clues"]
        n = len(givens)
        grid = parse_grid(answer, n, n)
        if grid is None or not is_latin(grid, n) or not respects_givens(grid, givens):
            return 0.0
        actual = skyscraper_clues(grid)
        ok = all(c == 0 or c == a for side in clues for c, a in zip(clues[side], actual[side]))
        return 1.0 if ok else 0.0


# --- calcudoko (KenKen) ----------------------------------------------------------------------

def cage_value_ok(op: str, target: int, values: list[int]) -> bool:
    if op == "+":
        return sum(values) == target
    if op == "*":
        return prod(values) == target
    if op == "-":
        return max(values) - min(values) == target
    if op == "/":
        return min(values) > 0 and max(values) == target * min(values)
    return len(values) == 1 and values[0] == target   # "=" fixed cell


def random_cages(rng: random.Random, n: int, max_size: int) -> list[list[tuple[int, int]]]:
    owner: dict[tuple[int, int], int] = {}
    cages: list[list[tuple[int, int]]] = []
    cells = [(r, c) for r in range(n) for c in range(n)]
    rng.shuffle(cells)
    for cell in cells:
        if cell in owner:
            continue
        size = rng.choice([1] + [2] * 3 + [3] * 2 if max_size >= 3 else [1, 2, 2, 2])
        cage = [cell]
        owner[cell] = len(cages)
        while len(cage) < size:
            frontier = sorted({(r + dr, c + dc) for r, c in cage for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0))
                               if 0 <= r + dr < n and 0 <= c + dc < n and (r + dr, c + dc) not in owner})
            if not frontier:
                break
            nxt = rng.choice(frontier)
            owner[nxt] = len(cages)
            cage.append(nxt)
        cages.append(sorted(cage))
    return cages


@dataclass(frozen=True)
class CalcudokoParams(LevelParams):
    size: int
    max_cage: int
    start_givens: int = 0


class Calcudoko(SynthTask):
    name = "calcudoko"
    family = "grid"
    answer_example = "1 2\n2 1"
    levels = (
        CalcudokoParams(3, 2), CalcudokoParams(4, 2), CalcudokoParams(4, 3),
        CalcudokoParams(5, 3), CalcudokoParams(6, 3, 4),
    )

    def build(self, rng: random.Random, p: CalcudokoParams) -> tuple[str, str, dict[str, Any]]:
        n = p.size
        solution = random_latin_square(rng, n)
        cages = []
        for cells in random_cages(rng, n, p.max_cage):
            values = [solution[r][c] for r, c in cells]
            if len(cells) == 1:
                op = "="
            elif len(cells) == 2:
                ops = ["+", "*", "-"] + (["/"] if max(values) % min(values) == 0 else [])
                op = rng.choice(ops)
            else:
                op = rng.choice(["+", "*"])
            target = {"=": values[0], "+": sum(values), "*": prod(values),
                      "-": max(values) - min(values),
                      "/": max(values) // min(values)}[op]
            cages.append({"cells": [list(x) for x in cells], "op": op, "target": target})
        cage_of = {(r, c): cage for cage in cages for r, c in cage["cells"]}

        def extra(grid: Grid, r: int, c: int) -> bool:
            cage = cage_of[(r, c)]
            values = [grid[a][b] for a, b in cage["cells"]]
            if all(values):
                return cage_value_ok(cage["op"], cage["target"], values)
            if cage["op"] == "+":
                return sum(values) < cage["target"]
            return True

        givens = reveal_until_unique(rng, solution, [[0] * n for _ in range(n)],
                                     lambda g: count_latin_solutions(n, g, extra), p.start_givens)
        lines = [
            f"{cage['target']}{'' if cage['op'] == '=' else cage['op']}: "
            + " ".join(f"R{r + 1}C{c + 1}" for r, c in cage["cells"])
            for cage in cages
        ]
        question = (
            f"Calcudoko on a {n}x{n} grid: fill in 1-{n} so that each row and column holds each "
            f"number once. Each cage lists its cells and a target with an operation: the cage's "
            f"numbers combine to the target under +, * (any order), - or / (larger by smaller, "
            f"two cells). A bare number is a fixed cell.\n" + "\n".join(lines)
            + f"\nGrid (_ = empty):\n{format_grid(givens, blank=0)}\n{GRID_FORMAT}"
        )
        return question, format_grid(solution), {"cages": cages, "givens": givens}

    def check(self, instance: TaskInstance, answer: str) -> float:
        givens = instance.metadata["givens"]
        n = len(givens)
        grid = parse_grid(answer, n, n)
        if grid is None or not is_latin(grid, n) or not respects_givens(grid, givens):
            return 0.0
        ok = all(cage_value_ok(cage["op"], cage["target"], [grid[r][c] for r, c in cage["cells"]])
                 for cage in instance.metadata["cages"])
        return 1.0 if ok else 0.0
