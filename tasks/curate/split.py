"""Leak-free SFT / RL split.

A leakage cluster is a connected component of every duplicate link the dedup stages saw
(exact, MinHash and semantic edges, removed rows included), so rows that are duplicates
through a chain still share a cluster. A whole cluster goes to one pool. When new rows
join a cluster that already has pool rows, they follow that pool; a new row whose cluster
already spans both pools is dropped. Because dedup is global (new rows against every kept
row), the RL pool is deduplicated against the SFT pool by construction; ``cross_pool_edges``
re-checks it on the final pools.
"""
from __future__ import annotations

import itertools

import numpy as np

from tasks.curate.config import SplitConfig
from tasks.curate.minhash import components
from tasks.text import hash_fraction

SFT, RL = "sft", "rl"


# salt of the open share's draw, so which open clusters go to RL does not follow rl_fraction's draw
_OPEN_SALT = "open_to_rl\x1f"


def choose_pool(cluster_id: str, all_verifiable: bool, cfg: SplitConfig, all_open: bool = False) -> str:
    """The side of a new cluster. ``all_open``: every row is open-domain (GenRM-rewarded);
    verifiable_to_rl sends such a cluster to RL with probability ``open_to_rl``."""
    to_rl = hash_fraction(cluster_id, cfg.seed) < cfg.rl_fraction
    if cfg.strategy == "verifiable_to_rl":
        if all_verifiable:
            return RL if to_rl else SFT
        if all_open and cfg.open_to_rl > 0:
            return RL if hash_fraction(_OPEN_SALT + cluster_id, cfg.seed) < cfg.open_to_rl else SFT
        return SFT
    return RL if to_rl else SFT


class LinkGraph:
    """Duplicate links between nodes (old pool rows first, then this run's candidate rows)."""

    def __init__(self, n_nodes: int):
        self.n = n_nodes
        self._edges: list[np.ndarray] = []

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        if len(a):
            self._edges.append(np.stack([np.asarray(a, np.int64), np.asarray(b, np.int64)], axis=1))

    def edges(self) -> np.ndarray:
        return np.concatenate(self._edges) if self._edges else np.zeros((0, 2), np.int64)

    def labels(self) -> np.ndarray:
        return components(self.n, self.edges())


def assign_pools(labels: np.ndarray, kept: np.ndarray, is_old: np.ndarray, old_pool: list[str | None],
                 old_cluster: list[str | None], node_ids: list[str], verifiable: np.ndarray,
                 cfg: SplitConfig, open_domain: np.ndarray | None = None,
                 ) -> tuple[list[str | None], list[str | None], dict[int, str]]:
    """(pool per node, cluster id per node, {new node: old node it straddles with}).

    ``verifiable`` and ``open_domain`` (None: no node is open) are bool per node. Only kept
    nodes get a pool. A component's cluster id is the smallest old cluster id in
    it, else the smallest row id among its kept rows (stable across runs).
    """
    pool: list[str | None] = [None] * len(labels)
    cluster: list[str | None] = [None] * len(labels)
    straddling: dict[int, str] = {}
    order = np.argsort(labels, kind="stable")
    bounds = np.flatnonzero(np.r_[True, labels[order][1:] != labels[order][:-1], True])
    for s, e in itertools.pairwise(bounds):
        members = order[s:e]
        members = members[kept[members]]
        if not len(members):
            continue
        old = [m for m in members if is_old[m]]
        new = [m for m in members if not is_old[m]]
        old_pools = {old_pool[m] for m in old}
        cid = min((old_cluster[m] for m in old if old_cluster[m]), default=None) or min(node_ids[m] for m in members)
        if len(old_pools) > 1:
            rl_member = next(m for m in old if old_pool[m] == RL)
            for m in new:
                straddling[m] = node_ids[rl_member]
            for m in old:
                pool[m], cluster[m] = old_pool[m], old_cluster[m] or cid
            continue
        all_open = open_domain is not None and bool(open_domain[members].all())
        chosen = old_pools.pop() if old_pools else choose_pool(cid, bool(verifiable[members].all()), cfg, all_open)
        for m in members:
            pool[m], cluster[m] = chosen, cid
    return pool, cluster, straddling


def cross_pool_edges(edges: np.ndarray, pool: list[str | None]) -> int:
    """Links between a kept SFT row and a kept RL row (must be zero)."""
    return sum(1 for a, b in edges if pool[a] and pool[b] and pool[a] != pool[b])
