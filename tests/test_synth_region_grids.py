"""Norinori, numbrix and magic square: seeded generation, unique solutions (checked against
brute force where it is cheap), verifiers that accept any valid answer and reject rule breaks,
perturbations and garbage."""
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_synth_properties import PROPERTY_SETTINGS, WRAPPERS, garbage

from tasks.synth.base import TaskInstance, parse_pairs
from tasks.synth.region_grids import (
    NEIGHBORS_4,
    MagicSquare,
    Norinori,
    Numbrix,
    grid_neighbors,
    magic_lines,
    norinori_valid,
    random_hamiltonian_path,
    random_magic_square,
    solve_magic,
    solve_norinori,
    solve_numbrix,
)

TASKS = [Norinori(), Numbrix(), MagicSquare()]
SMALL = settings(PROPERTY_SETTINGS, max_examples=8)


def hand_instance(task, metadata, answer=""):
    return TaskInstance(task=task.name, level=0, seed=0, question="", prompt="", answer=answer,
                        metadata=metadata)


def grid_of(text):
    return [[int(v) for v in line.split()] for line in text.splitlines()]


# --- the generic contract ----------------------------------------------------------------------

@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_gold_accepted_under_every_wrapper_and_perturbations_rejected(task):
    for seed in range(3):
        for level in range(task.n_levels):
            inst = task.generate(seed, level)
            for wrapper in WRAPPERS:
                assert task.verify(inst, wrapper.format(inst.answer)) == 1.0
            wrong = task.perturbations(inst, random.Random(seed))
            assert wrong
            for answer in wrong:
                assert answer.strip() != inst.answer.strip()
                assert task.verify(inst, f"<answer>{answer}</answer>") == 0.0, (answer, inst.answer)


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_garbage_scores_zero_and_never_raises(task):
    instances = [task.generate(s, lv) for s in range(2) for lv in (0, task.n_levels - 1)]
    fixed = ["", "hello", None, 7, "<answer></answer>", "<answer>((((</answer>", "<answer>1/0</answer>",
             "<answer>A=1, A=2</answer>", "<answer>9" * 50, "</think>", "<answer>(0,0), (0,1)</answer>",
             "<answer>(-1,0), (0,-1), (99,99), (3,3)</answer>", "<answer>(1,1), (1,1)</answer>",
             "<answer>" + " ".join(map(str, range(1, 37))) + "</answer>",
             "<answer>" + " ".join(map(str, range(1, 26))) + "</answer>",
             "<answer>" + " ".join(["1"] * 16) + "</answer>",
             "<answer>" + " ".join(map(str, range(-5, 20))) + "</answer>"]
    for inst in instances:
        for response in fixed:
            assert task.verify_strict(inst, response) == 0.0, response

    @SMALL
    @given(index=st.integers(0, len(instances) - 1), response=garbage)
    def prop(index, response):
        score = task.verify_strict(instances[index], response)
        assert 0.0 <= score <= 1.0
        if score > 0:
            assert response is not None and "<answer>" in response.lower()

    prop()


# --- norinori ----------------------------------------------------------------------------------

def domino_shadings(rows, cols):
    """Every shading of a rows x cols grid whose shaded cells form dominoes touching no other
    domino side by side (brute force, independent of the solver)."""
    out, state = [], [[0] * cols for _ in range(rows)]

    def fine(r, c):
        k = sum(state[r + dr][c + dc] for dr, dc in NEIGHBORS_4 if 0 <= r + dr < rows and 0 <= c + dc < cols)
        return k == 1

    def rec(i):
        if i == rows * cols:
            cells = [(r, c) for r in range(rows) for c in range(cols) if state[r][c]]
            if all(fine(r, c) for r, c in cells):
                out.append(cells)
            return
        r, c = divmod(i, cols)
        for v in (0, 1):
            state[r][c] = v
            # the cell above is final now: a shaded one needs exactly one shaded neighbour
            if r == 0 or not state[r - 1][c] or fine(r - 1, c):
                rec(i + 1)
        state[r][c] = 0

    rec(0)
    return out


def test_norinori_solution_is_unique_by_brute_force():
    task = Norinori()
    shadings = domino_shadings(4, 4)
    for seed in range(6):
        inst = task.generate(seed, 0)
        regions = inst.metadata["regions"]
        valid = [cells for cells in shadings if norinori_valid(regions, cells)]
        assert len(valid) == 1
        assert task.verify(inst, "<answer>" + ", ".join(f"({r},{c})" for r, c in valid[0]) + "</answer>") == 1.0


def test_norinori_solver_agrees_with_brute_force_on_random_regions():
    shadings = domino_shadings(4, 4)
    rng = random.Random(5)
    nbrs = grid_neighbors(4, 4)
    for _ in range(15):
        region = [-1] * 16
        seeds = rng.sample(range(16), rng.randint(2, 5))
        for k, i in enumerate(seeds):
            region[i] = k
        while -1 in region:
            i = rng.choice([i for i in range(16) if region[i] < 0 and any(region[j] >= 0 for j in nbrs[i])])
            region[i] = rng.choice([region[j] for j in nbrs[i] if region[j] >= 0])
        regions = [region[r * 4:(r + 1) * 4] for r in range(4)]
        truth = sum(norinori_valid(regions, cells) for cells in shadings)
        assert len(solve_norinori(regions, limit=10 ** 6)) == truth


