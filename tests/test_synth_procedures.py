"""Procedure tasks: water buckets, dyck reasoning errors, wordscapes. Determinism, solvability
and uniqueness, gold and alternative answers accepted, rule breaks and garbage scored 0."""
import itertools
import random
import re
from collections import deque

import pytest

from tasks.synth.base import TaskInstance
from tasks.synth.language import CLOSER, OPENERS
from tasks.synth.procedures import (
    VOCABULARY,
    Buckets,
    DyckReasoningErrors,
    Wordscapes,
    apply_move,
    jug_moves,
    slot_cells,
    solve_wordscape,
)

BUCKETS, DYCK, WORDS = Buckets(), DyckReasoningErrors(), Wordscapes()
TASKS = [BUCKETS, DYCK, WORDS]
GARBAGE = [None, "", "no tags", "<answer></answer>", "<answer>((((</answer>", "<answer>1/0</answer>",
           "<answer>A=1, A=2</answer>", "<answer>" + "9" * 50, "<answer>(1,2), (3,4)</answer>",
           "<answer>-3, 0, 99</answer>", "<answer>fill</answer>", "<answer>pour A A</answer>",
           "<answer>ÄÖÜ, ß</answer>", "<answer>\x00</answer>", "<answer>[1, 2]</answer>", "</think>"]


def answer(text: str) -> str:
    return f"<answer>{text}</answer>"


# --- the contract every task keeps -------------------------------------------------------------

@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_gold_accepted_perturbations_and_garbage_rejected(task):
    for level in range(task.n_levels):
        for seed in range(4):
            inst = task.generate(seed, level)
            assert task.verify(inst, answer(inst.answer)) == 1.0
            assert task.verify(inst, f"<think>x</think> so <ANSWER>\n{inst.answer}\n</Answer>") == 1.0
            wrong = task.perturbations(inst, random.Random(seed))
            assert wrong
            for text in wrong:
                assert text.strip() != inst.answer.strip()
                assert task.verify(inst, answer(text)) == 0.0, (text, inst.answer)
            for junk in GARBAGE:
                assert task.verify_strict(inst, junk) == 0.0, junk


# --- buckets -------------------------------------------------------------------------------------

def bucket_instance(capacities, start, target, max_moves):
    meta = {"capacities": capacities, "start": start, "target": target, "max_moves": max_moves}
    return TaskInstance(task="buckets", level=0, seed=0, question="", prompt="", answer="", metadata=meta)


def bfs_plan(capacities, start, target, reverse=False):
    """A shortest move list ending with a jug at ``target`` (moves tried in reverse order on request)."""
    moves = jug_moves(len(capacities))[::-1] if reverse else jug_moves(len(capacities))
    parent = {tuple(start): None}
    queue = deque([tuple(start)])
    while queue:
        state = queue.popleft()
        if target in state:
            path = []
            while parent[state]:
                state, move = parent[state]
                path.append(move)
            return path[::-1]
        for move in moves:
            nxt = apply_move(state, tuple(capacities), move)
            if nxt not in parent:
                parent[nxt] = (state, move)
                queue.append(nxt)
    return None


def move_text(move):
    kind, i, j = move
    return f"pour {'ABCD'[i]} {'ABCD'[j]}" if kind == "pour" else f"{kind} {'ABCD'[i]}"


def test_buckets_limit_is_the_proven_shortest_plan_plus_slack():
    for level, params in enumerate(BUCKETS.levels):
        for seed in range(3):
            meta = BUCKETS.generate(seed, level).metadata
            assert len(meta["capacities"]) == params.jugs
            plan = bfs_plan(meta["capacities"], meta["start"], meta["target"])
            assert len(plan) == meta["shortest"] >= params.min_moves
            assert meta["max_moves"] == meta["shortest"] + params.slack


def test_buckets_accepts_any_valid_plan_and_formatting_variants():
    differing = 0
    for seed in range(12):
        inst = BUCKETS.generate(seed, 2)
        meta = inst.metadata
        other = bfs_plan(meta["capacities"], meta["start"], meta["target"], reverse=True)
        text = "; ".join(move_text(m) for m in other)
        differing += text != inst.answer
        assert BUCKETS.verify(inst, answer(text)) == 1.0
        assert BUCKETS.verify(inst, answer(inst.answer.upper().replace("; ", "\n"))) == 1.0
        numbered = "\n".join(f"{k}. {m.replace('pour A', 'Pour jug A into')}."
                             for k, m in enumerate(inst.answer.split("; "), 1))
        assert BUCKETS.verify(inst, answer(numbered)) == 1.0
        assert meta["start"] == [0, 0, 0] and meta["max_moves"] == meta["shortest"] + 1
        assert BUCKETS.verify(inst, answer("empty A; " + inst.answer)) == 1.0   # a wasted move fits the slack
    assert differing, "reverse-order BFS never found a plan other than the gold one"


