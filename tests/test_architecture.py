"""The package layering, read from the source: every import (at module level or inside a function)
between the project's modules, checked for import circles and for imports that point back up
(flows -> stages -> storage/configs)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "stages", "storage", "configs")
# what each package may import from the others (its own modules always)
ALLOWED = {"flows": {"stages", "storage", "configs"}, "stages": {"storage", "configs"},
           "configs": {"storage"}, "storage": set()}
# stages/algos/ (estimators, losses, KL, rollout correction: pure torch) is a leaf that configs/ may
# import: it imports no stages/ module outside itself.
ALGOS = "stages.algos"
# the stage modules and the stage contract: `ls stages/*.py` reads as the pipeline
TOP_LEVEL_STAGES = {"__init__", "rollout", "logprob", "reward", "advantage", "update", "context", "session",
                    "scratch", "progress", "metrics"}


def project_imports() -> dict[str, set[str]]:
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    edges = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        edges[name] = {t for t in targets if t in modules and t != name}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    edges = project_imports()
    assert len(edges) > 60 and "stages.training.roles" in edges["stages.training.worker"]  # the walk saw them
    assert circles(edges) == []


def in_algos(module: str) -> bool:
    return module == ALGOS or module.startswith(ALGOS + ".")


def test_no_import_points_back_up():
    edges = project_imports()
    wrong = [(m, t) for m, targets in edges.items() for t in sorted(targets)
             if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in ALLOWED[m.split(".")[0]]
             and not (m.startswith("configs") and in_algos(t))]
    assert wrong == []
    assert any(in_algos(t) for m in edges if m.startswith("configs") for t in edges[m])  # the exception is used


def test_algos_is_a_leaf():
    edges = project_imports()
    algos = [m for m in edges if in_algos(m)]
    assert len(algos) >= 5
    assert {m: sorted(t for t in edges[m] if t.startswith("stages") and not in_algos(t)) for m in algos} == \
        {m: [] for m in algos}


def test_stage_modules_import_no_prefect():
    """Stages are plain functions over storage: flows wrap them as tasks."""
    found = []
    for path in (REPO / "stages").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(str(path.relative_to(REPO)), n) for n in names if n.split(".")[0] == "prefect"]
    assert found == []


def test_stages_top_level_is_the_pipeline():
    """The top of stages/ holds the five stage modules and the stage contract; everything else
    lives in a room by concept, none over ~12 modules."""
    assert {p.stem for p in (REPO / "stages").glob("*.py")} == TOP_LEVEL_STAGES
    for room in (p for p in (REPO / "stages").iterdir() if p.is_dir() and p.name != "__pycache__"):
        modules = [m for m in room.glob("*.py") if m.name != "__init__.py"]
        assert 1 <= len(modules) <= 12, room.name


def test_yaml_enums_are_the_registries():
    """The accepted values base.yaml documents for a registry-backed key are the registry's names
    (adding an estimator, loss, engine or sink means one registry entry; this test names the
    enum line to extend when the two disagree)."""
    from configs.schema import load_schema
    from stages.algos.advantages import ADV_ESTIMATORS
    from stages.algos.kl import KL_KINDS
    from stages.algos.policy_losses import POLICY_LOSSES
    from stages.engines import ENGINES
    from storage.sinks import SINKS

    specs = load_schema().specs
    registries = {"algorithm.adv_estimator": ADV_ESTIMATORS,
                  "actor_rollout_ref.actor.policy_loss.loss_mode": POLICY_LOSSES,
                  "actor_rollout_ref.rollout.name": ENGINES, "trainer.logger": SINKS,
                  "algorithm.kl_penalty": KL_KINDS}
    for key, registry in registries.items():
        assert set(specs[key].choices) == set(registry), key


def test_every_package_is_installed():
    """pyproject.toml lists every package (a non-editable install would leave a room out)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for package in PACKAGES
             for p in (REPO / package).rglob("__init__.py")}
    assert found == listed
