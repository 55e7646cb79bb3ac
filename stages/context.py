"""What every stage gets: the resolved config, the batch plan, the store and run layout, the step.

A stage module defines
    STAGE = "rollout"                     # its name in the run layout
    INPUTS = ("rollout", ...)             # earlier stages of the same step it reads
    CONFIG_KEYS = ("data", "actor_rollout_ref.rollout", ...)   # config sections it reads
    def run(ctx: StageContext) -> dict    # reads inputs, writes its artifact + manifest, returns the manifest
and imports no Prefect. Steps are numbered from 1 (as verl's global_steps); step k samples from
the weights written by step k-1 (step 1: actor_rollout_ref.model.path)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from configs.loader import get_path
from storage.artifacts import fingerprint as hash_obj
from storage.artifacts import read_manifest, read_table, require_manifest
from storage.layout import RunLayout
from storage.store import Store


def stage_seed(seed: int, step: int, stage: str) -> int:
    """A 31-bit seed from (trainer.seed, step, stage): every stage reseeds, so resume == no interruption."""
    digest = hashlib.sha256(f"{seed}/{step}/{stage}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class StageContext:
    cfg: dict
    plan: dict
    store: Store
    layout: RunLayout
    step: int
    extra: dict = field(default_factory=dict)  # flow-provided state (e.g. dataset position, KL controller)
    session: object = None  # stages.session.RunSession of a training run (never serialised), or None
    memo: dict | None = None  # one stage run's (flows.step.execute_stage): its inputs' manifests and
    #                           its fingerprints, read and computed once; None: read every time

    def input_manifest(self, name: str, required: bool = False) -> dict | None:
        """The manifest of this step's stage `name` (an input), or None while it is incomplete
        (required: storage.artifacts.IncompleteError instead). With `memo`, read once: a stage
        runs only once its inputs are complete, and they stay so while it runs."""
        key = ("manifest", self.step, name)  # a copy for another step (dataclasses.replace) shares the memo
        if self.memo is not None and key in self.memo:
            return self.memo[key]
        read = require_manifest if required else read_manifest
        manifest = read(self.store, self.layout, self.step, name)
        if self.memo is not None and manifest is not None:
            self.memo[key] = manifest
        return manifest

    def read_input(self, name: str):
        """The verified main table of this step's stage `name` (storage.artifacts.read_table)."""
        return read_table(self.store, self.layout, self.step, name, manifest=self.input_manifest(name, required=True))

    @classmethod
    def create(cls, cfg: dict, plan: dict, step: int, store: Store | None = None) -> "StageContext":
        store = store or Store.from_config(cfg.get("storage", {}))
        return cls(cfg=cfg, plan=plan, store=store, layout=RunLayout.from_config(cfg), step=step)

    def get(self, path: str, default=None):
        return get_path(self.cfg, path, default)

    def seed(self, stage: str) -> int:
        return stage_seed(self.get("trainer.seed"), self.step, stage)

    def fingerprint(self, stage: str, config_keys, inputs=()) -> str:
        """Hash of the config sections a stage reads, its inputs' fingerprints, the seed and the step."""
        memo_key = ("fingerprint", self.step, stage, tuple(config_keys), tuple(inputs))
        if self.memo is not None and memo_key in self.memo:
            return self.memo[memo_key]
        sections = {key: get_path(self.cfg, key) for key in config_keys}
        upstream = self.input_fingerprints(inputs)
        value = hash_obj({"stage": stage, "step": self.step, "seed": self.seed(stage),
                          "config": sections, "inputs": upstream, "plan": self.plan})
        if self.memo is not None and None not in upstream.values():
            self.memo[memo_key] = value
        return value

    def input_fingerprints(self, inputs) -> dict:
        out = {}
        for name in inputs:
            manifest = self.input_manifest(name)
            out[name] = manifest["fingerprint"] if manifest else None
        return out

    def actor_weights(self) -> Path:
        """Local folder of the policy this step samples from: the weights written by step-1 (step 0 is
        the warm start when warmstart.enable), or the initial model folder."""
        if self.step <= 1 and not self.get("warmstart.enable"):
            return self.reference_weights(initial=True)
        return self._load_weights(max(self.step - 1, 0))

    def policy_version(self) -> str | None:
        """The weights version this step samples from (see weights_version); None for the initial
        model folder."""
        if self.step <= 1 and not self.get("warmstart.enable"):
            return None
        return self.weights_version(max(self.step - 1, 0))

    def staleness(self) -> int:
        """trainer.staleness: how many updates the rollout lags (0: sample from step k-1's weights)."""
        return int(self.get("trainer.staleness") or 0)

    def rollout_policy_step(self) -> int:
        """The update whose weights step k's rollout samples from: max(0, k-1-staleness), a
        function of k only (0: the initial or warm-start weights). The stored policy_version."""
        return max(0, self.step - 1 - self.staleness())

    def rollout_weights(self) -> Path:
        """Local folder of the weights step k's rollout samples from (rollout_policy_step); at
        staleness 0 the same as actor_weights()."""
        if not self.staleness():
            return self.actor_weights()
        k = self.rollout_policy_step()
        if k == 0 and not self.get("warmstart.enable"):
            return self.reference_weights(initial=True)
        return self._load_weights(k)

    def rollout_version(self) -> str | None:
        """The weights version of rollout_weights(); None for the initial model folder."""
        if not self.staleness():
            return self.policy_version()
        k = self.rollout_policy_step()
        if k == 0 and not self.get("warmstart.enable"):
            return None
        return self.weights_version(k)

    def weights_version(self, k: int) -> str:
        """The identity of the weights after step k's update in this run (0: the warm start): an
        engine that holds it samples from it, whichever way it got them (stages.training.handoff)."""
        return self.store.url(self.layout.weights(k))

    def reference_weights(self, initial: bool = False) -> Path:
        """The reference policy: the warm-started model when warmstart.enable, else the initial folder."""
        if self.get("warmstart.enable") and not initial:
            return self._load_weights(0)
        return Path(os.path.expanduser(self.get("actor_rollout_ref.model.path")))

    def _load_weights(self, k: int) -> Path:
        from storage.weights import load_weights

        if self.session is not None:  # step k's weights may still be on their way to the store
            local = self.session.local_weights(k)
            if local is not None:
                return Path(local)
            self.session.wait_commit("update", k)  # a pending commit that hashes them itself

        return load_weights(self.store, self.layout, k, cache_dir=self.get("storage.cache_dir"))

    def to_json(self) -> str:
        """What a child process (an N-rank job) needs to rebuild this context."""
        return json.dumps({"cfg": dict(self.cfg), "plan": self.plan, "step": self.step, "extra": self.extra})

    @classmethod
    def from_json(cls, text: str) -> "StageContext":
        data = json.loads(text)
        ctx = cls.create(data["cfg"], data["plan"], data["step"])
        ctx.extra = data.get("extra", {})
        return ctx
