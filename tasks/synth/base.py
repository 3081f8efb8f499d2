"""The one interface every synthesized task implements (SynLogic-style).

A task has a name, a family, and an ordered tuple of difficulty levels (each level a typed,
frozen parameter record, easiest first). ``generate(seed, level)`` builds one instance
deterministically from ``(task name, seed, level)``; ``verify(instance, response)`` scores a
model response in [0, 1] and never raises; ``verify_strict`` raises ``TaskVerifyError`` where
that 0 is the verifier's failure rather than the response's.

Determinism: the random generator is seeded from a SHA-256 of the triple, never from
Python's salted ``hash()``, so the same (seed, level) gives the same instance anywhere.
Generators must also never iterate over sets of strings (their order is salted).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import random
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, ClassVar

ANSWER_INSTRUCTION = (
    "Think it through, then give only your final answer inside <answer></answer> tags, "
    "for example <answer>{example}</answer>."
)

PROMPT_TEMPLATE = "{question}\n\n{instruction}"


class TaskError(ValueError):
    """A task was asked for something it cannot produce (unknown level, bad parameters)."""


class TaskVerifyError(TaskError):
    """The verifier, not the response, failed: ``check`` raised, and it does not accept the
    instance's own gold answer either (a broken instance or checker)."""


def stable_int(*parts: Any, bits: int = 63) -> int:
    """A machine-independent integer digest of ``parts`` (SHA-256 of their JSON form)."""
    payload = json.dumps(list(parts), sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(payload.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - bits)


def derive_rng(task: str, seed: int, level: int) -> random.Random:
    return random.Random(stable_int("posttrain.synth", task, int(seed), int(level)))


def instance_id(task: str, prompt: str, answer: str) -> str:
    """Content id: two instances with the same task, prompt and gold answer are identical."""
    h = hashlib.sha256(json.dumps([task, prompt, answer], separators=(",", ":")).encode("utf-8"))
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class TaskInstance:
    task: str
    level: int
    seed: int
    question: str
    prompt: str
    answer: str                          # gold answer, as the text a model should put in <answer>
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return instance_id(self.task, self.prompt, self.answer)

    def metadata_json(self) -> str:
        return json.dumps(self.metadata, sort_keys=True, separators=(",", ":"))


# --- answer extraction -------------------------------------------------------------------

_THINK_END = re.compile(r"</think\s*>", re.IGNORECASE)
_ANSWER_OPEN = re.compile(r"<\s*answer\s*>", re.IGNORECASE)
_ANSWER_CLOSE = re.compile(r"<\s*/\s*answer\s*>", re.IGNORECASE)


def after_thinking(response: str) -> str:
    """What follows the last ``</think>`` (tolerant of case and spacing), else the whole text:
    where every extractor reads a response's answer."""
    ends = list(_THINK_END.finditer(response))
    return response[ends[-1].end():] if ends else response


def extract_answer(response: Any) -> str | None:
    """The final answer in a response, or None when there is none.

    Reads only what follows the last ``</think>``; takes the last ``<answer>`` block; a
    missing closing tag means "to the end of the text". Tags are case- and
    whitespace-tolerant. The content is stripped.
    """
    if not isinstance(response, str):
        return None
    text = after_thinking(response)
    opens = list(_ANSWER_OPEN.finditer(text))
    if not opens:
        return None
    body = text[opens[-1].end():]
    close = _ANSWER_CLOSE.search(body)
    if close:
        body = body[: close.start()]
    body = body.strip()
    return body or None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip() or None
        i += 1
    return None  # unbalanced: the response was cut off inside the box


def extract_final_answer(response: str) -> str | None:
    """The last <answer> block, else the last \\boxed{}; None when the response has neither."""
    if not isinstance(response, str):
        return None
    tagged = extract_answer(response)
    if tagged is not None:
        boxed = last_boxed(tagged)
        return boxed if boxed is not None else tagged
    return last_boxed(response)


# --- small parsing helpers shared by the task families ------------------------------------

_INT = re.compile(r"-?\d+")
_PAIR = re.compile(r"\(\s*(-?\d+)\s*,\s*(-?\d+)\s*\)")


def parse_ints(text: str) -> list[int]:
    return [int(t) for t in _INT.findall(text)]


def parse_pairs(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in _PAIR.findall(text)]


def parse_grid(text: str, rows: int, cols: int) -> list[list[int]] | None:
    """All integers of ``text`` read row-major into a rows x cols grid; None if the count is off."""
    values = parse_ints(text)
    if len(values) != rows * cols:
        return None
    return [values[r * cols:(r + 1) * cols] for r in range(rows)]


def format_grid(grid: list[list[Any]], blank: Any = None, blank_text: str = "_") -> str:
    return "\n".join(" ".join(blank_text if v == blank else str(v) for v in row) for row in grid)


def heldout_seed(index: int) -> int:
    """Seed of the ``index``-th held-out instance: negative, so disjoint from training seeds
    (evaluate's synthetic benchmark and the judge's held-out items draw from it)."""
    return -(1 + index)


def normalize_text(text: str) -> str:
    return " ".join(text.strip().lower().split())


# --- uniqueness and solvability checks -----------------------------------------------------

_CHECK_SECONDS = threading.local()


def uniqueness_check(fn: Callable) -> Callable:
    """Mark ``fn`` as a family's uniqueness or solvability check (a solution counter, a solver
    proving an instance can be solved): the seconds spent in it are added up per thread, so
    ``bench/synth_throughput.py`` can tell what the checks cost apart from generation. A check
    called from inside another is counted once."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if getattr(_CHECK_SECONDS, "depth", 0):
            return fn(*args, **kwargs)
        _CHECK_SECONDS.depth = 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _CHECK_SECONDS.depth = 0
            _CHECK_SECONDS.total = getattr(_CHECK_SECONDS, "total", 0.0) + time.perf_counter() - t0
    return timed


def uniqueness_seconds() -> float:
    """Seconds this thread has spent in ``uniqueness_check`` functions so far."""
    return getattr(_CHECK_SECONDS, "total", 0.0)


# --- the task interface --------------------------------------------------------------------

@dataclass(frozen=True)
class LevelParams:
    """Base for a task's typed difficulty parameters (each task subclasses it, frozen)."""


class SynthTask(ABC):
    name: ClassVar[str]
    family: ClassVar[str]
    levels: ClassVar[tuple[LevelParams, ...]]
    # an example of the answer format, shown in the prompt
    answer_example: ClassVar[str] = "42"
    # True when the gold answer is the only accepted one: any different answer is wrong
    unique_answer: ClassVar[bool] = True

    @property
    def n_levels(self) -> int:
        return len(self.levels)

    def params(self, level: int) -> LevelParams:
        if not isinstance(level, int) or not 0 <= level < len(self.levels):
            raise TaskError(f"task {self.name!r}: level {level!r} outside 0..{len(self.levels) - 1}")
        return self.levels[level]

    def level_params(self) -> list[dict[str, Any]]:
        return [asdict(p) if is_dataclass(p) else dict(p) for p in self.levels]

    def generate(self, seed: int, level: int) -> TaskInstance:
        params = self.params(level)
        rng = derive_rng(self.name, seed, level)
        question, answer, metadata = self.build(rng, params)
        metadata = {**metadata, "family": self.family, "params": asdict(params)}
        return TaskInstance(
            task=self.name, level=level, seed=int(seed), question=question,
            prompt=self.render_prompt(question), answer=answer, metadata=metadata,
        )

    def render_prompt(self, question: str) -> str:
        instruction = ANSWER_INSTRUCTION.format(example=self.answer_example)
        return PROMPT_TEMPLATE.format(question=question, instruction=instruction)

    def extract(self, response: Any) -> str | None:
        return extract_answer(response)

    def verify(self, instance: TaskInstance, response: Any) -> float:
        """Score of ``response`` in [0, 1]; 0 for anything unparsable or unscorable. Never raises
        (``verify_strict`` tells a verifier's failure from a wrong answer; callers that count
        errors use it, through ``tasks.verify.registry.verify_with_error``)."""
        try:
            return self.verify_strict(instance, response)
        except TaskVerifyError:
            return 0.0

    def verify_strict(self, instance: TaskInstance, response: Any) -> float:
        """Score of ``response`` in [0, 1]; 0 for garbage a model wrote (``check`` may raise on it).
        Raises ``TaskVerifyError`` when the verifier itself failed: ``check`` raised and does not
        accept the instance's own gold answer either, so its 0 would pass for a wrong answer."""
        try:
            answer = self.extract(response)
            if answer is None:
                return 0.0
            score = float(self.check(instance, answer))
        except Exception as e:  # a verifier must survive any garbage a model writes
            problem = self.gold_problem(instance)
            if problem is not None:
                raise TaskVerifyError(f"task {self.name!r}: check failed ({type(e).__name__}: {e}) "
                                      f"and {problem}") from e
            return 0.0
        return 0.0 if math.isnan(score) else min(1.0, max(0.0, score))

    def gold_problem(self, instance: TaskInstance) -> str | None:
        """Why ``check`` cannot score this instance (None: it accepts the instance's gold answer)."""
        try:
            gold = float(self.check(instance, str(instance.answer).strip()))
        except Exception as e:  # noqa: BLE001 - any failure on the gold is the verifier's
            return f"fails on the instance's own gold answer too ({type(e).__name__}: {e})"
        return None if gold >= 1.0 else f"scores the instance's own gold answer {gold:g}"

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        """Answers that are certainly wrong, to prove the verifier rejects them.

        The default suits unique-answer tasks: change one integer, or, failing that, one
        character. Tasks whose gold is one of several valid answers override this.
        """
        gold = instance.answer
        out = []
        tokens = list(_INT.finditer(gold))
        if tokens:
            tok = tokens[rng.randrange(len(tokens))]
            value = int(tok.group())
            out.append(gold[: tok.start()] + str(value + rng.choice([1, 2, 3])) + gold[tok.end():])
        else:
            out.append(gold + "x" if gold else "x")
        return out

    @abstractmethod
    def build(self, rng: random.Random, params: LevelParams) -> tuple[str, str, dict[str, Any]]:
        """(question, gold answer, metadata) for one instance; metadata must be JSON-safe."""

    @abstractmethod
    def check(self, instance: TaskInstance, answer: str) -> float:
        """Score an extracted answer; may raise on garbage (``verify`` turns that into 0, and
        ``verify_strict`` too unless the gold answer fails the same way)."""
