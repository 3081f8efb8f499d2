"""The one interface every environment implements, and what passes between it and the policy.

An episode: ``reset(seed)`` gives the opening messages and the tools; then, turn by turn, the
policy's parsed reply (an ``Action``) goes to ``step``, which answers with the messages the
policy sees next (tool results, feedback), a per-step process reward, and whether the episode
ended. The same seed gives the same episode: environments are deterministic given their seed
and the actions they receive (a paused trajectory is restored by replaying its actions).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from data_specs.agents import END_REASONS  # noqa: F401  (why an episode ended: the trajectory table's ``ended``)

EndReason = Literal["answered", "max_turns", "max_tokens", "tool_error", "timeout"]


@dataclass(frozen=True)
class Tool:
    """A function the policy may call: its name, what it does, and its JSON-schema parameters."""
    name: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face tool schema (what ``apply_chat_template(tools=...)`` takes)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Action:
    """The policy's turn, parsed: its visible text (thinking removed), the tool calls it made,
    and the parse error of a malformed call (the environment answers it with an error
    observation the policy sees; the error is counted)."""
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    thinking: str = ""
    parse_error: str | None = None


@dataclass(frozen=True)
class Reset:
    messages: list[dict[str, str]]      # the opening messages (system and/or user)
    tools: list[Tool]                   # empty: an environment with no tools (feedback only)


@dataclass(frozen=True)
class StepResult:
    """What ``step`` answers. ``observation`` holds the messages appended to the history: one
    ``{"role": "tool", "name": ..., "content": ...}`` per tool call, or a ``user`` message of
    feedback. ``reward`` is the process reward of this step (0 where the environment has none).
    When ``done``, ``info`` holds ``outcome`` (the task reward in [0, 1]), ``success`` (bool)
    and ``ended`` (an ``EndReason``). ``info["tool_error"]`` counts the step's failed tool calls."""
    observation: list[dict[str, str]]
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One family of tasks. Subclasses set ``name`` and ``max_turns`` and implement ``reset`` and
    ``step``; ``expert_actions`` gives a scripted solution (agent SFT data and tests), where the
    environment can write one. Settings come as keyword arguments from the profile."""

    name: ClassVar[str]
    max_turns: int = 6

    @abstractmethod
    def reset(self, seed: int) -> Reset: ...

    @abstractmethod
    def step(self, action: Action) -> StepResult: ...

    def expert_actions(self, seed: int) -> list[Action] | None:
        """A scripted policy's actions that solve episode ``seed`` (None: the environment has none)."""
        return None

    def close(self) -> None:
        """Release what ``reset`` acquired (sandbox scratch dirs...)."""
