import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import polars as pl
import pytest

from data_specs import SpecError
from warehouse import TableRef, Warehouse

PY = sys.executable


def _decisions(ids, stage="s"):
    return pl.DataFrame({"row_id": ids, "stage": [stage] * len(ids), "decision": ["removed"] * len(ids),
                         "reason": ["dup"] * len(ids)})


def test_write_read_snapshots_and_history(wh):
    r1 = wh.write("scratch", pl.DataFrame({"a": [1, 2]}))
    r2 = wh.write("scratch", pl.DataFrame({"a": [3]}))
    assert wh.read("scratch")["a"].to_list() == [3]
    assert wh.read("scratch", r1.snapshot)["a"].to_list() == [1, 2]
    assert wh.latest("scratch") == r2
    hist = wh.history("scratch")
    assert hist["snapshot"].to_list() == [r2.snapshot, r1.snapshot]
    assert wh.tables().filter(pl.col("name") == "scratch")["snapshots"].item() == 2


def test_append_shares_files_and_records_parent(wh):
    r1 = wh.write("decisions", _decisions(["a", "b"]))
    r2 = wh.append("decisions", _decisions(["c"]))
    assert r2.rows == 3
    assert sorted(wh.read("decisions")["row_id"].to_list()) == ["a", "b", "c"]
    assert wh.files("decisions")[0] == wh.files("decisions", r1.snapshot)[0]
    assert {"child": str(r2), "parent": str(r1)} in wh.lineage("decisions")
    wh.append("scratch2", pl.DataFrame({"x": [1]}))
    with pytest.raises(SpecError, match="schema"):
        wh.append("scratch2", pl.DataFrame({"y": ["s"]}))
    assert wh.read("scratch2")["x"].to_list() == [1]


def test_an_append_may_add_the_optional_columns_its_spec_gained(wh, monkeypatch):
    """A home whose rl_rollouts predates the partial-rollout columns takes rows that carry them:
    the old rows read them as null, in polars and in SQL; a required column is still refused."""
    from data_specs import get_spec

    spec = get_spec("rl_rollouts")
    new = spec.conform(pl.DataFrame([{
        "rollout_id": f"r{i}", "prompt_id": "p", "source_table": "rl_prompts", "domain": "logic", "sample_index": i,
        "num_tokens": 3, "finish_reason": "stop", "truncated": False, "reward": 1.0, "backend": "serve-model",
        "model": "run/rl@update0", "train_run": "run", "step": 0, "policy_version": 0, "staleness": 0,
        "policy_version_last": 2, "version_boundary": 2} for i in range(2)]))
    old = new.drop("policy_version_last", "version_boundary").with_columns(pl.col("rollout_id") + "-old")
    # the table as a home written before the spec gained the two columns holds it
    with monkeypatch.context() as before:
        before.setattr(spec, "columns", [c for c in spec.columns if c.name in old.columns])
        first = wh.write("rl_rollouts", old)
    assert "version_boundary" not in pl.read_parquet_schema(wh.files("rl_rollouts", first.snapshot)[0])
    grown = wh.append("rl_rollouts", new)
    rows = wh.read("rl_rollouts").sort("rollout_id")
    assert grown.rows == 4 and rows["version_boundary"].to_list() == [2, None, 2, None]
    assert wh.sql("SELECT count(version_boundary) AS n FROM rl_rollouts")["n"][0] == 2
    # a required column the table lacks cannot be added by an append: its old rows would break it
    with monkeypatch.context() as before:
        before.setattr(spec, "columns", [c for c in spec.columns if c.name != "staleness"])
        wh.write("rl_rollouts", new.drop("staleness"))
    with pytest.raises(SpecError, match="schema"):
        wh.append("rl_rollouts", new.with_columns(pl.col("rollout_id") + "-x"))


def test_spec_violations_refused(wh):
    with pytest.raises(SpecError, match="missing_required_field"):
        wh.write("decisions", _decisions([""]))
    assert not wh.exists("decisions")


def test_lineage_across_tables(wh):
    a = wh.write("raw_a", pl.DataFrame({"x": [1]}))
    b = wh.write("raw_b", pl.DataFrame({"x": [2]}), parents=[a])
    c = wh.write("derived", pl.DataFrame({"x": [3]}), parents=[b, a])
    parents = {e["parent"] for e in wh.lineage("derived", c.snapshot)}
    assert parents == {str(a), str(b)}
    assert TableRef.parse(str(c)).snapshot == c.snapshot


def test_content_hash_is_deterministic(wh):
    df = pl.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"]})
    assert wh.write("h1", df).content_hash == wh.write("h2", df).content_hash
    assert wh.write("h3", df.reverse()).content_hash != wh.write("h1", df).content_hash


def test_sql_over_latest_and_injection_refused(wh):
    wh.write("scratch", pl.DataFrame({"a": [1, 2, 3]}))
    assert wh.sql("SELECT sum(a) AS s FROM scratch")["s"].item() == 6
    assert wh.sql("SELECT count(*) AS n FROM catalog WHERE name = ?", ["scratch"])["n"].item() == 1
    # SQL runs in a private in-memory database: it cannot drop the catalog
    wh.sql("DROP VIEW scratch")
    assert wh.read("scratch").height == 3
    for bad in ("a;drop table snapshots", "../etc", "", "x" * 100):
        with pytest.raises(ValueError):
            wh.write(bad, pl.DataFrame({"a": [1]}))
        with pytest.raises(ValueError):
            wh.read(bad)


def test_missing_table_errors_name_it(wh):
    with pytest.raises(KeyError, match="nope"):
        wh.read("nope")
    assert wh.read("decisions", default_empty=True).height == 0


