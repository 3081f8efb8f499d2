"""Language and symbol tasks: dyck completion and error finding, word sorting and its
mistakes, boolean expressions, web of lies, object counting, object properties."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from tasks.synth.arithmetic import single_int
from tasks.synth.base import LevelParams, SynthTask, TaskInstance, normalize_text
from tasks.synth.vocabulary import (
    CATEGORIES,
    COLORS,
    MATERIALS,
    NAMES,
    NUMBER_WORDS,
    OBJECT_KINDS,
    WORDS,
)

BRACKETS = ("()", "[]", "{}", "<>")
CLOSER = {o: c for o, c in BRACKETS}
OPENERS = {o for o, _ in BRACKETS}


def yes_no(answer: str) -> str | None:
    words = re.findall(r"[a-z]+", answer.lower())
    return words[0] if words and words[0] in ("yes", "no", "true", "false") else None


def flip_yes_no(gold: str) -> str:
    return {"Yes": "No", "No": "Yes", "True": "False", "False": "True"}[gold]


def random_dyck(rng: random.Random, pairs: int, kinds: int, max_depth: int) -> list[str]:
    """A balanced bracket sequence with ``pairs`` pairs drawn from the first ``kinds`` types."""
    out: list[str] = []
    stack: list[str] = []
    opened = 0
    while opened < pairs or stack:
        can_open = opened < pairs and len(stack) < max_depth
        if can_open and (not stack or rng.random() < 0.55):
            o = BRACKETS[rng.randrange(kinds)][0]
            out.append(o)
            stack.append(o)
            opened += 1
        else:
            out.append(CLOSER[stack.pop()])
    return out


def plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s")


def article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def symbols_of(text: str) -> list[str]:
    return [ch for ch in text if not ch.isspace()]


# --- dyck completion -------------------------------------------------------------------------

@dataclass(frozen=True)
class DyckParams(LevelParams):
    pairs: int
    kinds: int
    max_depth: int


class DyckCompletion(SynthTask):
    name = "dyck_completion"
    family = "language"
    answer_example = "] )"
    levels = (DyckParams(3, 2, 3), DyckParams(5, 2, 4), DyckParams(7, 3, 5),
              DyckParams(10, 3, 6), DyckParams(14, 4, 8), DyckParams(20, 4, 10))

    def build(self, rng: random.Random, p: DyckParams) -> tuple[str, str, dict[str, Any]]:
        seq = random_dyck(rng, p.pairs, p.kinds, p.max_depth)
        depth, cuts = 0, []
        for i, s in enumerate(seq):
            depth += 1 if s in OPENERS else -1
            if depth > 0:
                cuts.append(i + 1)
        cut = rng.choice(cuts)
        prefix = seq[:cut]
        stack: list[str] = []
        for s in prefix:
            if s in OPENERS:
                stack.append(s)
            else:
                stack.pop()
        closing = [CLOSER[o] for o in reversed(stack)]
        question = (
            "Complete the bracket sequence so that every bracket is properly closed, using as "
            f"few brackets as possible:\n{' '.join(prefix)}\nGive only the brackets you add, "
            "separated by spaces."
        )
        return question, " ".join(closing), {"prefix": "".join(prefix)}

    def check(self, instance: TaskInstance, answer: str) -> float:
        got = "".join(symbols_of(answer))
        prefix = instance.metadata["prefix"]
        if got.startswith(prefix) and len(got) > len(prefix):   # the whole sequence was repeated
            got = got[len(prefix):]
        return 1.0 if got == instance.answer.replace(" ", "") else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        gold = instance.answer.split()
        wrong_type = list(gold)
        i = rng.randrange(len(gold))
        wrong_type[i] = next(c for _, c in BRACKETS if c != gold[i])
        return [" ".join(gold[:-1]) or "(", " ".join(wrong_type)]


# --- dyck error finding ----------------------------------------------------------------------

def first_bracket_error(seq: list[str]) -> int:
    """1-based position of the first bracket that breaks balance; 0 if the sequence is balanced."""
    stack: list[str] = []
    for i, s in enumerate(seq):
        if s in OPENERS:
            stack.append(s)
        elif not stack or CLOSER[stack.pop()] != s:
            return i + 1
    return len(seq) + 1 if stack else 0


class DyckErrorFinding(SynthTask):
    name = "dyck_error"
    family = "language"
    answer_example = "7"
    levels = DyckCompletion.levels

    def build(self, rng: random.Random, p: DyckParams) -> tuple[str, str, dict[str, Any]]:
        seq = random_dyck(rng, p.pairs, p.kinds, p.max_depth)
        if rng.random() < 0.8:   # most instances carry one wrong closing bracket
            closers = [i for i, s in enumerate(seq) if s not in OPENERS]
            i = rng.choice(closers)
            kinds = max(p.kinds, 2)
            seq[i] = rng.choice([c for _, c in BRACKETS[:kinds] if c != seq[i]])
        position = first_bracket_error(seq)
        question = (
            "Brackets are numbered from 1, left to right. Find the position of the first bracket "
            f"that makes this sequence unbalanced, or answer 0 if it is balanced:\n{' '.join(seq)}"
        )
        return question, str(position), {"sequence": "".join(seq)}

    def check(self, instance: TaskInstance, answer: str) -> float:
        value = single_int(answer)
        if value is None and normalize_text(answer) in ("balanced", "none", "no error"):
            value = 0
        return 1.0 if value == int(instance.answer) else 0.0


# --- word sorting ----------------------------------------------------------------------------

def parse_word_list(answer: str) -> list[str]:
    return [w for w in re.split(r"[\s,;]+", answer.lower()) if w]


@dataclass(frozen=True)
class WordSortingParams(LevelParams):
    count: int
    descending: bool


class WordSorting(SynthTask):
    name = "word_sorting"
    family = "language"
    answer_example = "apple, banana, cherry"
    levels = (WordSortingParams(4, False), WordSortingParams(7, False), WordSortingParams(10, True),
              WordSortingParams(14, False), WordSortingParams(18, True), WordSortingParams(25, True))

    def build(self, rng: random.Random, p: WordSortingParams) -> tuple[str, str, dict[str, Any]]:
        words = rng.sample(WORDS, p.count)
        order = "reverse alphabetical (Z to A)" if p.descending else "alphabetical (A to Z)"
        question = (f"Sort these words in {order} order:\n{', '.join(words)}\n"
                    "Give the sorted words separated by commas.")
        return question, ", ".join(sorted(words, reverse=p.descending)), {"words": words}

    def check(self, instance: TaskInstance, answer: str) -> float:
        return 1.0 if parse_word_list(answer) == parse_word_list(instance.answer) else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        words = parse_word_list(instance.answer)
        i = rng.randrange(len(words) - 1)
        words[i], words[i + 1] = words[i + 1], words[i]
        return [", ".join(words), ", ".join(parse_word_list(instance.answer)[:-1])]


# --- word sorting mistakes -------------------------------------------------------------------

@dataclass(frozen=True)
class SortingMistakeParams(LevelParams):
    count: int


class WordSortingMistake(SynthTask):
    name = "word_sorting_mistake"
    family = "language"
    answer_example = "3"
    levels = (SortingMistakeParams(4), SortingMistakeParams(6), SortingMistakeParams(8),
              SortingMistakeParams(10), SortingMistakeParams(13))

    def build(self, rng: random.Random, p: SortingMistakeParams) -> tuple[str, str, dict[str, Any]]:
        words = rng.sample(WORDS, p.count)
        mistake_step = rng.randint(2, p.count) if rng.random() < 0.8 else 0
        steps: list[list[str]] = []
        current: list[str] = []
        for k, word in enumerate(words, start=1):
            position = sum(w < word for w in current)
            if k == mistake_step:
                wrong = [i for i in range(len(current) + 1) if i != position]
                position = rng.choice(wrong)
            current = current[:position] + [word] + current[position:]
            steps.append(list(current))
        lines = [f"Step {k}: insert '{w}' -> {', '.join(s)}" for k, (w, s) in enumerate(zip(words, steps), 1)]
        question = (
            f"Someone sorts these words alphabetically by inserting them one at a time into a "
            f"sorted list: {', '.join(words)}.\n" + "\n".join(lines)
            + "\nWhich step first puts the list out of alphabetical order? Answer with the step "
            "number, or 0 if every step is correct."
        )
        return question, str(mistake_step), {"words": words}

    def check(self, instance: TaskInstance, answer: str) -> float:
        value = single_int(answer)
        if value is None and normalize_text(answer) in ("none", "no mistake", "no"):
            value = 0
        return 1.0 if value == int(instance.answer) else 0.0


# --- boolean expressions ---------------------------------------------------------------------

@dataclass(frozen=True)
class BooleanParams(LevelParams):
    depth: int


class BooleanExpressions(SynthTask):
    name = "boolean_expressions"
    family = "language"
    answer_example = "True"
    levels = (BooleanParams(1), BooleanParams(2), BooleanParams(3), BooleanParams(4),
              BooleanParams(5), BooleanParams(6))

    def build(self, rng: random.Random, p: BooleanParams) -> tuple[str, str, dict[str, Any]]:
        text, value = self._expr(rng, p.depth)
        question = f"Evaluate the boolean expression (not binds tighter than and, and than or):\n{text}"
        return question, str(value), {"expression": text}

    def _expr(self, rng: random.Random, depth: int) -> tuple[str, bool]:
        if depth == 0:
            v = rng.random() < 0.5
            return str(v), v
        kind = rng.choice(["and", "or", "not", "and", "or"])
        if kind == "not":
            t, v = self._expr(rng, depth - 1)
            return f"not ({t})" if " " in t else f"not {t}", not v
        lt, lv = self._expr(rng, rng.randint(0, depth - 1))
        rt, rv = self._expr(rng, depth - 1)
        lt = f"({lt})" if " " in lt else lt
        rt = f"({rt})" if " " in rt else rt
        return f"{lt} {kind} {rt}", (lv and rv) if kind == "and" else (lv or rv)

    def check(self, instance: TaskInstance, answer: str) -> float:
        return 1.0 if yes_no(answer) == instance.answer.lower() else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        return [flip_yes_no(instance.answer)]


# --- web of lies -----------------------------------------------------------------------------

@dataclass(frozen=True)
class WebOfLiesParams(LevelParams):
    people: int
    any_reference: bool   # statements may be about anyone already mentioned, not just the last


class WebOfLies(SynthTask):
    name = "web_of_lies"
    family = "language"
    answer_example = "Yes"
    levels = (WebOfLiesParams(3, False), WebOfLiesParams(4, False), WebOfLiesParams(5, False),
              WebOfLiesParams(6, True), WebOfLiesParams(8, True), WebOfLiesParams(10, True))

    def build(self, rng: random.Random, p: WebOfLiesParams) -> tuple[str, str, dict[str, Any]]:
        names = rng.sample(NAMES, p.people)
        truthful = [rng.random() < 0.5]
        sentences = [f"{names[0]} {'tells the truth' if truthful[0] else 'lies'}."]
        for i in range(1, p.people):
            target = rng.randrange(i) if p.any_reference else i - 1
            truthful.append(rng.random() < 0.5)
            # what i claims about target is true exactly when i is truthful
            claim_truthful = truthful[target] if truthful[i] else not truthful[target]
            sentences.append(f"{names[i]} says {names[target]} {'tells the truth' if claim_truthful else 'lies'}.")
        question = " ".join(sentences) + f" Does {names[-1]} tell the truth? Answer Yes or No."
        return question, "Yes" if truthful[-1] else "No", {"names": names}

    def check(self, instance: TaskInstance, answer: str) -> float:
        return 1.0 if yes_no(answer) == instance.answer.lower() else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        return [flip_yes_no(instance.answer)]


# --- object counting -------------------------------------------------------------------------

@dataclass(frozen=True)
class CountingParams(LevelParams):
    kinds: int
    max_each: int


class ObjectCounting(SynthTask):
    name = "object_counting"
    family = "language"
    answer_example = "6"
    levels = (CountingParams(3, 1), CountingParams(5, 2), CountingParams(7, 3),
              CountingParams(9, 4), CountingParams(12, 5), CountingParams(15, 6))

    def build(self, rng: random.Random, p: CountingParams) -> tuple[str, str, dict[str, Any]]:
        categories = sorted(CATEGORIES)
        asked = rng.choice(categories)
        items = [(cat, item) for cat in categories for item in CATEGORIES[cat]]
        chosen = rng.sample(items, p.kinds)
        if not any(cat == asked for cat, _ in chosen):   # item names are unique across categories
            chosen[0] = (asked, rng.choice(CATEGORIES[asked]))
        parts, total = [], 0
        for cat, item in chosen:
            k = rng.randint(1, p.max_each)
            parts.append(article(item) if k == 1 else f"{NUMBER_WORDS[k]} {plural(item)}")
            total += k if cat == asked else 0
        question = f"I have {', '.join(parts[:-1])} and {parts[-1]}. How many {asked} do I have?"
        return question, str(total), {"category": asked}

    def check(self, instance: TaskInstance, answer: str) -> float:
        value = single_int(answer)
        if value is None:
            words = normalize_text(answer).split()
            value = NUMBER_WORDS.index(words[0]) if words and words[0] in NUMBER_WORDS else None
        return 1.0 if value == int(instance.answer) else 0.0


# --- object properties -----------------------------------------------------------------------

@dataclass(frozen=True)
class PropertiesParams(LevelParams):
    objects: int
    operations: int


class ObjectProperties(SynthTask):
    name = "object_properties"
    family = "language"
    answer_example = "3"
    levels = (PropertiesParams(4, 0), PropertiesParams(6, 1), PropertiesParams(8, 2),
              PropertiesParams(10, 3), PropertiesParams(12, 4), PropertiesParams(15, 5))

    def build(self, rng: random.Random, p: PropertiesParams) -> tuple[str, str, dict[str, Any]]:
        objects = [{"color": rng.choice(COLORS), "material": rng.choice(MATERIALS),
                    "kind": rng.choice(OBJECT_KINDS)} for _ in range(p.objects)]
        listing = ", ".join(article(f"{o['color']} {o['material']} {o['kind']}") for o in objects)
        steps = []
        for _ in range(p.operations):
            op = rng.choice(["remove_color", "repaint_material", "remove_kind"])
            if op == "remove_color":
                color = rng.choice(COLORS)
                objects = [o for o in objects if o["color"] != color]
                steps.append(f"I give away every {color} item.")
            elif op == "repaint_material":
                material, color = rng.choice(MATERIALS), rng.choice(COLORS)
                for o in objects:
                    if o["material"] == material:
                        o["color"] = color
                steps.append(f"I paint every {material} item {color}.")
            else:
                kind = rng.choice(OBJECT_KINDS)
                objects = [o for o in objects if o["kind"] != kind]
                steps.append(f"I throw away every {kind}.")
        attr = rng.choice(["color", "material"])
        value = rng.choice(COLORS if attr == "color" else MATERIALS)
        count = sum(o[attr] == value for o in objects)
        question = (f"On my desk there are: {listing}. " + " ".join(steps)
                    + f" How many {value} items are on my desk now?")
        return question, str(count), {"attribute": attr, "value": value}

    check = ObjectCounting.check
