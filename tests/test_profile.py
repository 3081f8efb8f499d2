import pytest
from pydantic import BaseModel, ConfigDict

from tasks.profile import ProfileError, available_profiles, env_overrides, load_profile


class Demo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    threshold: float = 0.5
    nested: dict = {}


def test_shipped_profiles_load():
    assert {"tiny", "gpu", "m1"} <= set(available_profiles())
    for name in ("tiny", "gpu", "m1"):
        prof = load_profile(name, environ={})
        assert prof.core.seed == 0
    assert load_profile("tiny", environ={}).core.task_runner == "local"


def test_env_overrides_win_and_are_typed(tmp_path):
    (tmp_path / "demo.yaml").write_text("threshold: 0.7\n")
    prof = load_profile(tmp_path, environ={"POSTTRAIN__DEMO__THRESHOLD": "0.9",
                                           "POSTTRAIN__DEMO__NESTED__A": "3",
                                           "POSTTRAIN__PROFILE__SEED": "7"})
    cfg = prof.section("demo", Demo)
    assert cfg.threshold == 0.9 and cfg.nested == {"a": 3}
    assert prof.core.seed == 7


def test_bad_section_names_file(tmp_path):
    (tmp_path / "demo.yaml").write_text("threshold: high\n")
    with pytest.raises(ProfileError, match="demo.yaml"):
        load_profile(tmp_path, environ={}).section("demo", Demo)
    (tmp_path / "demo.yaml").write_text("unknown_key: 1\n")
    with pytest.raises(ProfileError):
        load_profile(tmp_path, environ={}).section("demo", Demo)


def test_unknown_profile_and_bad_override():
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("nope", environ={})
    with pytest.raises(ProfileError):
        env_overrides({"POSTTRAIN__ONLYSECTION": "1"})


def test_config_hash_changes_with_settings(tmp_path):
    (tmp_path / "demo.yaml").write_text("threshold: 0.7\n")
    a = load_profile(tmp_path, environ={}).config_hash("demo")
    b = load_profile(tmp_path, environ={"POSTTRAIN__DEMO__THRESHOLD": "0.8"}).config_hash("demo")
    assert a != b and a == load_profile(tmp_path, environ={}).config_hash("demo")



def test_the_docstring_override_examples_apply_and_validate():
    """Each ``POSTTRAIN__...=value`` example of tasks/profile.py's docstring, applied to the
    shipped tiny profile through the real override code, validates and changes the setting it names."""
    import re

    import yaml

    import tasks.profile
    from tasks.curate.config import CurateConfig

    def setting(prof, section: str, path: list[str]):
        value = prof.core if section == "profile" else prof.section(section, {"curate": CurateConfig}[section])
        for name in path:
            value = getattr(value, name)
        return value

    examples = re.findall(r"``(POSTTRAIN__\w+)=([^`]+)``", tasks.profile.__doc__)
    assert len(examples) == 2, examples
    for key, raw in examples:
        section, *path = key.removeprefix("POSTTRAIN__").lower().split("__")
        overridden = setting(load_profile("tiny", environ={key: raw}), section, path)
        assert overridden == yaml.safe_load(raw) != setting(load_profile("tiny", environ={}), section, path), key


def test_a_bad_environment_override_is_named_in_the_error(monkeypatch):
    """A typo in an override (here the key) names the variable that carried it, not only the file."""
    from tasks.profile import ProfileError, load_profile
    from tasks.train.config import TrainConfig

    monkeypatch.setenv("POSTTRAIN__TRAIN__SFT_SHORT__STEPZ", "3")
    with pytest.raises(ProfileError, match="set by the environment: POSTTRAIN__TRAIN__SFT_SHORT__STEPZ"):
        load_profile("tiny").section("train", TrainConfig)
    monkeypatch.delenv("POSTTRAIN__TRAIN__SFT_SHORT__STEPZ")
    monkeypatch.setenv("POSTTRAIN__TRAIN__SFT_SHORT__STEPS", "many")   # a wrong value: named too
    with pytest.raises(ProfileError, match="POSTTRAIN__TRAIN__SFT_SHORT__STEPS"):
        load_profile("tiny").section("train", TrainConfig)


def test_a_profile_that_samples_bare_prompts_where_training_renders_the_template_is_refused(tmp_path):
    """Training always renders the chat template, so difficulty, samples or evaluate sampling bare
    prompts would score prompts the model never trains on: the profile is refused at load, with
    the file (or the environment variable) and the field named."""
    (tmp_path / "evaluate.yaml").write_text("use_chat_template: false\n")
    with pytest.raises(ProfileError, match=r"evaluate\.yaml: use_chat_template is false"):
        load_profile(tmp_path, environ={})
    (tmp_path / "evaluate.yaml").write_text("use_chat_template: true\n")
    assert load_profile(tmp_path, environ={}).raw("evaluate") == {"use_chat_template": True}
    with pytest.raises(ProfileError, match="POSTTRAIN__DIFFICULTY__USE_CHAT_TEMPLATE"):
        load_profile("tiny", environ={"POSTTRAIN__DIFFICULTY__USE_CHAT_TEMPLATE": "false"})