WRITER = textwrap.dedent("""
    import sys, polars as pl
    from warehouse import Warehouse
    wh = Warehouse(sys.argv[1])
    n = int(sys.argv[3])
    i = 0
    while True:
        wh.write(sys.argv[2], pl.DataFrame({"i": pl.arange(0, n, eager=True) + i, "s": ["x" * 50] * n}))
        i += 1
        if len(sys.argv) > 4 and i >= int(sys.argv[4]):
            break
""")


def test_sigkill_mid_write_leaves_no_partial_table(home):
    wh = Warehouse(home)
    wh.write("big", pl.DataFrame({"i": [0], "s": ["seed"]}))
    table_dir = Path(home) / "tables" / "big"
    proc = subprocess.Popen([PY, "-c", WRITER, str(home), "big", "2000000"])
    try:
        deadline = time.time() + 120
        # wait until a write is in flight (its temporary directory exists), then kill it
        while time.time() < deadline and not any(p.name.startswith(".tmp-") for p in table_dir.iterdir()):
            time.sleep(0.005)
        assert proc.poll() is None, "writer finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    wh2 = Warehouse(home)  # the catalog opens
    hist = wh2.history("big")
    for snap in hist["snapshot"].to_list():
        df = wh2.read("big", snap)  # every visible snapshot is complete
        assert df.height in (1, 2_000_000)
    assert wh2.latest("big").rows == wh2.read("big").height
    ref = wh2.write("big", pl.DataFrame({"i": [7], "s": ["after"]}))
    assert wh2.read("big")["s"].to_list() == ["after"] and ref.rows == 1
    leftovers = [p for p in table_dir.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) <= 1  # the killed writer's scratch, invisible to readers
    visible = {Path(f).parent.name for s in hist["snapshot"].to_list() for f in map(str, wh2.files("big", s))}
    assert not any(name.startswith(".tmp-") for name in visible)


def test_two_processes_appending_at_once_keep_a_consistent_catalog(home):
    Warehouse(home)
    script = textwrap.dedent("""
        import sys, polars as pl
        from warehouse import Warehouse
        wh = Warehouse(sys.argv[1])
        for k in range(15):
            wh.append("decisions", pl.DataFrame({"row_id": [f"{sys.argv[2]}-{k}-{j}" for j in range(10)],
                "stage": ["s"] * 10, "decision": ["removed"] * 10, "reason": ["dup"] * 10}))
    """)
    procs = [subprocess.Popen([PY, "-c", script, str(home), tag]) for tag in ("p", "q")]
    for p in procs:
        assert p.wait(timeout=240) == 0
    wh = Warehouse(home)
    df = wh.read("decisions")
    assert df.height == 300 and df["row_id"].n_unique() == 300
    hist = wh.history("decisions")
    assert hist.height == 30
    assert wh.latest("decisions").rows == 300
    # each append's parent is the snapshot committed just before it
    parents = [json.loads(p)[0] for p in hist["parents"].to_list()[:-1]]
    assert parents == [f"decisions@{s}" for s in hist["snapshot"].to_list()[1:]]


def test_gc_removes_only_orphans(wh):
    wh.write("scratch", pl.DataFrame({"a": [1]}))
    orphan = wh.tables_dir / "scratch" / "20000101T000000-deadbeef"
    orphan.mkdir()
    (orphan / "part-0.parquet").write_bytes(b"partial")
    removed = wh.gc(older_than_s=0)
    assert removed == [orphan] and wh.read("scratch").height == 1


def test_each_snapshot_names_the_stage_that_wrote_it_here_and_in_processes_it_started(wh):
    """The catalog records the pipeline stage writing (``recording_writer``, or the environment
    a stage hands the processes it starts, as its training ranks); writes outside a stage name none."""
    from tasks.train.engine import subprocess_env
    from warehouse import recording_writer

    outside = wh.write("scratch", pl.DataFrame({"a": [1]}))
    with recording_writer("sft_long"):
        inside = wh.append("scratch", pl.DataFrame({"a": [2]}))
        env = subprocess_env()
    code = ("import sys, polars as pl; from warehouse import Warehouse; "
            "print(Warehouse(sys.argv[1]).append('scratch', pl.DataFrame({'a': [3]})).snapshot)")
    rank = subprocess.run([PY, "-c", code, str(wh.home)], env=env, capture_output=True, text=True, check=True)
    assert wh.writers() == {str(inside): "sft_long", f"scratch@{rank.stdout.strip()}": "sft_long"}
    assert str(outside) not in wh.writers()
    assert "POSTTRAIN_WRITER" not in subprocess_env()   # only a stage's own processes are named


def test_a_catalog_made_before_writers_were_recorded_opens_and_records_them(home):
    import duckdb

    from warehouse import recording_writer
    from warehouse.store import CATALOG_DDL

    old_ddl = CATALOG_DDL.replace(",\n    writer VARCHAR                 -- the pipeline stage that wrote it (``recording_writer``)", "")
    assert "writer" not in old_ddl
    con = duckdb.connect(str(Path(home) / "warehouse.duckdb"))
    con.execute(old_ddl)
    con.execute("INSERT INTO snapshots VALUES (1, 'scratch', '20260101T000000-00000000', NULL, 0, 'h', '[]', "
                "NULL, now()::TIMESTAMP, 'replace', '[]', NULL)")
    con.close()
    wh = Warehouse(home)
    assert wh.history("scratch").height == 1 and wh.writers() == {}
    with recording_writer("curate"):
        ref = wh.write("scratch", pl.DataFrame({"a": [1]}))
    assert wh.writers() == {str(ref): "curate"}
