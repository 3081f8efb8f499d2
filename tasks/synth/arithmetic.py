"""Arithmetic puzzles: game of 24, cryptarithm, custom operations."""
from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from tasks.synth.base import LevelParams, SynthTask, TaskInstance, parse_ints, uniqueness_check


def single_int(answer: str) -> int | None:
    """The integer an answer states, when it states exactly one."""
    values = parse_ints(answer.replace(",", ""))
    return values[0] if len(values) == 1 else None


# --- game of 24 ------------------------------------------------------------------------------

_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def evaluate_arithmetic(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of a + - * / expression over integers, and the integers it uses."""
    text = expr.replace("×", "*").replace("÷", "/").replace("x", "*").replace("X", "*")
    tree = ast.parse(text.strip(), mode="eval")
    used: list[int] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"not allowed in an arithmetic answer: {ast.dump(node)[:40]}")

    return ev(tree), used


@uniqueness_check
def solve_24(numbers: list[int], target: int) -> str | None:
    """One expression using each number once that equals ``target``, or None."""
    failed: set[tuple[Fraction, ...]] = set()

    def search(items: list[tuple[Fraction, str]]) -> str | None:
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        key = tuple(sorted(v for v, _ in items))
        if key in failed:
            return None
        for i in range(len(items)):
            for j in range(len(items)):
                if i == j:
                    continue
                (a, ea), (b, eb) = items[i], items[j]
                rest = [items[k] for k in range(len(items)) if k not in (i, j)]
                candidates = [(a - b, f"({ea} - {eb})"), (a / b, f"({ea} / {eb})") if b != 0 else None]
                if i < j:  # commutative operations once per pair
                    candidates += [(a + b, f"({ea} + {eb})"), (a * b, f"({ea} * {eb})")]
                for cand in candidates:
                    if cand is None:
                        continue
                    found = search(rest + [cand])
                    if found:
                        return found
        failed.add(key)
        return None

    found = search([(Fraction(n), str(n)) for n in numbers])
    if found and found.startswith("(") and found.endswith(")"):
        found = found[1:-1]
    return found


@dataclass(frozen=True)
class Game24Params(LevelParams):
    count: int
    max_value: int
    target: int


class GameOf24(SynthTask):
    name = "game_of_24"
    family = "arithmetic"
    answer_example = "(8 - 4) * 6 * 1"
    unique_answer = False
    levels = (
        Game24Params(3, 9, 24), Game24Params(4, 9, 24), Game24Params(4, 13, 24),
        Game24Params(4, 13, 36), Game24Params(5, 13, 24), Game24Params(5, 20, 48),
    )

    def build(self, rng: random.Random, p: Game24Params) -> tuple[str, str, dict[str, Any]]:
        while True:
            numbers = sorted(rng.randint(1, p.max_value) for _ in range(p.count))
            expr = solve_24(numbers, p.target)
            if expr:
                break
        question = (
            f"Use each of the numbers {', '.join(map(str, numbers))} exactly once, with + - * / "
            f"and parentheses, to make {p.target}. Write the expression (without '= {p.target}')."
        )
        return question, expr, {"numbers": numbers, "target": p.target}

    def check(self, instance: TaskInstance, answer: str) -> float:
        expr = answer.split("=")[0]
        value, used = evaluate_arithmetic(expr)
        ok = value == instance.metadata["target"] and sorted(used) == instance.metadata["numbers"]
        return 1.0 if ok else 0.0


# --- cryptarithm -----------------------------------------------------------------------------

def _word_value(word: str, digits: dict[str, int]) -> int:
    v = 0
    for ch in word:
        v = v * 10 + digits[ch]
    return v


@uniqueness_check
def count_cryptarithm_solutions(addends: list[str], result: str, fixed: dict[str, int],
                                limit: int = 2) -> int:
    """Digit assignments (distinct digits, no leading zeros) making sum(addends) == result."""
    words = addends + [result]
    width = max(len(w) for w in words)
    order: list[str] = []
    column_done: list[int] = []   # number of letters in `order` once column k is complete
    for k in range(width):
        for w in words:
            if k < len(w) and w[-1 - k] not in order:
                order.append(w[-1 - k])
        column_done.append(len(order))
    leading = {w[0] for w in words if len(w) > 1}
    digits: dict[str, int] = {}
    used = [False] * 10
    count = 0

    def low(word: str, k: int) -> int:
        return _word_value(word[-k:], digits) if k else 0

    def consistent(n_assigned: int) -> bool:
        for k, done in enumerate(column_done, start=1):
            if done > n_assigned:
                break
            mod = 10 ** k
            if sum(low(w, k) for w in addends) % mod != low(result, k) % mod:
                return False
        return True

    def search(i: int) -> None:
        nonlocal count
        if count >= limit:
            return
        if i == len(order):
            if sum(_word_value(w, digits) for w in addends) == _word_value(result, digits):
                count += 1
            return
        letter = order[i]
        choices = [fixed[letter]] if letter in fixed else range(10)
        for d in choices:
            if used[d] or (d == 0 and letter in leading):
                continue
            digits[letter] = d
            used[d] = True
            if consistent(i + 1):
                search(i + 1)
            used[d] = False
            del digits[letter]

    search(0)
    return count


@dataclass(frozen=True)
class CryptarithmParams(LevelParams):
    digits: int
    addends: int


class Cryptarithm(SynthTask):
    name = "cryptarithm"
    family = "arithmetic"
    answer_example = "A=1, B=7, C=0"
    levels = (
        CryptarithmParams(2, 2), CryptarithmParams(3, 2), CryptarithmParams(3, 3),
        CryptarithmParams(4, 2), CryptarithmParams(4, 3), CryptarithmParams(5, 3),
    )
    LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

    def build(self, rng: random.Random, p: CryptarithmParams) -> tuple[str, str, dict[str, Any]]:
        while True:
            nums = [rng.randint(10 ** (p.digits - 1), 10 ** p.digits - 1) for _ in range(p.addends)]
            total = sum(nums)
            used_digits = sorted({int(c) for n in nums + [total] for c in str(n)})
            if len(used_digits) <= 10:
                break
        letters = rng.sample(self.LETTERS, len(used_digits))
        to_letter = dict(zip(used_digits, letters))
        addends = ["".join(to_letter[int(c)] for c in str(n)) for n in nums]
        result = "".join(to_letter[int(c)] for c in str(total))
        solution = {to_letter[d]: d for d in used_digits}
        hints: dict[str, int] = {}
        hint_order = sorted(solution)
        rng.shuffle(hint_order)
        # reveal letters until the puzzle has exactly one solution
        while count_cryptarithm_solutions(addends, result, hints) > 1:
            hints[hint_order[len(hints)]] = solution[hint_order[len(hints)]]
        hint_text = (" Known: " + ", ".join(f"{k}={v}" for k, v in sorted(hints.items())) + ".") if hints else ""
        question = (
            "Solve the cryptarithm: each letter stands for a different digit, and no number "
            f"starts with 0.\n{' + '.join(addends)} = {result}.{hint_text}\n"
            "Give the digit of every letter as LETTER=DIGIT pairs separated by commas."
        )
        answer = ", ".join(f"{k}={v}" for k, v in sorted(solution.items()))
        return question, answer, {"addends": addends, "result": result, "hints": hints}

    def check(self, instance: TaskInstance, answer: str) -> float:
        meta = instance.metadata
        pairs = re.findall(r"([A-Za-z])\s*[=:]\s*(\d+)", answer)
        digits: dict[str, int] = {}
        for letter, d in pairs:
            letter = letter.upper()
            if letter in digits and digits[letter] != int(d):
                return 0.0
            digits[letter] = int(d)
        letters = sorted({c for w in meta["addends"] + [meta["result"]] for c in w})
        if sorted(digits) != letters:
            return 0.0
        values = list(digits.values())
        if any(not 0 <= v <= 9 for v in values) or len(set(values)) != len(values):
            return 0.0
        if any(digits[w[0]] == 0 for w in meta["addends"] + [meta["result"]] if len(w) > 1):
            return 0.0
        if any(digits[k] != v for k, v in meta["hints"].items()):
            return 0.0
        total = sum(_word_value(w, digits) for w in meta["addends"])
        return 1.0 if total == _word_value(meta["result"], digits) else 0.0


# --- custom operations -----------------------------------------------------------------------

# (formula shown to the model, python function); all map ints to ints
_OPERATION_RULES: list[tuple[str, Any]] = [
    ("a * b + a", lambda a, b: a * b + a),
    ("a + 2 * b", lambda a, b: a + 2 * b),
    ("a * a - b", lambda a, b: a * a - b),
    ("(a - b) * (a + b)", lambda a, b: (a - b) * (a + b)),
    ("a * b - a - b", lambda a, b: a * b - a - b),
    ("3 * a - 2 * b", lambda a, b: 3 * a - 2 * b),
    ("a + b + a * b", lambda a, b: a + b + a * b),
    ("2 * a * b - b", lambda a, b: 2 * a * b - b),
]
_CONDITIONAL_RULES: list[tuple[str, Any]] = [
    ("a + b if a > b, otherwise a * b", lambda a, b: a + b if a > b else a * b),
    ("a - b if a is even, otherwise a + b", lambda a, b: a - b if a % 2 == 0 else a + b),
    ("a * b if a + b is odd, otherwise a - b", lambda a, b: a * b if (a + b) % 2 else a - b),
]
_SYMBOLS = ["⊕", "⊗", "△", "◇", "☆"]


@dataclass(frozen=True)
class OperationParams(LevelParams):
    n_operators: int
    depth: int
    max_operand: int
    conditional: bool


class Operation(SynthTask):
    name = "operation"
    family = "arithmetic"
    answer_example = "17"
    levels = (
        OperationParams(1, 1, 9, False), OperationParams(2, 2, 9, False),
        OperationParams(2, 2, 9, True), OperationParams(3, 3, 9, True),
        OperationParams(3, 4, 12, True), OperationParams(4, 5, 15, True),
    )

    def build(self, rng: random.Random, p: OperationParams) -> tuple[str, str, dict[str, Any]]:
        pool = list(range(len(_OPERATION_RULES)))
        rng.shuffle(pool)
        rules = [_OPERATION_RULES[i] for i in pool[: p.n_operators]]
        if p.conditional:
            rules[-1] = _CONDITIONAL_RULES[rng.randrange(len(_CONDITIONAL_RULES))]
        symbols = _SYMBOLS[: len(rules)]
        while True:
            text, value = self._expression(rng, p, rules, symbols, p.depth)
            if abs(value) <= 10 ** 6:
                break
        defs = "\n".join(f"a {s} b = {formula}" for s, (formula, _) in zip(symbols, rules))
        question = (
            f"New operations are defined for integers a and b:\n{defs}\n"
            f"Compute {text}. Innermost parentheses first."
        )
        return question, str(value), {"expression": text}

    def _expression(self, rng, p, rules, symbols, depth) -> tuple[str, int]:
        if depth == 0:
            v = rng.randint(1, p.max_operand)
            return str(v), v
        k = rng.randrange(len(rules))
        left_depth = rng.randint(0, depth - 1)
        lt, lv = self._expression(rng, p, rules, symbols, left_depth)
        rt, rv = self._expression(rng, p, rules, symbols, depth - 1 - left_depth if rng.random() < 0.5 else 0)
        if left_depth > 0:
            lt = f"({lt})"
        if rt.count(" ") > 0:
            rt = f"({rt})"
        return f"{lt} {symbols[k]} {rt}", rules[k][1](lv, rv)

    def check(self, instance: TaskInstance, answer: str) -> float:
        return 1.0 if single_int(answer) == int(instance.answer) else 0.0
