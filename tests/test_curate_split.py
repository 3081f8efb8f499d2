"""The SFT / RL split's choice of side per leakage cluster: verifiable clusters by rl_fraction,
all-open clusters (general / instruction, rewarded by the GenRM in RL) by open_to_rl, with an
independent hash draw; mixed clusters stay on the SFT side."""
from __future__ import annotations

import numpy as np

from tasks.curate.config import SplitConfig
from tasks.curate.split import RL, SFT, assign_pools, choose_pool
from tasks.text import hash_fraction

CLUSTERS = [f"cluster-{i}" for i in range(400)]


def _open_sides(cfg: SplitConfig) -> list[str]:
    return [choose_pool(c, False, cfg, all_open=True) for c in CLUSTERS]


def test_open_to_rl_sends_a_deterministic_share_of_all_open_clusters_to_rl():
    cfg = SplitConfig(open_to_rl=0.5)
    sides = _open_sides(cfg)
    assert sides == _open_sides(SplitConfig(open_to_rl=0.5))            # same clusters, same sides
    assert set(sides) == {RL, SFT}
    assert 0.4 < sides.count(RL) / len(sides) < 0.6
    # a larger share only adds clusters (one draw per cluster, compared with the share)
    wider = _open_sides(SplitConfig(open_to_rl=0.8))
    assert all(w == RL for s, w in zip(sides, wider) if s == RL) and wider.count(RL) > sides.count(RL)
    assert set(_open_sides(SplitConfig(open_to_rl=1.0))) == {RL}
    # the open draw is not rl_fraction's: with both at 0.5 the clusters they pick differ
    by_rl_fraction = [RL if hash_fraction(c, cfg.seed) < 0.5 else SFT for c in CLUSTERS]
    assert sides != by_rl_fraction
    agree = sum(a == b for a, b in zip(sides, by_rl_fraction)) / len(CLUSTERS)
    assert 0.35 < agree < 0.65


def test_default_keeps_every_open_cluster_on_sft_and_verifiable_ones_follow_rl_fraction():
    assert set(_open_sides(SplitConfig())) == {SFT}
    for cfg in (SplitConfig(), SplitConfig(open_to_rl=0.5), SplitConfig(open_to_rl=1.0)):
        verifiable = [choose_pool(c, True, cfg) for c in CLUSTERS]
        assert verifiable == [RL if hash_fraction(c, cfg.seed) < cfg.rl_fraction else SFT for c in CLUSTERS]
        # unverifiable rows outside the open domains (e.g. science) never go to RL
        assert {choose_pool(c, False, cfg, all_open=False) for c in CLUSTERS} == {SFT}
    # the hash strategy ignores open_to_rl
    hashed = [choose_pool(c, False, SplitConfig(strategy="hash"), all_open=True) for c in CLUSTERS]
    assert hashed == [choose_pool(c, False, SplitConfig(strategy="hash", open_to_rl=1.0), all_open=True)
                      for c in CLUSTERS]


def _assign(cfg: SplitConfig, open_domain: np.ndarray | None):
    # clusters: {0 math, 1 general} mixed; {2 general, 3 instruction} all open; {4 math} verifiable;
    # {5 science} unverifiable, not open
    labels = np.array([0, 0, 1, 1, 2, 3])
    verifiable = np.array([True, False, False, False, True, False])
    n = len(labels)
    ids = ["a-math", "b-general", "c-general", "d-instruction", "e-math", "f-science"]
    return assign_pools(labels, np.ones(n, bool), np.zeros(n, bool), [None] * n, [None] * n, ids,
                        verifiable, cfg, open_domain)


OPEN = np.array([False, True, True, True, False, False])


def test_assign_pools_reads_which_clusters_are_all_open():
    pool, cluster, straddling = _assign(SplitConfig(rl_fraction=1.0, open_to_rl=1.0), OPEN)
    assert pool == [SFT, SFT, RL, RL, RL, SFT]      # mixed stays sft; all-open and verifiable go rl
    assert cluster == ["a-math", "a-math", "c-general", "c-general", "e-math", "f-science"] and not straddling
    assert _assign(SplitConfig(rl_fraction=1.0, open_to_rl=1.0), OPEN) == (pool, cluster, straddling)
    # the default, or a caller that passes no domain information: every open cluster on sft
    assert _assign(SplitConfig(rl_fraction=1.0), OPEN)[0] == [SFT, SFT, SFT, SFT, RL, SFT]
    assert _assign(SplitConfig(rl_fraction=1.0, open_to_rl=1.0), None)[0] == [SFT, SFT, SFT, SFT, RL, SFT]
