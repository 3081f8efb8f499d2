"""Zebra puzzles, compass directions and nested layouts: deterministic instances whose answers
an independent solver in this file re-derives (brute force for zebra puzzles, the question text
alone for the spatial tasks), tolerant answer spellings, and wrong answers or garbage scored 0."""
import itertools
import random
import re

import pytest

from tasks.synth.base import TaskInstance
from tasks.synth.spatial import (
    SpaceReasoning,
    SpaceReasoningTree,
    ZebraPuzzle,
    count_zebra_solutions,
    parse_direction,
    solve_zebra,
)

TASKS = [ZebraPuzzle(), SpaceReasoning(), SpaceReasoningTree()]
GARBAGE = [None, 12, "", "</think>", "no tags", "<answer></answer>", "<answer>((((</answer>",
           "<answer>1/0</answer>", "<answer>A=1, A=2</answer>", "<answer>9" * 50,
           "<answer>(1,2), (3,4)</answer>", "<answer>1 2 3 4 5</answer>", "<answer>\ud800\x00</answer>",
           "<answer>north-east and south-west</answer>", "<answer>left or right</answer>",
           "<answer>house 2 or 3</answer>", "<answer>" + "x" * 500 + "</answer>"]


def _names(task):
    return task.name


# --- the generic contract ------------------------------------------------------------------

@pytest.mark.parametrize("task", TASKS, ids=_names)
def test_gold_accepted_perturbations_and_garbage_rejected(task):
    for level in range(task.n_levels):
        for seed in range(4):
            inst = task.generate(seed, level)
            for wrapper in ("<answer>{}</answer>", "<think><answer>no</answer></think> <ANSWER>\n{}\n</Answer>",
                            "<answer>draft</answer> so <answer>{}"):
                assert task.verify(inst, wrapper.format(inst.answer)) == 1.0
            wrong = task.perturbations(inst, random.Random(seed))
            assert wrong
            for answer in wrong:
                assert answer.strip() != inst.answer.strip()
                assert task.verify(inst, f"<answer>{answer}</answer>") == 0.0, (answer, inst.answer)
            for response in GARBAGE:
                assert task.verify_strict(inst, response) == 0.0, response


# --- zebra puzzle --------------------------------------------------------------------------

def _holds(clue, pos):
    """The clue semantics, written again: pos maps an item to its 0-based house."""
    kind, a, b = clue
    if kind == "at":
        return pos[a] == b
    if kind == "not_at":
        return pos[a] != b
    if kind == "same":
        return pos[a] == pos[b]
    if kind == "diff":
        return pos[a] != pos[b]
    if kind == "left":
        return pos[a] < pos[b]
    if kind == "right":
        return pos[a] > pos[b]
    if kind == "adjacent_left":
        return pos[b] - pos[a] == 1
    if kind == "next":
        return abs(pos[a] - pos[b]) == 1
    raise AssertionError(kind)


def _brute_force(houses, categories, clues):
    perms = list(itertools.permutations(range(houses)))
    found = []
    for combo in itertools.product(perms, repeat=categories):
        pos = [h for perm in combo for h in perm]
        if all(_holds(c, pos) for c in clues):
            found.append(tuple(pos))
    return found


def _hidden(meta):
    n, cats, values = meta["houses"], meta["categories"], meta["values"]
    return [next(h for h in range(n) if meta["solution"][h][cat] == values[c][v])
            for c, cat in enumerate(cats) for v in range(n)]


