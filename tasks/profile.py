"""Profiles: typed configuration chosen by name, never by editing code.

A profile is a directory ``configs/profiles/<name>/`` holding ``profile.yaml`` (the core
settings below) and one YAML file per section (``curate.yaml``, ``rollout.yaml`` ...).
Each area validates its own section with its own pydantic model via ``Profile.section``.

Environment overrides win over files: ``POSTTRAIN__<SECTION>__<KEY>=value`` (nested keys
joined with ``__``), e.g. ``POSTTRAIN__CURATE__MINHASH__THRESHOLD=0.7`` (``minhash.threshold``
of ``curate.yaml``) or ``POSTTRAIN__PROFILE__SEED=3`` for a core setting. Values are parsed as
YAML scalars.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "POSTTRAIN__"
CORE_SECTION = "profile"
M = TypeVar("M", bound=BaseModel)


class ProfileError(ValueError):
    pass


class DaskSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str | None = None   # a running scheduler; None starts a LocalCluster
    n_workers: int = 2
    threads_per_worker: int = 1


class CoreSettings(BaseModel):
    """Settings every flow reads."""
    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    task_runner: Literal["local", "dask"] = "local"
    dask: DaskSettings = Field(default_factory=DaskSettings)
    tracking_uri: str | None = None          # None: sqlite under $POSTTRAIN_HOME
    experiment: str = "posttrain"
    description: str = ""
    # how many pipeline stages may hold one accelerator at a time (a training engine, a vLLM
    # engine and a local sampler each take most of a GPU's memory); CPU stages are not limited
    stages_per_device: int = Field(1, ge=1)


def configs_dir() -> Path:
    env = os.environ.get("POSTTRAIN_CONFIGS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "configs"


def available_profiles() -> list[str]:
    root = configs_dir() / "profiles"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_path(tree: dict, keys: list[str], value: Any) -> None:
    for k in keys[:-1]:
        node = tree.get(k)
        if not isinstance(node, dict):
            node = tree[k] = {}
        tree = node
    tree[keys[-1]] = value


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, dict]:
    environ = dict(os.environ) if environ is None else environ
    out: dict[str, dict] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in key[len(ENV_PREFIX):].split("__") if p]
        if len(parts) < 2:
            raise ProfileError(f"environment override {key!r} needs a section and a key: "
                               f"{ENV_PREFIX}<SECTION>__<KEY>")
        _set_path(out.setdefault(parts[0], {}), parts[1:], _parse_scalar(raw))
    return out


def _deep_merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for k, v in over.items():
        merged[k] = _deep_merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def env_override_names(environ: dict[str, str] | None = None) -> dict[tuple[str, ...], str]:
    """(section, key, ...) -> the environment variable that overrides it."""
    environ = dict(os.environ) if environ is None else environ
    return {tuple(p.lower() for p in key[len(ENV_PREFIX):].split("__") if p): key
            for key in environ if key.startswith(ENV_PREFIX)}


class Profile:
    def __init__(self, name: str, path: Path | None, sections: dict[str, dict],
                 env_names: dict[tuple[str, ...], str] | None = None):
        self.name = name
        self.path = path
        self.sections = sections
        self.env_names = env_names or {}
        try:
            self.core = CoreSettings(**sections.get(CORE_SECTION, {}))
        except ValidationError as e:
            raise ProfileError(f"profile {name!r}, section 'profile': {e}") from None

    def raw(self, section: str) -> dict:
        return dict(self.sections.get(section, {}))

    def section(self, section: str, model: type[M]) -> M:
        """The named section validated by ``model`` (defaults fill what the files omit)."""
        try:
            return model(**self.raw(section))
        except ValidationError as e:
            where = self.path / f"{section}.yaml" if self.path else section
            raise ProfileError(f"profile {self.name!r}, {where}{self._from_env(section, e)}: {e}") from None

    def _from_env(self, section: str, error: ValidationError) -> str:
        """", set by POSTTRAIN__..." for the settings in ``error`` an environment variable gave."""
        names = []
        for err in error.errors():
            path = (section, *(str(p).lower() for p in err["loc"]))
            for n in range(len(path), 1, -1):
                if path[:n] in self.env_names:
                    names.append(self.env_names[path[:n]])
                    break
        return f" (set by the environment: {', '.join(dict.fromkeys(names))})" if names else ""

    def config_hash(self, *sections: str) -> str:
        """Stable hash of the named sections (all when none named): a flow's cache key."""
        chosen = {s: self.sections.get(s, {}) for s in (sections or sorted(self.sections))}
        blob = json.dumps(chosen, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def as_dict(self) -> dict[str, dict]:
        return json.loads(json.dumps(self.sections, default=str))


# the sections whose stages sample prompts through tasks.scoring.render_prompt
SCORING_SECTIONS = ("difficulty", "evaluate", "samples")


def refuse_raw_prompts(profile: Profile) -> None:
    """Raise ``ProfileError`` when a profile turns ``use_chat_template`` off in a sampling stage.

    Training renders every prompt with the model's chat template (``tasks.train.encoding``), as
    do the RL and agent samplers, so difficulty, samples or evaluate sampling bare prompts would
    measure, filter and pair prompts the model never trains on. No backend here applies a
    template of its own, so one setting governs every stage: the template."""
    off = [s for s in SCORING_SECTIONS if profile.raw(s).get("use_chat_template") is False]
    if off:
        where = ", ".join(profile.env_names.get((s, "use_chat_template"))
                          or f"{profile.path / (s + '.yaml') if profile.path else s}: use_chat_template" for s in off)
        raise ProfileError(f"profile {profile.name!r}: {where} is false, but training always renders the chat "
                           "template, so these stages would sample prompts the model never trains on; remove "
                           "the setting")


def load_profile(name_or_path: str | Path = "tiny", environ: dict[str, str] | None = None) -> Profile:
    """Load a profile by name (``configs/profiles/<name>``) or from a directory path."""
    candidate = Path(name_or_path)
    if candidate.is_dir():
        path = candidate
    else:
        path = configs_dir() / "profiles" / str(name_or_path)
        if not path.is_dir():
            raise ProfileError(f"unknown profile {str(name_or_path)!r}; available: {available_profiles()}")
    sections: dict[str, dict] = {}
    for f in sorted(path.glob("*.yaml")):
        try:
            data = yaml.safe_load(f.read_text()) or {}
        except yaml.YAMLError as e:
            raise ProfileError(f"{f}: invalid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ProfileError(f"{f}: expected a mapping at the top level")
        sections[f.stem] = data
    sections = _deep_merge(sections, env_overrides(environ))
    profile = Profile(path.name, path, sections, env_override_names(environ))
    refuse_raw_prompts(profile)
    return profile
