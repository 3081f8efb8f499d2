"""Logic and spatial puzzles: zebra puzzles, compass directions on a plane, nested layouts.

``zebra_puzzle`` hides a random assignment of attributes to houses and adds clues, each one
ruling out a rival solution the solver found, until the solver proves the assignment unique;
redundant clues are then dropped. ``space_reasoning`` places objects at integer points and
describes a tree of relative offsets (some of them only qualitative), asking for the compass
direction between two objects that are not directly related; the answer is recomputed from
the statements and kept only when they determine it. ``space_reasoning_tree`` nests regions
inside regions, lays every region's children out in a row or a column, and asks how two
pictures in different branches lie relative to each other.
"""
from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from typing import Any

from tasks.synth.base import (
    LevelParams,
    SynthTask,
    TaskInstance,
    uniqueness_check,
)
from tasks.synth.vocabulary import COLORS, NAMES

_WORD = re.compile(r"[a-z0-9]+")


def _capitalize(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _plain_answer(answer: str) -> str:
    """Lower-cased words of an answer, without punctuation or a leading article."""
    words = _WORD.findall(answer.lower())
    if words and words[0] in ("the", "a", "an"):
        words = words[1:]
    return " ".join(words)


# --- zebra puzzle --------------------------------------------------------------------------

@dataclass(frozen=True)
class ZebraCategory:
    key: str
    label: str            # plural, for the listing
    values: tuple[str, ...]
    subject: str          # noun phrase naming the person with value {v}
    predicate: str        # verb phrase saying a person has value {v}
    ask: str              # question for this category about the person {p}


ZEBRA_NAMES = ZebraCategory("name", "Names", NAMES[:10], "{v}", "is {v}", "Who is {p}?")
ZEBRA_CATEGORIES = (
    ZebraCategory("color", "House colors", COLORS, "the person in the {v} house",
                  "lives in the {v} house", "What color is the house of {p}?"),
    ZebraCategory("pet", "Pets", ("cat", "dog", "fish", "bird", "horse", "rabbit", "turtle", "hamster"),
                  "the person who keeps the {v}", "keeps the {v}", "Which pet does {p} keep?"),
    ZebraCategory("drink", "Drinks", ("tea", "coffee", "milk", "water", "juice", "cocoa", "lemonade",
                                      "soda"),
                  "the person who drinks {v}", "drinks {v}", "What does {p} drink?"),
    ZebraCategory("hobby", "Hobbies", ("chess", "painting", "gardening", "cycling", "fishing", "dancing",
                                       "reading", "hiking"),
                  "the person who enjoys {v}", "enjoys {v}", "Which hobby does {p} enjoy?"),
    ZebraCategory("food", "Favourite foods", ("pizza", "pasta", "salad", "soup", "curry", "sushi",
                                              "tacos", "bread"),
                  "the person who likes {v}", "likes {v}", "Which food does {p} like?"),
    ZebraCategory("instrument", "Instruments", ("piano", "violin", "flute", "drum", "guitar", "cello",
                                                "harp", "trumpet"),
                  "the person who plays the {v}", "plays the {v}", "Which instrument does {p} play?"),
)
ZEBRA_BY_KEY = {c.key: c for c in (ZEBRA_NAMES, *ZEBRA_CATEGORIES)}
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")

# clue kinds: ("same", a, b), ("diff", a, b), ("left", a, b): a somewhere left of b,
# ("right", a, b): a somewhere right of b, ("adjacent_left", a, b): a directly left of b,
# ("next", a, b): neighbours, ("at", a, h), ("not_at", a, h); a, b are item indices
# (category * houses + value index), h a 0-based house
ZEBRA_CLUE_WEIGHTS = (("same", 6), ("next", 4), ("adjacent_left", 3), ("left", 2), ("right", 2),
                      ("diff", 2), ("at", 1), ("not_at", 1))


def zebra_clue_holds(clue: list | tuple, pos: list[int] | tuple[int, ...]) -> bool:
    kind, a, b = clue
    if kind == "at":
        return pos[a] == b
    if kind == "not_at":
        return pos[a] != b
    pa, pb = pos[a], pos[b]
    return {"same": pa == pb, "diff": pa != pb, "left": pa < pb, "right": pa > pb,
            "adjacent_left": pa + 1 == pb, "next": abs(pa - pb) == 1}[kind]


def _zebra_propagate(dom: list[int], binary: list[tuple[str, int, int]], houses: int,
                     categories: int) -> bool:
    """Narrow the house bitmasks ``dom`` in place to a fixpoint; False on a contradiction."""
    full = (1 << houses) - 1
    changed = True
    while changed:
        changed = False
        for kind, a, b in binary:
            da, db = dom[a], dom[b]
            if kind == "same":
                na = nb = da & db
            elif kind == "diff":
                na = da & ~db if db & (db - 1) == 0 else da
                nb = db & ~da if da & (da - 1) == 0 else db
            elif kind == "left":          # pos[a] < pos[b]
                na = da & ((1 << (db.bit_length() - 1)) - 1)
                nb = db & ~((1 << (da & -da).bit_length()) - 1)
            elif kind == "adjacent_left":  # pos[a] + 1 == pos[b]
                na = da & (db >> 1)
                nb = db & (da << 1) & full
            else:                         # next
                na = da & ((db << 1) | (db >> 1)) & full
                nb = db & ((da << 1) | (da >> 1)) & full
            if na != da or nb != db:
                if not na or not nb:
                    return False
                dom[a], dom[b] = na, nb
                changed = True
        for c in range(categories):
            items = range(c * houses, (c + 1) * houses)
            taken = 0
            for i in items:
                d = dom[i]
                if d & (d - 1) == 0:
                    if taken & d:
                        return False
                    taken |= d
            for i in items:
                d = dom[i]
                if d & (d - 1) and d & taken:
                    d &= ~taken
                    if not d:
                        return False
                    dom[i] = d
                    changed = True
            for h in range(houses):
                bit = 1 << h
                holders = [i for i in items if dom[i] & bit]
                if not holders:
                    return False
                if len(holders) == 1 and dom[holders[0]] != bit:
                    dom[holders[0]] = bit
                    changed = True
    return True


@uniqueness_check
def solve_zebra(houses: int, categories: int, clues: list, limit: int = 2) -> list[tuple[int, ...]]:
    """Up to ``limit`` solutions (each the 0-based house of every item) of a zebra puzzle."""
    full = (1 << houses) - 1
    dom = [full] * (houses * categories)
    binary: list[tuple[str, int, int]] = []
    for kind, a, b in clues:
        if kind == "at":
            dom[a] &= 1 << b
        elif kind == "not_at":
            dom[a] &= ~(1 << b)
        elif kind == "right":
            binary.append(("left", b, a))
        else:
            binary.append((kind, a, b))
    solutions: list[tuple[int, ...]] = []

    def search(dom: list[int]) -> None:
        if not _zebra_propagate(dom, binary, houses, categories):
            return
        best, best_count = -1, houses + 1
        for i, d in enumerate(dom):
            n = d.bit_count()
            if 1 < n < best_count:
                best, best_count = i, n
        if best < 0:
            solutions.append(tuple(d.bit_length() - 1 for d in dom))
            return
        d = dom[best]
        while d and len(solutions) < limit:
            bit = d & -d
            d ^= bit
            trial = list(dom)
            trial[best] = bit
            search(trial)

    if all(dom):
        search(dom)
    return solutions


def count_zebra_solutions(houses: int, categories: int, clues: list, limit: int = 2) -> int:
    return len(solve_zebra(houses, categories, clues, limit))


@dataclass(frozen=True)
class ZebraParams(LevelParams):
    houses: int
    categories: int     # attribute categories, names included


class ZebraPuzzle(SynthTask):
    name = "zebra_puzzle"
    family = "logic"
    answer_example = "Alice"
    levels = (ZebraParams(3, 2), ZebraParams(3, 3), ZebraParams(4, 3), ZebraParams(4, 4),
              ZebraParams(5, 4), ZebraParams(5, 5), ZebraParams(6, 5), ZebraParams(6, 6))

    def build(self, rng: random.Random, p: ZebraParams) -> tuple[str, str, dict[str, Any]]:
        n, k = p.houses, p.categories
        cats = [ZEBRA_NAMES] + rng.sample(ZEBRA_CATEGORIES, k - 1)
        values = [rng.sample(c.values, n) for c in cats]
        hidden: list[int] = []
        for _ in cats:
            perm = list(range(n))
            rng.shuffle(perm)
            hidden.extend(perm)
        clues: list[list] = []
        while True:
            found = solve_zebra(n, k, clues, limit=2)
            if len(found) == 1:
                break
            rival = found[0] if list(found[0]) != hidden else found[1]
            clues.append(self._ruling_out_clue(rng, n, k, hidden, rival))
        order = list(range(len(clues)))
        rng.shuffle(order)
        dropped: set[int] = set()
        for i in order:   # drop clues the others already imply
            rest = [c for j, c in enumerate(clues) if j != i and j not in dropped]
            if count_zebra_solutions(n, k, rest) == 1:
                dropped.add(i)
        clues = [c for j, c in enumerate(clues) if j not in dropped]
        rng.shuffle(clues)

        def item_text(i: int, role: str) -> str:
            c, v = divmod(i, n)
            return getattr(cats[c], role).format(v=values[c][v])

        question_text, answer, ask = self._question(rng, n, k, cats, values, hidden, clues, item_text)
        listing = "\n".join(f"- {c.label}: {', '.join(sorted(vals))}" for c, vals in zip(cats, values))
        lines = [f"{i}. {self._clue_text(c, item_text, n)}" for i, c in enumerate(clues, 1)]
        question = (
            f"There are {n} houses in a row, numbered 1 to {n} from left to right. Each house has "
            f"exactly one occupant, and each occupant has exactly one value of every attribute "
            f"below; no two occupants share a value.\n{listing}\n"
            f"'Somewhere to the left' allows houses in between; 'directly to the left' means the "
            f"neighbouring house; 'next to each other' means neighbouring houses.\n"
            f"Clues:\n" + "\n".join(lines) + f"\n\n{question_text}"
        )
        solution = [{cats[c].key: values[c][v] for c in range(k) for v in range(n)
                     if hidden[c * n + v] == h} for h in range(n)]
        metadata = {
            "houses": n, "categories": [c.key for c in cats], "values": values,
            "clues": clues, "solution": solution, "ask": ask,
        }
        return question, answer, metadata

    @staticmethod
    def _ruling_out_clue(rng: random.Random, n: int, k: int, hidden: list[int],
                         rival: tuple[int, ...]) -> list:
        """A random clue true of ``hidden`` and false of ``rival``."""
        kinds = [kd for kd, _ in ZEBRA_CLUE_WEIGHTS]
        weights = [w for _, w in ZEBRA_CLUE_WEIGHTS]
        items = n * k
        for _ in range(300):
            kind = rng.choices(kinds, weights)[0]
            a = rng.randrange(items)
            if kind in ("at", "not_at"):
                h = hidden[a] if kind == "at" else rng.choice([x for x in range(n) if x != hidden[a]])
                clue = [kind, a, h]
            else:
                b = rng.randrange(items)
                if a // n == b // n:
                    continue
                clue = [kind, a, b]
                if not zebra_clue_holds(clue, hidden):
                    if kind == "left":
                        clue = ["right", a, b]
                    elif kind == "right":
                        clue = ["left", a, b]
                    elif kind == "adjacent_left" and hidden[b] + 1 == hidden[a]:
                        clue = ["adjacent_left", b, a]
                    elif kind == "same":
                        same = [x for x in range((b // n) * n, (b // n + 1) * n) if hidden[x] == hidden[a]]
                        clue = ["same", a, same[0]]
                    else:
                        continue
            if zebra_clue_holds(clue, hidden) and not zebra_clue_holds(clue, rival):
                return clue
        a = rng.choice([i for i in range(items) if hidden[i] != rival[i]])
        return ["at", a, hidden[a]]

    @staticmethod
    def _clue_text(clue: list, item_text, n: int) -> str:
        kind, a, b = clue
        sa = item_text(a, "subject")
        if kind == "at":
            where = "the first house" if b == 0 else "the last house" if b == n - 1 else f"house {b + 1}"
            return _capitalize(f"{sa} lives in {where}.")
        if kind == "not_at":
            return _capitalize(f"{sa} does not live in house {b + 1}.")
        sb = item_text(b, "subject")
        text = {
            "same": f"{sa} {item_text(b, 'predicate')}.",
            "diff": f"{sa} and {sb} live in different houses.",
            "left": f"{sa} lives somewhere to the left of {sb}.",
            "right": f"{sa} lives somewhere to the right of {sb}.",
            "adjacent_left": f"{sa} lives directly to the left of {sb}.",
            "next": f"{sa} and {sb} live next to each other.",
        }[kind]
        return _capitalize(text)

    @staticmethod
    def _question(rng, n, k, cats, values, hidden, clues, item_text):
        """(question, answer, ask) about a pair that no single clue links directly."""
        direct = set()
        for kind, a, b in clues:
            if kind == "same":
                direct.add((a, b // n))
                direct.add((b, a // n))
            elif kind == "at":
                direct.add((a, -1))
        options = [(i, c) for i in range(n * k) for c in [-1, *range(k)]
                   if c != i // n and (i, c) not in direct]
        if not options:
            options = [(i, c) for i in range(n * k) for c in [-1, *range(k)] if c != i // n]
        item, target = rng.choice(options)
        subject = item_text(item, "subject")
        if target == -1:
            if cats[item // n].key == "color":
                color = values[item // n][item % n]
                text = f"Which house (1 to {n}) is the {color} house? Answer with the house number."
            else:
                text = f"In which house (1 to {n}) does {subject} live? Answer with the house number."
            return text, str(hidden[item] + 1), "house"
        value = next(values[target][v] for v in range(n) if hidden[target * n + v] == hidden[item])
        if target == 0:
            text = f"Who {item_text(item, 'predicate')}? Answer with a name."
        else:
            label = cats[target].label.lower()
            text = cats[target].ask.format(p=subject) + f" Answer with one of the {label} listed."
        return _capitalize(text), value, cats[target].key

    def check(self, instance: TaskInstance, answer: str) -> float:
        gold = instance.answer
        if instance.metadata["ask"] == "house":
            got = self._house_number(answer)
            return 1.0 if got is not None and got == int(gold) else 0.0
        return 1.0 if _plain_answer(answer) == gold.lower() else 0.0

    @staticmethod
    def _house_number(answer: str) -> int | None:
        words = [w for w in _plain_answer(answer).split() if w not in ("house", "number", "no")]
        if len(words) != 1:
            return None
        word = words[0]
        if word.isdigit():
            return int(word)
        m = re.fullmatch(r"(\d+)(st|nd|rd|th)", word)
        if m:
            return int(m.group(1))
        return ORDINALS.index(word) + 1 if word in ORDINALS else None

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        meta = instance.metadata
        n = meta["houses"]
        if meta["ask"] == "house":
            others = [str(h) for h in range(1, n + 1) if str(h) != instance.answer]
        else:
            c = meta["categories"].index(meta["ask"])
            others = [v for v in meta["values"][c] if v != instance.answer]
        return rng.sample(others, min(3, len(others)))


# --- space reasoning: compass directions on a plane -----------------------------------------

SPACE_OBJECTS = (
    "lamp", "chair", "vase", "table", "clock", "bench", "statue", "well", "oak tree", "fountain",
    "tent", "barrel", "crate", "flagpole", "boulder", "cart", "ladder", "scarecrow", "mailbox",
    "signpost",
)
DIRECTIONS = {   # (sign of east offset, sign of north offset) -> name
    (0, 1): "north", (1, 1): "north-east", (1, 0): "east", (1, -1): "south-east",
    (0, -1): "south", (-1, -1): "south-west", (-1, 0): "west", (-1, 1): "north-west",
}
DIRECTION_NAMES = tuple(DIRECTIONS.values())
_DIRECTION_SPELLINGS = {}
for _dir in DIRECTIONS.values():
    _DIRECTION_SPELLINGS[_dir.replace("-", "")] = _dir
    _DIRECTION_SPELLINGS["".join(part[0] for part in _dir.split("-"))] = _dir


def parse_direction(answer: str) -> str | None:
    """A compass direction in any usual spelling ("north-east", "northeast", "NE", "N.E.")."""
    text = re.sub(r"[^a-z]", "", answer.lower()).removeprefix("due")
    return _DIRECTION_SPELLINGS.get(text)


def _sign(x: int) -> int:
    return (x > 0) - (x < 0)


@uniqueness_check
def determined_direction(path: list[tuple[int, int, bool, bool]]) -> tuple[int, int] | None:
    """The (east, north) signs every placement consistent with the statements gives the offset
    summed along ``path``, or None when the statements leave either sign open or the offset may
    be zero. Each step is (dx, dy, x_known, y_known): a known component is exact, an unknown one
    is only known to have the sign of the value given (any positive or negative amount)."""
    signs = []
    for axis in (0, 1):
        exact = sum(step[axis] for step in path if step[2 + axis])
        free = {_sign(step[axis]) for step in path if not step[2 + axis] and step[axis]}
        if not free:
            s = _sign(exact)
        elif free == {1}:
            s = 1 if exact >= 0 else None
        elif free == {-1}:
            s = -1 if exact <= 0 else None
        else:
            s = None
        if s is None:
            return None
        signs.append(s)
    return None if signs == [0, 0] else (signs[0], signs[1])


@dataclass(frozen=True)
class SpaceParams(LevelParams):
    objects: int
    min_path: int     # statements linking the two objects asked about, at least
    vague: int        # statements giving only a direction, not a distance, at most


class SpaceReasoning(SynthTask):
    name = "space_reasoning"
    family = "spatial"
    answer_example = "north-west"
    levels = (SpaceParams(3, 2, 0), SpaceParams(4, 2, 0), SpaceParams(5, 3, 1), SpaceParams(6, 3, 2),
              SpaceParams(8, 4, 3), SpaceParams(10, 5, 4))

    def build(self, rng: random.Random, p: SpaceParams) -> tuple[str, str, dict[str, Any]]:
        names = rng.sample(SPACE_OBJECTS, p.objects)
        parent = [-1] + list(range(p.min_path)) + [0] * (p.objects - p.min_path - 1)
        for i in range(p.min_path + 1, p.objects):
            parent[i] = rng.randrange(i)
        pos = [(0, 0)]
        offsets: list[tuple[int, int]] = [(0, 0)]
        for i in range(1, p.objects):
            while True:
                if rng.random() < 0.4:
                    d = rng.choice([1, -1]) * rng.randint(1, 4)
                    off = (d, 0) if rng.random() < 0.5 else (0, d)
                else:
                    off = (rng.choice([1, -1]) * rng.randint(1, 4), rng.choice([1, -1]) * rng.randint(1, 4))
                here = (pos[parent[i]][0] + off[0], pos[parent[i]][1] + off[1])
                if here not in pos:
                    break
            pos.append(here)
            offsets.append(off)

        def ancestors(i: int) -> list[int]:
            out = [i]
            while parent[out[-1]] >= 0:
                out.append(parent[out[-1]])
            return out

        def path_nodes(u: int, w: int) -> tuple[list[int], list[int]]:
            """Nodes whose parent edge is walked upward from u, and those walked down to w."""
            au, aw = ancestors(u), ancestors(w)
            common = next(x for x in au if x in aw)
            return au[:au.index(common)], aw[:aw.index(common)]

        pairs = []
        for u in range(p.objects):
            for w in range(p.objects):
                up, down = path_nodes(u, w)
                if u != w and len(up) + len(down) >= p.min_path:
                    pairs.append((u, w))
        u, w = rng.choice(pairs)          # where is u relative to w
        up, down = path_nodes(u, w)
        vague = [False] * p.objects

        def walk() -> list[tuple[int, int, bool, bool]]:
            """The offsets from w to u, step by step, with which components are exact."""
            steps = []
            for i, sign in [(i, 1) for i in up] + [(i, -1) for i in down]:
                dx, dy = offsets[i][0] * sign, offsets[i][1] * sign
                # a vague statement keeps only the signs; "directly north" keeps the zero exact
                steps.append((dx, dy, not vague[i] or dx == 0, not vague[i] or dy == 0))
            return steps

        on_path = up + down
        rng.shuffle(on_path)
        off_path = [i for i in range(1, p.objects) if i not in on_path]
        rng.shuffle(off_path)
        budget = p.vague
        for i in on_path + off_path:
            if budget == 0:
                break
            vague[i] = True
            if determined_direction(walk()) is None:
                vague[i] = False
            else:
                budget -= 1
        signs = determined_direction(walk())
        if signs is None or signs != (_sign(pos[u][0] - pos[w][0]), _sign(pos[u][1] - pos[w][1])):
            raise RuntimeError(f"{self.name}: the statements do not determine the direction")
        statements = []
        for i in range(1, p.objects):
            a, b, off = i, parent[i], offsets[i]
            if rng.random() < 0.5:
                a, b, off = b, a, (-off[0], -off[1])
            statements.append(self._statement(names[a], names[b], off, vague[i]))
        rng.shuffle(statements)
        options = ", ".join(DIRECTION_NAMES)
        question = (
            "Some objects stand on a flat field; north is up and east is to the right. "
            "'3 units north and 2 units west' is an exact displacement, and '3 units north' alone "
            "means due north (no east-west shift). 'Directly north, at an unknown distance' means due "
            "north by some positive distance. 'Somewhere to the north-east' means further north and "
            "further east, by unknown positive amounts.\n"
            + "\n".join(statements)
            + f"\n\nIn which direction is the {names[u]} from the {names[w]}? A diagonal answer such "
            f"as north-east means the {names[u]} is both further north and further east than the "
            f"{names[w]} (not necessarily at 45 degrees); a plain answer such as north means due north. "
            f"Answer with one of: {options}."
        )
        metadata = {
            "objects": names, "positions": [list(q) for q in pos], "parent": parent,
            "vague": vague, "asked": [names[u], names[w]],
        }
        return question, DIRECTIONS[signs], metadata

    @staticmethod
    def _statement(a: str, b: str, off: tuple[int, int], vague: bool) -> str:
        dx, dy = off
        ns = "north" if dy > 0 else "south"
        ew = "east" if dx > 0 else "west"
        if vague:
            if dx == 0 or dy == 0:
                return f"The {a} is directly {ns if dx == 0 else ew} of the {b}, at an unknown distance."
            return f"The {a} is somewhere to the {ns}-{ew} of the {b}."

        def units(d: int) -> str:
            return f"{abs(d)} unit{'s' if abs(d) != 1 else ''}"

        parts = ([f"{units(dy)} {ns}"] if dy else []) + ([f"{units(dx)} {ew}"] if dx else [])
        return f"The {a} is {' and '.join(parts)} of the {b}."

    def check(self, instance: TaskInstance, answer: str) -> float:
        return 1.0 if parse_direction(answer) == instance.answer else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        i = DIRECTION_NAMES.index(instance.answer)
        opposite = DIRECTION_NAMES[(i + 4) % 8]
        near = DIRECTION_NAMES[(i + rng.choice([1, -1])) % 8]
        return [opposite, near, near.upper().replace("-", " ")]


# --- space reasoning tree: nested regions laid out in rows and columns -----------------------

REGION_KINDS = ("section", "zone", "panel", "frame", "box")   # outermost first
REGION_PLURALS = {"section": "sections", "zone": "zones", "panel": "panels", "frame": "frames",
                  "box": "boxes"}
REGION_LABELS = {
    "section": ("Alpha", "Beta", "Gamma", "Delta", "Epsilon", "Zeta", "Eta", "Theta", "Iota",
                "Kappa", "Lambda", "Sigma", "Tau", "Omega", "Rho", "Omicron"),
    "zone": ("Amber", "Birch", "Coral", "Dune", "Ember", "Fern", "Glade", "Haze", "Ivory", "Jade",
             "Kelp", "Lotus", "Maple", "Nova", "Onyx", "Pine"),
    "panel": tuple("ABCDEFGHJKLMNPQRSTUVWXYZ"),
    "frame": tuple(str(i) for i in range(1, 41)),
    "box": tuple(f"{c}{d}" for c in "KMPRSTVWXZ" for d in "23456789"),
}
PICTURES = (
    "anchor", "apple", "arrow", "balloon", "bell", "bicycle", "boat", "candle", "castle", "cat",
    "cloud", "crown", "diamond", "dolphin", "drum", "feather", "fish", "flag", "flower", "guitar",
    "hammer", "heart", "horse", "kettle", "key", "kite", "lantern", "leaf", "lemon", "moon",
    "mushroom", "owl", "pencil", "rocket", "shell", "snowflake", "star", "sun", "tree", "umbrella",
    "violin", "whale",
)
RELATION_WORDS = ("left", "right", "above", "below")
OPPOSITE = {"left": "right", "right": "left", "above": "below", "below": "above"}
_RELATION_FILLER = ("to", "the", "of", "on", "is")


def parse_relation(answer: str) -> str | None:
    words = [w for w in _WORD.findall(answer.lower()) if w not in _RELATION_FILLER]
    return words[0] if len(words) == 1 and words[0] in RELATION_WORDS else None


@uniqueness_check
def derive_relation(parent: dict[str, str], relations: list[tuple[str, str, str]], a: str,
                    c: str) -> str | None:
    """Where ``a`` lies relative to ``c``, derived from the containment map (part -> region) and
    the stated relations (x, word, y) between parts of one region alone; None if not derived."""
    def chain(x: str) -> list[str]:
        out = [x]
        while out[-1] in parent:
            out.append(parent[out[-1]])
        return out

    ca, cc = chain(a), chain(c)
    common = next((x for x in ca if x in cc), None)
    if common is None or common in (a, c):
        return None
    x, y = ca[ca.index(common) - 1], cc[cc.index(common) - 1]
    before: dict[tuple[str, str], list[str]] = {}   # (axis, part) -> parts after it on that axis
    for p, word, q in relations:
        axis = "row" if word in ("left", "right") else "column"
        first, second = (p, q) if word in ("left", "above") else (q, p)
        before.setdefault((axis, first), []).append(second)

    def reaches(axis: str, start: str, goal: str) -> bool:
        seen, todo = {start}, [start]
        while todo:
            for nxt in before.get((axis, todo.pop()), []):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    found = [word for axis, words in (("row", ("left", "right")), ("column", ("above", "below")))
             for word, (s, t) in zip(words, ((x, y), (y, x))) if reaches(axis, s, t)]
    return found[0] if len(found) == 1 else None


@dataclass(frozen=True)
class TreeParams(LevelParams):
    depth: int          # levels of regions between the board and the pictures
    branching: int      # parts of every region that is described
    distractors: int    # described branches beyond the two holding the asked pictures


class SpaceReasoningTree(SynthTask):
    name = "space_reasoning_tree"
    family = "spatial"
    answer_example = "left"
    levels = (TreeParams(1, 2, 0), TreeParams(2, 2, 0), TreeParams(2, 3, 1), TreeParams(3, 3, 1),
              TreeParams(4, 3, 2), TreeParams(5, 3, 2))

    def build(self, rng: random.Random, p: TreeParams) -> tuple[str, str, dict[str, Any]]:
        d, b = p.depth, p.branching
        kinds = REGION_KINDS[len(REGION_KINDS) - d:]
        # a path is the child index taken at levels 1..d+1 (the last one picks the picture)
        first = [rng.randrange(b) for _ in range(d + 1)]
        split = rng.randrange(d)               # the asked pictures' regions part at level split+1
        second = first[:split] + [rng.choice([x for x in range(b) if x != first[split]])]
        second += [rng.randrange(b) for _ in range(d + 1 - len(second))]
        paths = [first, second] + [[rng.randrange(b) for _ in range(d + 1)] for _ in range(p.distractors)]
        expanded: list[tuple[int, ...]] = []    # regions (index paths) whose parts are described
        for path in paths:
            for level in range(d + 1):
                node = tuple(path[:level])
                if node not in expanded:
                    expanded.append(node)
        labels: dict[tuple[int, ...], str] = {(): "the board"}
        pools = {kind: rng.sample(REGION_LABELS[kind], len(REGION_LABELS[kind])) for kind in kinds}
        pictures = rng.sample(PICTURES, len(PICTURES))
        layout: dict[tuple[int, ...], tuple[str, list[int]]] = {}
        for node in expanded:
            kind = kinds[len(node)] if len(node) < d else None
            for x in range(b):
                labels[node + (x,)] = f"{kind} {pools[kind].pop()}" if kind else f"the {pictures.pop()}"
            order = list(range(b))
            rng.shuffle(order)
            layout[node] = ("row" if rng.random() < 0.5 else "column", order)
        statements = []
        relations: list[tuple[str, str, str]] = []
        for node in expanded:
            parts = [labels[node + (x,)] for x in range(b)]
            rng.shuffle(parts)
            verb = "holds the pictures" if len(node) == d else "is divided into"
            statements.append(f"{_capitalize(labels[node])} {verb}: {_join(parts)}.")
            how, order = layout[node]
            for x, y in itertools.pairwise(order):   # x lies just left of / above y
                first_word, second_word = ("left", "right") if how == "row" else ("above", "below")
                if rng.random() < 0.5:
                    relations.append((labels[node + (x,)], first_word, labels[node + (y,)]))
                else:
                    relations.append((labels[node + (y,)], second_word, labels[node + (x,)]))
                statements.append(self._relation(*relations[-1]))
        rng.shuffle(statements)
        how, order = layout[tuple(first[:split])]
        before = order.index(first[split]) < order.index(second[split])
        if how == "row":
            answer = "left" if before else "right"
        else:
            answer = "above" if before else "below"
        a, c = labels[tuple(first)], labels[tuple(second)]
        parent_of = {labels[node + (x,)]: labels[node] for node in expanded for x in range(b)}
        if derive_relation(parent_of, relations, a, c) != answer:
            raise RuntimeError(f"{self.name}: the statements do not determine {answer!r}")
        nesting = ", ".join(f"each {k} into {REGION_PLURALS[k2]}" for k, k2 in itertools.pairwise(kinds))
        intro = (f"A board is divided into {REGION_PLURALS[kinds[0]]}" + (f", {nesting}" if nesting else "")
                 + f", and each {kinds[-1]} holds small pictures. Regions never overlap and everything "
                 f"in a region lies inside it, so if one region is left of another, everything in the "
                 f"first is left of everything in the second (likewise for above and below). The parts "
                 f"of any one region lie either side by side in a row or stacked in a column.")
        question = (
            intro + "\n" + "\n".join(statements)
            + f"\n\nWhere is {a} relative to {c}? Exactly one of left, right, above and below follows "
            f"from the description; answer with that one word."
        )
        metadata = {"asked": [a, c], "depth": d, "split_level": split,
                    "statements": len(statements)}
        return question, answer, metadata

    @staticmethod
    def _relation(a: str, word: str, c: str) -> str:
        phrase = f"{word} of" if word in ("left", "right") else word
        return f"{_capitalize(a)} is {phrase} {c}."

    def check(self, instance: TaskInstance, answer: str) -> float:
        return 1.0 if parse_relation(answer) == instance.answer else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        others = [w for w in RELATION_WORDS if w != instance.answer]
        rng.shuffle(others)
        return [OPPOSITE[instance.answer], f"to the {others[0]}", others[1].upper()]

