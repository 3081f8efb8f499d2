"""Property tests for every own task: gold accepted (however it is wrapped), perturbed answers
rejected, garbage scored 0 without raising, and instances reproducible from (seed, level)."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.synth.registry import OWN_TASKS

PROPERTY_SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.too_slow])
TASK_NAMES = sorted(OWN_TASKS)
seeds = st.integers(min_value=0, max_value=2 ** 40)

WRAPPERS = [
    "<answer>{}</answer>",
    "<think>let me see <answer>wrong</answer></think>\nSo the result is <answer>\n{}\n</answer>",
    "Final: <ANSWER> {} </Answer>",
    "<answer>draft</answer> on reflection <answer>{}",   # last block, closing tag missing
]

garbage = st.one_of(
    st.text(max_size=200),
    st.text(max_size=200).map(lambda t: f"<answer>{t}</answer>"),
    st.lists(st.integers(-5, 20), max_size=40).map(lambda xs: "<answer>" + " ".join(map(str, xs)) + "</answer>"),
    st.lists(st.tuples(st.integers(-2, 12), st.integers(-2, 12)), max_size=12).map(
        lambda ps: "<answer>" + ", ".join(f"({a},{b})" for a, b in ps) + "</answer>"),
    st.sampled_from(["<answer></answer>", "<answer>((((</answer>", "<answer>1/0</answer>",
                     "<answer>A=1, A=2</answer>", "<answer>9" * 50, "</think>", None]),
)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_gold_accepted_and_perturbations_rejected(name):
    task = OWN_TASKS[name]

    @PROPERTY_SETTINGS
    @given(seed=seeds, level=st.integers(0, task.n_levels - 1), wrapper=st.sampled_from(WRAPPERS))
    def prop(seed, level, wrapper):
        inst = task.generate(seed, level)
        assert inst == task.generate(seed, level)
        assert task.verify(inst, wrapper.format(inst.answer)) == 1.0
        wrong = task.perturbations(inst, random.Random(seed))
        assert wrong, f"{name}: no perturbation produced"
        for answer in wrong:
            assert answer.strip() != inst.answer.strip()
            assert task.verify(inst, f"<answer>{answer}</answer>") == 0.0, (answer, inst.answer)

    prop()


@pytest.mark.parametrize("name", TASK_NAMES)
def test_garbage_scores_zero_and_never_raises(name):
    task = OWN_TASKS[name]
    instances = [task.generate(s, lv) for s in range(2) for lv in range(task.n_levels)]

    @PROPERTY_SETTINGS
    @given(index=st.integers(0, len(instances) - 1), response=garbage)
    def prop(index, response):
        inst = instances[index]
        score = task.verify(inst, response)
        assert 0.0 <= score <= 1.0
        if score > 0:   # garbage can only win by stating a valid answer
            assert response is not None and "<answer>" in response.lower()

    prop()
