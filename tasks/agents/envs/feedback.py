"""Multi-turn feedback: guess a hidden number, the verifier's verdict on each guess is the next turn.

There are no tools: every turn the policy answers a guess as ``<answer>N</answer>`` and the next
observation is the verifier's feedback as a user message ("N is too low." / "N is too high.", or
how to answer when no guess could be read). What it teaches is using feedback across turns:
the expert is a binary search, and the process reward scores each guess by whether it agrees
with every earlier hint (inside the interval they still allow).
"""
from __future__ import annotations

import random
import re

from tasks.agents.envs.base import Action, Environment, Reset, StepResult
from tasks.synth.base import extract_final_answer, stable_int

# the hidden number lies in [1, 16 * 4 ** level]
LEVEL_HIGHS: tuple[int, ...] = (16, 64, 256, 1024)

_GUESS = re.compile(r"[+-]?\d+")


def read_guess(text: str) -> int | None:
    """The guess in a reply's ``<answer>`` block (one whole number), or None."""
    answer = extract_final_answer(text)
    if answer is None:
        return None
    answer = answer.strip().rstrip(".").replace(",", "")
    return int(answer) if _GUESS.fullmatch(answer) else None


class Feedback(Environment):
    """Guess the number in [1, high] within ``max_turns`` guesses (default: what a binary search
    needs at this level, plus one: 6 at level 0). Process reward: +``process_reward`` for a guess
    consistent with every hint so far, -``process_reward`` otherwise (0 turns it off)."""

    name = "feedback"

    def __init__(self, level: int = 0, max_turns: int | None = None, process_reward: float = 0.1):
        if not 0 <= level < len(LEVEL_HIGHS):
            raise ValueError(f"{self.name}: level {level!r} outside 0..{len(LEVEL_HIGHS) - 1}")
        self.level, self.high = level, LEVEL_HIGHS[level]
        # a binary search over [1, high] needs at most high.bit_length() guesses
        self.max_turns = self.high.bit_length() + 1 if max_turns is None else max_turns
        if self.max_turns < 1:
            raise ValueError(f"{self.name}: max_turns must be at least 1, got {max_turns!r}")
        self.process_reward = float(process_reward)
        self._hidden, self._low, self._high, self._turns = 0, 1, self.high, 0
        self._done = True

    def hidden(self, seed: int) -> int:
        """The number episode ``seed`` hides."""
        return random.Random(stable_int(self.name, int(seed), self.level)).randint(1, self.high)

    def reset(self, seed: int) -> Reset:
        self._hidden, self._low, self._high, self._turns = self.hidden(seed), 1, self.high, 0
        self._done = False
        prompt = (f"I am thinking of a whole number from 1 to {self.high}. Guess it: reply with only "
                  f"your guess as <answer>N</answer>, and I will say if it is too low or too high. "
                  f"You have {self.max_turns} guesses.")
        return Reset(messages=[{"role": "user", "content": prompt}], tools=[])

    def step(self, action: Action) -> StepResult:
        if self._done:
            raise RuntimeError(f"{self.name}: no live episode (call reset(seed) first)")
        self._turns += 1
        tool_error = len(action.tool_calls) + (action.parse_error is not None)
        if tool_error:
            feedback, consistent = ("error: there are no tools here. Reply with only your guess "
                                    "as <answer>N</answer>."), False
        else:
            guess = read_guess(action.text)
            if guess is None:
                feedback, consistent = "I could not read a guess. Reply with one number as <answer>N</answer>.", False
            else:
                consistent = self._low <= guess <= self._high
                if guess == self._hidden:
                    self._done = True
                    return StepResult([], self.process_reward, True, {
                        "tool_error": 0, "outcome": 1.0, "success": True, "ended": "answered",
                        "guesses": self._turns})
                feedback = self._hint(guess)
        reward = self.process_reward if consistent else -self.process_reward
        observation = [{"role": "user", "content": feedback}]
        if self._turns >= self.max_turns:
            self._done = True
            return StepResult(observation, reward, True, {
                "tool_error": tool_error, "outcome": 0.0, "success": False, "ended": "max_turns",
                "guesses": self._turns})
        return StepResult(observation, reward, False, {"tool_error": tool_error})

    def _hint(self, guess: int) -> str:
        """The verdict on a wrong guess; the still-possible interval narrows with it."""
        if not 1 <= guess <= self.high:
            return f"{guess} is outside 1 to {self.high}."
        if guess < self._hidden:
            self._low = max(self._low, guess + 1)
            return f"{guess} is too low."
        self._high = min(self._high, guess - 1)
        return f"{guess} is too high."

    def expert_actions(self, seed: int) -> list[Action]:
        """Binary search: always the middle of what the hints still allow."""
        hidden, low, high, actions = self.hidden(seed), 1, self.high, []
        while True:
            guess = (low + high) // 2
            actions.append(Action(f"<answer>{guess}</answer>",
                                  thinking=f"It is from {low} to {high}: I guess the middle."))
            if guess == hidden:
                return actions
            low, high = (guess + 1, high) if guess < hidden else (low, guess - 1)
