"""Swiss-system tournament that picks the best candidate answer of a prompt.

Each round pairs players with equal or close scores who have not met before; with an odd
count the lowest-ranked player without a bye sits out and scores a win. After the planned
rounds (default ceil(log2 N), enough for one unbeaten player among N) the ranking is:
points, then Buchholz (the sum of the opponents' final points: beating strong players
counts more), then wins, then the initial seed (the candidate's position in the source
order, earliest first) so the winner is always deterministic.

Verdicts use the pairwise judge's frame: ``verdict`` is Answer 2 (``second``) against
Answer 1 (``first``): 1 second wins, -1 first wins, 0 or None (unreadable) a tie.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class Standing:
    candidate: str
    seed: int               # initial position; the last tie-break
    points: float = 0.0
    wins: int = 0
    byes: int = 0
    opponents: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Pairing:
    round: int
    first: str
    second: str | None      # None: ``first`` has a bye


@dataclass(frozen=True)
class MatchRecord:
    round: int
    first: str
    second: str | None
    verdict: int | None
    status: str
    points_first: float
    points_second: float | None


def planned_rounds(n_candidates: int, rounds: int | None = None) -> int:
    if n_candidates < 2:
        return 0
    return rounds if rounds is not None else math.ceil(math.log2(n_candidates))


def rank_order(standings: Sequence[Standing]) -> list[Standing]:
    """Pairing order within a round: points, then the initial seed."""
    return sorted(standings, key=lambda s: (-s.points, s.seed))


def _pair_without_rematch(players: list[Standing], played: set[frozenset[str]]) -> list[tuple[Standing, Standing]] | None:
    """Pair the top player with the closest-ranked opponent it has not met; backtrack if stuck."""
    if not players:
        return []
    top, rest = players[0], players[1:]
    for j, opponent in enumerate(rest):
        if frozenset((top.candidate, opponent.candidate)) in played:
            continue
        tail = _pair_without_rematch(rest[:j] + rest[j + 1:], played)
        if tail is not None:
            return [(top, opponent)] + tail
    return None


def swiss_round_pairings(standings: Sequence[Standing], played: set[frozenset[str]],
                         round_number: int) -> list[Pairing] | None:
    """Pairings for one round with no rematch, or None when no such pairing exists.

    The bye goes to the lowest-ranked player among those with the fewest byes, moving up
    the ranking only when the rest cannot be paired without a rematch.
    """
    ordered = rank_order(standings)
    if len(ordered) % 2 == 0:
        pairs = _pair_without_rematch(ordered, played)
        return None if pairs is None else [Pairing(round_number, a.candidate, b.candidate) for a, b in pairs]
    fewest = min(s.byes for s in ordered)
    for bye in reversed([s for s in ordered if s.byes == fewest]):
        pairs = _pair_without_rematch([s for s in ordered if s is not bye], played)
        if pairs is not None:
            return ([Pairing(round_number, a.candidate, b.candidate) for a, b in pairs]
                    + [Pairing(round_number, bye.candidate, None)])
    return None


def buchholz(standings: Sequence[Standing]) -> dict[str, float]:
    """Sum of each player's opponents' points (a bye adds nothing)."""
    points = {s.candidate: s.points for s in standings}
    return {s.candidate: sum(points[o] for o in s.opponents) for s in standings}


def final_ranking(standings: Sequence[Standing]) -> list[Standing]:
    tie_break = buchholz(standings)
    return sorted(standings, key=lambda s: (-s.points, -tie_break[s.candidate], -s.wins, s.seed))


class SwissTournament:
    """One prompt's tournament, played round by round so many prompts can share a judge batch."""

    def __init__(self, candidates: Sequence[str], rounds: int | None = None, win_points: float = 1.0,
                 tie_points: float = 0.5, bye_points: float = 1.0):
        if len(set(candidates)) != len(candidates):
            raise ValueError("candidate ids must be unique")
        self.standings = {c: Standing(c, i) for i, c in enumerate(candidates)}
        self.rounds_planned = planned_rounds(len(candidates), rounds)
        self.win_points, self.tie_points, self.bye_points = win_points, tie_points, bye_points
        self.rounds_played = 0
        self.stopped_early = False   # no rematch-free pairing was left
        self.matches: list[MatchRecord] = []
        self._played: set[frozenset[str]] = set()
        self._open: set[tuple[str, str]] = set()

    @property
    def finished(self) -> bool:
        return self.stopped_early or self.rounds_played >= self.rounds_planned

    def next_round(self) -> list[Pairing]:
        """Pair the next round (byes are scored at once); the games the judge must decide."""
        if self._open:
            raise RuntimeError(f"round {self.rounds_played} still has undecided games: {sorted(self._open)}")
        if self.finished:
            return []
        number = self.rounds_played + 1
        pairings = swiss_round_pairings(list(self.standings.values()), self._played, number)
        if pairings is None:
            self.stopped_early = True
            return []
        self.rounds_played = number
        games = []
        for p in pairings:
            if p.second is None:
                self._score_bye(p)
            else:
                self._open.add((p.first, p.second))
                games.append(p)
        return games

    def _score_bye(self, pairing: Pairing) -> None:
        s = self.standings[pairing.first]
        s.points += self.bye_points
        s.byes += 1
        s.wins += 1  # a bye counts as a win
        self.matches.append(MatchRecord(pairing.round, pairing.first, None, None, "bye", self.bye_points, None))

    def record(self, pairing: Pairing, verdict: int | None, status: str) -> None:
        """Score a decided game; ``verdict`` is second vs first (1, 0, -1) or None (a tie)."""
        key = (pairing.first, pairing.second)
        if key not in self._open:
            raise ValueError(f"no open game {key} in round {self.rounds_played}")
        self._open.discard(key)
        first, second = self.standings[pairing.first], self.standings[pairing.second]
        if verdict == 1:
            p_first, p_second = 0.0, self.win_points
            second.wins += 1
        elif verdict == -1:
            p_first, p_second = self.win_points, 0.0
            first.wins += 1
        else:
            p_first = p_second = self.tie_points
        first.points += p_first
        second.points += p_second
        first.opponents.append(second.candidate)
        second.opponents.append(first.candidate)
        self._played.add(frozenset(key))
        self.matches.append(MatchRecord(pairing.round, pairing.first, pairing.second, verdict, status,
                                        p_first, p_second))

    def ranking(self) -> list[Standing]:
        return final_ranking(list(self.standings.values()))

    def winner(self) -> str:
        return self.ranking()[0].candidate


def run_swiss(candidates: Sequence[str], decide: Callable[[list[Pairing]], list[int | None]],
              rounds: int | None = None, **points) -> SwissTournament:
    """Play a whole tournament; ``decide`` returns one verdict per game of a round."""
    tournament = SwissTournament(candidates, rounds, **points)
    while not tournament.finished:
        games = tournament.next_round()
        for game, verdict in zip(games, decide(games), strict=True):
            tournament.record(game, verdict, "ok" if verdict is not None else "unparseable")
    return tournament