def test_buckets_rules():
    inst = bucket_instance([3, 5], [0, 0], 4, 6)
    six = "fill B; pour B A; empty A; pour B A; fill B; pour B A"
    assert BUCKETS.verify(inst, answer(six)) == 1.0
    eight = "fill A; pour A B; fill A; pour A B; empty B; pour A B; fill A; pour A B"
    assert BUCKETS.verify(inst, answer(eight)) == 0.0                      # over the 6-move limit
    assert BUCKETS.verify(bucket_instance([3, 5], [0, 0], 4, 8), answer(eight)) == 1.0
    assert BUCKETS.verify(inst, answer(six.replace("fill B", "fill C", 1))) == 0.0   # no jug C
    assert BUCKETS.verify(inst, answer("fill A; pour A C")) == 0.0
    assert BUCKETS.verify(inst, answer(six.replace("pour B A", "pour B B", 1))) == 0.0
    assert BUCKETS.verify(inst, answer(six + "; empty A")) == 0.0          # 7 moves, over the limit
    assert BUCKETS.verify(bucket_instance([3, 5], [0, 0], 4, 7), answer(six + "; empty B")) == 0.0  # 4 poured away
    assert BUCKETS.verify(inst, answer("fill B; pour B A; empty A; pour B A")) == 0.0   # never reaches 4
    assert BUCKETS.verify(inst, answer(six.replace(";", " then"))) == 0.0


# --- dyck reasoning errors ------------------------------------------------------------------------

def trace_errors(question: str) -> set[int]:
    """Erroneous steps recomputed from the question text alone."""
    steps = re.findall(r"Step (\d+): read '(.)' ; stack now: (.*)", question)
    previous: list[str] = []
    wrong = set()
    for k, symbol, stack_text in steps:
        stack = [] if stack_text == "empty" else stack_text.split()
        if symbol in OPENERS:
            expected = previous + [symbol]
        else:
            assert previous and CLOSER[previous[-1]] == symbol   # every closer meets its opener
            expected = previous[:-1]
        if stack != expected:
            wrong.add(int(k))
        previous = stack
    last, closing = re.search(r"Step (\d+): close what is still open, top first: (.*)", question).groups()
    assert int(last) == len(steps) + 1
    if closing.split() != [CLOSER[o] for o in reversed(previous)]:
        wrong.add(int(last))
    return wrong


def test_dyck_gold_is_the_set_of_locally_wrong_steps():
    counts = set()
    for level in range(DYCK.n_levels):
        for seed in range(8):
            inst = DYCK.generate(seed, level)
            wrong = trace_errors(inst.question)
            assert wrong == set(inst.metadata["errors"])
            assert len(wrong) <= DYCK.levels[level].max_errors
            assert inst.answer == (", ".join(map(str, sorted(wrong))) if wrong else "none")
            counts.add(len(wrong))
    assert {0, 1, 2} <= counts


def test_dyck_answer_formats_and_wrong_sets():
    multi = next(DYCK.generate(s, 3) for s in range(100) if len(DYCK.generate(s, 3).metadata["errors"]) >= 2)
    errors = multi.metadata["errors"]
    for text in (",".join(map(str, errors)), " , ".join(map(str, reversed(errors))),
                 "steps " + " and ".join(map(str, errors)), "; ".join(map(str, errors)) + "."):
        assert DYCK.verify(multi, answer(text)) == 1.0, text
    assert DYCK.verify(multi, answer(", ".join(map(str, errors[1:])))) == 0.0    # one step missing
    extra = next(k for k in range(1, 99) if k not in errors)
    assert DYCK.verify(multi, answer(", ".join(map(str, sorted(errors + [extra]))))) == 0.0
    assert DYCK.verify(multi, answer("none")) == 0.0
    assert DYCK.verify(multi, answer(f"{errors[0]}, x{errors[1]}")) == 0.0
    clean = next(DYCK.generate(s, 1) for s in range(100) if not DYCK.generate(s, 1).metadata["errors"])
    for text in ("none", "None.", "No errors"):
        assert DYCK.verify(clean, answer(text)) == 1.0
    assert DYCK.verify(clean, answer("1")) == 0.0
    assert DYCK.verify(clean, answer("none, 1")) == 0.0


