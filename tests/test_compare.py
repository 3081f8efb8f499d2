"""Comparing two pipeline runs and the per-run report, on real MLflow runs and a real warehouse."""
from __future__ import annotations

import polars as pl
import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console

from flows.compare import compare, print_comparison, resolve_run, write_run_report
from tasks import tracking
from warehouse import Warehouse

DECISION_SCHEMA = {"row_id": pl.Utf8, "stage": pl.Utf8, "decision": pl.Utf8, "reason": pl.Utf8,
                   "reference_id": pl.Utf8, "score": pl.Float64, "run_id": pl.Utf8}


def removed(wh: Warehouse, stage: str, reason: str, count: int, run_id: str) -> None:
    rows = [{"row_id": f"{stage}-{reason}-{i}", "stage": stage, "decision": "removed", "reason": reason,
             "reference_id": "kept-row", "score": 1.0, "run_id": run_id} for i in range(count)]
    wh.append("decisions", pl.DataFrame(rows, schema=DECISION_SCHEMA))


def pipeline_run(wh: Warehouse, experiment: str, threshold: float, lr: float, rewards: list[float],
                 pass1: dict[str, float], near_dups: int, rl_stage: bool = False) -> str:
    """A pipeline parent with curate / train / evaluate children, logged as the flows log them."""
    with tracking.tracked_run("pipeline", params={"profile": "tiny", "stages": ["curate", "train", "evaluate"]},
                              tags={"posttrain.profile": "tiny"}, experiment=experiment) as parent:
        with tracking.tracked_run("curate", params={"curate": {"minhash_threshold": threshold, "shingle": 5}}) as cur:
            tracking.log_counters({"rows_in": 100, "kept": 100 - near_dups - 3}, prefix="curate")
            removed(wh, "minhash", "duplicate-of", near_dups, cur)
            removed(wh, "decontaminate", "contaminated-by", 3, cur)
        with tracking.tracked_run("train", params={"rl": {"lr": lr, "epsilon_high": 0.2}}):
            for step, reward in enumerate(rewards):
                tracking.log_counters({"reward_mean": reward, "loss": 1.0 - reward}, prefix="rl", step=step)
        with tracking.tracked_run("evaluate", params={"n": 4, **({"stages": "sft_long,rl"} if rl_stage else {})}):
            tracking.log_counters({f"{b}.pass_at_1": v for b, v in pass1.items()}, prefix="eval")
            # the per-stage ladder (B also evaluated an RL model; A has no such row)
            ladder = {"sft_long": 0.3, **({"rl": 0.45} if rl_stage else {})}
            tracking.log_counters({f"{stage}.synthetic_heldout.pass_at_{k}": v for stage, v in ladder.items()
                                   for k in (1, 4)}, prefix="eval")
    return parent


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One home for the module: the runs are built once and only read by the tests."""
    path = tmp_path_factory.mktemp("compare_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POSTTRAIN_HOME", str(path))
        yield path


@pytest.fixture(scope="module")
def two_runs(home):
    wh = Warehouse(home)
    a = pipeline_run(wh, "exp-a", 0.8, 1e-4, [0.1, 0.2, 0.25], {"math500": 0.4, "humaneval": 0.1}, near_dups=5)
    b = pipeline_run(wh, "exp-b", 0.7, 3e-4, [0.1, 0.3, 0.5, 0.6], {"math500": 0.5, "humaneval": 0.2}, near_dups=9,
                     rl_stage=True)
    return a, b


def test_compare_shows_params_metrics_eval_and_funnel_side_by_side(two_runs, home, tmp_path):
    a, b = two_runs
    result = compare(a, b, out_dir=tmp_path / "cmp", home=home)
    params = {r["param"]: (r["a"], r["b"]) for r in result.params.iter_rows(named=True)}
    assert params == {"curate.minhash_threshold": ("0.8", "0.7"), "train.rl.lr": ("0.0001", "0.0003")}
    # the legends say what differs, not a run id
    assert (result.a, result.b) == ("train.rl.lr=0.0001", "train.rl.lr=0.0003")

    metrics = {r["metric"]: (r["a"], r["b"], r["delta"]) for r in result.metrics.iter_rows(named=True)}
    assert metrics["train/rl.reward_mean"] == pytest.approx((0.25, 0.6, 0.35))   # final values
    assert metrics["curate/curate.rows_in"] == (100.0, 100.0, 0.0)

    evals = {(r["benchmark"], r["k"]): (r["a"], r["b"]) for r in result.eval.iter_rows(named=True)}
    assert evals == {("humaneval", 1): pytest.approx((0.1, 0.2)), ("math500", 1): pytest.approx((0.4, 0.5))}

    funnel = {(r["stage"], r["reason"]): (r["a"], r["b"]) for r in result.funnel.iter_rows(named=True)}
    assert funnel == {("decontaminate", "contaminated-by"): (3, 3), ("minhash", "duplicate-of"): (5, 9)}

    assert set(result.plots) == {"reward_curves", "pass_at_k", "funnel"}
    for path in result.plots.values():
        assert path.parent == tmp_path / "cmp" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a setting only one run has is kept apart from the ones a user changed
    assert result.params_one_sided.rows() == [("evaluate.stages", None, "sft_long,rl")]
    # the held-out ladder side by side; the stage A never evaluated is missing, not 0
    ladder = {(r["benchmark"], r["stage"]): (r["a"], r["b"]) for r in result.ladder.iter_rows(named=True)}
    assert ladder == {("synthetic_heldout", "sft_long"): (0.3, 0.3), ("synthetic_heldout", "rl"): (None, 0.45)}
    # every table in full, where the command says
    assert result.out_dir == tmp_path / "cmp"
    for name in ("params", "params_one_sided", "ladder", "eval", "funnel", "metrics"):
        assert pl.read_csv(tmp_path / "cmp" / f"{name}.csv").height == getattr(result, name).height


def test_experiment_names_resolve_to_their_newest_pipeline_run(two_runs, home):
    a, b = two_runs
    tracking.configure(home=home)
    client = MlflowClient()
    assert resolve_run(client, "exp-b").info.run_id == b
    assert resolve_run(client, a).info.run_id == a
    result = compare("exp-a", "exp-b", home=home)
    assert (result.a_run_id, result.b_run_id) == (a, b)
    assert all(p.is_relative_to(home) for p in result.plots.values())
    with pytest.raises(LookupError, match="neither an MLflow run id nor an experiment name"):
        compare("no-such-run", b, home=home)


def test_printed_comparison_lists_every_section(two_runs, home, tmp_path):
    console = Console(record=True, width=200)
    print_comparison(compare(*two_runs, out_dir=tmp_path, home=home), console)
    text = console.export_text()
    for expected in ("parameters that differ", "train.rl.lr", "held-out pass@k", "math500",
                     "data funnel", "contaminated-by", "final metrics", "reward_mean",
                     "1 more set in one run only", "held-out pass@1 after each training stage",
                     f"full tables (CSV) and plots: {tmp_path}"):
        assert expected in text


def test_run_report_is_logged_to_the_run(two_runs, home):
    a, _ = two_runs
    report = write_run_report(a, home=home)
    page = report.read_text()
    for expected in ("Stages", "curate", "Held-out pass@k", "math500", "duplicate-of",
                     "Reward curves", "rl.reward_mean", "data:image/png;base64,"):
        assert expected in page
    # each run id opens that run in the MLflow UI `posttrain ui` serves, in its Model-training view
    experiment = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}").get_run(a).info.experiment_id
    assert (f'href="http://127.0.0.1:5000/#/experiments/{experiment}/runs/{a}?workflowType=machine_learning"'
            in page)
    tracking.configure(home=home)   # artifact listing resolves runs through the global tracking URI
    client = MlflowClient()
    logged = {f.path for f in client.list_artifacts(a, "report")}
    assert {"report/report.html", "report/reward_curves.png", "report/pass_at_k.png", "report/funnel.png"} <= logged


def test_reward_curves_keep_rl_and_every_stage_however_many_metrics_sort_first():
    from flows.compare import pick_curves

    names = {f"dpo_short/dpo_short.reward_{c}" for c in "abcdefgh"} | {
        "dpo_short/dpo_short.reward_mean", "rl/rl.reward_mean", "rl/rl.reward_std", "references/genrm.reward_x"}
    picked = pick_curves(names, 4)
    assert picked[:2] == ["rl/rl.reward_mean", "dpo_short/dpo_short.reward_mean"]
    assert "references/genrm.reward_x" in picked and len(picked) == 4
    assert pick_curves(set(), 6) == []


def _sections(page: str) -> tuple[list[str], list[str]]:
    """(h2 headings in order, headings folded inside <details>) of a report page."""
    from html.parser import HTMLParser

    class Sections(HTMLParser):
        def __init__(self):
            super().__init__()
            self.headings, self.folded, self._in_h2, self._depth = [], [], False, 0

        def handle_starttag(self, tag, attrs):
            self._in_h2 = self._in_h2 or tag == "h2"
            self._depth += tag == "details"

        def handle_endtag(self, tag):
            self._in_h2 = self._in_h2 and tag != "h2"
            self._depth -= tag == "details"

        def handle_data(self, data):
            if self._in_h2 and data.strip():
                self.headings.append(data.strip())
                if self._depth:
                    self.folded.append(data.strip())

    parser = Sections()
    parser.feed(page)
    return parser.headings, parser.folded


def test_report_leads_with_the_summary_folds_the_long_tables_and_says_why_a_chart_is_missing(two_runs, home,
                                                                                            tmp_path):
    a, _ = two_runs
    headings, folded = _sections(write_run_report(a, home=home, out_dir=tmp_path / "a", log_to_mlflow=False)
                                 .read_text())
    assert headings[:2] == ["Stages", "What each training stage did: held-out pass@1"]
    assert [h.split(" (")[0] for h in folded] == ["Datasets", "Final metrics", "Parameters"] == \
        [h.split(" (")[0] for h in headings[-3:]]
    # a run that logged nothing to draw: every chart says why it is absent
    with tracking.tracked_run("pipeline", experiment="exp-empty") as empty, tracking.tracked_run("ingest"):
        tracking.log_counters({"rows": 3}, prefix="ingest")
    page = write_run_report(empty, home=home, out_dir=tmp_path / "empty", log_to_mlflow=False).read_text()
    assert page.count("<em>no chart: ") == 4 and "data:image/png" not in page


def branched_pipeline(experiment: str, branch_order: list[str], lr: dict[str, float]) -> str:
    """A pipeline whose train flow runs once per branch (as the judge and policy branches do,
    concurrently): each a "train" run named after its stage, with the stage's own run inside."""
    with tracking.tracked_run("pipeline", experiment=experiment) as parent:
        for stage in branch_order:
            with (tracking.tracked_run("train", run_name=f"train {stage}", params={"stages": stage}),
                  tracking.tracked_run(stage, params={"lr": lr[stage]})):
                tracking.log_counters({"loss": lr[stage] * 10}, prefix=stage)
    return parent


