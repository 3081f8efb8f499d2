"""The SynLogic-style task library: registry coverage, determinism, answer extraction,
multi-solution verifiers, and the reasoning-gym adapter."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.synth.base import TaskError, derive_rng, extract_answer, stable_int
from tasks.synth.registry import OWN_TASKS, get_task, own_task_names

SYNLOGIC_FAMILIES = {
    "arithmetic": {"game_of_24", "cryptarithm", "operation", "magic_square"},
    "grid": {"sudoku", "futoshiki", "skyscraper", "kukurasu", "star_placement", "minesweeper",
             "number_wall", "calcudoko", "survo", "campsite", "norinori", "numbrix"},
    "sequence": {"math_path", "arrow_maze", "time_sequence"},
    "language": {"dyck_completion", "dyck_error", "dyck_reasoning_errors", "word_sorting", "word_sorting_mistake",
                 "boolean_expressions", "web_of_lies", "object_counting", "object_properties", "wordscapes"},
    "cipher": {"cipher"},
    "exchange": {"goods_exchange"},
    "logic": {"zebra_puzzle"},
    "spatial": {"space_reasoning", "space_reasoning_tree"},
    "planning": {"buckets"},
}


def test_registry_covers_the_synlogic_families():
    assert len(OWN_TASKS) >= 35   # SynLogic's published list
    for family, names in SYNLOGIC_FAMILIES.items():
        for name in names:
            assert OWN_TASKS[name].family == family, name
    assert set(own_task_names()) == set().union(*SYNLOGIC_FAMILIES.values())


def test_every_task_has_ordered_typed_levels():
    for task in OWN_TASKS.values():
        assert task.n_levels >= 4, task.name
        kinds = {type(p) for p in task.levels}
        assert len(kinds) == 1, f"{task.name}: one parameter type for all levels"
        assert len(set(task.levels)) == task.n_levels, f"{task.name}: levels must differ"
        assert all(isinstance(d, dict) for d in task.level_params())


def test_unknown_task_and_level_are_clear_errors():
    with pytest.raises(TaskError, match="unknown synthetic task 'nope'"):
        get_task("nope")
    with pytest.raises(TaskError, match="level 99 outside"):
        get_task("sudoku").generate(0, 99)
    with pytest.raises(TaskError, match="no dataset"):
        get_task("rg:not_a_dataset")


def test_seeded_rng_is_stable_and_unsalted():
    assert stable_int("a", 1) == stable_int("a", 1) != stable_int("a", 2)
    assert derive_rng("sudoku", 3, 1).random() == derive_rng("sudoku", 3, 1).random()
    assert derive_rng("sudoku", 3, 1).random() != derive_rng("sudoku", 3, 2).random()


def _fingerprint(names):
    return {n: [get_task(n).generate(s, lv).id for s in range(2) for lv in (0, get_task(n).n_levels - 1)]
            for n in names}


def test_same_seed_and_level_give_the_same_instance_in_a_fresh_process():
    # a fresh interpreter has a different string-hash salt: ids must not depend on it
    names = ["sudoku", "star_placement", "word_sorting", "cipher", "goods_exchange", "campsite", "zebra_puzzle",
             "space_reasoning", "space_reasoning_tree", "buckets", "dyck_reasoning_errors", "wordscapes", "norinori",
             "numbrix", "magic_square"]
    code = ("import json; from tests.test_synth_tasks import _fingerprint; "
            f"print(json.dumps(_fingerprint({names!r})))")
    env_out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": "12345", "PATH": ""},
                             cwd=str(Path(__file__).resolve().parents[1]))
    assert json.loads(env_out.stdout) == _fingerprint(names)


def test_generation_is_deterministic_and_varies_with_seed():
    for task in OWN_TASKS.values():
        a, b = task.generate(7, 1), task.generate(7, 1)
        assert a == b, task.name
        others = {task.generate(s, 1).id for s in range(8)}
        assert len(others) > 1, f"{task.name}: seeds should give different instances"
        json.loads(a.metadata_json())
        assert "<answer>" in a.prompt and a.question in a.prompt


@pytest.mark.parametrize("response, expected", [
    ("<answer>42</answer>", "42"),
    ("<ANSWER>  42 \n</Answer>", "42"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("<think><answer>7</answer></think> final <answer>8</answer>", "8"),
    ("<think>try <answer>7</answer></think> no tag after", None),
    ("reasoning...<answer> 13", "13"),
    ("< answer >x< / answer >", "x"),
    ("no tags at all", None),
    ("<answer>   </answer>", None),
    (None, None),
    (12, None),
])
def test_extract_answer_is_tolerant(response, expected):
    assert extract_answer(response) == expected


def test_game_of_24_accepts_any_valid_expression():
    from tasks.synth.base import TaskInstance
    task = get_task("game_of_24")
    inst = TaskInstance(task="game_of_24", level=1, seed=0, question="", prompt="", answer="1 * 2 * 3 * 4",
                        metadata={"numbers": [1, 2, 3, 4], "target": 24})
    for expr in ("1 * 2 * 3 * 4", "(1 + 3) * (2 + 4)", "4 × 3 × 2 ÷ 1", "(2 + 4) * (3 + 1) = 24"):
        assert task.verify(inst, f"<answer>{expr}</answer>") == 1.0, expr
    assert task.verify(inst, "<answer>24</answer>") == 0.0                 # numbers not used
    assert task.verify(inst, "<answer>(1 + 2 + 3) * 4</answer>") == 1.0
    assert task.verify(inst, "<answer>4 * 3 * 2</answer>") == 0.0          # 1 left out
    assert task.verify(inst, "<answer>__import__('os')</answer>") == 0.0
    generated = task.generate(5, 2)
    assert task.verify(generated, f"<answer>{generated.answer}</answer>") == 1.0


def test_math_path_accepts_an_alternative_filling():
    task = get_task("math_path")
    for seed in range(200):
        inst = task.generate(seed, 1)   # 3 operands, 2 blanks, + and -
        given, ops, result = inst.metadata["numbers"], inst.metadata["ops"], inst.metadata["result"]
        blanks = [i for i, v in enumerate(given) if v is None]
        for a in range(1, 10):
            for b in range(1, 10):
                filled = list(given)
                filled[blanks[0]], filled[blanks[1]] = a, b
                text = " ".join([str(filled[0])] + [f"{o} {n}" for o, n in zip(ops, filled[1:])])
                if f"{text} = {result}" != inst.answer and eval(text) == result:
                    assert task.verify(inst, f"<answer>{text} = {result}</answer>") == 1.0
                    assert task.verify(inst, f"<answer>{a}, {b}</answer>") == 1.0
                    return
    pytest.fail("no math_path instance with two valid fillings in 200 seeds")


def test_arrow_maze_accepts_any_path_following_the_arrows():
    from tasks.synth.base import TaskInstance
    task = get_task("arrow_maze")
    # 3x3 board: two different landing sequences both reach G
    arrows = ["→↘↓", "↓↓↓", "→→G"]
    inst = TaskInstance(task="arrow_maze", level=0, seed=0, question="", prompt="", answer="",
                        metadata={"arrows": arrows, "start": [0, 0], "goal": [2, 2]})
    assert task.verify(inst, "<answer>(1,1), (1,3), (3,3)</answer>") == 1.0
    assert task.verify(inst, "<answer>(1,1), (1,2), (3,3)</answer>") == 0.0   # (1,2) points down-right
    assert task.verify(inst, "<answer>(1,1), (1,2), (2,3), (3,3)</answer>") == 1.0
    assert task.verify(inst, "<answer>(1,1), (2,2), (3,3)</answer>") == 0.0   # (1,1) points right
    assert task.verify(inst, "<answer>(1,1), (1,3)</answer>") == 0.0          # never reaches G


def test_grid_verifiers_check_rules_not_string_equality():
    sudoku = get_task("sudoku")
    inst = sudoku.generate(1, 0)
    compact = ",".join(inst.answer.split())   # different formatting, same grid
    assert sudoku.verify(inst, f"<answer>[{compact}]</answer>") == 1.0
    stars = get_task("star_placement")
    inst = stars.generate(2, 1)
    reordered = ", ".join(reversed(inst.answer.split(", ")))
    assert stars.verify(inst, f"<answer>{reordered}</answer>") == 1.0


def test_reasoning_gym_adapter_uses_the_curriculum_and_score_answer():
    task = get_task("rg:basic_arithmetic")
    assert task.n_levels >= 3
    easy, hard = task.generate(0, 0), task.generate(0, task.n_levels - 1)
    assert easy == task.generate(0, 0)
    assert easy.metadata["rg_metadata"]["difficulty"] != hard.metadata["rg_metadata"]["difficulty"]
    assert task.verify(easy, f"<answer>{easy.answer}</answer>") == 1.0
    assert task.verify(easy, "<answer>not a number</answer>") == 0.0
    assert task.verify(easy, None) == 0.0


def test_reasoning_gym_numeric_answers_are_read_flexibly_only_without_tags():
    """A small model answers "1 + 4 = 5" without tags: with a one-number gold, the response's
    last number is scored by score_answer; a tagged answer is read strictly, and a non-numeric
    gold never falls back."""
    task = get_task("rg:chain_sum")
    inst = task.generate(10_000, 0)
    right, wrong = inst.answer, str(int(inst.answer) + 1)
    assert task.verify(inst, f"Adding them up gives {right}.") == 1.0
    assert task.verify(inst, f"Adding them up gives {right}, or maybe {wrong}") == 0.0   # the last number
    assert task.verify(inst, f"<answer>{wrong}</answer> so it is {right}") == 0.0        # tags are strict
    assert task.verify(inst, "no number here") == 0.0
    words = get_task("rg:spell_backward")
    spelled = words.generate(3, 0)
    assert words.verify(spelled, f"<answer>{spelled.answer}</answer>") == 1.0
    assert words.verify(spelled, f"It is {spelled.answer} 7") == 0.0


@pytest.mark.parametrize("dataset", ["products", "basic_arithmetic", "chain_sum", "aiw", "word_sorting",
                                     "zebra_puzzles", "knights_knaves", "spell_backward", "countdown"])
def test_reasoning_gym_perturbations_are_edits_its_own_scorer_rejects(dataset):
    """reasoning-gym tasks join DPO and judge data: their wrong answers are edits of the gold that
    the dataset's ``score_answer`` does not accept (those it scores 0 first), reproducible."""
    import random

    task = get_task(f"rg:{dataset}")
    made = 0
    for seed in range(4):
        inst = task.generate(seed, 0)
        wrong = task.perturbations(inst, random.Random(seed))
        assert wrong == task.perturbations(inst, random.Random(seed))
        scores = [task.verify(inst, f"<answer>{w}</answer>") for w in wrong]
        assert all(w.strip() != inst.answer.strip() for w in wrong) and all(s < 1.0 for s in scores)
        assert scores == sorted(scores, key=lambda s: s > 0)    # the answers it scores 0 first
        made += len(wrong)
    assert made >= 4, f"rg:{dataset}: the edits gave almost no wrong answers"


def test_reasoning_gym_dataset_without_curriculum_has_one_level():
    task = get_task("rg:acre")
    assert task.n_levels == 1
    inst = task.generate(5, 0)
    assert task.verify(inst, f"<answer>{inst.answer}</answer>") == 1.0


def test_reasoning_gym_registry_is_whole_while_another_thread_imports_it():
    """The pipeline runs ingest (which imports reasoning_gym) beside synthesize (which reads its
    registry): a registry read while the package is half imported missed 'basic_arithmetic' and
    failed the run. A fresh interpreter reads it the moment the other thread's import has made
    the factory module importable."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import sys, threading
        from tasks.synth.reasoning_gym_adapter import reasoning_gym_datasets
        importer = threading.Thread(target=lambda: __import__("reasoning_gym"))
        importer.start()
        while "reasoning_gym.factory" not in sys.modules:
            pass
        seen = reasoning_gym_datasets()
        importer.join()
        from reasoning_gym.factory import DATASETS
        print(len(seen), len(DATASETS), "basic_arithmetic" in seen)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()
    assert out[0] == out[1] and out[2] == "True", out