# --- wordscapes ------------------------------------------------------------------------------------

def test_wordscapes_solution_is_unique_over_the_vocabulary():
    for level in range(WORDS.n_levels):
        for seed in range(3):
            inst = WORDS.generate(seed, level)
            meta = inst.metadata
            slots = [tuple(s) for s in meta["slots"]]
            assert len(slots) == WORDS.levels[level].slots
            revealed = {(r, c): ch for r, c, ch in meta["revealed"]}
            assert solve_wordscape(slots, meta["bag"], revealed, limit=2) == [inst.answer.split(", ")]


def test_wordscapes_brute_force_agrees_with_the_solver():
    for seed in range(3):
        inst = WORDS.generate(seed, 1)
        slots = inst.metadata["slots"]
        options = [[w for w in VOCABULARY if len(w) == s[3] and all(ch in inst.metadata["bag"] for ch in w)]
                   for s in slots]
        accepted = [combo for combo in itertools.product(*options) if WORDS.check(inst, ", ".join(combo)) == 1.0]
        assert accepted == [tuple(inst.answer.split(", "))]


def word_instance(slots, bag, revealed=()):
    meta = {"slots": [list(s) for s in slots], "bag": bag, "revealed": [list(x) for x in revealed]}
    return TaskInstance(task="wordscapes", level=0, seed=0, question="", prompt="", answer="", metadata=meta)


def test_wordscapes_rules():
    # CAT across from (0,0); TEA down from its T at (0,2)
    inst = word_instance([(0, 0, "across", 3), (0, 2, "down", 3)], "ACETX")
    assert WORDS.verify(inst, answer("CAT, TEA")) == 1.0
    assert WORDS.verify(inst, answer("cat\ntea")) == 1.0
    assert WORDS.verify(inst, answer("1. Cat 2. Tea")) == 1.0
    assert WORDS.verify(inst, answer("ACT, TEA")) == 1.0                 # another valid filling
    assert WORDS.verify(inst, answer("TAC, CAT")) == 0.0                 # TAC: not a vocabulary word
    assert WORDS.verify(inst, answer("CAT, EAT")) == 0.0                 # crossing letter differs
    assert WORDS.verify(inst, answer("CAT, TEAX")) == 0.0                # wrong length
    assert WORDS.verify(inst, answer("CAT")) == 0.0                      # a slot left empty
    assert WORDS.verify(inst, answer("CAT, TEA, ACE")) == 0.0            # too many words
    assert WORDS.verify(inst, answer("CAT, TOE")) == 0.0                 # O is not in the bag
    assert WORDS.verify(word_instance([(0, 0, "across", 3), (0, 2, "down", 3)], "ACT"),
                        answer("CAT, TEA")) == 0.0                       # E is not in the bag
    assert WORDS.verify(word_instance([(0, 0, "across", 4), (2, 0, "across", 4)], "BEORT"),
                        answer("TREE, TREE")) == 0.0                     # E twice, and a repeat
    repeat = word_instance([(0, 0, "across", 3), (2, 0, "across", 3)], "ACT")
    assert WORDS.verify(repeat, answer("CAT, ACT")) == 1.0
    assert WORDS.verify(repeat, answer("CAT, CAT")) == 0.0               # words must differ
    hinted = word_instance([(0, 0, "across", 3), (0, 2, "down", 3)], "ACETX", revealed=[(0, 0, "A")])
    assert WORDS.verify(hinted, answer("CAT, TEA")) == 0.0               # revealed A ignored
    assert WORDS.verify(hinted, answer("ACT, TEA")) == 1.0


def test_wordscapes_cells_cross_where_the_slots_say():
    for seed in range(5):
        inst = WORDS.generate(seed, 4)
        grid = {}
        for slot, word in zip(inst.metadata["slots"], inst.answer.split(", ")):
            for cell, ch in zip(slot_cells(tuple(slot)), word):
                assert grid.setdefault(cell, ch) == ch
        assert len(grid) < sum(s[3] for s in inst.metadata["slots"])   # the words do cross