def test_repeated_stages_pair_by_branch_whatever_order_the_branches_started_in(home, tmp_path):
    """The pipeline's judge and policy branches each open a "train" run; which starts first
    varies between runs, so pairing them by start order (train, train#2) compared the judge's
    settings with SFT's. Keys come from the run names, and the report nests each stage run
    under its train run."""
    a = branched_pipeline("exp-branches-a", ["judge", "sft_short"], {"judge": 1e-3, "sft_short": 3e-4})
    b = branched_pipeline("exp-branches-b", ["sft_short", "judge"], {"judge": 1e-3, "sft_short": 5e-4})
    result = compare(a, b, out_dir=tmp_path / "cmp", home=home)
    params = {r["param"]: (r["a"], r["b"]) for r in result.params.iter_rows(named=True)}
    assert params == {"sft_short.lr": ("0.0003", "0.0005")}   # the branches' own params all match
    metrics = {r["metric"]: (r["a"], r["b"]) for r in result.metrics.iter_rows(named=True)}
    assert metrics["judge/judge.loss"] == pytest.approx((0.01, 0.01))
    assert not any("#" in name for name in [*params, *metrics])

    page = write_run_report(b, home=home, log_to_mlflow=False).read_text()
    stages_table = page.split("<h2>Stages</h2>")[1].split("</table>")[0]
    cells = [row.split("</td><td>")[:2] for row in stages_table.split("<tr><td>")[1:]]
    assert [tuple(c) for c in cells] == [("pipeline", "-"), ("train sft_short", "pipeline"),
                                         ("sft_short", "train sft_short"), ("train judge", "pipeline"),
                                         ("judge", "train judge")]