def test_norinori_generated_puzzles_have_one_solution_and_regions_hold_two():
    task = Norinori()
    for level in range(task.n_levels):
        for seed in range(2):
            inst = task.generate(seed, level)
            regions = inst.metadata["regions"]
            assert solve_norinori(regions, limit=3) == [sorted(parse_pairs(inst.answer))]
            assert all(sum(regions[r][c] == k for r, c in parse_pairs(inst.answer)) == 2
                       for k in {v for row in regions for v in row})
            letters = inst.question.split("(letters):\n")[1].split("\nShade")[0].splitlines()
            assert len(letters) == len(regions)


def test_norinori_accepts_any_valid_shading_and_other_formatting():
    task = Norinori()
    inst = hand_instance(task, {"regions": [[0, 0, 1, 1], [0, 0, 1, 1]]})
    for answer in ("(0,0), (0,1), (1,2), (1,3)", "(0,0), (1,0), (0,3), (1,3)",
                   "(1,3),(1,2)\n(0,1) ,  ( 0 , 0 )", "[(0, 0), (1, 0), (0, 3), (1, 3)]"):
        assert task.verify(inst, f"<answer>{answer}</answer>") == 1.0, answer
    gold = task.generate(1, 2)
    reordered = ", ".join(reversed(gold.answer.split(", ")))
    assert task.verify(gold, f"<answer>\n{reordered}\n</answer>") == 1.0


def test_norinori_rejects_rule_breaks():
    task = Norinori()
    inst = hand_instance(task, {"regions": [[0, 0, 1, 1], [0, 0, 1, 1]]})
    for answer in ("(0,0), (0,1), (0,2), (0,3)",           # two dominoes touch side by side
                   "(0,0), (1,1), (0,2), (1,3)",           # lone shaded cells
                   "(0,0), (0,1)",                         # a region without shading
                   "(0,0), (0,1), (1,0), (1,2), (1,3)",    # three shaded in a region
                   "(0,0), (0,1), (1,2), (1,3), (1,3)",    # a cell twice
                   "(0,0), (0,1), (1,2), (1,3), (2,3)"):   # off the grid
        assert task.verify(inst, f"<answer>{answer}</answer>") == 0.0, answer
    gold = task.generate(2, 1)
    cells = gold.answer.split(", ")
    assert task.verify(gold, "<answer>" + ", ".join(cells[:-1]) + "</answer>") == 0.0
    # 1-based coordinates of the same shading are another (wrong) shading
    one_based = ", ".join(f"({r + 1},{c + 1})" for r, c in
                          (map(int, cell.strip("()").split(",")) for cell in cells))
    assert task.verify(gold, f"<answer>{one_based}</answer>") == 0.0


# --- numbrix -----------------------------------------------------------------------------------

def all_numbrix_fillings(n):
    nbrs = grid_neighbors(n, n)
    out = []

    def extend(path, used):
        if len(path) == n * n:
            grid = [0] * (n * n)
            for k, i in enumerate(path):
                grid[i] = k + 1
            out.append(grid)
            return
        for j in nbrs[path[-1]]:
            if not used[j]:
                used[j] = True
                path.append(j)
                extend(path, used)
                path.pop()
                used[j] = False

    for start in range(n * n):
        used = [False] * (n * n)
        used[start] = True
        extend([start], used)
    return out


