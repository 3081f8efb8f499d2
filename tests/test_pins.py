"""Every package the project installs is pinned: a fresh clone gets the versions its figures
were measured with. The bench extra's peers included (`make bench` installs them under
constraints.txt), since a bench's ratio is only as good as knowing which peer it beat."""
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from sides import pinned_versions


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_every_dependency_and_extra_is_pinned_in_constraints():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {name.replace("_", "-") for name in pinned_versions()}
    wanted = {_name(r) for r in project["dependencies"]}
    for extra, requirements in project["optional-dependencies"].items():
        if extra != "gpu":   # vllm: installed on GPU machines from wheels of their own (shared/gpu)
            wanted |= {_name(r) for r in requirements}
    wanted -= {"torch"}      # pinned in the Makefile (its CPU build)
    assert sorted(wanted - pins) == []


def test_the_makefile_installs_the_bench_peers_under_the_pins():
    bench = re.search(r"^bench:.*?(?=^\S)", (ROOT / "Makefile").read_text(), re.DOTALL | re.MULTILINE).group(0)
    assert '-c constraints.txt -e ".[bench]"' in bench
