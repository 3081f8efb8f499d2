"""A killed pipeline leaves nothing of itself running, and a rerun ends with the tables an
uninterrupted run writes (issue #32, item 12).

The whole `posttrain run --profile tiny` through the installed entry point, in subprocesses of
their own sessions (as a shell runs them), on a smaller copy of the default run (fewer steps and
instances, set by environment overrides; every stage still runs). One home runs without
interruption. A second home's run is killed with -9 on its process group while the judge trains
in its own launcher process (after its first checkpoint), rerun and stopped with SIGTERM while
the judge trains again, then rerun to the end. Then:

- 10 s after the kill -9 no process of that run is alive (the launcher included), and SIGTERM
  ends the run and its launcher within 30 s with the command returning;
- the judge resumed from its checkpoint instead of starting over;
- every table of the interrupted home holds what the uninterrupted one holds (run ids, times,
  paths under the home and the like set aside: the columns ``VOLATILE`` names).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import polars as pl
import psutil
import pytest
from test_cli import POSTTRAIN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

# every stage runs, on fewer steps and rows: the judge trains 60 steps (a checkpoint every 10) in
# its own launcher, the policy's stages a few steps each, evaluate a few items; curate without
# its embedding model (the MinHash and n-gram stages run)
SMALL_RUN = {
    "POSTTRAIN__TRAIN__JUDGE__STEPS": "60",
    "POSTTRAIN__TRAIN__JUDGE__CHECKPOINT_EVERY": "10",
    "POSTTRAIN__TRAIN__SFT_SHORT__STEPS": "20",
    "POSTTRAIN__TRAIN__SFT_SHORT__CHECKPOINT_EVERY": "10",
    "POSTTRAIN__TRAIN__DPO_SHORT__STEPS": "4",
    "POSTTRAIN__TRAIN__DPO_SHORT__CHECKPOINT_EVERY": "2",
    "POSTTRAIN__TRAIN__RL__STEPS": "6",
    "POSTTRAIN__TRAIN__RL__CHECKPOINT_EVERY": "3",
    "POSTTRAIN__TRAIN__RL__MAX_PROMPTS": "40",
    "POSTTRAIN__TRAIN__DATA__JUDGE_EXAMPLES_PER_TASK": "40",
    "POSTTRAIN__TRAIN__BASE_MODEL__TOKENIZER_TEXTS": "1000",
    "POSTTRAIN__SYNTHESIZE__PER_TASK": "4",
    "POSTTRAIN__SYNTHESIZE__PER_TASK_BY_TASK": "{web_of_lies: 60, object_properties: 60, object_counting: 60}",
    "POSTTRAIN__EVALUATE__SYNTHETIC__PER_TASK": "10",
    "POSTTRAIN__EVALUATE__N": "2",
    "POSTTRAIN__EVALUATE__K": "[1, 2]",
    "POSTTRAIN__EVALUATE__MAX_ITEMS": "1",
    "POSTTRAIN__REFERENCES__VALIDATION__SYNTHETIC_ITEMS": "10",
    "POSTTRAIN__INGEST__REASONING_GYM_PER_TASK": "5",
    "POSTTRAIN__CURATE__SEMANTIC__ENABLED": "false",
    "POSTTRAIN__CURATE__DECONTAM__EMBEDDING": "false",
}
# what differs between two homes by construction: ids and times of runs (and row ids hashed with
# them), seconds taken, and the run bookkeeping (stage_runs: which snapshots each stage read; its
# stages and cache keys are compared). Paths under a home and snapshot ids inside values are
# written as <home> and <snapshot> before comparing.
VOLATILE = ("run_id", "curate_run", "ingest_run", "mlflow_run_id", "prefect_flow_run_id", "created", "created_at",
            "started_at", "finished_at", "ingested_at", "seconds", "snapshot", "data_snapshots", "model_id",
            "judgment_id", "match_id", "summary", "inputs", "outputs")
SNAPSHOT_ID = r"\d{8}T\d{6}-[0-9a-f]{8}"
RUN_ID = r"\b[0-9a-f]{32}\b"


def _start(home: Path, log: Path) -> subprocess.Popen:
    """`posttrain run --profile tiny` on ``home``, in a session of its own (as a shell starts it)."""
    env = {**os.environ, **SMALL_RUN, "POSTTRAIN_HOME": str(home), "COLUMNS": "200"}
    for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "POSTTRAIN_MLFLOW_RUN_ID"):
        env.pop(name, None)
    with open(log, "ab") as out:
        return subprocess.Popen([POSTTRAIN, "run", "--profile", "tiny"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _of_home(home: Path) -> list[psutil.Process]:
    """Live processes of a run on ``home``: its environment names the home, or its command line
    does (a stage's launcher, its ranks, the run's temporary Prefect server)."""
    mine = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if (str(home) in " ".join(p.info["cmdline"] or [])
                    or p.environ().get("POSTTRAIN_HOME") == str(home)):
                mine.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return mine


def _judge_stage(home: Path) -> Path | None:
    found = sorted((home / "checkpoints").glob("*/judge"))
    return found[0] if found else None


def _judge_past_checkpoint(home: Path, run: subprocess.Popen, after: int = 0) -> int:
    """Wait until the judge's launcher has saved a checkpoint past step ``after`` and trains on;
    that step."""
    from tasks.train import checkpoint

    deadline = time.time() + 900
    while time.time() < deadline:
        assert run.poll() is None, f"the run ended ({run.returncode}) before the judge checkpointed"
        stage = _judge_stage(home)
        step = checkpoint.latest_step(stage) if stage is not None else None
        if step is not None and step > after and not checkpoint.is_done(stage):
            launchers = [p for p in _of_home(home) if "launcher_entry" in " ".join(p.cmdline())]
            if launchers:
                return step
        time.sleep(0.5)
    raise AssertionError("the judge saved no checkpoint within 900 s")


def _gone_within(home: Path, seconds: float) -> list[str]:
    """The processes of ``home``'s run still alive ``seconds`` from now (empty: all gone)."""
    deadline = time.time() + seconds
    while True:
        left = _of_home(home)
        if not left or time.time() >= deadline:
            return [f"{p.pid} {' '.join(p.cmdline())[:200]}" for p in left if p.is_running()]
        time.sleep(0.5)


