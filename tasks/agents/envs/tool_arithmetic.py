"""Arithmetic too long for a 135M model to do in its head, with a calculator tool: the first
agent skill (call a tool, read its result, answer with it).

Level 0 is a 3-digit x 2-digit product plus a 2-3 digit term; higher levels add digits and
terms. The calculator is a safe ``ast`` evaluator over exact fractions (numbers, + - * / // %
**, unary signs, parentheses), with bounds on sizes and exponents; anything else is an error
the policy sees.
"""
from __future__ import annotations

import ast
import math
import operator
import random
import re
from dataclasses import dataclass
from fractions import Fraction

from tasks.agents.envs.base import Action, Environment, Reset, StepResult, Tool, ToolCall
from tasks.synth.base import extract_final_answer, stable_int

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10 ** 30          # largest |value| (and denominator) the calculator returns
MAX_EXPONENT = 64
ERROR_CHARS = 160                 # observations stay short: a small model reads them


@dataclass(frozen=True)
class ArithmeticLevel:
    """``products``: the digit counts of each product's factors; ``addends``: the most digits of
    each added or subtracted term (at least 2); ``signs``: the operators joining the terms."""
    products: tuple[tuple[int, ...], ...]
    addends: tuple[int, ...]
    signs: str = "+-"


LEVELS: tuple[ArithmeticLevel, ...] = (
    ArithmeticLevel(products=((3, 2),), addends=(3,), signs="+"),
    ArithmeticLevel(products=((3, 3), (2, 2)), addends=(3,)),
    ArithmeticLevel(products=((4, 3), (3, 2)), addends=(3, 3)),
    ArithmeticLevel(products=((4, 3, 2), (4, 3)), addends=(4,)),
)

CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 347 * 58 + 912"}},
                "required": ["expression"]},
)


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message is shown to the policy)."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; raises ``CalculatorError`` for anything else
    (names, calls, attributes...: nothing is ever executed, the tree is walked)."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    # forms a small model writes for the same thing: x and / signs, a trailing "="
    text = expression.replace("\u00d7", "*").replace("\u00f7", "/").strip().rstrip("=").strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {text[:40]!r}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(Fraction(str(node.value)))   # str: 0.1 is the decimal 1/10, not a binary float
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("^ is not a power here: write ** for powers")
    raise CalculatorError("only numbers, + - * / // % ** and parentheses are allowed, "
                          f"not {type(node).__name__}")


def _check_power(base: Fraction, exponent: Fraction) -> None:
    """Refuse a power before computing it when the result would be huge (9 ** 10 ** 9 must not
    run for minutes): the exponent must be a small integer and the result's size bounded."""
    if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    for part in (base.numerator, base.denominator):
        if abs(part) > 1 and abs(exponent) * math.log10(abs(part)) > math.log10(MAX_MAGNITUDE):
            raise CalculatorError("result too large")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise CalculatorError("result too large")
    return value


def format_value(value: Fraction) -> str:
    """An integer exactly; anything else as a decimal with 10 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


_INTEGER = re.compile(r"[+-]?\d+(?:\.0*)?")


def parse_integer(answer: str | None) -> int | None:
    """An answer as an integer ("20,138", "20138.0" and "+20138" read as 20138); None otherwise."""
    if answer is None:
        return None
    text = answer.replace(",", "").replace(" ", "")
    if not _INTEGER.fullmatch(text):
        return None
    return int(text.split(".")[0])


def _tool_message(name: str, content: str) -> dict[str, str]:
    return {"role": "tool", "name": name, "content": content}


def _parse_error_message(error: str) -> dict[str, str]:
    """The observation answering a tool call that did not parse (``Action.parse_error``)."""
    text = error if error.startswith("could not parse") else f"could not parse the tool call: {error}"
    return _tool_message("tool_call", f"error: {text}"[:ERROR_CHARS])


def _final_info(outcome: float, ended: str, tool_error: int = 0, **more) -> dict:
    return {"tool_error": tool_error, "outcome": float(outcome), "success": outcome >= 1.0,
            "ended": ended, **more}


class ToolArithmetic(Environment):
    """One arithmetic question per seed; tool ``calculator(expression)``; outcome 1 iff the final
    answer is the exact integer value. Process reward: +``process_reward`` per calculator call
    that evaluates, -``process_reward`` per failed or malformed call (0 turns it off)."""

    name = "tool_arithmetic"

    def __init__(self, level: int = 0, max_turns: int = 4, process_reward: float = 0.1):
        if not 0 <= level < len(LEVELS):
            raise ValueError(f"{self.name}: level {level!r} outside 0..{len(LEVELS) - 1}")
        if max_turns < 1:
            raise ValueError(f"{self.name}: max_turns must be at least 1, got {max_turns!r}")
        self.level, self.max_turns, self.process_reward = level, max_turns, float(process_reward)
        self._value: int | None = None
        self._turns = 0
        self._done = True

    def problem(self, seed: int) -> tuple[str, int]:
        """(expression, its exact value) of episode ``seed``."""
        rng = random.Random(stable_int(self.name, int(seed), self.level))
        params = LEVELS[self.level]
        terms = [" * ".join(str(_number(rng, digits)) for digits in factors) for factors in params.products]
        terms += [str(rng.randint(10, 10 ** digits - 1)) for digits in params.addends]
        expression = terms[0] + "".join(f" {rng.choice(params.signs)} {term}" for term in terms[1:])
        return expression, evaluate(expression).numerator

    def reset(self, seed: int) -> Reset:
        expression, self._value = self.problem(seed)
        self._turns, self._done = 0, False
        prompt = (f"What is {expression}?\nUse the calculator tool to compute it, then give only "
                  "the final number as <answer>N</answer>.")
        return Reset(messages=[{"role": "user", "content": prompt}], tools=[CALCULATOR])

    def step(self, action: Action) -> StepResult:
        if self._done:
            raise RuntimeError(f"{self.name}: no live episode (call reset(seed) first)")
        self._turns += 1
        if action.parse_error is None and not action.tool_calls:
            answer = extract_final_answer(action.text)
            self._done = True
            outcome = 1.0 if parse_integer(answer) == self._value else 0.0
            return StepResult([], 0.0, True, _final_info(outcome, "answered", answer=answer))
        observation, failed, evaluated = [], 0, 0
        if action.parse_error is not None:
            observation.append(_parse_error_message(action.parse_error))
            failed += 1
        for call in action.tool_calls:
            content, ok = self._call(call)
            observation.append(_tool_message(call.name, content))
            evaluated, failed = evaluated + ok, failed + (not ok)
        reward = self.process_reward * (evaluated - failed)
        if self._turns >= self.max_turns:
            self._done = True
            return StepResult(observation, reward, True, _final_info(0.0, "max_turns", failed))
        return StepResult(observation, reward, False, {"tool_error": failed})

    def _call(self, call: ToolCall) -> tuple[str, bool]:
        if call.name != CALCULATOR.name:
            return f"error: unknown tool {call.name[:40]!r}; the tool is calculator", False
        if set(call.arguments) != {"expression"}:
            return "error: calculator takes one argument, expression (a string)", False
        try:
            return format_value(evaluate(call.arguments["expression"])), True
        except CalculatorError as e:
            return f"error: {e}"[:ERROR_CHARS], False

    def expert_actions(self, seed: int) -> list[Action]:
        expression, value = self.problem(seed)
        return [Action("", (ToolCall(CALCULATOR.name, {"expression": expression}),),
                       thinking="This is too long to do in my head: use the calculator."),
                Action(f"<answer>{value}</answer>", thinking=f"The calculator says {value}.")]


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)
