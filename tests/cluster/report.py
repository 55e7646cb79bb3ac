"""Run on a cluster host (it reaches the S3 endpoint): what the store says about experiments.

    python tests/cluster/report.py ROOT EXPERIMENT [EXPERIMENT ...]

Prints JSON: per experiment, for each step and stage its manifest's host (where the stage ran)
and, for the N-rank stages, rank_hosts (where each rank ran), plus the checksum of every weights
folder (the sha256 over its files' sha256s, storage/weights.py)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from storage.artifacts import read_manifest  # noqa: E402
from storage.layout import STAGES, RunLayout  # noqa: E402
from storage.store import Store  # noqa: E402
from storage.weights import folder_manifest, list_weights  # noqa: E402


def describe(store: Store, experiment: str, project: str = "stagerl") -> dict:
    layout = RunLayout(project, experiment)
    steps = {}
    for step in range(1, 100):
        found = {s: read_manifest(store, layout, step, s) for s in STAGES}
        if not any(found.values()):
            break
        steps[step] = {s: (None if m is None else {
            "host": m.get("host"), "pid": m.get("pid"), "written_at": m.get("written_at"),
            "rank_hosts": (m.get("extra") or {}).get("rank_hosts")}) for s, m in found.items()}
    weights = {k: folder_manifest(store, layout.weights(k))["checksum"] for k in list_weights(store, layout)}
    return {"steps": steps, "weights": weights}


def main() -> None:
    root, experiments = sys.argv[1], sys.argv[2:]
    store = Store.from_config({"root": root})
    print(json.dumps({e: describe(store, e) for e in experiments}))


if __name__ == "__main__":
    main()
