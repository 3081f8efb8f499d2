"""Paths and sequences: math path, arrow maze, time sequence."""
from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from typing import Any

from tasks.synth.arithmetic import evaluate_arithmetic
from tasks.synth.base import LevelParams, SynthTask, TaskInstance, parse_pairs

# --- math path: fill the '?' digits of an equation ---------------------------------------------


@dataclass(frozen=True)
class MathPathParams(LevelParams):
    operands: int
    blanks: int
    ops: str


class MathPath(SynthTask):
    name = "math_path"
    family = "sequence"
    answer_example = "3 + 4 * 5 = 23"
    unique_answer = False
    levels = (
        MathPathParams(3, 1, "+-"), MathPathParams(3, 2, "+-"), MathPathParams(4, 2, "+-*"),
        MathPathParams(4, 3, "+-*"), MathPathParams(5, 3, "+-*"), MathPathParams(6, 4, "+-*"),
    )

    def build(self, rng: random.Random, p: MathPathParams) -> tuple[str, str, dict[str, Any]]:
        numbers = [rng.randint(1, 9) for _ in range(p.operands)]
        ops = [rng.choice(p.ops) for _ in range(p.operands - 1)]
        text = self._expression(numbers, ops)
        result = int(evaluate_arithmetic(text)[0])
        blanks = sorted(rng.sample(range(p.operands), p.blanks))
        template = self._expression(["?" if i in blanks else n for i, n in enumerate(numbers)], ops)
        question = (
            f"Replace each ? with a digit from 1 to 9 (the same digit may repeat) so that the "
            f"equation holds, with the usual order of operations:\n{template} = {result}\n"
            f"Write the completed equation."
        )
        meta = {"numbers": [None if i in blanks else n for i, n in enumerate(numbers)], "ops": ops,
                "result": result}
        return question, f"{text} = {result}", meta

    @staticmethod
    def _expression(numbers: list, ops: list[str]) -> str:
        parts = [str(numbers[0])]
        for op, n in zip(ops, numbers[1:]):
            parts += [op, str(n)]
        return " ".join(parts)

    def check(self, instance: TaskInstance, answer: str) -> float:
        meta = instance.metadata
        given = meta["numbers"]
        values = [int(v) for v in re.findall(r"\d+", answer.split("=")[0])]   # operands are positive
        blanks = [i for i, v in enumerate(given) if v is None]
        if len(values) == len(given):
            filled = values
        elif len(values) == len(blanks):   # only the missing digits, in order
            filled = list(given)
            for i, v in zip(blanks, values):
                filled[i] = v
        else:
            return 0.0
        if any(g is not None and g != v for g, v in zip(given, filled)):
            return 0.0
        if any(not 1 <= filled[i] <= 9 for i in blanks):
            return 0.0
        value, _ = evaluate_arithmetic(self._expression(filled, meta["ops"]))
        return 1.0 if value == meta["result"] else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        meta = instance.metadata
        values = [int(v) for v in re.findall(r"\d+", instance.answer.split("=")[0])]
        blanks = [i for i, v in enumerate(meta["numbers"]) if v is None]
        out_of_range = list(values)
        out_of_range[rng.choice(blanks)] = 10 + rng.randrange(5)
        wrong_fixed = list(values)
        fixed = [i for i, v in enumerate(meta["numbers"]) if v is not None]
        wrong_fixed[rng.choice(fixed)] += 1
        return [f"{self._expression(v, meta['ops'])} = {meta['result']}" for v in (out_of_range, wrong_fixed)]


# --- arrow maze ------------------------------------------------------------------------------

DIRECTIONS = {"↑": (-1, 0), "↓": (1, 0), "←": (0, -1), "→": (0, 1),
              "↖": (-1, -1), "↗": (-1, 1), "↙": (1, -1), "↘": (1, 1)}
ARROWS = tuple(DIRECTIONS)


@dataclass(frozen=True)
class ArrowMazeParams(LevelParams):
    size: int
    steps: int


