"""Every task by name: the own SynLogic-style generators, plus ``rg:<dataset>`` adapters."""
from __future__ import annotations

from functools import cache

from tasks.synth.arithmetic import Cryptarithm, GameOf24, Operation
from tasks.synth.base import SynthTask, TaskError
from tasks.synth.ciphers import Cipher
from tasks.synth.exchange import GoodsExchange
from tasks.synth.language import (
    BooleanExpressions,
    DyckCompletion,
    DyckErrorFinding,
    ObjectCounting,
    ObjectProperties,
    WebOfLies,
    WordSorting,
    WordSortingMistake,
)
from tasks.synth.latin_grids import Calcudoko, Futoshiki, Skyscraper, Sudoku
from tasks.synth.placement_grids import (
    Campsite,
    Kukurasu,
    Minesweeper,
    NumberWall,
    StarPlacement,
    Survo,
)
from tasks.synth.procedures import Buckets, DyckReasoningErrors, Wordscapes
from tasks.synth.reasoning_gym_adapter import PREFIX as RG_PREFIX
from tasks.synth.reasoning_gym_adapter import ReasoningGymTask
from tasks.synth.region_grids import MagicSquare, Norinori, Numbrix
from tasks.synth.sequences import ArrowMaze, MathPath, TimeSequence
from tasks.synth.spatial import SpaceReasoning, SpaceReasoningTree, ZebraPuzzle

OWN_TASK_CLASSES: tuple[type[SynthTask], ...] = (
    GameOf24, Cryptarithm, Operation,
    Sudoku, Futoshiki, Skyscraper, Calcudoko,
    Kukurasu, StarPlacement, Minesweeper, NumberWall, Survo, Campsite,
    MathPath, ArrowMaze, TimeSequence,
    DyckCompletion, DyckErrorFinding, WordSorting, WordSortingMistake, BooleanExpressions,
    WebOfLies, ObjectCounting, ObjectProperties,
    Cipher, GoodsExchange,
    ZebraPuzzle, SpaceReasoning, SpaceReasoningTree,
    Buckets, DyckReasoningErrors, Wordscapes,
    Norinori, Numbrix, MagicSquare,
)
OWN_TASKS: dict[str, SynthTask] = {cls.name: cls() for cls in OWN_TASK_CLASSES}


def own_task_names() -> list[str]:
    return list(OWN_TASKS)


@cache
def _reasoning_gym_task(dataset: str) -> ReasoningGymTask:
    return ReasoningGymTask(dataset)


def get_task(name: str) -> SynthTask:
    if name in OWN_TASKS:
        return OWN_TASKS[name]
    if name.startswith(RG_PREFIX):
        return _reasoning_gym_task(name[len(RG_PREFIX):])
    raise TaskError(f"unknown synthetic task {name!r}; own tasks: {', '.join(OWN_TASKS)}; "
                    f"or '{RG_PREFIX}<reasoning-gym dataset>'")