def _stop_all(home: Path) -> None:
    for p in _of_home(home):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _tables(home: Path) -> dict[str, pl.DataFrame]:
    """Every table's newest snapshot, volatile columns set aside, rows in a canonical order."""
    from warehouse import Warehouse

    wh = Warehouse(home)
    out = {}
    for name in sorted(wh.tables()["name"].unique().to_list()):
        df = wh.read(name)
        df = df.drop([c for c in df.columns if c in VOLATILE]).with_columns(
            pl.col(pl.Utf8).str.replace_all(str(home), "<home>", literal=True)
            .str.replace_all(SNAPSHOT_ID, "<snapshot>").str.replace_all(RUN_ID, "<run>"))
        out[name] = df.sort(df.columns, nulls_last=True) if df.columns else df
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    home = tmp_path_factory.mktemp("uninterrupted")
    log = home.parent / "uninterrupted.log"
    run = _start(home, log)
    try:
        rc = run.wait(timeout=1800)
    finally:
        _stop_all(home)
    assert rc == 0, log.read_text()[-5000:]
    return home


def test_a_killed_run_leaves_nothing_running_and_its_rerun_ends_with_the_uninterrupted_tables(
        uninterrupted, tmp_path):
    home, log = tmp_path / "home", tmp_path / "run.log"
    try:
        # kill -9 of the run's process group while the judge trains in its own launcher
        run = _start(home, log)
        killed_at = _judge_past_checkpoint(home, run)
        os.killpg(run.pid, signal.SIGKILL)
        t0 = time.time()
        left = _gone_within(home, 10)
        assert not left, f"alive 10 s after the kill -9: {left}"
        print(f"kill -9 at judge step {killed_at}: every process gone after {time.time() - t0:.1f} s")

        # rerun, stopped with SIGTERM (as `timeout` sends it, to the command alone) once the judge trains again
        run = _start(home, log)
        stopped_at = _judge_past_checkpoint(home, run, after=killed_at)
        t0 = time.time()
        run.send_signal(signal.SIGTERM)
        rc = run.wait(timeout=30)
        left = _gone_within(home, max(0.0, 30 - (time.time() - t0)))
        took = time.time() - t0
        assert not left, f"alive 30 s after SIGTERM: {left}"
        assert rc != 0, "a run stopped by SIGTERM does not report success"
        print(f"SIGTERM at judge step {stopped_at}: command exited {rc}, every process gone after {took:.1f} s")

        # rerun to the end
        run = _start(home, log)
        assert run.wait(timeout=1800) == 0, log.read_text()[-5000:]
    finally:
        _stop_all(home)
    launcher_log = (_judge_stage(home) / "launcher.log").read_text()   # every launcher of the stage appends
    for step in (killed_at, stopped_at):
        assert f"judge resumes from its checkpoint at step {step}" in launcher_log, launcher_log[-5000:]
    steps = [json.loads(line)["step"] for line in (_judge_stage(home) / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(int(SMALL_RUN["POSTTRAIN__TRAIN__JUDGE__STEPS"])))

    want, got = _tables(uninterrupted), _tables(home)
    assert sorted(got) == sorted(want)
    differ = [name for name in want if not got[name].equals(want[name])]
    assert not differ, "\n".join(_difference(name, want[name], got[name]) for name in differ)


def _difference(name: str, want: pl.DataFrame, got: pl.DataFrame) -> str:
    """What a table's two versions disagree on: heights, and the columns whose values differ with
    a row of each side that the other lacks."""
    out = f"{name}: {want.height} rows uninterrupted, {got.height} interrupted"
    if want.columns != got.columns:
        return f"{out}; columns {want.columns} vs {got.columns}"
    cols = [c for c in want.columns if not want[c].sort(nulls_last=True).equals(got[c].sort(nulls_last=True))]
    only_want, only_got = want.join(got, on=want.columns, how="anti", nulls_equal=True), \
        got.join(want, on=want.columns, how="anti", nulls_equal=True)
    out += f"; columns that differ {cols}; {only_want.height} rows only uninterrupted, {only_got.height} only interrupted"
    for side, rows in (("uninterrupted", only_want), ("interrupted", only_got)):
        if rows.height:
            first = {k: v[:80] if isinstance(v, str) else v for k, v in rows.row(0, named=True).items()}
            out += f"\n  first only {side}: {first}"
    return out


def _weights(path: str) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(Path(path).glob("*.safetensors")))


