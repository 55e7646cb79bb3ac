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
# the algorithm registries: configs reads what an estimator declared it needs (the plan adds the
# critic for it). They are leaves: torch only, no other project module. stages.advantages is the
# complete registry: the registry itself (stages.adv_registry) and verl's further estimators
# (stages.advantages_more, registering into stages.adv_registry) come with it.
PURE_REGISTRIES = {"stages.advantages", "stages.adv_registry", "stages.advantages_more"}


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
    assert len(edges) > 60 and "stages.update_roles" in edges["stages.update_worker"]  # the walk saw them
    assert circles(edges) == []


def test_no_import_points_back_up():
    edges = project_imports()
    wrong = [(m, t) for m, targets in edges.items() for t in sorted(targets)
             if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in ALLOWED[m.split(".")[0]]
             and not (m.startswith("configs") and t in PURE_REGISTRIES)]
    assert wrong == []
    assert {m: edges[m] - PURE_REGISTRIES for m in PURE_REGISTRIES} == {m: set() for m in PURE_REGISTRIES}


def test_yaml_enums_are_the_registries():
    """The accepted values base.yaml documents for a registry-backed key are the registry's names
    (adding an estimator, loss, engine or sink means one registry entry; this test names the
    enum line to extend when the two disagree)."""
    from configs.schema import load_schema
    from stages.advantages import ADV_ESTIMATORS
    from stages.engines import ENGINES
    from stages.kl import KL_KINDS
    from stages.losses import POLICY_LOSSES
    from storage.sinks import SINKS

    specs = load_schema().specs
    registries = {"algorithm.adv_estimator": ADV_ESTIMATORS,
                  "actor_rollout_ref.actor.policy_loss.loss_mode": POLICY_LOSSES,
                  "actor_rollout_ref.rollout.name": ENGINES, "trainer.logger": SINKS,
                  "algorithm.kl_penalty": KL_KINDS}
    for key, registry in registries.items():
        assert set(specs[key].choices) == set(registry), key
