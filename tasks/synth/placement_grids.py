"""Placement grid puzzles: kukurasu, star placement, minesweeper, number wall, survo, campsite.

Every puzzle is built from a random solution and made unique with the solver beside it
(retrying the layout or revealing hints until exactly one solution remains). Verifiers check
the rules, so any valid solution scores 1.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction
from math import comb
from typing import Any

from tasks.synth.base import (
    LevelParams,
    SynthTask,
    TaskInstance,
    format_grid,
    parse_grid,
    parse_pairs,
    uniqueness_check,
)

Cell = tuple[int, int]
NEIGHBORS_8 = [(dr, dc) for dr in (-1, 0, 1) for dc in (-1, 0, 1) if (dr, dc) != (0, 0)]
NEIGHBORS_4 = [(0, 1), (1, 0), (0, -1), (-1, 0)]


def format_cells(cells: list[Cell]) -> str:
    return ", ".join(f"({r + 1},{c + 1})" for r, c in sorted(cells))


def parse_cells(answer: str) -> list[Cell] | None:
    """1-based "(row,col)" pairs to 0-based cells; None when a cell is repeated."""
    cells = [(r - 1, c - 1) for r, c in parse_pairs(answer)]
    return cells if len(set(cells)) == len(cells) else None


def flip_one_cell(answer: str, rng: random.Random) -> str:
    """A 0/1 grid answer with one cell flipped."""
    digits = [i for i, ch in enumerate(answer) if ch in "01"]
    i = digits[rng.randrange(len(digits))]
    return answer[:i] + ("1" if answer[i] == "0" else "0") + answer[i + 1:]


def move_one_cell(answer: str, rng: random.Random, rows: int, cols: int) -> str:
    """A cell-list answer with one cell moved to a cell not in the list."""
    cells = parse_cells(answer) or []
    taken = set(cells)
    free = [(r, c) for r in range(rows) for c in range(cols) if (r, c) not in taken]
    k = rng.randrange(len(cells))
    cells[k] = free[rng.randrange(len(free))]
    return format_cells(cells)


# --- kukurasu --------------------------------------------------------------------------------

def kukurasu_sums(grid: list[list[int]]) -> tuple[list[int], list[int]]:
    n, m = len(grid), len(grid[0])
    rows = [sum(c + 1 for c in range(m) if grid[r][c]) for r in range(n)]
    cols = [sum(r + 1 for r in range(n) if grid[r][c]) for c in range(m)]
    return rows, cols


@uniqueness_check
def count_kukurasu_solutions(row_sums: list[int], col_sums: list[int],
                             hints: dict[Cell, int], limit: int = 2) -> int:
    n, m = len(row_sums), len(col_sums)
    options: list[list[tuple[int, ...]]] = []
    for r in range(n):
        opts = []
        for mask in range(1 << m):
            row = tuple((mask >> c) & 1 for c in range(m))
            if sum(c + 1 for c in range(m) if row[c]) != row_sums[r]:
                continue
            if any(hints.get((r, c), row[c]) != row[c] for c in range(m)):
                continue
            opts.append(row)
        options.append(opts)
    col_acc = [0] * m
    count = 0
    later_weight = [sum(i + 1 for i in range(r, n)) for r in range(n + 1)] + [0]

    def search(r: int) -> None:
        nonlocal count
        if count >= limit:
            return
        if r == n:
            count += col_acc == col_sums
            return
        for row in options[r]:
            ok = True
            for c in range(m):
                col_acc[c] += (r + 1) * row[c]
            for c in range(m):
                if col_acc[c] > col_sums[c] or col_acc[c] + later_weight[r + 1] < col_sums[c]:
                    ok = False
                    break
            if ok:
                search(r + 1)
            for c in range(m):
                col_acc[c] -= (r + 1) * row[c]

    search(0)
    return count


@dataclass(frozen=True)
class KukurasuParams(LevelParams):
    size: int
    density: float


class Kukurasu(SynthTask):
    name = "kukurasu"
    family = "grid"
    answer_example = "1 0\n0 1"
    levels = (KukurasuParams(3, 0.5), KukurasuParams(4, 0.5), KukurasuParams(5, 0.45),
              KukurasuParams(6, 0.45), KukurasuParams(7, 0.4))

    def build(self, rng: random.Random, p: KukurasuParams) -> tuple[str, str, dict[str, Any]]:
        n = p.size
        grid = [[int(rng.random() < p.density) for _ in range(n)] for _ in range(n)]
        rows, cols = kukurasu_sums(grid)
        cells = [(r, c) for r in range(n) for c in range(n)]
        rng.shuffle(cells)
        hints: dict[Cell, int] = {}
        while count_kukurasu_solutions(rows, cols, hints) > 1:
            r, c = cells.pop()
            hints[(r, c)] = grid[r][c]
        hint_text = ""
        if hints:
            hint_text = "\nKnown cells (row,col)=value: " + ", ".join(
                f"({r + 1},{c + 1})={v}" for (r, c), v in sorted(hints.items()))
        question = (
            f"Kukurasu on a {n}x{n} grid: mark some cells with 1 (the rest 0). A 1 in column j "
            f"counts j toward its row's sum; a 1 in row i counts i toward its column's sum "
            f"(rows and columns numbered from 1).\nRow sums (top to bottom): "
            f"{' '.join(map(str, rows))}\nColumn sums (left to right): {' '.join(map(str, cols))}"
            f"{hint_text}\nGive the grid of 0s and 1s: one row per line, separated by spaces."
        )
        meta = {"row_sums": rows, "col_sums": cols,
                "hints": [[r, c, v] for (r, c), v in sorted(hints.items())]}
        return question, format_grid(grid), meta

    def check(self, instance: TaskInstance, answer: str) -> float:
        meta = instance.metadata
        n = len(meta["row_sums"])
        grid = parse_grid(answer, n, n)
        if grid is None or any(v not in (0, 1) for row in grid for v in row):
            return 0.0
        if any(grid[r][c] != v for r, c, v in meta["hints"]):
            return 0.0
        return 1.0 if kukurasu_sums(grid) == (meta["row_sums"], meta["col_sums"]) else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        return [flip_one_cell(instance.answer, rng)]


# --- star placement (star battle, one star per row/column/region) ----------------------------

@uniqueness_check
def count_star_solutions(regions: list[list[int]], fixed: dict[int, int], limit: int = 2) -> int:
    n = len(regions)
    count = 0
    used_cols: set[int] = set()
    used_regions: set[int] = set()

    def search(r: int, prev: int) -> None:
        nonlocal count
        if count >= limit:
            return
        if r == n:
            count += 1
            return
        for c in ([fixed[r]] if r in fixed else range(n)):
            if c in used_cols or regions[r][c] in used_regions or (prev >= 0 and abs(c - prev) <= 1):
                continue
            used_cols.add(c)
            used_regions.add(regions[r][c])
            search(r + 1, c)
            used_cols.discard(c)
            used_regions.discard(regions[r][c])

    search(0, -1)
    return count


def grow_regions(rng: random.Random, n: int, seeds: list[Cell]) -> list[list[int]]:
    region = [[-1] * n for _ in range(n)]
    frontier: list[Cell] = []
    for k, (r, c) in enumerate(seeds):
        region[r][c] = k
        frontier.append((r, c))
    while frontier:
        r, c = frontier[rng.randrange(len(frontier))]
        free = [(r + dr, c + dc) for dr, dc in NEIGHBORS_4
                if 0 <= r + dr < n and 0 <= c + dc < n and region[r + dr][c + dc] < 0]
        if not free:
            frontier.remove((r, c))
            continue
        nr, nc = rng.choice(free)
        region[nr][nc] = region[r][c]
        frontier.append((nr, nc))
    return region


@dataclass(frozen=True)
class StarParams(LevelParams):
    size: int


class StarPlacement(SynthTask):
    name = "star_placement"
    family = "grid"
    answer_example = "(1,2), (2,4), (3,1), (4,3)"
    levels = (StarParams(4), StarParams(5), StarParams(6), StarParams(7), StarParams(8))

    def build(self, rng: random.Random, p: StarParams) -> tuple[str, str, dict[str, Any]]:
        n = p.size
        while True:
            cols = rng.sample(range(n), n)
            if all(abs(cols[i] - cols[i + 1]) > 1 for i in range(n - 1)):
                break
        stars = [(r, cols[r]) for r in range(n)]
        for _ in range(20):  # a few region layouts; most are unique without help
            regions = grow_regions(rng, n, stars)
            if count_star_solutions(regions, {}) == 1:
                break
        fixed: dict[int, int] = {}
        order = rng.sample(range(n), n)
        while count_star_solutions(regions, fixed) > 1:
            r = order[len(fixed)]
            fixed[r] = cols[r]
        letters = "ABCDEFGHIJ"
        grid_text = "\n".join(" ".join(letters[v] for v in row) for row in regions)
        hint_text = ("\nKnown stars: " + format_cells([(r, c) for r, c in sorted(fixed.items())])) if fixed else ""
        question = (
            f"Star placement on a {n}x{n} grid divided into regions (letters):\n{grid_text}\n"
            f"Place {n} stars so that every row, every column and every region has exactly one "
            f"star, and no two stars touch, not even diagonally.{hint_text}\n"
            f"Give the star cells as (row,col) pairs, numbered from 1."
        )
        meta = {"regions": regions, "fixed": [[r, c] for r, c in sorted(fixed.items())]}
        return question, format_cells(stars), meta

    def check(self, instance: TaskInstance, answer: str) -> float:
        regions = instance.metadata["regions"]
        n = len(regions)
        cells = parse_cells(answer)
        if cells is None or len(cells) != n:
            return 0.0
        if any(not (0 <= r < n and 0 <= c < n) for r, c in cells):
            return 0.0
        if len({r for r, _ in cells}) != n or len({c for _, c in cells}) != n:
            return 0.0
        if len({regions[r][c] for r, c in cells}) != n:
            return 0.0
        star_set = set(cells)
        if any((r + dr, c + dc) in star_set for r, c in cells for dr, dc in NEIGHBORS_8):
            return 0.0
        return 1.0 if all((r, c) in star_set for r, c in instance.metadata["fixed"]) else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        n = len(instance.metadata["regions"])
        return [move_one_cell(instance.answer, rng, n, n)]


# --- minesweeper -----------------------------------------------------------------------------

def neighbors(r: int, c: int, rows: int, cols: int) -> list[Cell]:
    return [(r + dr, c + dc) for dr, dc in NEIGHBORS_8 if 0 <= r + dr < rows and 0 <= c + dc < cols]


@uniqueness_check
def count_mine_solutions(rows: int, cols: int, numbers: dict[Cell, int], hidden: list[Cell],
                         total: int, limit: int = 2) -> int:
    hidden_index = {cell: i for i, cell in enumerate(hidden)}
    watchers: list[list[Cell]] = [[] for _ in hidden]
    for cell in numbers:
        for nb in neighbors(*cell, rows, cols):
            if nb in hidden_index:
                watchers[hidden_index[nb]].append(cell)
    mines_near = {cell: 0 for cell in numbers}
    open_near = {cell: sum(nb in hidden_index for nb in neighbors(*cell, rows, cols)) for cell in numbers}
    count = 0

    def feasible(i: int) -> bool:
        return all(mines_near[w] <= numbers[w] <= mines_near[w] + open_near[w] for w in watchers[i])

    def search(i: int, placed: int) -> None:
        nonlocal count
        if count >= limit or placed > total or placed + len(hidden) - i < total:
            return
        if i == len(hidden):
            count += 1
            return
        for is_mine in (0, 1):
            for w in watchers[i]:
                open_near[w] -= 1
                mines_near[w] += is_mine
            if feasible(i):
                search(i + 1, placed + is_mine)
            for w in watchers[i]:
                open_near[w] += 1
                mines_near[w] -= is_mine

    search(0, 0)
    return count


@dataclass(frozen=True)
class MinesweeperParams(LevelParams):
    rows: int
    cols: int
    mines: int
    extra_hidden: int


class Minesweeper(SynthTask):
    name = "minesweeper"
    family = "grid"
    answer_example = "(1,3), (4,2)"
    levels = (
        MinesweeperParams(4, 4, 2, 3), MinesweeperParams(5, 5, 3, 6), MinesweeperParams(6, 6, 5, 9),
        MinesweeperParams(7, 7, 7, 14), MinesweeperParams(8, 8, 10, 20),
    )

    def build(self, rng: random.Random, p: MinesweeperParams) -> tuple[str, str, dict[str, Any]]:
        cells = [(r, c) for r in range(p.rows) for c in range(p.cols)]
        mines = sorted(rng.sample(cells, p.mines))
        mine_set = set(mines)
        safe = [cell for cell in cells if cell not in mine_set]
        hidden_safe = rng.sample(safe, min(p.extra_hidden, len(safe)))
        while True:
            hidden = sorted(mines + hidden_safe)
            hidden_set = set(hidden)
            numbers = {cell: sum(nb in mine_set for nb in neighbors(*cell, p.rows, p.cols))
                       for cell in cells if cell not in hidden_set}
            if count_mine_solutions(p.rows, p.cols, numbers, hidden, p.mines) == 1:
                break
            hidden_safe.pop(rng.randrange(len(hidden_safe)))   # reveal one more safe cell
        board = [["?" if (r, c) in hidden_set else str(numbers[(r, c)]) for c in range(p.cols)]
                 for r in range(p.rows)]
        question = (
            f"Minesweeper board ({p.rows} rows x {p.cols} columns). A number is how many of its up "
            f"to 8 neighbours hold a mine; '?' cells are unopened. There are exactly {p.mines} "
            f"mines, all under '?' cells.\n{format_grid(board)}\n"
            f"List every mine as (row,col), numbered from 1."
        )
        meta = {"board": ["".join(row) if p.cols <= 9 else " ".join(row) for row in board],
                "rows": p.rows, "cols": p.cols, "mines": p.mines}
        return question, format_cells(mines), meta

    def check(self, instance: TaskInstance, answer: str) -> float:
        meta = instance.metadata
        rows, cols = meta["rows"], meta["cols"]
        board = [list(row) if " " not in row else row.split(" ") for row in meta["board"]]
        cells = parse_cells(answer)
        if cells is None or len(cells) != meta["mines"]:
            return 0.0
        if any(not (0 <= r < rows and 0 <= c < cols) or board[r][c] != "?" for r, c in cells):
            return 0.0
        mine_set = set(cells)
        for r in range(rows):
            for c in range(cols):
                if board[r][c] != "?" and int(board[r][c]) != sum(nb in mine_set for nb in neighbors(r, c, rows, cols)):
                    return 0.0
        return 1.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        m = instance.metadata
        return [move_one_cell(instance.answer, rng, m["rows"], m["cols"])]


# --- number wall (each brick is the sum of the two beneath it) -------------------------------

def build_wall(bottom: list[int]) -> list[list[int]]:
    wall = [list(bottom)]
    while len(wall[-1]) > 1:
        below = wall[-1]
        wall.append([below[i] + below[i + 1] for i in range(len(below) - 1)])
    return wall


def matrix_rank(rows: list[list[int]]) -> int:
    mat = [[Fraction(v) for v in row] for row in rows]
    rank, width = 0, len(mat[0]) if mat else 0
    for col in range(width):
        pivot = next((i for i in range(rank, len(mat)) if mat[i][col] != 0), None)
        if pivot is None:
            continue
        mat[rank], mat[pivot] = mat[pivot], mat[rank]
        for i in range(len(mat)):
            if i != rank and mat[i][col] != 0:
                f = mat[i][col] / mat[rank][col]
                mat[i] = [a - f * b for a, b in zip(mat[i], mat[rank])]
        rank += 1
    return rank


@dataclass(frozen=True)
class NumberWallParams(LevelParams):
    width: int
    max_value: int


class NumberWall(SynthTask):
    name = "number_wall"
    family = "grid"
    answer_example = "3 5 2 7"
    levels = (NumberWallParams(3, 9), NumberWallParams(4, 9), NumberWallParams(5, 12),
              NumberWallParams(6, 15), NumberWallParams(7, 20))

    def build(self, rng: random.Random, p: NumberWallParams) -> tuple[str, str, dict[str, Any]]:
        w = p.width
        bottom = [rng.randint(1, p.max_value) for _ in range(w)]
        wall = build_wall(bottom)
        bricks = [(k, i) for k in range(w) for i in range(w - k)]
        rng.shuffle(bricks)
        shown: list[tuple[int, int]] = []
        rows: list[list[int]] = []
        # a brick (k, i) is sum_j C(k, j) * bottom[i + j]; reveal until the bottom is determined
        for k, i in bricks:
            coeffs = [comb(k, j - i) if i <= j <= i + k else 0 for j in range(w)]
            if matrix_rank(rows + [coeffs]) > len(rows):
                rows.append(coeffs)
                shown.append((k, i))
            if len(rows) == w:
                break
        shown_set = set(shown)
        lines = []
        for k in range(w - 1, -1, -1):
            cells = [str(wall[k][i]) if (k, i) in shown_set else "_" for i in range(w - k)]
            lines.append(" ".join(cells))
        question = (
            "A number wall: each brick holds the sum of the two bricks directly beneath it. "
            "Rows from the top brick down to the bottom row; '_' bricks are unknown.\n" + "\n".join(lines)
            + f"\nGive the bottom row's {w} numbers from left to right, separated by spaces."
        )
        meta = {"width": w, "shown": [[k, i, wall[k][i]] for k, i in sorted(shown)]}
        return question, " ".join(map(str, bottom)), meta

    def check(self, instance: TaskInstance, answer: str) -> float:
        w = instance.metadata["width"]
        bottom = parse_grid(answer, 1, w)
        if bottom is None:
            return 0.0
        wall = build_wall(bottom[0])
        return 1.0 if all(wall[k][i] == v for k, i, v in instance.metadata["shown"]) else 0.0


# --- survo -----------------------------------------------------------------------------------

@uniqueness_check
def count_survo_solutions(grid: list[list[int]], row_sums: list[int], col_sums: list[int],
                          limit: int = 2) -> int:
    rows, cols = len(grid), len(grid[0])
    present = {v for row in grid for v in row if v}
    missing = [v for v in range(1, rows * cols + 1) if v not in present]
    blanks = [(r, c) for r in range(rows) for c in range(cols) if not grid[r][c]]
    work = [row[:] for row in grid]
    used = [False] * len(missing)
    count = 0

    def line_ok(cells: list[int], target: int) -> bool:
        s = sum(cells)
        return s == target if all(cells) else s < target

    def search(i: int) -> None:
        nonlocal count
        if count >= limit:
            return
        if i == len(blanks):
            count += 1
            return
        r, c = blanks[i]
        for k, v in enumerate(missing):
            if used[k]:
                continue
            work[r][c] = v
            if line_ok(work[r], row_sums[r]) and line_ok([work[x][c] for x in range(rows)], col_sums[c]):
                used[k] = True
                search(i + 1)
                used[k] = False
            work[r][c] = 0

    search(0)
    return count


@dataclass(frozen=True)
class SurvoParams(LevelParams):
    rows: int
    cols: int
    max_blanks: int


class Survo(SynthTask):
    name = "survo"
    family = "grid"
    answer_example = "1 2 3\n4 5 6"
    levels = (SurvoParams(3, 3, 4), SurvoParams(3, 3, 6), SurvoParams(3, 4, 7),
              SurvoParams(4, 4, 8), SurvoParams(4, 4, 10))

    def build(self, rng: random.Random, p: SurvoParams) -> tuple[str, str, dict[str, Any]]:
        values = rng.sample(range(1, p.rows * p.cols + 1), p.rows * p.cols)
        solution = [values[r * p.cols:(r + 1) * p.cols] for r in range(p.rows)]
        row_sums = [sum(row) for row in solution]
        col_sums = [sum(solution[r][c] for r in range(p.rows)) for c in range(p.cols)]
        cells = [(r, c) for r in range(p.rows) for c in range(p.cols)]
        rng.shuffle(cells)
        puzzle = [row[:] for row in solution]
        for r, c in cells[: p.max_blanks]:
            puzzle[r][c] = 0
        hidden = cells[: p.max_blanks]
        while count_survo_solutions(puzzle, row_sums, col_sums) > 1:
            r, c = hidden.pop()
            puzzle[r][c] = solution[r][c]
        table = "\n".join(" ".join(str(v) if v else "_" for v in row) + f" | {s}"
                          for row, s in zip(puzzle, row_sums))
        question = (
            f"Survo puzzle: fill the blanks (_) of this {p.rows}x{p.cols} grid so that the numbers "
            f"1 to {p.rows * p.cols} each appear exactly once and every row and column adds up "
            f"to its sum (row sums after '|', column sums in the last line).\n{table}\n"
            f"{' '.join(map(str, col_sums))}\n"
            f"Give the completed grid (without the sums): one row per line, numbers separated by spaces."
        )
        meta = {"puzzle": puzzle, "row_sums": row_sums, "col_sums": col_sums}
        return question, format_grid(solution), meta

    def check(self, instance: TaskInstance, answer: str) -> float:
        meta = instance.metadata
        puzzle = meta["puzzle"]
        rows, cols = len(puzzle), len(puzzle[0])
        grid = parse_grid(answer, rows, cols)
        if grid is None:
            return 0.0
        if sorted(v for row in grid for v in row) != list(range(1, rows * cols + 1)):
            return 0.0
        if any(g and g != v for grow, row in zip(puzzle, grid) for g, v in zip(grow, row)):
            return 0.0
        ok = [sum(row) for row in grid] == meta["row_sums"] and [
            sum(grid[r][c] for r in range(rows)) for c in range(cols)] == meta["col_sums"]
        return 1.0 if ok else 0.0


# --- campsite (tents and trees) --------------------------------------------------------------

def tents_match_trees(tents: list[Cell], trees: list[Cell]) -> bool:
    """A one-to-one pairing of tents with orthogonally adjacent trees exists (Kuhn's matching)."""
    if len(tents) != len(trees):
        return False
    tree_index = {t: i for i, t in enumerate(trees)}
    adjacent = [[tree_index[(r + dr, c + dc)] for dr, dc in NEIGHBORS_4 if (r + dr, c + dc) in tree_index]
                for r, c in tents]
    owner = [-1] * len(trees)

    def augment(t: int, seen: list[bool]) -> bool:
        for tree in adjacent[t]:
            if not seen[tree]:
                seen[tree] = True
                if owner[tree] < 0 or augment(owner[tree], seen):
                    owner[tree] = t
                    return True
        return False

    return all(augment(t, [False] * len(trees)) for t in range(len(tents)))


def campsite_valid(tents: list[Cell], trees: list[Cell], n: int, row_counts: list[int],
                   col_counts: list[int]) -> bool:
    tent_set, tree_set = set(tents), set(trees)
    if any(not (0 <= r < n and 0 <= c < n) or (r, c) in tree_set for r, c in tents):
        return False
    if any((r + dr, c + dc) in tent_set for r, c in tents for dr, dc in NEIGHBORS_8):
        return False
    if [sum(r == i for r, _ in tents) for i in range(n)] != row_counts:
        return False
    if [sum(c == j for _, c in tents) for j in range(n)] != col_counts:
        return False
    return tents_match_trees(tents, trees)


@uniqueness_check
def count_campsite_solutions(n: int, trees: list[Cell], row_counts: list[int], col_counts: list[int],
                             fixed: set[Cell], limit: int = 2) -> int:
    tree_set = set(trees)
    candidates = sorted({(r + dr, c + dc) for r, c in trees for dr, dc in NEIGHBORS_4
                         if 0 <= r + dr < n and 0 <= c + dc < n and (r + dr, c + dc) not in tree_set})
    remaining_in_row = [sum(r == i for r, _ in candidates) for i in range(n)]
    rows_left, cols_left = list(row_counts), list(col_counts)
    chosen: list[Cell] = []
    chosen_set: set[Cell] = set()
    count = 0

    def search(i: int) -> None:
        nonlocal count
        if count >= limit:
            return
        if i == len(candidates):
            if not any(rows_left) and not any(cols_left) and tents_match_trees(chosen, trees):
                count += 1
            return
        r, c = candidates[i]
        if (i == 0 or candidates[i - 1][0] != r) and any(rows_left[x] for x in range(r)):
            return   # a new row starts while an earlier row is left short
        remaining_in_row[r] -= 1
        can_place = (rows_left[r] > 0 and cols_left[c] > 0
                     and not any((r + dr, c + dc) in chosen_set for dr, dc in NEIGHBORS_8))
        if can_place:
            chosen.append((r, c))
            chosen_set.add((r, c))
            rows_left[r] -= 1
            cols_left[c] -= 1
            search(i + 1)
            rows_left[r] += 1
            cols_left[c] += 1
            chosen.pop()
            chosen_set.discard((r, c))
        if (r, c) not in fixed and rows_left[r] <= remaining_in_row[r]:
            search(i + 1)
        remaining_in_row[r] += 1

    search(0)
    return count


@dataclass(frozen=True)
class CampsiteParams(LevelParams):
    size: int
    tents: int


class Campsite(SynthTask):
    name = "campsite"
    family = "grid"
    answer_example = "(1,2), (3,4)"
    levels = (CampsiteParams(4, 3), CampsiteParams(5, 4), CampsiteParams(6, 6),
              CampsiteParams(7, 8), CampsiteParams(8, 11))

    def build(self, rng: random.Random, p: CampsiteParams) -> tuple[str, str, dict[str, Any]]:
        n = p.size
        tents, trees = self._layout(rng, p)
        row_counts = [sum(r == i for r, _ in tents) for i in range(n)]
        col_counts = [sum(c == j for _, c in tents) for j in range(n)]
        order = sorted(tents)
        rng.shuffle(order)
        fixed: set[Cell] = set()
        while count_campsite_solutions(n, trees, row_counts, col_counts, fixed) > 1:
            fixed.add(order[len(fixed)])
        board = [["T" if (r, c) in trees else "." for c in range(n)] for r in range(n)]
        hint_text = ("\nKnown tents: " + format_cells(sorted(fixed))) if fixed else ""
        question = (
            f"Campsite puzzle on a {n}x{n} grid ('T' = tree, '.' = empty). Place one tent per "
            f"tree: each tent sits on an empty cell next to its own tree (up, down, left or "
            f"right), tents never touch each other, not even diagonally, and each row and "
            f"column holds the given number of tents.\n{format_grid(board)}\n"
            f"Tents per row (top to bottom): {' '.join(map(str, row_counts))}\n"
            f"Tents per column (left to right): {' '.join(map(str, col_counts))}{hint_text}\n"
            f"Give the tent cells as (row,col) pairs, numbered from 1."
        )
        meta = {"size": n, "trees": [list(t) for t in sorted(trees)], "row_counts": row_counts,
                "col_counts": col_counts, "fixed": [list(t) for t in sorted(fixed)]}
        return question, format_cells(tents), meta

    def _layout(self, rng: random.Random, p: CampsiteParams) -> tuple[list[Cell], list[Cell]]:
        n = p.size
        while True:
            tents: list[Cell] = []
            trees: list[Cell] = []
            occupied: set[Cell] = set()
            cells = [(r, c) for r in range(n) for c in range(n)]
            rng.shuffle(cells)
            for r, c in cells:
                if len(tents) == p.tents:
                    break
                if (r, c) in occupied or any((r + dr, c + dc) in set(tents) for dr, dc in NEIGHBORS_8):
                    continue
                spots = [(r + dr, c + dc) for dr, dc in NEIGHBORS_4
                         if 0 <= r + dr < n and 0 <= c + dc < n and (r + dr, c + dc) not in occupied]
                if not spots:
                    continue
                tree = rng.choice(spots)
                tents.append((r, c))
                trees.append(tree)
                occupied.update({(r, c), tree})
            if len(tents) == p.tents:
                return sorted(tents), sorted(trees)

    def check(self, instance: TaskInstance, answer: str) -> float:
        meta = instance.metadata
        cells = parse_cells(answer)
        if cells is None:
            return 0.0
        trees = [tuple(t) for t in meta["trees"]]
        if not all(tuple(f) in set(cells) for f in meta["fixed"]):
            return 0.0
        ok = campsite_valid(cells, trees, meta["size"], meta["row_counts"], meta["col_counts"])
        return 1.0 if ok else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        n = instance.metadata["size"]
        return [move_one_cell(instance.answer, rng, n, n)]