def test_a_sweep_trains_rl_again_with_each_seed_from_the_run_s_start_and_scores_each_against_sft(
        uninterrupted, monkeypatch, capsys):
    """`posttrain sweep` (issue #46, item 5) on the finished uninterrupted home (after the test
    above compared its tables): RL trained again with seeds 1 and 2 from the model and data the
    run's RL started from, each seed's model scored against SFT on the same held-out items, and
    each seed's figures on its own MLflow run, which `posttrain compare` puts side by side."""
    from mlflow.tracking import MlflowClient

    from flows.cli import _print_sweep
    from flows.compare import compare
    from flows.sweep import sweep_flow
    from tasks.evaluate import SYNTHETIC_BENCHMARK, UNTRAINED_BENCHMARK, choose_model, stage_ladder
    from tasks.model_registry import stage_model
    from tasks.train.harness import StageJob
    from warehouse import Warehouse

    home = uninterrupted
    for key, value in {**SMALL_RUN, "POSTTRAIN_HOME": str(home)}.items():
        monkeypatch.setenv(key, value)
    wh = Warehouse(home)
    rl = wh.read("models").filter(pl.col("stage") == "rl").row(-1, named=True)
    run = rl["run_name"]
    newest_before, ladder_before = choose_model(wh).model_id, stage_ladder(wh, ["sft_long", "rl"])

    res = sweep_flow(profile="tiny", home=str(home), stage="rl", seeds=2)
    assert res["against"] == "sft_long" and res["run_name"] == run and res["settings"] == "the run's own"
    assert [s["seed"] for s in res["seeds"]] == [1, 2]   # the run's own seed (0) + 1 onwards

    # each seed trained RL from the model and data the run's RL started from, with its settings but the seed
    original = StageJob.load(Path(rl["path"]).parent / "job.json")
    weights = {_weights(rl["path"])}
    for s in res["seeds"]:
        job = StageJob.load(Path(s["path"]).parent / "job.json")
        assert job.run_name == f"{run}~seed{s['seed']}"
        assert job.init_model == original.init_model and job.data_ref == original.data_ref
        assert job.config["seed"] == s["seed"] and {**job.config, "seed": 0} == {**original.config, "seed": 0}
        assert s["steps"] == rl["steps"] and not s["skipped"]
        weights.add(_weights(s["path"]))
    assert len(weights) == 3, "each seed trains other weights"

    # the seeds' models stand beside the run's: never the newest model, a stage name, or the ladder
    assert {f"{run}~seed{k}/rl" for k in (1, 2)} <= set(wh.read("models")["model_id"])
    assert choose_model(wh).model_id == newest_before
    assert stage_model(wh, "rl") == rl["path"]
    assert stage_ladder(wh, ["sft_long", "rl"]) == ladder_before

    # ... and a later `posttrain run` takes none of what the sweep wrote for new data
    from flows.pipeline import changed_reads
    stage_runs = wh.read("stage_runs")
    for stage in ("rl", "evaluate", "audit"):
        assert changed_reads(wh, stage, stage_runs.filter(pl.col("stage") == stage).row(-1, named=True)) == []

    # every seed has its difference over SFT with a paired interval, pooled and per family ...
    assert set(res["pooled"]) == {SYNTHETIC_BENCHMARK, UNTRAINED_BENCHMARK}
    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    sft_scores = set()
    for s in res["seeds"]:
        b = s["benchmarks"][SYNTHETIC_BENCHMARK]
        assert b["lo"] <= b["diff"] <= b["hi"] and b["diff"] == pytest.approx(b["rl"] - b["sft_long"])
        sft_scores.add(b["sft_long"])
        assert any(name.startswith(f"{SYNTHETIC_BENCHMARK}/") for name in s["benchmarks"])
        # ... logged on the seed's own training run under the pipeline's metric names
        seed_run = client.get_run(s["mlflow_run_id"])
        assert seed_run.data.params["seed"] == str(s["seed"])
        assert seed_run.data.tags["posttrain.sweep_seed"] == str(s["seed"])
        assert seed_run.data.tags["mlflow.parentRunId"] == res["mlflow_run_id"]
        m = seed_run.data.metrics
        assert m[f"eval.rl.{SYNTHETIC_BENCHMARK}.pass_at_1"] == pytest.approx(b["rl"])
        assert m[f"eval.sft_long.{SYNTHETIC_BENCHMARK}.pass_at_1"] == pytest.approx(b["sft_long"])
        for what in ("diff", "lo", "hi"):
            assert m[f"eval.delta.rl_vs_sft_long.{SYNTHETIC_BENCHMARK}.{what}"] == pytest.approx(b[what])
    assert len(sft_scores) == 1, "every seed is measured against the same SFT scores"

    # mean and sample sd across seeds, recomputed here; in the sweep's run with its plot
    diffs = [s["benchmarks"][SYNTHETIC_BENCHMARK]["diff"] for s in res["seeds"]]
    summary = res["summary"][SYNTHETIC_BENCHMARK]
    assert summary["mean"] == pytest.approx(sum(diffs) / 2)
    assert summary["sd"] == pytest.approx(abs(diffs[0] - diffs[1]) / 2 ** 0.5)
    assert summary["positive"] == sum(d > 0 for d in diffs) and summary["seeds"] == 2
    sweep_run = client.get_run(res["mlflow_run_id"])
    assert sweep_run.data.metrics[f"sweep.{SYNTHETIC_BENCHMARK}.diff.mean"] == pytest.approx(summary["mean"])
    assert "plots/sweep_seeds.png" in {a.path for a in client.list_artifacts(res["mlflow_run_id"], "plots")}
    stored = json.loads(Path(client.download_artifacts(res["mlflow_run_id"], "sweep/seeds.json")).read_text())
    assert [s["seed"] for s in stored["seeds"]] == [1, 2]

    # the evaluate run scored SFT and each seed's model by their model ids
    evaluated = wh.read("eval_results").filter(pl.col("run_id") == res["evaluate"]["mlflow_run_id"])
    assert set(evaluated["model"]) == {f"{run}/sft_long", *(f"{run}~seed{k}/rl" for k in (1, 2))}

    # `posttrain compare` of two seeds puts their held-out ladders side by side
    cmp = compare(res["seeds"][0]["mlflow_run_id"], res["seeds"][1]["mlflow_run_id"], home=str(home),
                  out_dir=home / "cmp")
    assert set(cmp.ladder.filter(pl.col("benchmark") == SYNTHETIC_BENCHMARK)["stage"]) == {"sft_long", "rl"}

    # what the CLI prints: a row per seed and the mean +- sd line
    capsys.readouterr()
    _print_sweep(res)
    printed = capsys.readouterr().out
    assert f"{SYNTHETIC_BENCHMARK}: rl - sft_long over 2 seeds: {summary['mean']:+.3f} +-" in printed
    assert res["seeds"][0]["mlflow_run_id"] in printed