def test_zebra_solver_agrees_with_brute_force_on_random_clue_sets():
    rng = random.Random(5)
    kinds = ["same", "diff", "left", "right", "adjacent_left", "next", "at", "not_at"]
    for _ in range(60):
        n, k = rng.choice([(3, 2), (3, 3), (4, 2)])
        clues = []
        for _ in range(rng.randint(0, 6)):
            kind = rng.choice(kinds)
            a = rng.randrange(n * k)
            if kind in ("at", "not_at"):
                clues.append([kind, a, rng.randrange(n)])
            else:
                b = rng.choice([x for x in range(n * k) if x // n != a // n])
                clues.append([kind, a, b])
        brute = _brute_force(n, k, clues)
        assert count_zebra_solutions(n, k, clues, limit=1000) == len(brute)
        assert sorted(solve_zebra(n, k, clues, limit=1000)) == sorted(brute)


def test_zebra_clues_have_exactly_one_solution_and_none_is_redundant():
    task = ZebraPuzzle()
    for level in range(task.n_levels):
        for seed in range(2):
            inst = task.generate(seed, level)
            meta = inst.metadata
            n, k, clues = meta["houses"], len(meta["categories"]), meta["clues"]
            hidden = _hidden(meta)
            assert all(_holds(c, hidden) for c in clues)
            assert solve_zebra(n, k, clues, limit=2) == [tuple(hidden)]
            if level <= 2:   # small enough to enumerate every assignment
                assert _brute_force(n, k, clues) == [tuple(hidden)]
            if seed == 0:
                for i in range(len(clues)):
                    assert count_zebra_solutions(n, k, clues[:i] + clues[i + 1:]) == 2
            assert len(re.findall(r"^\d+\. ", inst.question, re.MULTILINE)) == len(clues)


def test_zebra_answer_matches_the_solution():
    task = ZebraPuzzle()
    for seed in range(30):
        inst = task.generate(seed, 3)
        meta = inst.metadata
        if meta["ask"] == "house":
            assert 1 <= int(inst.answer) <= meta["houses"]
        else:
            column = [house[meta["ask"]] for house in meta["solution"]]
            assert inst.answer in column


def test_zebra_accepts_usual_spellings():
    task = ZebraPuzzle()
    house = TaskInstance(task="zebra_puzzle", level=0, seed=0, question="", prompt="", answer="3",
                         metadata={"ask": "house", "houses": 4, "categories": [], "values": []})
    for text in ("3", "House 3", "house #3.", "3rd", "third", "House number 3"):
        assert task.verify(house, f"<answer>{text}</answer>") == 1.0, text
    for text in ("2", "house 4", "3 or 4", "33", "second"):
        assert task.verify(house, f"<answer>{text}</answer>") == 0.0, text
    pet = TaskInstance(task="zebra_puzzle", level=0, seed=0, question="", prompt="", answer="fish",
                       metadata={"ask": "pet", "houses": 3, "categories": ["name", "pet"],
                                 "values": [["Alice", "Bob", "Carol"], ["cat", "dog", "fish"]]})
    for text in ("fish", "The fish.", "  FISH ", "a fish"):
        assert task.verify(pet, f"<answer>{text}</answer>") == 1.0, text
    for text in ("cat", "fish or cat", "goldfish"):
        assert task.verify(pet, f"<answer>{text}</answer>") == 0.0, text
    name = TaskInstance(task="zebra_puzzle", level=0, seed=0, question="", prompt="", answer="Alice",
                        metadata={"ask": "name", "houses": 3, "categories": ["name"],
                                  "values": [["Alice", "Bob", "Carol"]]})
    assert task.verify(name, "<answer>alice.</answer>") == 1.0
    assert task.verify(name, "<answer>Bob</answer>") == 0.0


# --- space reasoning -----------------------------------------------------------------------

_EXACT = re.compile(r"^The (.+?) is (\d+) units? (north|south|east|west)"
                    r"(?: and (\d+) units? (north|south|east|west))? of the (.+?)\.$")
_DIRECTLY = re.compile(r"^The (.+?) is directly (north|south|east|west) of the (.+?), at an unknown distance\.$")
_SOMEWHERE = re.compile(r"^The (.+?) is somewhere to the (north|south)-(east|west) of the (.+?)\.$")
_UNIT = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}


def _space_answer_from_text(question):
    """Every compass answer the statements allow, found by trying extreme unknown distances."""
    edges = {}   # (a, b) -> (x terms, y terms) of a - b; a term is an int or ("free", sign, unknown)
    n_statements = 0
    for line in question.splitlines():
        free = [("free", 0, 2 * n_statements), ("free", 0, 2 * n_statements + 1)]
        if m := _EXACT.match(line):
            a, b = m.group(1), m.group(6)
            dx = dy = 0
            for amount, word in ((m.group(2), m.group(3)), (m.group(4), m.group(5))):
                if amount:
                    dx += int(amount) * _UNIT[word][0]
                    dy += int(amount) * _UNIT[word][1]
            offset = ([dx], [dy])
        elif m := _DIRECTLY.match(line):
            a, word, b = m.groups()
            ux, uy = _UNIT[word]
            offset = ([("free", ux, free[0][2])] if ux else [0], [("free", uy, free[1][2])] if uy else [0])
        elif m := _SOMEWHERE.match(line):
            a, ns, ew, b = m.groups()
            offset = ([("free", _UNIT[ew][0], free[0][2])], [("free", _UNIT[ns][1], free[1][2])])
        else:
            continue
        n_statements += 1
        edges[(a, b)] = offset
        edges[(b, a)] = tuple([-t if isinstance(t, int) else ("free", -t[1], t[2]) for t in axis]
                              for axis in offset)
    u, w = re.search(r"In which direction is the (.+?) from the (.+?)\?", question).groups()
    objects = sorted({a for a, _ in edges})
    assert n_statements == len(objects) - 1   # a tree: one way to relate any two objects
    # walk from w to u collecting the terms of u - w
    paths = {w: ([], [])}
    todo = [w]
    while todo:
        here = todo.pop()
        for (a, b), (tx, ty) in edges.items():
            if b == here and a not in paths:
                paths[a] = (paths[here][0] + tx, paths[here][1] + ty)
                todo.append(a)
    assert set(paths) == set(objects)
    tx, ty = paths[u]
    free_ids = sorted({t[2] for t in tx + ty if not isinstance(t, int)})
    outcomes = set()
    for choice in itertools.product((0.001, 1000.0), repeat=len(free_ids)):
        amount = dict(zip(free_ids, choice))

        def total(terms, amount=amount):
            return sum(t if isinstance(t, int) else t[1] * amount[t[2]] for t in terms)

        x, y = total(tx), total(ty)
        outcomes.add(((x > 0) - (x < 0), (y > 0) - (y < 0)))
    names = {(0, 1): "north", (1, 1): "north-east", (1, 0): "east", (1, -1): "south-east",
             (0, -1): "south", (-1, -1): "south-west", (-1, 0): "west", (-1, 1): "north-west",
             (0, 0): "same place"}
    return {names[o] for o in outcomes}


def test_space_answer_follows_from_the_statements_alone():
    task = SpaceReasoning()
    vague_seen = 0
    for level in range(task.n_levels):
        for seed in range(15):
            inst = task.generate(seed, level)
            assert _space_answer_from_text(inst.question) == {inst.answer}, (level, seed)
            vague_seen += "unknown" in inst.question or "somewhere" in inst.question
            params = task.levels[level]
            assert inst.question.count("\nThe ") == params.objects - 1
    assert vague_seen > 20


def test_space_accepts_usual_direction_spellings():
    task = SpaceReasoning()
    inst = TaskInstance(task="space_reasoning", level=0, seed=0, question="", prompt="",
                        answer="north-east", metadata={})
    for text in ("north-east", "northeast", "North East", "NE", "n.e.", "North-East.", "due northeast"):
        assert task.verify(inst, f"<answer>{text}</answer>") == 1.0, text
    for text in ("north", "east", "south-west", "NW", "north-east-east", "the north-east corner", "EN"):
        assert task.verify(inst, f"<answer>{text}</answer>") == 0.0, text
    assert parse_direction("W") == "west" and parse_direction("south") == "south"


# --- space reasoning tree ------------------------------------------------------------------

_PARTS = re.compile(r"^(.+?) (?:is divided into|holds the pictures): (.+)\.$")
_RELATION = re.compile(r"^(.+?) is (left of|right of|above|below) (.+?)\.$")


def _tree_answers_from_text(question):
    parent, after = {}, {"row": {}, "column": {}}
    lines = question.splitlines()[1:]   # the first line states the rules
    for line in lines:
        if m := _PARTS.match(line):
            whole = m.group(1).lower()
            for part in re.split(r", | and ", m.group(2)):
                assert part.lower() not in parent
                parent[part.lower()] = whole
    for line in lines:
        if (m := _RELATION.match(line)) and not _PARTS.match(line):
            a, word, b = m.group(1).lower(), m.group(2), m.group(3).lower()
            axis = "row" if word in ("left of", "right of") else "column"
            first, second = (a, b) if word in ("left of", "above") else (b, a)
            assert parent[first] == parent[second]   # only parts of one region are compared
            after[axis].setdefault(first, []).append(second)
    a, c = (s.lower() for s in re.search(r"Where is (.+?) relative to (.+?)\?", question).groups())

    def chain(x):
        out = [x]
        while out[-1] in parent:
            out.append(parent[out[-1]])
        return out

    ca, cc = chain(a), chain(c)
    assert ca[-1] == cc[-1] == "the board"
    common = next(x for x in ca if x in cc)
    x, y = ca[ca.index(common) - 1], cc[cc.index(common) - 1]

    def reaches(axis, start, goal):
        seen, todo = {start}, [start]
        while todo:
            for nxt in after[axis].get(todo.pop(), []):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    found = set()
    for axis, (word_before, word_after) in (("row", ("left", "right")), ("column", ("above", "below"))):
        if reaches(axis, x, y):
            found.add(word_before)
        if reaches(axis, y, x):
            found.add(word_after)
    return found, ca.index(common)


def test_tree_answer_follows_from_the_statements_alone():
    task = SpaceReasoningTree()
    split_depths = set()
    for level in range(task.n_levels):
        for seed in range(15):
            inst = task.generate(seed, level)
            found, depth_below_split = _tree_answers_from_text(inst.question)
            assert found == {inst.answer}, (level, seed)
            assert depth_below_split >= 2       # the pictures sit in different regions
            split_depths.add((level, depth_below_split))
    assert len(split_depths) > task.n_levels    # the split happens at different depths


def test_tree_accepts_usual_relation_spellings():
    task = SpaceReasoningTree()
    inst = TaskInstance(task="space_reasoning_tree", level=0, seed=0, question="", prompt="",
                        answer="left", metadata={})
    for text in ("left", "Left.", "to the left", "left of", "LEFT", "on the left"):
        assert task.verify(inst, f"<answer>{text}</answer>") == 1.0, text
    for text in ("right", "above", "left and above", "leftward", "below left"):
        assert task.verify(inst, f"<answer>{text}</answer>") == 0.0, text
