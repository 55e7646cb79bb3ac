"""Read-only view of one run in the store (local folder or S3) for inspect/show/query/export/plot.

Everything goes through the manifests (storage.artifacts): a stage without a manifest is
incomplete and its files are never read. Tables are cached per (step, stage) for one view.

    view = RunView.open(store, "stagerl", "tiny-cpu")
    view.require(2, ["rollout", "reward"])        # StepIncomplete names what is missing
    view.table(2, "rollout"); view.update_metrics(2); view.data_metrics(2)
"""
from __future__ import annotations

from storage.artifacts import (list_steps, read_file, read_manifest, read_run_json, read_table,
                               step_status)
from storage.layout import STAGES, RunLayout, check_stage

__all__ = ["RunView", "RunNotFound", "StepIncomplete", "flatten_metrics"]


class RunNotFound(LookupError):
    """No experiment of that name in the project (message lists the ones there are)."""


class StepIncomplete(LookupError):
    """A step, or a stage of it, has no manifest yet (message names the stages missing)."""


def flatten_metrics(obj, prefix: str = "") -> dict:
    """{'actor': {'pg_loss': [0.1, 0.3]}} -> {'actor/pg_loss': 0.2}: nested dicts joined with '/',
    lists of numbers averaged (verl's reduce_metrics for non-max/min names), non-numbers dropped."""
    out = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten_metrics(value, f"{prefix}/{key}" if prefix else str(key)))
        return out
    if isinstance(obj, bool) or obj is None:
        return out
    if isinstance(obj, (int, float)):
        out[prefix] = float(obj)
    elif isinstance(obj, list) and obj and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in obj):
        name = prefix.rsplit("/", 1)[-1]
        if "max" in name:
            out[prefix] = float(max(obj))
        elif "min" in name:
            out[prefix] = float(min(obj))
        else:
            out[prefix] = float(sum(obj) / len(obj))
    return out


class RunView:
    def __init__(self, store, layout: RunLayout):
        self.store = store
        self.layout = layout
        self._tables = {}
        self._manifests = {}
        self._run_json = read_run_json(store, layout)

    @classmethod
    def open(cls, store, project: str, experiment: str) -> "RunView":
        layout = RunLayout(project, experiment)
        if not (store.exists(layout.run_json) or store.list(layout.steps_dir)):
            there = [e for e in store.list(project) if not e.startswith((".", "_"))]
            where = store.url(project)
            hint = (f"experiments there: {', '.join(there)}" if there
                    else "that project has no experiments (check --root / --project)")
            raise RunNotFound(f"experiment {experiment!r} does not exist in project {project!r} "
                              f"at {where}: {hint}")
        return cls(store, layout)

    # ---- identity and config --------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.layout.base

    @property
    def url(self) -> str:
        return self.store.url(self.layout.base)

    @property
    def config(self) -> dict:
        return (self._run_json or {}).get("config") or {}

    @property
    def lineage(self) -> dict:
        """A fork's source and fork point (run.json's lineage, flows/fork.py); {} otherwise."""
        return (self._run_json or {}).get("lineage") or {}

    def config_value(self, path: str, default=None):
        node = self.config
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def max_response_length(self):
        """The response width the run sampled with (None when run.json is missing)."""
        value = (self.config_value("actor_rollout_ref.rollout.response_length")
                 or self.config_value("data.max_response_length"))
        return int(value) if value else None

    # ---- steps and status -----------------------------------------------------------------
    def steps(self) -> list:
        return list_steps(self.store, self.layout)

    def status(self, step: int) -> dict:
        return step_status(self.store, self.layout, step)

    def is_complete(self, step: int, stages=STAGES) -> bool:
        status = self.status(step)
        return all(status[s] for s in stages)

    def complete_steps(self, stages=STAGES) -> list:
        return [s for s in self.steps() if self.is_complete(s, stages)]

    def require(self, step: int, stages=STAGES) -> None:
        """Raise StepIncomplete unless `step` exists and every stage in `stages` is complete."""
        steps = self.steps()
        if step not in steps:
            have = f"steps present: {_ranges(steps)}" if steps else "it has no steps yet"
            raise StepIncomplete(f"step {step} of {self.name} does not exist ({have})")
        status = self.status(step)
        missing = [s for s in stages if not status[s]]
        if missing:
            done = [s for s in STAGES if status[s]]
            raise StepIncomplete(
                f"step {step} of {self.name} is not complete: no manifest yet for "
                f"{', '.join(missing)} (complete: {', '.join(done) or 'none'}); "
                "it is still running, or its writer died before committing")

    # ---- artifacts --------------------------------------------------------------------------
    def manifest(self, step: int, stage: str):
        key = (step, check_stage(stage))
        if key not in self._manifests:
            self._manifests[key] = read_manifest(self.store, self.layout, step, stage)
        return self._manifests[key]

    def table(self, step: int, stage: str):
        """The stage's verified table (update: microbatches); StepIncomplete if not committed."""
        key = (step, check_stage(stage))
        if key not in self._tables:
            self.require(step, [stage])
            table = read_table(self.store, self.layout, step, stage)
            if stage == "logprob":
                table = self._with_update_log_probs(step, table)
            self._tables[key] = table
        return self._tables[key]

    def _with_update_log_probs(self, step: int, table):
        """logprob rows plus the update's old_log_probs / entropy when its forward replaced the
        old-log-prob pass (update/log_probs.parquet; absent until the update is complete)."""
        manifest = self.manifest(step, "update")
        if "old_log_probs" in table.schema.names or not manifest \
                or "update/log_probs.parquet" not in (manifest.get("files") or {}):
            return table
        extra = read_file(self.store, self.layout, step, "update", "update/log_probs.parquet")
        for name in extra.schema.names:
            table = table.append_column(extra.schema.field(name), extra.column(name))
        return table

    def update_metrics(self, step: int, raw: bool = False) -> dict:
        """update/metrics.json flattened to {name: float} (raw=True: as stored); {} while the
        update is incomplete."""
        if self.manifest(step, "update") is None:
            return {}
        key = (step, "update/metrics.json")
        if key not in self._tables:
            self._tables[key] = read_file(self.store, self.layout, step, "update",
                                          "update/metrics.json")
        return dict(self._tables[key]) if raw else flatten_metrics(self._tables[key])

    def data_metrics(self, step: int) -> dict:
        """verl's data metrics from the advantage manifest's extra['metrics'] ({} if none)."""
        manifest = self.manifest(step, "advantage")
        return flatten_metrics(((manifest or {}).get("extra") or {}).get("metrics") or {})

    def stage_extra(self, step: int, stage: str) -> dict:
        manifest = self.manifest(step, stage)
        return dict((manifest or {}).get("extra") or {})


def _ranges(steps: list) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    parts, start, prev = [], None, None
    for s in steps:
        if start is None:
            start = prev = s
        elif s == prev + 1:
            prev = s
        else:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = s
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ", ".join(parts)
