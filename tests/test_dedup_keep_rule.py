"""Keep rule of duplicate clusters: the cleanest member stays, no cluster vanishes, decisions name kept rows.

Clusters are word problems with planted copies: here a few written for the test (one copy
padded with inserted words, the longest member, which the old length rule kept, and a few
with a one-word edit), and in ``planted_run`` real CHAMP and MATH500 problems with planted
edited copies (``tests/dedup_corpus.py``), siblings included.
"""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from dedup_corpus import add_members, measure, planted_corpus

from tasks.curate import keep_rule as kr
from tasks.curate.config import CurateConfig, MinHashConfig, SemanticConfig
from tasks.curate.pipeline import run_curate
from tasks.ingest import store_records
from tasks.records import RawRecord
from warehouse import Warehouse

DOCS = [   # (prompt, answer): word problems of a few sentences each
    (("A farmer keeps chickens and cows in the same barn. Together the animals have 50 heads and 140 legs. "
      "Every chicken has two legs and every cow has four legs. How many cows does the farmer keep in the "
      "barn?"), "20"),
    (("A train leaves the station at nine in the morning and travels at a constant speed of 80 kilometres "
      "per hour. A second train leaves the same station one hour later on a parallel track and travels at "
      "100 kilometres per hour. After how many hours of travel does the second train catch up with the "
      "first one?"), "4"),
    (("A rectangular garden is three times as long as it is wide, and a path of width one metre runs around"
      " the outside. The area of the garden without the path is 75 square metres. What is the total area, "
      "in square metres, of the garden together with the path?"), "119"),
    (("Maria has a jar with red, green and blue marbles. One third of the marbles are red and one quarter "
      "are green. The remaining 25 marbles in the jar are blue. How many marbles are in the jar altogether?"), "60"),
    (("A shop sells notebooks for 3 dollars each and pens for 2 dollars each. On Monday the shop sold 40 "
      "items and collected 100 dollars in total from those sales. How many notebooks did the shop sell on "
      "Monday?"), "20"),
    (("The sum of the ages of a mother and her daughter is 50 years. Five years ago the mother was exactly "
      "four times as old as her daughter was at that time. How old is the daughter today, in years?"), "13"),
]
FILLER = ["really", "actually", "basically", "simply", "quite", "indeed", "certainly", "rather"]