def test_the_judge_table_reads_logged_metrics_and_prints_whole_at_80_columns():
    """One row per group, all synthetic items first; the CLI's table keeps every header whole
    in an 80-column terminal (long headers were cut to "unreadab…")."""
    from flows import cli
    from tasks.genrm.validation import judge_table

    def group(name, acc):
        return {f"genrm.{name}_grade_accuracy": acc, f"genrm.{name}_grade_p_vs_chance": 1e-9,
                f"genrm.{name}_grade_unreadable": 0.02, f"genrm.{name}_sample_accuracy": 0.6,
                f"genrm.{name}_parseable": 0.99}

    rows = judge_table({**group("synthetic_web_of_lies", 0.55), **group("synthetic", 0.83), "genrm.other": 1.0})
    assert [r["items"] for r in rows] == ["all synthetic", "web_of_lies"]
    assert rows[0] == {"items": "all synthetic", "grade accuracy": 0.83, "p vs chance": 1e-9, "grades unread": 0.02,
                       "pairwise accuracy": 0.6, "pairwise read": 0.99}
    console = Console(record=True, width=80)
    saved, cli.console = cli.console, console
    try:
        cli._print_judge({"validation": {**group("synthetic_object_properties", 0.97), **group("synthetic", 0.83)}})
    finally:
        cli.console = saved
    text = console.export_text()
    assert "…" not in text and "object_properties" in text and "1.0e-09" in text


def test_the_verdict_line_says_whether_training_helped():
    from tasks.evaluate import ladder_verdict

    ladder = {"synthetic_heldout/a": {"base": 0.1, "sft_long": 0.3, "rl": 0.5},
              "synthetic_heldout/b": {"base": 0.0, "sft_long": 0.2, "rl": 0.1},
              "synthetic_heldout": {"base": 0.05, "sft_long": 0.25, "rl": 0.3}, "math500": {"base": 0.0, "rl": 0.0}}
    assert ladder_verdict(ladder, True) == ("Training helped: mean held-out pass@1 over 2 families 0.05 (base) -> "
                                            "0.30 (rl), +0.25; rl vs sft_long +0.05; training-data audit passed.")
    worse = {"synthetic_heldout/a": {"base": 0.4, "rl": 0.2}}
    assert ladder_verdict(worse).startswith("Training did not help: mean held-out pass@1 over 1 family 0.40 (base)")
    assert ladder_verdict({"math500": {"base": 0.0}}) is None
