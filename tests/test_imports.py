"""The import direction the project's layout promises, checked on the source itself.

flows -> tasks -> model -> kernels; ``data_specs`` and ``kernels`` import nothing of ours,
``warehouse`` only ``data_specs``, and no layer below ``flows`` (``tasks`` included) imports Prefect (the
orchestrator stays on the top floor). No cycle among module-level imports. In ``tasks/`` no stage
imports another stage, and the pieces they share import no stage.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("flows", "tasks", "model", "kernels", "data_specs", "warehouse")
MAY_IMPORT = {
    "flows": set(OURS),
    "tasks": {"tasks", "model", "kernels", "data_specs", "warehouse"},
    "model": {"model", "kernels"},
    "kernels": {"kernels"},
    "data_specs": {"data_specs"},
    "warehouse": {"warehouse", "data_specs"},
}
PREFECT_FREE = ("tasks", "model", "kernels", "data_specs", "warehouse")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(tree: ast.Module, top_level_only: bool) -> list[tuple[int, str]]:
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _sources():
    for package in OURS:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield package, path, ast.parse(path.read_text(), filename=str(path))


def test_every_import_follows_the_declared_direction():
    wrong = []
    for package, path, tree in _sources():
        for line, name in _imports(tree, top_level_only=False):
            top = name.split(".")[0]
            if top in OURS and top not in MAY_IMPORT[package]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
            if top == "prefect" and package in PREFECT_FREE:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} (Prefect stays in flows/)")
    assert not wrong, "\n".join(wrong)


def test_no_cycle_among_module_level_imports():
    modules = {_module(path): tree for _, path, tree in _sources()}
    # edges to the named modules only: a package's __init__ re-exporting its own submodules is
    # the normal layout, not a cycle (the parent is in sys.modules before the child runs)
    def targets(tree: ast.Module) -> set[str]:
        named = {name for _, name in _imports(tree, top_level_only=True) if name in modules}
        # "from pkg import submodule" depends on the submodule, not on pkg's __init__
        return {n for n in named if not any(o.startswith(n + ".") for o in named)}
    graph = {m: targets(tree) - {m} for m, tree in modules.items()}
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


# the pipeline's stages in tasks/ (a module or a package each); everything else in tasks/ is a
# shared piece below them (the judge, the task families, verifiers, rollouts, scoring, text ...)
STAGE_MODULES = ("tasks.ingest", "tasks.curate", "tasks.synthesize", "tasks.samples", "tasks.difficulty",
                 "tasks.evaluate", "tasks.audit", "tasks.train")


def _stage_of(module: str) -> str | None:
    return next((s for s in STAGE_MODULES if module == s or module.startswith(s + ".")), None)


def _tasks_imports():
    """(path, module, line, imported name) of every import in tasks/, deferred ones included."""
    for package, path, tree in _sources():
        if package == "tasks":
            module = _module(path)
            for line, name in _imports(tree, top_level_only=False):
                yield path, module, line, name


def test_no_stage_imports_another_stage_and_no_shared_piece_imports_a_stage():
    wrong = []
    for path, module, line, name in _tasks_imports():
        me, other = _stage_of(module), _stage_of(name)
        if other is not None and other != me:
            what = f"stage {me}" if me else "a shared piece"
            wrong.append(f"{path.relative_to(ROOT)}:{line} ({what}) imports {name} (stage {other})")
    assert not wrong, "\n".join(sorted(set(wrong)))


def _tasks_package(module: str) -> str | None:
    """The sub-package of tasks/ a module is in (``tasks.synth.base`` -> ``tasks.synth``); None
    for a top-level module of tasks/ or anything outside it."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[0] == "tasks" and (ROOT / "tasks" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return None


def test_no_two_tasks_packages_import_each_other():
    """Between the packages of tasks/ (synth, verify, genrm, rollout, train ...) arrows run one
    way, imports inside functions included: a deferred import hides a cycle, it does not remove
    it (synth's reasoning-gym scorer once reached up into verify, which dispatches to synth)."""
    arrows: dict[tuple[str, str], str] = {}
    for path, module, line, name in _tasks_imports():
        me, other = _tasks_package(module), _tasks_package(name)
        if me and other and other != me:
            arrows.setdefault((me, other), f"{path.relative_to(ROOT)}:{line} imports {name}")
    both = sorted(f"{a} <-> {b}: {arrows[(a, b)]}; {arrows[(b, a)]}" for a, b in arrows if (b, a) in arrows and a < b)
    assert not both, "\n".join(both)


def test_the_rollout_engine_and_the_model_load_without_the_warehouse_libraries():
    """A GPU machine carries the sampler, the model and the losses but not DuckDB or Polars
    (bench/gpu_real_model.py runs there): importing them must not pull the warehouse's store."""
    import subprocess
    import sys

    code = ("import sys; import tasks.rollout.local, tasks.rollout.smol, model.logprobs, model.losses, model.loading; "
            "print(sorted(m for m in ('duckdb', 'polars', 'prefect', 'mlflow', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