def padded(text: str, every: int = 12) -> str:
    """A copy with a filler word inserted every ``every`` words (the longest member of its cluster)."""
    words, out = text.split(), []
    for i, word in enumerate(words):
        out.append(word)
        if i % every == 1 and i < len(words) - 2:
            out.append(FILLER[(i // every) % len(FILLER)])
    return " ".join(out)


def substituted(text: str, at: int, word: str) -> str:
    words = text.split()
    words[at] = word
    return " ".join(words)


def deleted(text: str, at: int) -> str:
    words = text.split()
    del words[at]
    return " ".join(words)


def planted_cluster(text: str) -> list[str]:
    """Original first, then the padded copy and two one-word edits."""
    n = len(text.split())
    return [text, padded(text), substituted(text, n // 3, "some"), deleted(text, 2 * n // 3)]


def add_prompts(wh, rows: list[dict], source: str = "unit") -> None:
    store_records(wh, [RawRecord("test.jsonl", i + 1, data=r) for i, r in enumerate(rows)], source,
                  kind="prompts")


def ids_by_text(wh) -> dict[str, str]:
    return dict(zip(*wh.read("prompts").select("prompt", "id").to_dict(as_series=False).values()))


def pooled_ids(wh) -> set[str]:
    return set(pl.concat([wh.read("sft_pool"), wh.read("rl_pool")])["id"])


def assert_accounted(wh, res, rows_in: int) -> None:
    """Rows in = kept + removed, per stage and overall; every removed duplicate names a kept row."""
    for stage in res.stages.values():
        assert stage.rows_in == stage.kept + stage.removed_total, stage.stage
    kept = pooled_ids(wh)
    removed = wh.read("decisions").filter(pl.col("decision") == "removed")
    assert rows_in == len(kept) + removed.height
    assert not kept & set(removed["row_id"])
    dups = removed.filter(pl.col("stage").is_in(["curate.exact", "curate.minhash", "curate.semantic"]))
    assert set(dups["reference_id"]) <= kept


@pytest.fixture(scope="module")
def semantic_cfg():
    cfg = SemanticConfig(threshold=0.9, batch_size=16)
    from tasks.curate.semantic import load_model
    load_model(cfg)
    return cfg


def test_cluster_keeps_the_original_not_its_padded_copy(wh, semantic_cfg):
    clusters = [planted_cluster(text) for text, _ in DOCS]
    assert all(len(c[1]) == max(len(t) for t in c) for c in clusters)   # the padded copy is the longest
    add_prompts(wh, [{"prompt": t, "answer": a, "domain": "math"}
                     for c, (_, a) in zip(clusters, DOCS) for t in c[::-1]])   # originals not first in input
    res = run_curate(wh, CurateConfig(minhash=MinHashConfig(threshold=0.7), semantic=semantic_cfg))
    ids, kept = ids_by_text(wh), pooled_ids(wh)
    kept_per_cluster = [[t for t in c if ids[t] in kept] for c in clusters]
    assert kept_per_cluster == [[c[0]] for c in clusters]          # exactly one each: the original
    assert_accounted(wh, res, rows_in=sum(len(c) for c in clusters))


# Two different problems from one template (different answers); the bridge is a copy of A
# that took B's first number, so it links to both while A and B do not link.
TEMPLATE = ("A bag holds 5 red marbles, {b} blue marbles and 9 green marbles, and all of them have the same size "
            "and weight. Sam draws marbles one at a time without looking and without putting any marble back into "
            "the bag. What is the smallest number of marbles Sam must draw to be sure of holding {k} marbles of "
            "one colour?")


def test_chain_of_links_does_not_remove_a_different_problem(wh):
    a, b = TEMPLATE.format(b=7, k="three"), TEMPLATE.format(b=12, k="four")
    bridge = TEMPLATE.format(b=12, k="three")
    copies = [a.replace("without looking", "without peeking"), a.replace("marble back", "marble")]
    add_prompts(wh, [{"prompt": t, "answer": ans, "domain": "math"}
                     for t, ans in [(bridge, "7"), (b, "10"), (copies[0], "7"), (copies[1], "7"), (a, "7")]])
    mh_cfg = MinHashConfig(threshold=0.75, num_perm=256)
    res = run_curate(wh, CurateConfig(minhash=mh_cfg, semantic=SemanticConfig(enabled=False)))
    ids = ids_by_text(wh)
    assert pooled_ids(wh) == {ids[a], ids[b]}
    assert_accounted(wh, res, rows_in=5)
    near = wh.read("decisions").filter(pl.col("stage") == "curate.minhash")
    assert set(near["reference_id"]) == {ids[a]} and (near["score"] >= mh_cfg.threshold).all()


def test_edit_distance_is_levenshtein_over_words():
    words = {w: i for i, w in enumerate(["the", "cat", "sat", "on", "a", "mat", "red"])}

    def ids(text):
        return np.array([words[w] for w in text.split()])
    assert kr.edit_distance(ids("the cat sat on the mat"), ids("the cat sat on the mat")) == 0
    assert kr.edit_distance(ids("the cat sat on the mat"), ids("the red cat sat on a mat")) == 2
    assert kr.edit_distance(ids("the cat sat"), ids("")) == 3
    assert kr.edit_distance(ids("cat sat on"), ids("sat on cat")) == 2


# Two CHAMP problems that differ in one word and in their answers; MinHash links them (J ~ 0.8).
AUTOMORPHIC = ("An integer a is called automorphic if a^2 ends in a. For example, 5 is automorphic because 5^2=25 "
               "ends in 5. 25 is also automorphic because 25^2=625 ends in 25. Find all {} automorphic numbers.")


def test_linked_problems_with_different_answers_each_keep_their_own(wh):
    three, four = AUTOMORPHIC.format("three-digit"), AUTOMORPHIC.format("four-digit")
    copies = [three.replace("Find all", "Find all of the"), four.replace("Find all", "Now find all")]
    add_prompts(wh, [{"prompt": t, "answer": a, "domain": "math"}
                     for t, a in [(copies[0], "376 and 625"), (copies[1], "9376"), (three, "376 and 625"),
                                  (four, "9376")]])
    res = run_curate(wh, CurateConfig(minhash=MinHashConfig(threshold=0.7), semantic=SemanticConfig(enabled=False)))
    ids = ids_by_text(wh)
    assert pooled_ids(wh) == {ids[three], ids[four]}     # before: one problem went for the other
    assert_accounted(wh, res, rows_in=4)
    near = wh.read("decisions").filter(pl.col("stage") == "curate.minhash")
    assert dict(zip(near["row_id"], near["reference_id"])) == {ids[copies[0]]: ids[three], ids[copies[1]]: ids[four]}
    assert res.counters["keep.links_answers_differ"] >= 1
    pools = pl.concat([wh.read("sft_pool"), wh.read("rl_pool")])
    assert pools["cluster_id"].n_unique() == 1 and pools["pool"].n_unique() == 1   # still one leakage cluster


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory, semantic_cfg):
    """One curate run over the planted corpus: (members, quality, curate result)."""
    members = planted_corpus()
    with pytest.MonkeyPatch.context() as mp:
        home = tmp_path_factory.mktemp("planted")
        mp.setenv("POSTTRAIN_HOME", str(home))
        wh = Warehouse(home)
        add_members(wh, members)
        res = run_curate(wh, CurateConfig(minhash=MinHashConfig(threshold=0.7), semantic=semantic_cfg))
        return members, measure(wh, members), res


def test_no_planted_cluster_loses_every_member(planted_run):
    _, q, res = planted_run
    print(f"planted corpus: {q}")
    assert q.lost == 0, f"{q.lost} of {q.clusters} clusters lost every member: {q}"
    assert q.near_recall == 1.0, f"a cluster kept more than one member: {q}"
    assert q.across_documents == 0 and q.singles_removed == 0, f"a document went for another: {q}"
    assert q.unexplained == 0, q               # every removal is a dedup decision naming a kept row
    assert q.exact_recall == 1.0, q
    assert res.counters["keep.links_answers_differ"] >= 1   # the siblings are linked, and kept apart


def test_clean_text_is_kept_in_nineteen_clusters_of_twenty(planted_run):
    _, q, _ = planted_run
    print(f"clean text kept in {q.clean_kept} of {q.clusters} planted clusters ({q.clean_share:.1%})")
    assert q.clean_share >= 0.95, (f"clean text kept in {q.clean_kept} of {q.clusters} planted clusters "
                                   f"= {q.clean_share:.3f} (< 0.95): {q}")


def test_consensus_sees_past_an_edit_two_copies_share():
    # each copy carries its own edits, but two share a header that also lines up with the
    # padding of two others: the medoid picks the header copy, the consensus the original
    text = "Find the number of ways that n pairs can be constructed for the first round with 2n players"
    words = text.split()
    pad = ["Please", "solve", "this", "carefully."]
    members = [words, ["Exercise:"] + words, ["Exercise:"] + [w if w != "first" else "frist" for w in words],
               pad + words, pad + words[:5] + ["still"] + words[5:]]
    vocab: dict[str, int] = {}
    ids = [np.array([vocab.setdefault(w, len(vocab)) for w in m]) for m in members]
    medoid = [sum(kr.capped_distance(a, b) for b in ids) for a in ids]
    consensus = kr.consensus_costs(ids, ids)
    assert int(np.argmin(medoid)) == 1
    assert int(np.argmin(consensus)) == 0 and consensus[0] == 0


def test_padding_two_copies_share_does_not_beat_the_original():
    # MATH500: two copies padded with the same prefix (and different suffixes) are the
    # cluster's majority; the prefix is no extra word of the original's, the suffix is the
    # copies' own. (Counting the original's missing prefix as a cost kept a padded copy.)
    text = ("Suppose $a$ and $b$ are different prime numbers greater than 2. How many whole-number divisors are "
            "there for the integer $a(2a+b)-2a^{2}+ab$?")
    members = [text, f"Please solve this carefully. {text} Show your work.",
               f"Please solve this carefully. {text} Give your final answer only."]
    vocab: dict[str, int] = {}
    ids = [np.array([vocab.setdefault(w, len(vocab)) for w in m.split()]) for m in members]
    costs = [(c, sum(kr.capped_distance(a, b) for b in ids)) for a, c in zip(ids, kr.consensus_costs(ids, ids))]
    standing = {i: kr.Standing(True, 100, False, len(ids[i]), i, str(i)) for i in range(3)}
    assert kr.rank([0, 1, 2], costs, standing)[0] == 0
    # a pair: the padded copy's extra words are half-outvoted, the original has none
    pair = kr.consensus_costs(ids[:2], ids[:2])
    assert pair[0] == 0 and pair[1] > 0


def test_removals_follow_direct_links_to_a_kept_row():
    # chain 1 - 2 - 3 - 4 of (stage, score) links, ranked 2 first: 1 and 3 go to 2; 4 is no
    # duplicate of 2, so it stays
    links = {1: {2: (1, 0.9)}, 2: {1: (1, 0.9), 3: (2, 0.8)}, 3: {2: (2, 0.8), 4: (1, 0.85)}, 4: {3: (1, 0.85)}}
    order = [2, 1, 3, 4]

    def ranked(rows):
        return [r for r in order if r in rows]
    assert kr.removals([1, 2, 3, 4], [], links, ranked) == {1: (2, 1, 0.9), 3: (2, 2, 0.8)}
    # a row an earlier run kept stays, and a new row linked to it goes to it
    assert kr.removals([2, 3, 4], [1], links, ranked) == {2: (1, 1, 0.9), 4: (3, 1, 0.85)}


def test_rows_left_after_a_keeper_are_ranked_again_among_themselves():
    # 1 keeps and takes 2 and 3; 4 and 5 (linked to each other, not to 1) are ranked again:
    # against the whole cluster 4 looked better, among themselves 5 is
    links = {1: {2: (1, 0.9), 3: (1, 0.9)}, 2: {1: (1, 0.9)}, 3: {1: (1, 0.9), 4: (2, 0.92)},
             4: {3: (2, 0.92), 5: (2, 0.95)}, 5: {4: (2, 0.95)}}
    calls = []

    def ranked(rows):
        calls.append(rows)
        return [1, 4, 5, 2, 3] if len(rows) == 5 else [5, 4]
    assert kr.removals([1, 2, 3, 4, 5], [], links, ranked) == {2: (1, 1, 0.9), 3: (1, 1, 0.9), 4: (5, 2, 0.95)}
    assert calls == [[1, 2, 3, 4, 5], [4, 5]]


def test_rank_prefers_checkable_then_source_then_consensus_then_medoid_then_fewer_words_then_earlier():
    def s(row_id, verifiable=True, priority=100, words=10, ingested=0):
        return kr.Standing(verifiable, priority, False, words, ingested, row_id)
    assert kr.rank([1, 2], [(9, 9), (1, 1)], {1: s("a"), 2: s("b", verifiable=False)}) == [1, 2]
    assert kr.rank([1, 2], [(9, 9), (1, 1)], {1: s("a", priority=1), 2: s("b")}) == [1, 2]
    assert kr.rank([1, 2], [(9, 1), (1, 9)], {1: s("a"), 2: s("b")}) == [2, 1]
    assert kr.rank([1, 2], [(1, 9), (1, 1)], {1: s("a"), 2: s("b")}) == [2, 1]
    assert kr.rank([1, 2], [(4, 4), (4, 4)], {1: s("a", words=12), 2: s("b", words=10)}) == [2, 1]
    assert kr.rank([1, 2], [(4, 4), (4, 4)], {1: s("a", ingested=7), 2: s("b", ingested=3)}) == [2, 1]
