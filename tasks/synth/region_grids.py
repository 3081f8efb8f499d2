"""Region and path puzzles: norinori, numbrix, magic square.

Each puzzle is built from a random solution (a domino layout, a Hamiltonian path, a magic
square) and proved unique with the solver beside it: norinori draws regions that a chain of
forced moves solves, then reshapes them one change at a time, keeping only changes after which
the solver still finds one shading; numbrix and the magic square reveal cells until one filling
remains. Verifiers check the rules, so any valid answer scores 1.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations
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
from tasks.synth.latin_grids import GRID_FORMAT

Cell = tuple[int, int]
NEIGHBORS_4 = ((0, 1), (1, 0), (0, -1), (-1, 0))
REGION_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


class _OutOfBudget(Exception):
    """A solver ran past its step budget."""


def grid_neighbors(rows: int, cols: int) -> list[list[int]]:
    """Orthogonal neighbours of every cell of a rows x cols grid, cells numbered row-major."""
    return [[(r + dr) * cols + c + dc for dr, dc in NEIGHBORS_4 if 0 <= r + dr < rows and 0 <= c + dc < cols]
            for r in range(rows) for c in range(cols)]


def format_cells0(cells: list[Cell]) -> str:
    return ", ".join(f"({r},{c})" for r, c in sorted(cells))


def parse_cells0(answer: str) -> list[Cell] | None:
    """0-based "(row,col)" pairs; None when a cell is repeated."""
    cells = parse_pairs(answer)
    return cells if len(set(cells)) == len(cells) else None


# --- norinori --------------------------------------------------------------------------------

def _norinori_propagate(state: list[int], regions: list[list[int]], nbrs: list[list[int]]) -> bool:
    """Apply the forced moves to ``state`` (-1 unknown, 0 empty, 1 shaded) in place; False on a
    contradiction."""
    n = len(state)
    changed = True
    while changed:
        changed = False
        for cells in regions:
            shaded = unknown = 0
            for i in cells:
                v = state[i]
                if v == 1:
                    shaded += 1
                elif v < 0:
                    unknown += 1
            if shaded > 2 or shaded + unknown < 2:
                return False
            if unknown and (shaded == 2 or shaded + unknown == 2):
                fill = 0 if shaded == 2 else 1
                for i in cells:
                    if state[i] < 0:
                        state[i] = fill
                changed = True
        for i in range(n):
            v = state[i]
            if v == 0:
                continue
            shaded = unknown = 0
            last = -1
            for j in nbrs[i]:
                w = state[j]
                if w == 1:
                    shaded += 1
                elif w < 0:
                    unknown += 1
                    last = j
            if v < 0:
                if shaded >= 2 or shaded + unknown == 0:   # two shaded neighbours, or none possible
                    state[i] = 0
                    changed = True
                continue
            if shaded > 1 or (shaded == 0 and unknown == 0):
                return False
            if shaded == 1 and unknown:
                for j in nbrs[i]:
                    state[j] = max(state[j], 0)
                changed = True
            elif shaded == 0 and unknown == 1:
                state[last] = 1
                changed = True
    return True


@uniqueness_check
def solve_norinori(regions: list[list[int]], limit: int = 2,
                   max_nodes: int | None = None) -> list[list[Cell]] | None:
    """Up to ``limit`` shadings of a region grid (region id per cell): two shaded cells per
    region, every shaded cell next to exactly one other. Each shading is a sorted cell list.
    None when the search would take more than ``max_nodes`` steps (the count is then unknown)."""
    rows, cols = len(regions), len(regions[0])
    nbrs = grid_neighbors(rows, cols)
    groups: dict[int, list[int]] = {}
    for r in range(rows):
        for c in range(cols):
            groups.setdefault(regions[r][c], []).append(r * cols + c)
    region_cells = [groups[k] for k in sorted(groups)]
    found: list[list[Cell]] = []
    budget = [max_nodes if max_nodes is not None else -1]

    def search(state: list[int]) -> None:
        budget[0] -= 1
        if budget[0] == 0:
            raise _OutOfBudget
        if len(found) >= limit or not _norinori_propagate(state, region_cells, nbrs):
            return
        best, best_options = None, 0
        for cells in region_cells:
            unknown = [i for i in cells if state[i] < 0]
            if not unknown:
                continue
            need = 2 - sum(state[i] == 1 for i in cells)
            options = comb(len(unknown), need)
            if best is None or options < best_options:
                best, best_options = (unknown, need), options
        if best is None:
            found.append([(i // cols, i % cols) for i in range(rows * cols) if state[i] == 1])
            return
        unknown, need = best
        for chosen in combinations(unknown, need):
            child = state[:]
            for i in unknown:
                child[i] = 0
            for i in chosen:
                child[i] = 1
            search(child)
            if len(found) >= limit:
                return

    try:
        search([-1] * (rows * cols))
    except _OutOfBudget:
        return None
    return found


def place_dominoes(rng: random.Random, rows: int, cols: int) -> list[tuple[Cell, Cell]]:
    """A random maximal packing of dominoes in which no two dominoes touch orthogonally."""
    nbrs = grid_neighbors(rows, cols)
    shaded = [False] * (rows * cols)
    blocked = [False] * (rows * cols)   # shaded, or next to a shaded cell
    dominoes = []
    order = list(range(rows * cols))
    rng.shuffle(order)
    for i in order:
        if blocked[i]:
            continue
        partners = [j for j in nbrs[i] if not blocked[j]]
        if not partners:
            continue
        j = rng.choice(partners)
        for k in (i, j):
            shaded[k] = True
            blocked[k] = True
            for m in nbrs[k]:
                blocked[m] = True
        a, b = sorted((i, j))
        dominoes.append(((a // cols, a % cols), (b // cols, b % cols)))
    return sorted(dominoes)


def norinori_regions(rng: random.Random, rows: int, cols: int,
                     dominoes: list[tuple[Cell, Cell]]) -> list[int] | None:
    """Regions (flat, one id per cell) around ``dominoes`` that a chain of forced moves solves,
    or None when this try leaves a cell out.

    The dominoes get an order; domino k's region is domino k plus empty cells that already
    touch an earlier domino (or whose every neighbour does). Solving in that order, each region
    has exactly two cells left that can be shaded, so the shading is unique."""
    nbrs = grid_neighbors(rows, cols)
    n = rows * cols
    domino_of = [-1] * n
    for k, ((r1, c1), (r2, c2)) in enumerate(dominoes):
        domino_of[r1 * cols + c1] = domino_of[r2 * cols + c2] = k
    touching = [sorted({domino_of[j] for j in nbrs[i] if domino_of[j] >= 0}) if domino_of[i] < 0 else []
                for i in range(n)]
    # dominoes that are the only neighbour of many cells go early: those cells need a later region
    only_one = [0] * len(dominoes)
    for ks in touching:
        if len(ks) == 1:
            only_one[ks[0]] += 1
    noise = [rng.random() for _ in dominoes]
    order = sorted(range(len(dominoes)), key=lambda k: -(only_one[k] + 3 * noise[k]))
    rank = [0] * len(dominoes)
    for pos, k in enumerate(order):
        rank[k] = pos
    # when each empty cell is known to be empty, as a rank: it may join any later region
    known = [min(rank[k] for k in ks) if ks else -1 for ks in touching]
    for i in range(n):
        if domino_of[i] < 0 and not touching[i]:   # no domino next to it: all its neighbours do
            known[i] = max(known[j] for j in nbrs[i])
    region = [rank[domino_of[i]] if domino_of[i] >= 0 else -1 for i in range(n)]
    size = [2] * len(dominoes)
    frontier = [(region[j], i) for i in range(n) if region[i] < 0 for j in nbrs[i] if region[j] > known[i]]
    while frontier:
        pos = rng.randrange(len(frontier))
        other = rng.randrange(len(frontier))   # of two random candidates, grow the smaller region
        if size[frontier[other][0]] < size[frontier[pos][0]]:
            pos = other
        k, i = frontier[pos]
        frontier[pos] = frontier[-1]
        frontier.pop()
        if region[i] >= 0:
            continue
        region[i] = k
        size[k] += 1
        frontier.extend((k, j) for j in nbrs[i] if region[j] < 0 and k > known[j])
    return None if -1 in region else region


def _region_connected(region: list[int], nbrs: list[list[int]], k: int, skip: int = -1, extra: int = -1) -> bool:
    """Whether region ``k`` without cell ``skip`` and with cell ``extra`` is connected."""
    cells = [i for i, v in enumerate(region) if (v == k and i != skip) or i == extra]
    if not cells:
        return False
    inside = set(cells)
    seen = {cells[0]}
    stack = [cells[0]]
    while stack:
        for j in nbrs[stack.pop()]:
            if j in inside and j not in seen:
                seen.add(j)
                stack.append(j)
    return len(seen) == len(cells)


NORINORI_NODE_BUDGET = 100


def norinori_reshape(rng: random.Random, rows: int, cols: int, region: list[int], shaded: set[int],
                     attempts: int) -> list[int]:
    """Random region changes, each kept only if the solution stays unique: an empty cell joins
    a small neighbouring region, or two shaded cells of different regions trade regions (so
    dominoes come to cross region borders)."""
    nbrs = grid_neighbors(rows, cols)
    region = region[:]
    n = rows * cols
    for _ in range(attempts):
        sizes: dict[int, int] = {}
        for v in region:
            sizes[v] = sizes.get(v, 0) + 1
        moves: list[tuple[int, int]] = []   # (cell, new region)
        if rng.random() < 0.75:   # grow one of the smallest regions by a neighbouring empty cell
            smallest = min(sizes.values())
            k = rng.choice(sorted(v for v, size in sizes.items() if size <= smallest + 1))
            border = sorted({j for i in range(n) if region[i] == k for j in nbrs[i]
                             if region[j] != k and j not in shaded})
            if border:
                i = rng.choice(border)
                if _region_connected(region, nbrs, region[i], skip=i):
                    moves = [(i, k)]
        else:   # two nearby shaded cells of different regions trade regions
            i = rng.choice(sorted(shaded))
            near = sorted(j for j in shaded if region[j] != region[i]
                          and abs(j // cols - i // cols) + abs(j % cols - i % cols) <= 3)
            if near:
                j = rng.choice(near)
                if _region_connected(region, nbrs, region[i], skip=i, extra=j) \
                        and _region_connected(region, nbrs, region[j], skip=j, extra=i):
                    moves = [(i, region[j]), (j, region[i])]
        if not moves:
            continue
        undo = [(i, region[i]) for i, _ in moves]
        for i, k in moves:
            region[i] = k
        solutions = solve_norinori([region[r * cols:(r + 1) * cols] for r in range(rows)], 2, NORINORI_NODE_BUDGET)
        if solutions is None or len(solutions) != 1:   # not proved unique: undo
            for i, k in undo:
                region[i] = k
    return region


def relabel_regions(regions: list[list[int]]) -> list[list[int]]:
    """Regions numbered in reading order, so their letters run A, B, C, ... down the grid."""
    relabel: dict[int, int] = {}
    return [[relabel.setdefault(v, len(relabel)) for v in row] for row in regions]


def norinori_valid(regions: list[list[int]], cells: list[Cell]) -> bool:
    rows, cols = len(regions), len(regions[0])
    if any(not (0 <= r < rows and 0 <= c < cols) for r, c in cells):
        return False
    shaded = set(cells)
    per_region: dict[int, int] = {}
    for r, c in cells:
        per_region[regions[r][c]] = per_region.get(regions[r][c], 0) + 1
        if sum((r + dr, c + dc) in shaded for dr, dc in NEIGHBORS_4) != 1:
            return False
    n_regions = len({v for row in regions for v in row})
    return len(per_region) == n_regions and all(k == 2 for k in per_region.values())


@dataclass(frozen=True)
class NorinoriParams(LevelParams):
    rows: int
    cols: int
    reshapes: int   # region changes tried after the layout (each kept only if still unique)


class Norinori(SynthTask):
    name = "norinori"
    family = "grid"
    answer_example = "(0,1), (0,2), (2,0), (3,0)"
    levels = (NorinoriParams(4, 4, 40), NorinoriParams(5, 5, 60), NorinoriParams(6, 6, 90),
              NorinoriParams(7, 7, 120), NorinoriParams(8, 8, 160))

    def build(self, rng: random.Random, p: NorinoriParams) -> tuple[str, str, dict[str, Any]]:
        while True:
            dominoes = place_dominoes(rng, p.rows, p.cols)
            region = norinori_regions(rng, p.rows, p.cols, dominoes)
            if region is not None and len(dominoes) >= 2 and len(solve_norinori(
                    [region[r * p.cols:(r + 1) * p.cols] for r in range(p.rows)], 2)) == 1:
                break
        shaded = {r * p.cols + c for domino in dominoes for r, c in domino}
        region = norinori_reshape(rng, p.rows, p.cols, region, shaded, p.reshapes)
        regions = relabel_regions([region[r * p.cols:(r + 1) * p.cols] for r in range(p.rows)])
        return self._render(p, regions, [cell for domino in dominoes for cell in domino])

    def _render(self, p: NorinoriParams, regions: list[list[int]],
                shaded: list[Cell]) -> tuple[str, str, dict[str, Any]]:
        grid_text = "\n".join(" ".join(REGION_LETTERS[v] for v in row) for row in regions)
        question = (
            f"Norinori on a {p.rows}x{p.cols} grid divided into regions (letters):\n{grid_text}\n"
            f"Shade cells so that every region holds exactly two shaded cells and every shaded "
            f"cell has exactly one shaded neighbour (up, down, left or right): the shaded cells "
            f"form dominoes, which may cross region borders, and no two dominoes touch side by "
            f"side.\nGive all shaded cells as (row,col) pairs, numbered from 0: the top-left "
            f"cell is (0,0), rows go down, columns go right."
        )
        return question, format_cells0(shaded), {"regions": regions}

    def check(self, instance: TaskInstance, answer: str) -> float:
        cells = parse_cells0(answer)
        if cells is None:
            return 0.0
        return 1.0 if norinori_valid(instance.metadata["regions"], cells) else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        regions = instance.metadata["regions"]
        rows, cols = len(regions), len(regions[0])
        cells = parse_cells0(instance.answer) or []
        taken = set(cells)
        free = [(r, c) for r in range(rows) for c in range(cols) if (r, c) not in taken]
        out = [format_cells0(cells[1:])]   # one shaded cell left out
        for _ in range(20):   # one shaded cell moved elsewhere
            moved = list(cells)
            moved[rng.randrange(len(moved))] = free[rng.randrange(len(free))]
            if not norinori_valid(regions, moved):
                out.append(format_cells0(moved))
                break
        return out


# --- numbrix ---------------------------------------------------------------------------------

def random_hamiltonian_path(rng: random.Random, n: int, moves: int) -> list[int]:
    """A random Hamiltonian path of the n x n grid (cells row-major): a serpentine walk changed
    by ``moves`` random backbites (link an end to a grid neighbour, cut the edge that closes a
    cycle) and then turned by a random symmetry of the square."""
    nbrs = grid_neighbors(n, n)
    path = [r * n + (c if r % 2 == 0 else n - 1 - c) for r in range(n) for c in range(n)]
    pos = [0] * (n * n)
    for k, i in enumerate(path):
        pos[i] = k
    last = n * n - 1
    for _ in range(moves):
        if rng.random() < 0.5:
            path.reverse()
            for k, i in enumerate(path):
                pos[i] = k
        end = path[last]
        options = [j for j in nbrs[end] if j != path[last - 1]]
        if not options:
            continue
        k = pos[rng.choice(options)]
        path[k + 1:] = path[:k:-1]
        for m in range(k + 1, n * n):
            pos[path[m]] = m
    transpose, flip_r, flip_c = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
    out = []
    for i in path:
        r, c = divmod(i, n)
        if transpose:
            r, c = c, r
        if flip_r:
            r = n - 1 - r
        if flip_c:
            c = n - 1 - c
        out.append(r * n + c)
    return out


@uniqueness_check
def solve_numbrix(givens: list[list[int]], limit: int = 2,
                  max_nodes: int | None = None) -> list[list[list[int]]] | None:
    """Up to ``limit`` fillings of an n x n numbrix grid (0 = empty) with 1..n*n, consecutive
    numbers orthogonally adjacent. The path grows from 1 upwards; each step must keep the next
    given number within reach (distance and parity), leave no empty cell stranded, and keep
    every empty cell reachable from the path's head. None when the search would take more than
    ``max_nodes`` steps (the count is then unknown)."""
    n = len(givens)
    total = n * n
    nbrs = grid_neighbors(n, n)
    cell_of = [-1] * (total + 1)
    value = [0] * total
    for r in range(n):
        for c in range(n):
            v = givens[r][c]
            if v:
                if not 1 <= v <= total or cell_of[v] >= 0:
                    return []
                cell_of[v] = r * n + c
                value[r * n + c] = v
    fixed = [cell_of[v] >= 0 for v in range(total + 1)]
    above = [0] * (total + 2)   # the nearest given number above each number (0: none)
    for v in range(total - 1, 0, -1):
        above[v] = v + 1 if fixed[v + 1] else above[v + 1]
    empty_left = [value.count(0)]
    found: list[list[list[int]]] = []
    budget = [max_nodes if max_nodes is not None else -1]

    def reachable(i: int, v: int) -> bool:
        target = above[v]
        if not target:
            return True
        j = cell_of[target]
        dist = abs(i // n - j // n) + abs(i % n - j % n)
        return dist <= target - v and (target - v - dist) % 2 == 0

    def blocked(prev: int, head: int, v: int) -> bool:
        """Whether, with ``v`` just placed at ``head``, some empty cell can no longer be filled:
        one beside ``prev`` with too few usable neighbours (empty cells, the head, givens not
        yet reached; it needs two, or one if it may take n*n), or any that the head cannot
        reach through empty cells and unreached givens."""
        last_free = not fixed[total]
        for f in nbrs[prev] if prev >= 0 else ():
            if value[f]:
                continue
            usable = sum(1 for j in nbrs[f] if not value[j] or j == head or value[j] > v)
            if usable == 0 or (usable == 1 and not last_free):
                return True
        seen = {head}
        stack = [head]
        empty_seen = 0
        while stack:
            for j in nbrs[stack.pop()]:
                w = value[j]
                if j not in seen and (not w or w > v):
                    seen.add(j)
                    stack.append(j)
                    empty_seen += not w
        return empty_seen < empty_left[0]

    def place(v: int, prev: int) -> None:
        # number v goes next to cell ``prev`` (that of v - 1; -1 when v is 1)
        budget[0] -= 1
        if budget[0] == 0:
            raise _OutOfBudget
        if v > total:
            found.append([value[r * n:(r + 1) * n] for r in range(n)])
            return
        if fixed[v]:
            i = cell_of[v]
            if (prev < 0 or i in nbrs[prev]) and not blocked(prev, i, v):
                place(v + 1, i)
            return
        for i in (nbrs[prev] if prev >= 0 else range(total)):
            if value[i] or not reachable(i, v):
                continue
            value[i] = v
            cell_of[v] = i
            empty_left[0] -= 1
            if not blocked(prev, i, v):
                place(v + 1, i)
            value[i] = 0
            cell_of[v] = -1
            empty_left[0] += 1
            if len(found) >= limit:
                return

    try:
        place(1, -1)
    except _OutOfBudget:
        return None
    return found


def reveal_where_solutions_differ(rng: random.Random, solution: list[list[int]], givens: list[list[int]],
                                  solve: Callable[[list[list[int]]], list | None]) -> list[list[int]]:
    """Copy cells of ``solution`` into ``givens`` until ``solve(givens)`` (a list of up to two
    solutions, or None when it gave up) proves the solution unique: each round reveals a cell
    where the other solution found differs, or a random hidden cell when the solver gave up."""
    n = len(solution)
    givens = [row[:] for row in givens]
    while True:
        solutions = solve(givens)
        if solutions is None:
            hidden = [(r, c) for r in range(n) for c in range(n) if not givens[r][c]]
        else:
            other = next((s for s in solutions if s != solution), None)
            if other is None:
                return givens
            hidden = [(r, c) for r in range(n) for c in range(n) if other[r][c] != solution[r][c]]
        r, c = hidden[rng.randrange(len(hidden))]
        givens[r][c] = solution[r][c]


def swap_two_cells(grid: list[list[int]], givens: list[list[int]], rng: random.Random) -> list[list[int]]:
    """``grid`` with the values of two different non-given cells exchanged."""
    n = len(grid)
    open_cells = [(r, c) for r in range(n) for c in range(n) if not givens[r][c]]
    (r1, c1), (r2, c2) = rng.sample(open_cells, 2)
    out = [row[:] for row in grid]
    out[r1][c1], out[r2][c2] = out[r2][c2], out[r1][c1]
    return out


def wrong_grids(task: SynthTask, instance: TaskInstance, rng: random.Random, givens: list[list[int]]) -> list[str]:
    """Certainly wrong grid answers: two open cells swapped (kept once ``check`` gives it 0), and
    one number changed into another that the grid already holds."""
    n = len(givens)
    gold = parse_grid(instance.answer, n, n)
    out = []
    open_cells = sum(not v for row in givens for v in row)
    for _ in range(10 if open_cells >= 2 else 0):
        text = format_grid(swap_two_cells(gold, givens, rng))
        if task.check(instance, text) == 0.0:
            out.append(text)
            break
    r, c = rng.randrange(n), rng.randrange(n)
    changed = [row[:] for row in gold]
    changed[r][c] = gold[r][c] % (n * n) + 1   # now repeats another number
    out.append(format_grid(changed))
    return out


@dataclass(frozen=True)
class NumbrixParams(LevelParams):
    size: int
    start_givens: int   # random cells shown before revealing until unique (more: easier)


NUMBRIX_NODE_BUDGET = 2000


class Numbrix(SynthTask):
    name = "numbrix"
    family = "grid"
    answer_example = "1 2 3\n4 5 6\n7 8 9"   # the format only: not a valid path
    levels = (NumbrixParams(3, 1), NumbrixParams(4, 2), NumbrixParams(5, 2), NumbrixParams(6, 10),
              NumbrixParams(6, 2))

    def build(self, rng: random.Random, p: NumbrixParams) -> tuple[str, str, dict[str, Any]]:
        n = p.size
        path = random_hamiltonian_path(rng, n, 10 * n * n)
        solution = [[0] * n for _ in range(n)]
        for k, i in enumerate(path):
            solution[i // n][i % n] = k + 1
        givens = [[0] * n for _ in range(n)]
        for i in rng.sample(range(n * n), p.start_givens):
            givens[i // n][i % n] = solution[i // n][i % n]
        givens = reveal_where_solutions_differ(rng, solution, givens,
                                               lambda g: solve_numbrix(g, 2, NUMBRIX_NODE_BUDGET))
        question = (
            f"Numbrix on a {n}x{n} grid: write the numbers 1 to {n * n} in the cells, each exactly "
            f"once, so that every number from 1 to {n * n - 1} is orthogonally adjacent (up, "
            f"down, left or right) to the next one: together they trace one path through all "
            f"cells. Some numbers are given; _ is an empty cell.\n{format_grid(givens, blank=0)}\n"
            f"{GRID_FORMAT}"
        )
        return question, format_grid(solution), {"givens": givens}

    def check(self, instance: TaskInstance, answer: str) -> float:
        givens = instance.metadata["givens"]
        n = len(givens)
        grid = parse_grid(answer, n, n)
        if grid is None or sorted(v for row in grid for v in row) != list(range(1, n * n + 1)):
            return 0.0
        if any(g and g != v for grow, row in zip(givens, grid) for g, v in zip(grow, row)):
            return 0.0
        where = {grid[r][c]: (r, c) for r in range(n) for c in range(n)}
        ok = all(abs(where[k][0] - where[k + 1][0]) + abs(where[k][1] - where[k + 1][1]) == 1
                 for k in range(1, n * n))
        return 1.0 if ok else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        return wrong_grids(self, instance, rng, instance.metadata["givens"])


# --- magic square ----------------------------------------------------------------------------

def magic_lines(n: int) -> list[list[int]]:
    """Cells (row-major) of the rows, the columns and the two main diagonals of an n x n square."""
    rows = [[r * n + c for c in range(n)] for r in range(n)]
    cols = [[r * n + c for r in range(n)] for c in range(n)]
    return rows + cols + [[i * n + i for i in range(n)], [i * n + n - 1 - i for i in range(n)]]


@uniqueness_check
def solve_magic(givens: list[list[int]], limit: int = 2,
                max_nodes: int | None = None) -> list[list[list[int]]] | None:
    """Up to ``limit`` magic squares (1..n*n once each, every row, column and main diagonal
    summing to n(n*n+1)/2) that agree with ``givens`` (0 = hidden); None when the search
    would take more than ``max_nodes`` steps (the count is then unknown)."""
    return magic_search(givens, limit, None, max_nodes)


def magic_search(givens: list[list[int]], limit: int, rng: random.Random | None,
                 max_nodes: int | None) -> list[list[list[int]]] | None:
    """The search behind ``solve_magic``: fills the line with the fewest open cells first (its
    last cell is forced) and bounds every line's open cells by the smallest and largest sums
    the unused numbers allow. ``rng`` shuffles the order numbers are tried in (to draw a
    random square)."""
    n = len(givens)
    total = n * n
    target = n * (total + 1) // 2
    lines = magic_lines(n)
    lines_of = [[k for k, line in enumerate(lines) if i in line] for i in range(total)]
    grid = [v for row in givens for v in row]
    used = [False] * (total + 1)
    for v in grid:
        if v:
            if not 1 <= v <= total or used[v]:
                return []
            used[v] = True
    found: list[list[list[int]]] = []
    budget = [max_nodes if max_nodes is not None else -1]

    def line_ok(k: int, free: list[int]) -> bool:
        known = open_cells = 0
        for i in lines[k]:
            if grid[i]:
                known += grid[i]
            else:
                open_cells += 1
        rest = target - known
        if not open_cells:
            return rest == 0
        return sum(free[:open_cells]) <= rest <= sum(free[len(free) - open_cells:])

    def search() -> None:
        budget[0] -= 1
        if budget[0] == 0:
            raise _OutOfBudget
        free = [v for v in range(1, total + 1) if not used[v]]
        if not free:
            found.append([grid[r * n:(r + 1) * n] for r in range(n)])
            return
        if not all(line_ok(k, free) for k in range(len(lines))):
            return
        best, best_open = None, total + 1
        for line in lines:
            open_here = [i for i in line if not grid[i]]
            if open_here and len(open_here) < best_open:
                best, best_open = line, len(open_here)
        open_here = [i for i in best if not grid[i]]
        if best_open == 1:
            cell = open_here[0]
            forced = target - sum(grid[i] for i in best)
            candidates = [forced] if 1 <= forced <= total and not used[forced] else []
        else:   # the open cell of this line that lies on the most lines
            cell = max(open_here, key=lambda i: (len(lines_of[i]), -i))
            candidates = free[:]
            if rng is not None:
                rng.shuffle(candidates)
        for v in candidates:
            grid[cell] = v
            used[v] = True
            search()
            grid[cell] = 0
            used[v] = False
            if len(found) >= limit:
                return

    try:
        search()
    except _OutOfBudget:
        return None
    return found


def random_magic_square(rng: random.Random, n: int) -> list[list[int]]:
    """A random magic square of order n. Odd prime n >= 5: n*A + B + 1 for two orthogonal
    linear Latin squares A, B (every row, column and diagonal of each holds 0..n-1 once) with
    their symbols shuffled; otherwise a randomised solver search from an empty square. Then a
    random symmetry of the square, and with probability 1/2 the complement (k -> n*n + 1 - k)."""
    if n >= 5 and all(n % d for d in range(2, n)):
        units = [(a, b) for a in range(1, n) for b in range(1, n) if (a + b) % n and (a - b) % n]
        while True:
            (a1, b1), (a2, b2) = rng.choice(units), rng.choice(units)
            if (a1 * b2 - a2 * b1) % n:
                break
        sigma, tau = rng.sample(range(n), n), rng.sample(range(n), n)
        square = [[n * sigma[(a1 * r + b1 * c) % n] + tau[(a2 * r + b2 * c) % n] + 1 for c in range(n)]
                  for r in range(n)]
    else:
        square = None
        while not square:   # restart a search that wanders: most finish in a few hundred steps
            square = magic_search([[0] * n for _ in range(n)], 1, rng, 300)
        square = square[0]
    if rng.random() < 0.5:
        square = [list(row) for row in zip(*square)]
    if rng.random() < 0.5:
        square = square[::-1]
    if rng.random() < 0.5:
        square = [row[::-1] for row in square]
    if rng.random() < 0.5:
        square = [[n * n + 1 - v for v in row] for row in square]
    return square


def is_magic(grid: list[list[int]]) -> bool:
    n = len(grid)
    if sorted(v for row in grid for v in row) != list(range(1, n * n + 1)):
        return False
    flat = [v for row in grid for v in row]
    target = n * (n * n + 1) // 2
    return all(sum(flat[i] for i in line) == target for line in magic_lines(n))


MAGIC_NODE_BUDGET = 1000


@dataclass(frozen=True)
class MagicSquareParams(LevelParams):
    size: int
    hidden: int   # cells hidden at first; some come back until the square is unique


class MagicSquare(SynthTask):
    name = "magic_square"
    family = "arithmetic"
    answer_example = "1 2 3\n4 5 6\n7 8 9"   # the format only: not magic
    levels = (MagicSquareParams(3, 5), MagicSquareParams(3, 7), MagicSquareParams(4, 8),
              MagicSquareParams(4, 11), MagicSquareParams(5, 16))

    def build(self, rng: random.Random, p: MagicSquareParams) -> tuple[str, str, dict[str, Any]]:
        n = p.size
        square = random_magic_square(rng, n)
        givens = [row[:] for row in square]
        for i in rng.sample(range(n * n), p.hidden):
            givens[i // n][i % n] = 0
        givens = reveal_where_solutions_differ(rng, square, givens,
                                               lambda g: solve_magic(g, 2, MAGIC_NODE_BUDGET))
        target = n * (n * n + 1) // 2
        question = (
            f"Complete this {n}x{n} magic square: fill the blanks (_) so that the numbers 1 to "
            f"{n * n} each appear exactly once and every row, every column and both main "
            f"diagonals add up to {target}.\n{format_grid(givens, blank=0)}\n"
            f"Give the completed square: one row per line, numbers separated by spaces."
        )
        return question, format_grid(square), {"givens": givens}

    def check(self, instance: TaskInstance, answer: str) -> float:
        givens = instance.metadata["givens"]
        n = len(givens)
        grid = parse_grid(answer, n, n)
        if grid is None or not is_magic(grid):
            return 0.0
        ok = all(g == 0 or g == v for grow, row in zip(givens, grid) for g, v in zip(grow, row))
        return 1.0 if ok else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        return wrong_grids(self, instance, rng, instance.metadata["givens"])
