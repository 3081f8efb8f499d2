"""Goods exchange: track who holds what through a sequence of swaps and hand-overs."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tasks.synth.base import LevelParams, SynthTask, TaskInstance, normalize_text
from tasks.synth.vocabulary import GOODS, NAMES


def strip_article(text: str) -> str:
    words = normalize_text(text).rstrip(".").split()
    return " ".join(words[1:] if words and words[0] in ("a", "an", "the") else words)


@dataclass(frozen=True)
class ExchangeParams(LevelParams):
    people: int
    moves: int
    rotations: bool     # three-way rotations besides pairwise swaps


class GoodsExchange(SynthTask):
    name = "goods_exchange"
    family = "exchange"
    answer_example = "kite"
    levels = (ExchangeParams(3, 2, False), ExchangeParams(3, 4, False), ExchangeParams(4, 5, False),
              ExchangeParams(5, 6, True), ExchangeParams(6, 9, True), ExchangeParams(7, 12, True))

    def build(self, rng: random.Random, p: ExchangeParams) -> tuple[str, str, dict[str, Any]]:
        names = rng.sample(NAMES, p.people)
        goods = rng.sample(GOODS, p.people)
        holding = dict(zip(names, goods))
        steps = []
        for _ in range(p.moves):
            if p.rotations and rng.random() < 0.35:
                a, b, c = rng.sample(names, 3)
                holding[a], holding[b], holding[c] = holding[c], holding[a], holding[b]
                steps.append(f"{a} gives their item to {b}, {b} gives theirs to {c}, "
                             f"and {c} gives theirs to {a}.")
            else:
                a, b = rng.sample(names, 2)
                holding[a], holding[b] = holding[b], holding[a]
                steps.append(f"{a} and {b} swap items.")
        asked = rng.choice(names)
        start = ", ".join(f"{n} has the {g}" for n, g in zip(names, goods))
        question = (f"At the start of a market day, {start}. Then, in order:\n" + "\n".join(steps)
                    + f"\nWhich item does {asked} hold at the end? Answer with the item's name.")
        return question, holding[asked], {"goods": goods}

    def check(self, instance: TaskInstance, answer: str) -> float:
        return 1.0 if strip_article(answer) == instance.answer else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        others = [g for g in instance.metadata["goods"] if g != instance.answer]
        return [rng.choice(others)]
