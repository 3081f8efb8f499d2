import json

import polars as pl
import pytest

from tasks.genrm.judge import constraints_from_metadata
from tasks.ingest import ingest_files, store_records
from tasks.records import read_records
from tasks.sources import (
    champ_records,
    humaneval_records,
    mmath_records,
    open_prompt_records,
    reasoning_gym_records,
)
from warehouse import Warehouse


def _bad_corpus(tmp_path):
    """A JSONL file with 100 good rows and 60 bad ones of every kind, plus other files."""
    tmp_path = tmp_path / "corpus"
    tmp_path.mkdir()
    lines: list[bytes] = []
    expected: dict[str, int] = {}

    def bad(line: bytes, reason: str):
        lines.append(line)
        expected[reason] = expected.get(reason, 0) + 1

    for i in range(100):
        lines.append(json.dumps({"question": f"What is {i} + {i}?", "answer": 2 * i, "difficulty": i % 3}).encode())
        if i % 10 == 0:
            bad(b'{"question": "unterminated', "malformed_json")
            bad(b"{'single': 'quotes'}", "malformed_json")
            bad(b'{"question": "caf\xe9 au lait", "answer": "1"}', "invalid_utf8")
            bad(json.dumps({"question": 12345, "answer": "1"}).encode(), "wrong_type")
            bad(json.dumps({"question": ["a", "list"], "answer": "1"}).encode(), "wrong_type")
            bad(json.dumps({"answer": "no prompt"}).encode(), "missing_required_field")
            bad(json.dumps({"question": "   ", "answer": "1"}).encode(), "missing_required_field")
        if i % 20 == 0:
            bad(json.dumps({"question": "x" * 300_000, "answer": "1"}).encode(), "oversized_field")
            bad(b"[1, 2, 3]", "not_an_object")
            bad(json.dumps({"question": "q?", "answer": "1", "domain": "astrology"}).encode(), "not_allowed")
            bad(json.dumps({"question": "q?", "answer": {"nested": 1}}).encode(), "wrong_type")
    (tmp_path / "corpus.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    expected["empty_file"] = 1
    (tmp_path / "table.csv").write_text('question,answer\n"What is 1+1?",2\n"broken, row",3,extra\n"Cap of France?",Paris\n')
    expected["malformed_csv"] = 1
    pl.DataFrame({"problem": ["Parquet q1?", "Parquet q2?"], "answer": ["1", "2"]}).write_parquet(tmp_path / "p.parquet")
    return tmp_path, expected


def test_bad_input_corpus_is_quarantined_and_counts_add_up(tmp_path, wh):
    corpus, expected = _bad_corpus(tmp_path)
    n_bad = sum(expected.values())
    assert n_bad >= 50
    rep = ingest_files(wh, [corpus], source="user_math", domain="math")
    assert rep.accounted
    assert rep.quarantined == n_bad
    assert rep.stored["prompts"] == 100 + 2 + 2
    assert rep.quarantine_reasons == expected
    q = wh.read("quarantine")
    assert q.height == n_bad
    assert q["file"].null_count() == 0 and q["reason"].null_count() == 0
    row = q.filter(pl.col("reason").str.starts_with("invalid_utf8")).row(0, named=True)
    assert row["file"].endswith("corpus.jsonl") and row["line"] > 1
    row = q.filter(pl.col("reason").str.starts_with("wrong_type")).row(0, named=True)
    assert row["field"] in ("question", "answer")
    prompts = wh.read("prompts")
    assert prompts["id"].n_unique() == prompts.height
    meta = json.loads(prompts.filter(pl.col("prompt") == "What is 3 + 3?")["metadata"].item())
    assert meta == {"difficulty": 0}
    # re-ingesting the same files stores nothing new and still accounts for every row
    again = ingest_files(wh, [corpus], source="user_math", domain="math")
    assert again.accounted and again.stored["prompts"] == 0 and again.already_present == 104


def test_reader_reports_line_numbers(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"prompt": "a"}\n\nnot json\n{"prompt": "b"}\n')
    recs = list(read_records(f))
    assert [r.line for r in recs] == [1, 3, 4]
    assert recs[1].reason.startswith("malformed_json")


def test_unsupported_and_missing_files_fail_clearly(tmp_path, wh):
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ValueError, match="unsupported file type"):
        ingest_files(wh, [tmp_path / "x.txt"], source="s", domain="math")
    with pytest.raises(FileNotFoundError):
        ingest_files(wh, [tmp_path / "missing.jsonl"], source="s", domain="math")
    with pytest.raises(ValueError):
        ingest_files(wh, [tmp_path / "x.txt"], source="../etc", domain="math")


def test_benchmark_files_go_to_benchmarks(tmp_path, wh):
    f = tmp_path / "bench.jsonl"
    f.write_text('{"id": "q1", "question": "What is 2+2?", "answer": "4"}\n{"id": "q2"}\n')
    rep = ingest_files(wh, [f], source="mybench", kind="benchmarks", domain="math")
    assert rep.stored["benchmarks"] == 1 and rep.quarantined == 1
    assert wh.read("benchmarks").row(0, named=True)["item_id"] == "q1"


def test_bundled_sources_read_offline():
    mm = mmath_records()
    assert len(mm["aime2024"]) == 30 and len(mm["aime2025"]) == 15 and len(mm["math500"]) >= 300
    he = humaneval_records()
    assert len(he) == 164 and "check(" in he[0].data["tests"]
    ch = champ_records()
    assert len(ch) == 270 and all(r.data["answer"] for r in ch)
    op = open_prompt_records()
    assert len(op) == 20 and {r.data["domain"] for r in op} == {"instruction"}
    assert all(constraints_from_metadata(r.data["metadata"]) is not None for r in op)
    rg = list(reasoning_gym_records(["basic_arithmetic", "no_such_task"], 3, seed=1))
    assert [r.reason is None for r in rg] == [True, True, True, False]
    assert json.loads(json.dumps(rg[0].data["metadata"]))["rg_dataset"] == "basic_arithmetic"


def test_reasoning_gym_rows_are_deterministic(tmp_path):
    a, b = Warehouse(tmp_path / "a"), Warehouse(tmp_path / "b")
    ra = store_records(a, reasoning_gym_records(["chain_sum"], 5, seed=3), "reasoning_gym")
    rb = store_records(b, reasoning_gym_records(["chain_sum"], 5, seed=3), "reasoning_gym")
    assert a.read("prompts").drop("ingest_run")["id"].to_list() == b.read("prompts")["id"].to_list()
    assert ra.stored == rb.stored == {"prompts": 5}