class ArrowMaze(SynthTask):
    name = "arrow_maze"
    family = "sequence"
    answer_example = "(1,1), (3,3), (3,1)"
    unique_answer = False
    levels = (ArrowMazeParams(4, 2), ArrowMazeParams(4, 3), ArrowMazeParams(5, 4),
              ArrowMazeParams(6, 6), ArrowMazeParams(7, 8), ArrowMazeParams(8, 10))

    def build(self, rng: random.Random, p: ArrowMazeParams) -> tuple[str, str, dict[str, Any]]:
        n = p.size
        while True:
            path = self._random_path(rng, p)
            if path:
                break
        arrows = [[rng.choice(ARROWS) for _ in range(n)] for _ in range(n)]
        for (r, c), (r2, c2) in itertools.pairwise(path):
            dr, dc = r2 - r, c2 - c
            k = max(abs(dr), abs(dc))
            arrows[r][c] = next(a for a, v in DIRECTIONS.items() if v == (dr // k, dc // k))
        start, goal = path[0], path[-1]
        arrows[goal[0]][goal[1]] = "G"
        board = "\n".join(" ".join(row) for row in arrows)
        question = (
            f"Arrow maze on a {n}x{n} grid. From a cell you may jump any number of cells in the "
            f"direction of its arrow (staying inside the grid). Start at ({start[0] + 1},"
            f"{start[1] + 1}) and reach the goal G.\n{board}\n"
            f"Give the cells you land on, start and goal included, as (row,col) pairs numbered from 1."
        )
        meta = {"arrows": ["".join(row) for row in arrows], "start": list(start), "goal": list(goal)}
        answer = ", ".join(f"({r + 1},{c + 1})" for r, c in path)
        return question, answer, meta

    @staticmethod
    def _random_path(rng: random.Random, p: ArrowMazeParams) -> list[tuple[int, int]] | None:
        n = p.size
        cur = (rng.randrange(n), rng.randrange(n))
        path = [cur]
        for _ in range(p.steps):
            moves = []
            for dr, dc in DIRECTIONS.values():
                for k in range(1, n):
                    r, c = cur[0] + dr * k, cur[1] + dc * k
                    if not (0 <= r < n and 0 <= c < n):
                        break
                    if (r, c) not in path:
                        moves.append((r, c))
            if not moves:
                return None
            cur = rng.choice(moves)
            path.append(cur)
        return path

    def check(self, instance: TaskInstance, answer: str) -> float:
        meta = instance.metadata
        arrows = meta["arrows"]
        n = len(arrows)
        cells = [(r - 1, c - 1) for r, c in parse_pairs(answer)]
        if len(cells) < 2 or list(cells[0]) != meta["start"] or list(cells[-1]) != meta["goal"]:
            return 0.0
        for (r, c), (r2, c2) in itertools.pairwise(cells):
            if not (0 <= r2 < n and 0 <= c2 < n) or arrows[r][c] not in DIRECTIONS:
                return 0.0
            dr, dc = DIRECTIONS[arrows[r][c]]
            k = max(abs(r2 - r), abs(c2 - c))
            if k == 0 or (r2 - r, c2 - c) != (dr * k, dc * k):
                return 0.0
        return 1.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        pairs = parse_pairs(instance.answer)
        return [", ".join(f"({r},{c})" for r, c in pairs[:-1])]


# --- time sequence: earliest common free slot --------------------------------------------------

def clock(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def parse_clock(text: str) -> int | None:
    m = re.search(r"(\d{1,2})\s*:\s*(\d{2})\s*([ap]\.?m\.?)?", text, re.IGNORECASE)
    if not m:
        return None
    hours, minutes = int(m.group(1)), int(m.group(2))
    suffix = (m.group(3) or "").lower().replace(".", "")
    if suffix == "pm" and hours < 12:
        hours += 12
    if suffix == "am" and hours == 12:
        hours = 0
    return hours * 60 + minutes if hours < 24 and minutes < 60 else None


@dataclass(frozen=True)
class TimeSequenceParams(LevelParams):
    people: int
    busy_per_person: int
    granularity: int
    duration: int


class TimeSequence(SynthTask):
    name = "time_sequence"
    family = "sequence"
    answer_example = "13:30"
    DAY_START, DAY_END = 9 * 60, 17 * 60
    levels = (
        TimeSequenceParams(2, 2, 60, 60), TimeSequenceParams(3, 2, 30, 60),
        TimeSequenceParams(3, 3, 30, 90), TimeSequenceParams(4, 3, 15, 60),
        TimeSequenceParams(5, 4, 15, 75), TimeSequenceParams(6, 4, 5, 50),
    )

    def build(self, rng: random.Random, p: TimeSequenceParams) -> tuple[str, str, dict[str, Any]]:
        names = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank"][: p.people]
        while True:
            busy = {name: self._busy(rng, p) for name in names}
            start = self._earliest(busy, p)
            if start is not None and start > self.DAY_START:   # 09:00 would be a giveaway
                break
        lines = [f"{name} is busy " + ", ".join(f"{clock(a)}-{clock(b)}" for a, b in slots) + "."
                 for name, slots in busy.items()]
        question = (
            f"Everyone is available between {clock(self.DAY_START)} and {clock(self.DAY_END)} except:\n"
            + "\n".join(lines)
            + f"\nMeetings start on multiples of {p.granularity} minutes past the hour. What is the "
            f"earliest start time (HH:MM, 24-hour) for a {p.duration}-minute meeting with everyone?"
        )
        meta = {"busy": {k: [list(s) for s in v] for k, v in busy.items()}, "duration": p.duration}
        return question, clock(start), meta

    def _busy(self, rng: random.Random, p: TimeSequenceParams) -> list[tuple[int, int]]:
        while True:
            slots: list[tuple[int, int]] = []
            for _ in range(p.busy_per_person):
                length = rng.choice([p.granularity, 2 * p.granularity, 30, 60])
                a = rng.randrange(self.DAY_START, self.DAY_END - length, 5)
                slots.append((a, a + length))
            slots.sort()
            if all(b < a2 for (_, b), (a2, _) in itertools.pairwise(slots)):   # one person, no overlaps
                return slots

    def _earliest(self, busy: dict, p: TimeSequenceParams) -> int | None:
        for t in range(self.DAY_START, self.DAY_END - p.duration + 1, p.granularity):
            if all(b <= t or a >= t + p.duration for slots in busy.values() for a, b in slots):
                return t
        return None

    def check(self, instance: TaskInstance, answer: str) -> float:
        return 1.0 if parse_clock(answer) == parse_clock(instance.answer) else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        t = parse_clock(instance.answer)
        return [clock(t + instance.metadata["params"]["granularity"]), clock(t - 5)]
