"""Swiss rounds: pairing rules on fixed cases, Buchholz, and noisy-judge robustness."""
import math
import random

import pytest

from tasks.genrm.references import decided_by
from tasks.genrm.swiss import (
    Pairing,
    Standing,
    SwissTournament,
    buchholz,
    planned_rounds,
    run_swiss,
    swiss_round_pairings,
)


def pairs_of(pairings):
    return [(p.first, p.second) for p in pairings]


def test_planned_rounds_is_ceil_log2_unless_configured():
    assert [planned_rounds(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    assert planned_rounds(8, rounds=5) == 5


def test_pairing_by_score_avoids_rematches():
    standings = [Standing("a", 0, 1.0), Standing("b", 1, 1.0), Standing("c", 2, 0.0), Standing("d", 3, 0.0)]
    assert pairs_of(swiss_round_pairings(standings, set(), 2)) == [("a", "b"), ("c", "d")]
    played = {frozenset("ab"), frozenset("cd")}
    assert pairs_of(swiss_round_pairings(standings, played, 2)) == [("a", "c"), ("b", "d")]


def test_pairing_backtracks_and_reports_when_no_rematch_free_round_exists():
    standings = [Standing(x, i) for i, x in enumerate("abcd")]
    played = {frozenset("ab"), frozenset("ac")}
    assert pairs_of(swiss_round_pairings(standings, played, 3)) == [("a", "d"), ("b", "c")]
    assert swiss_round_pairings(standings, played | {frozenset("bc")}, 3) is None


def test_byes_go_to_the_lowest_ranked_player_once_and_count_as_wins():
    t = SwissTournament(["a", "b", "c", "d", "e"], rounds=3)
    byes = []
    while not t.finished:
        for game in t.next_round():
            t.record(game, -1, "ok")  # Answer 1 (the higher-ranked player) always wins
        byes.append(next(m.first for m in t.matches if m.status == "bye" and m.round == t.rounds_played))
    assert byes[0] == "e"                                   # lowest seed at equal points
    assert len(set(byes)) == 3                              # nobody gets a second bye
    bye_e = next(m for m in t.matches if m.status == "bye" and m.first == "e")
    assert (bye_e.round, bye_e.points_first, t.standings["e"].byes) == (1, 1.0, 1)
    assert t.standings["e"].wins >= 1   # the bye is counted among e's wins
    played = [frozenset((m.first, m.second)) for m in t.matches if m.second is not None]
    assert len(played) == len(set(played))                 # no rematch in the whole tournament
    assert sum(1 for m in t.matches if m.status == "bye") == 3


def test_scoring_buchholz_and_tie_break():
    verdicts = {("a", "b"): -1, ("c", "d"): 1, ("a", "d"): 0, ("b", "c"): -1}
    t = run_swiss("abcd", lambda games: [verdicts[(g.first, g.second)] for g in games])
    assert [pairs_of([Pairing(m.round, m.first, m.second)]) for m in t.matches] == [
        [("a", "b")], [("c", "d")], [("a", "d")], [("b", "c")]]
    points = {s.candidate: s.points for s in t.standings.values()}
    assert points == {"a": 1.5, "d": 1.5, "b": 1.0, "c": 0.0}
    assert buchholz(list(t.standings.values())) == {"a": 2.5, "d": 1.5, "b": 1.5, "c": 2.5}
    ranking = t.ranking()
    assert [s.candidate for s in ranking] == ["a", "d", "b", "c"]
    assert decided_by(ranking) == "buchholz" and t.winner() == "a"


def test_all_ties_fall_back_to_the_stated_seed_rule():
    t = run_swiss(["x", "y", "z", "w"], lambda games: [None] * len(games))  # an unreadable judge
    assert [s.points for s in t.ranking()] == [1.0] * 4
    assert t.winner() == "x" and decided_by(t.ranking()) == "seed"


def test_record_rejects_games_that_were_not_paired():
    t = SwissTournament(["a", "b"])
    (game,) = t.next_round()
    with pytest.raises(ValueError, match="no open game"):
        t.record(Pairing(1, "b", "a"), 1, "ok")
    t.record(game, 1, "ok")
    assert t.finished and t.winner() == "b"
    with pytest.raises(ValueError, match="unique"):
        SwissTournament(["a", "a"])


def noisy_judge(strengths: dict[str, float], rng: random.Random):
    """Bradley-Terry verdicts from hidden strengths, with occasional ties and garbage."""
    def decide(games):
        verdicts = []
        for g in games:
            if rng.random() < 0.1:
                verdicts.append(rng.choice([0, None]))  # ties and unreadable verdicts happen
                continue
            p_second = 1 / (1 + math.exp(-2.0 * (strengths[g.second] - strengths[g.first])))
            verdicts.append(1 if rng.random() < p_second else -1)
        return verdicts
    return decide


def test_the_strongest_candidate_wins_most_noisy_tournaments():
    wins, trials = 0, 200
    for trial in range(trials):
        rng = random.Random(trial)
        strengths = {f"c{i}": rng.gauss(0, 1) for i in range(8)}
        strongest = max(strengths, key=strengths.get)
        order = list(strengths)
        rng.shuffle(order)  # seeds carry no information about strength
        wins += run_swiss(order, noisy_judge(strengths, rng)).winner() == strongest
    assert wins / trials > 0.5, wins / trials   # chance is 1/8
