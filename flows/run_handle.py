"""The run a step works on, passed explicitly from the training flow to the step's flow and its
stage tasks (no process-global registry).

A RunHandle is a small pydantic model whose only field is the run's URI
(`store.url(layout.base)`, e.g. 's3://bucket/prefix/project/experiment'). That field is all that
Prefect records of it: a flow parameter is validated with pydantic (a RunHandle instance is taken
as it is, `revalidate_instances='never'`) and serialised for the API with FastAPI's
jsonable_encoder (a model's fields only), so the rl-step subflow run shows `{"uri": ...}` and no
config, credential or process handle reaches Prefect's database; task parameters are not recorded
at all (the stage task has cache_policy=NO_CACHE, so they feed no cache key either).

In the training flow's process the handle also carries, as private attributes, what that flow
resolved: the config (with its credentials), the plan, the store, and the run session
(stages/session.py: resident engines, scorers, background commits). Anywhere else (a stage flow run
by an rl-stage/* deployment on another machine, a handle rebuilt from recorded parameters) it has
only the URI and reads the config and plan from the run's run.json on first use, taking S3
credentials from that machine's AWS_* environment; it has no session.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, PrivateAttr

from storage.artifacts import read_run_json
from storage.faults import with_faults
from storage.layout import RunLayout
from storage.store import Store


class RunHandle(BaseModel):
    uri: str
    _resolved: Any = PrivateAttr(default=None)  # (cfg, plan, store) once known
    _session: Any = PrivateAttr(default=None)  # stages.session.RunSession of the training flow
    _events: Any = PrivateAttr(default=None)  # flows.task_events.EventPacer of the training flow

    @classmethod
    def of(cls, cfg: dict, plan: dict, store: Store, session=None) -> "RunHandle":
        """The handle of a run the caller resolved (the training flow), with its session."""
        handle = cls(uri=store.url(RunLayout.from_config(cfg).base))
        handle._resolved = (cfg, plan, with_faults(store))
        handle._session = session
        return handle

    @property
    def session(self):
        """The run session of the training flow that made this handle; None elsewhere."""
        return self._session

    @property
    def events(self):
        """The training flow's EventPacer (flows/task_events.py) while its steps run; else None."""
        return self._events

    @events.setter
    def events(self, pacer) -> None:
        self._events = pacer

    def open(self) -> tuple[dict, dict, Store]:
        """(cfg, plan, store): as resolved by the training flow, else read from run.json once."""
        if self._resolved is None:
            self._resolved = read_run(self.uri)
        return self._resolved

    def context(self, step: int, extra: dict | None = None):
        """A stage's StageContext for `step` (ctx.extra: a copy of `extra`; ctx.session: the session)."""
        from stages.context import StageContext

        cfg, plan, store = self.open()
        ctx = StageContext.create(cfg, plan, step, store=store)
        ctx.extra = dict(extra or {})
        ctx.session = self._session
        return ctx


def split_run_uri(run_uri: str) -> tuple[str, str, str]:
    """'s3://bucket/prefix/project/experiment' -> ('s3://bucket/prefix', project, experiment)."""
    root, project, experiment = run_uri.rstrip("/").rsplit("/", 2)
    return root, project, experiment


def read_run(run_uri: str) -> tuple[dict, dict, Store]:
    """(cfg, plan, store) of a run from its run.json (S3 credentials then come from this
    machine's AWS_* environment)."""
    root, project, experiment = split_run_uri(run_uri)
    probe = Store.from_config({"root": root})
    doc = read_run_json(probe, RunLayout(project, experiment))
    if doc is None:
        raise FileNotFoundError(f"no run.json at {run_uri}/run.json: start the run with "
                                f"`stagerl train` or the rl-train deployment first")
    cfg = doc["config"]
    # run.json holds no credentials ("***"): this machine's AWS_* environment provides them,
    # here and in any rank process rebuilt from this config.
    kept = {**(cfg.get("storage") or {}), "root": root, "key": None, "secret": None}
    cfg["storage"] = kept
    return cfg, doc["plan"], with_faults(Store.from_config(kept))