def test_numbrix_paths_are_hamiltonian_and_varied():
    for n in (3, 5, 6):
        seen = set()
        for seed in range(5):
            path = random_hamiltonian_path(random.Random(seed), n, 10 * n * n)
            assert sorted(path) == list(range(n * n))
            assert all(abs(a // n - b // n) + abs(a % n - b % n) == 1 for a, b in itertools.pairwise(path))
            seen.add(tuple(path))
        assert len(seen) == 5


def test_numbrix_solution_is_unique_by_brute_force():
    task = Numbrix()
    fillings = all_numbrix_fillings(4)
    assert len(fillings) == 552
    for seed in range(6):
        inst = task.generate(seed, 1)
        givens = [v for row in inst.metadata["givens"] for v in row]
        matching = [f for f in fillings if all(g in (0, v) for g, v in zip(givens, f))]
        assert matching == [[v for row in grid_of(inst.answer) for v in row]]


def test_numbrix_solver_agrees_with_brute_force_and_gives_up_on_budget():
    fillings = all_numbrix_fillings(4)
    rng = random.Random(2)
    for _ in range(25):
        filling = rng.choice(fillings)
        shown = rng.sample(range(16), rng.randint(1, 5))
        givens = [[filling[r * 4 + c] if r * 4 + c in shown else 0 for c in range(4)] for r in range(4)]
        truth = sum(all(givens[i // 4][i % 4] in (0, f[i]) for i in range(16)) for f in fillings)
        assert len(solve_numbrix(givens, limit=10 ** 6)) == truth
    assert solve_numbrix([[0] * 6 for _ in range(6)], limit=10 ** 6, max_nodes=50) is None


def test_numbrix_generated_puzzles_have_one_solution():
    task = Numbrix()
    for level in range(task.n_levels):
        inst = task.generate(11, level)
        assert solve_numbrix(inst.metadata["givens"], limit=3) == [grid_of(inst.answer)]


def test_numbrix_accepts_any_valid_filling_and_rejects_rule_breaks():
    task = Numbrix()
    inst = hand_instance(task, {"givens": [[1, 0, 0], [0, 0, 0], [0, 0, 0]]})
    for answer in ("1 2 3\n6 5 4\n7 8 9", "1 6 7\n2 5 8\n3 4 9", "[[1, 2, 3], [6, 5, 4], [7, 8, 9]]",
                   "1 2 3 6 5 4 7 8 9"):
        assert task.verify(inst, f"<answer>{answer}</answer>") == 1.0, answer
    for answer in ("1 2 3\n4 5 6\n7 8 9",      # 3 and 4 not adjacent
                   "9 8 7\n4 5 6\n3 2 1",      # breaks the given 1
                   "1 2 3\n6 5 4\n7 8 8",      # 9 missing
                   "1 2 3\n6 5 4\n7 8",        # short
                   "1 2 3\n6 5 4\n7 8 9 10"):  # long
        assert task.verify(inst, f"<answer>{answer}</answer>") == 0.0, answer
    gold = task.generate(5, 2)
    spaced = "\n\n".join("  ".join(line.split()) + "  " for line in gold.answer.splitlines())
    assert task.verify(gold, f"<answer>{spaced}</answer>") == 1.0


# --- magic square ------------------------------------------------------------------------------

def test_magic_squares_are_magic_and_varied():
    for n in (3, 4, 5):
        squares = set()
        for seed in range(12):
            square = random_magic_square(random.Random(seed), n)
            flat = [v for row in square for v in row]
            assert sorted(flat) == list(range(1, n * n + 1))
            assert {sum(flat[i] for i in line) for line in magic_lines(n)} == {n * (n * n + 1) // 2}
            squares.add(tuple(flat))
        assert len(squares) >= (6 if n == 3 else 12)


def test_magic_solver_counts_all_3x3_squares():
    assert len(solve_magic([[0] * 3 for _ in range(3)], limit=100)) == 8
    assert solve_magic([[0] * 4 for _ in range(4)], limit=10 ** 6, max_nodes=100) is None


def test_magic_square_solution_is_unique_by_brute_force():
    task = MagicSquare()
    target = 34
    for seed in range(2):
        inst = task.generate(seed, 2)   # 4x4, at most 8 hidden cells
        givens = [v for row in inst.metadata["givens"] for v in row]
        holes = [i for i, v in enumerate(givens) if not v]
        missing = sorted(set(range(1, 17)) - set(givens))
        count = 0
        for perm in itertools.permutations(missing):
            grid = givens[:]
            for i, v in zip(holes, perm):
                grid[i] = v
            count += all(sum(grid[i] for i in line) == target for line in magic_lines(4))
        assert count == 1


def test_magic_generated_puzzles_have_one_solution():
    task = MagicSquare()
    for level in range(task.n_levels):
        inst = task.generate(7, level)
        assert solve_magic(inst.metadata["givens"], limit=3) == [grid_of(inst.answer)]


def test_magic_square_accepts_any_valid_square_and_rejects_rule_breaks():
    task = MagicSquare()
    inst = hand_instance(task, {"givens": [[0, 0, 0], [0, 5, 0], [0, 0, 0]]})
    for answer in ("2 7 6\n9 5 1\n4 3 8", "4 9 2\n3 5 7\n8 1 6", "8,1,6;3,5,7;4,9,2", "6 1 8 7 5 3 2 9 4"):
        assert task.verify(inst, f"<answer>{answer}</answer>") == 1.0, answer
    for answer in ("2 7 6\n9 5 1\n4 8 3",      # columns and diagonal off
                   "1 2 3\n4 5 6\n7 8 9",      # only the middle row and column and diagonals add up
                   "5 5 5\n5 5 5\n5 5 5",      # every line 15, but numbers repeat
                   "2 7 6\n9 5 1\n4 3",        # short
                   "4 9 2\n3 5 7\n8 1 6 0"):   # long
        assert task.verify(inst, f"<answer>{answer}</answer>") == 0.0, answer
    corner = hand_instance(task, {"givens": [[2, 0, 0], [0, 0, 0], [0, 0, 0]]})
    assert task.verify(corner, "<answer>4 9 2\n3 5 7\n8 1 6</answer>") == 0.0   # breaks the given 2
    gold = task.generate(3, 4)
    assert task.verify(gold, "<answer>" + " ,".join(gold.answer.split()) + "</answer>") == 1.0
