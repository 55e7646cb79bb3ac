"""Forks: an experiment NEW that starts from experiment SRC's finished work up to (not including)
stage STAGE of step STEP, and runs from there with its own overrides (`stagerl fork`, `stagerl
rescore --as`, and the rl-train flow's `fork` parameter, which is what both run).

- What NEW reuses is referenced, not copied (storage.lineage): SRC's warm start, every stage of
  steps 1..STEP-1 and the stages of STEP before STAGE get a manifest in NEW that lists SRC's
  objects with their checksums, and NEW's weights, critic and train-state folders of steps
  < STEP reference SRC's. SRC keeps a record of each fork, so pruning or deleting SRC first copies
  what the fork references into it.
- Each referenced manifest carries the fingerprint NEW's own config gives that stage, so NEW's
  flow (and any later `stagerl resume NEW`) finds those stages complete, continues at STAGE of
  STEP, and a failed fork resumes like any run.
- An override that would change a stage NEW reuses from step STEP (those before STAGE, and the
  warm start) is refused, naming the keys and the stage: its fingerprint, computed from NEW's
  config over SRC's inputs, differs from the one SRC's manifest holds. Stages of earlier steps are
  history: NEW keeps them as SRC computed them, whatever the override.
- NEW's run.json records the lineage (source, fork point, overrides); `stagerl runs` shows it.

    fork = {"source": "tour", "at": "3:advantage"}   # the flow parameter
"""
from __future__ import annotations

import copy
import os
import socket
import time

from configs.schema import ConfigError
from storage.artifacts import read_manifest, read_run_json, write_run_json
from storage.layout import STAGES, RunLayout, owner_base
from storage.lineage import record_fork, reference_folder, reference_stage
from storage.store import Store


class ForkRefused(ConfigError):
    """The fork cannot be made as asked (message names the keys, stages or objects, and what to do)."""


def parse_at(text: str) -> tuple[int, str]:
    """'3:advantage' -> (3, 'advantage')."""
    step, _, stage = str(text).partition(":")
    if not step.strip().isdigit() or int(step) < 1 or stage.strip() not in STAGES:
        raise ForkRefused(f"fork point {text!r}: give STEP:STAGE with STEP >= 1 and STAGE one of "
                          f"{', '.join(STAGES)} (e.g. 3:advantage)")
    return int(step), stage.strip()


def fork_arguments(config: str, overrides: list, fork: dict) -> tuple[str, list]:
    """(config, overrides) of the fork: SRC's config and overrides as its run.json records them
    (credentials left out), then the fork's own `overrides` (a storage.root among them replaces
    SRC's). SRC is looked up in the store that `config` + `overrides` name."""
    from configs.loader import load_config
    from storage.secrets import is_scrubbed_override

    store = Store.from_config(load_config(config, list(overrides))["storage"])
    src = RunLayout(*RunLayout.find(store, str(fork["source"])))
    source = (read_run_json(store, src) or {}).get("source") or {}
    stored = [o for o in source.get("overrides") or [] if not is_scrubbed_override(o)]
    if any(str(o).startswith("storage.root=") for o in overrides):
        stored = [o for o in stored if not o.startswith("storage.root=")]
    return source.get("config") or config, stored + list(overrides)


def _set(tree: dict, path: str, value) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
    tree[parts[-1]] = value


def _plan_keys(src_cfg: dict, new_flat: dict, changed: list) -> set:
    """The changed keys that alone change the batch plan (which every fingerprint holds)."""
    from configs.plan import compute_plan

    def plan(cfg):
        try:
            return {k: v for k, v in compute_plan(cfg).items() if k != "warnings"}
        except Exception as exc:  # noqa: BLE001 - a plan that fails differs
            return repr(exc)

    base, out = plan(src_cfg), set()
    for key in changed:
        one = copy.deepcopy(src_cfg)
        _set(one, key, new_flat.get(key))
        if plan(one) != base:
            out.add(key)
    return out


def _keys_of(module, changed: list, plan_keys: set) -> list:
    """The changed keys that the stage reads (its CONFIG_KEYS), or that reach it through the plan
    or the seed."""
    reads = tuple(getattr(module, "CONFIG_KEYS", ()))
    return [k for k in changed
            if any(k == c or k.startswith(c + ".") or c.startswith(k + ".") for c in reads)
            or k in plan_keys or k == "trainer.seed"]


def reused(step: int, stage: str, warmstart: bool) -> list[tuple[int, str]]:
    """(step, stage) of everything a fork at step:stage reuses, in the order it is committed."""
    out = [(0, "warmstart")] if warmstart else []
    for s in range(1, step + 1):
        out += [(s, st) for st in STAGES if s < step or STAGES.index(st) < STAGES.index(stage)]
    return out


def check_fork(store: Store, cfg: dict, plan: dict, fork: dict) -> dict:
    """Refuse a fork that cannot be made (ForkRefused naming why); else what create_fork needs:
    {src, step, stage, reuse: [(step, stage)], folders: [(src key, dst key)]}."""
    from configs.changes import changed_keys, flatten
    from flows.step import stage_fingerprint, stage_module  # imports Prefect: not at load
    from stages.context import StageContext
    from storage.secrets import scrub

    step, stage = parse_at(fork["at"])
    try:
        src = RunLayout(*RunLayout.find(store, str(fork["source"])))
    except LookupError as exc:
        raise ForkRefused(f"fork: no source: {exc}") from None
    new = RunLayout.from_config(cfg)
    if new.project != src.project or new.experiment == src.experiment:
        raise ForkRefused(f"fork {new.base} of {src.base}: a fork lives in its source's project "
                          f"under a new experiment name")
    doc = read_run_json(store, src) or {}
    src_cfg = doc.get("config") or {}
    warm = bool((src_cfg.get("warmstart") or {}).get("enable"))
    if warm != bool((cfg.get("warmstart") or {}).get("enable")):
        raise ForkRefused(f"warmstart.enable: {warm} -> {not warm} would change the warm start "
                          f"(step 0) and the reference policy, upstream of every fork point")
    reuse = reused(step, stage, warm)
    missing = [f"{st} of step {s}" for s, st in reuse if read_manifest(store, src, s, st) is None]
    if missing:
        raise ForkRefused(f"{src.base} has no complete {missing[0]}, which a fork at {step}:{stage} "
                          f"reuses ({len(missing)} stage(s) missing): fork at an earlier point, or "
                          f"finish {src.experiment} first (`stagerl resume {src.base}`)")
    changed = [k for k in changed_keys(src_cfg, scrub(dict(cfg), store.secret_values))
               if k != "trainer.experiment_name"]
    new_flat, plan_keys = flatten(scrub(dict(cfg), store.secret_values)), None
    by_key, unexplained = {}, []
    for s, st in [(s, st) for s, st in reuse if s in (0, step)]:
        module = stage_module(st)
        ctx = StageContext(cfg=cfg, plan=plan, store=store, layout=src, step=s)
        if stage_fingerprint(module, ctx) == read_manifest(store, src, s, st)["fingerprint"]:
            continue
        if plan_keys is None:
            plan_keys = _plan_keys(src_cfg, new_flat, changed) if changed else set()
        keys = _keys_of(module, changed, plan_keys)
        for key in keys:
            by_key.setdefault(key, []).append(st if s == 0 else f"{st} of step {s}")
        if not keys:
            unexplained.append(st if s == 0 else f"{st} of step {s}")
    if by_key or unexplained:
        why = [f"{k} would change {', '.join(where)}" for k, where in sorted(by_key.items())]
        if unexplained:
            why.append(f"{', '.join(unexplained)} would compute something else (changed keys: "
                       f"{', '.join(changed) or 'none'}; a file it reads may have changed)")
        later = [t for t in STAGES if STAGES.index(t) >= STAGES.index(stage)]
        raise ForkRefused(f"fork of {src.base} at {step}:{stage} refused: {'; '.join(why)}, which "
                          f"the fork reuses from {src.experiment}. Overrides may change only "
                          f"{', '.join(later)} of step {step} and later steps: fork at an earlier "
                          f"stage to change it")
    return {"src": src, "step": step, "stage": stage, "reuse": reuse,
            "folders": _folders(store, src, new, step, stage, plan, warm)}


def _folders(store, src: RunLayout, new: RunLayout, step: int, stage: str, plan: dict,
             warm: bool) -> list:
    """(SRC folder, NEW folder) pairs of steps < step that SRC still has; refuses when one that
    NEW needs (the previous weights for a fork at rollout/logprob; the warm start) is gone. No
    train state is needed: the update of STEP restores the newest one SRC kept (none: the initial
    weights) and replays the updates after it from the stored rows NEW references
    (stages/training/worker.py::restore_job), as a resume does."""
    from storage.layout import WEIGHTS_MANIFEST

    pairs, k0 = [], step - 1
    for k in range(0, step):
        pairs += [(src.weights(k), new.weights(k)), (src.critic_weights(k), new.critic_weights(k))]
        base = f"{src.train_state}/step_{k:06d}"
        pairs += [(f"{base}/{r}", f"{new.train_state}/step_{k:06d}/{r}") for r in store.list(base)]
    needed = []
    if k0 and STAGES.index(stage) <= STAGES.index("logprob"):
        needed.append((src.weights(k0), f"the {stage} of step {step}"))
        if plan.get("critic"):
            needed.append((src.critic_weights(k0), f"the logprob of step {step}"))
    lag = int((plan.get("async") or {}).get("staleness") or 0)  # trainer.staleness: older versions sampled
    first_rollout = step if stage == "rollout" else step + 1  # the first rollout NEW runs itself
    for k in range(max(1, first_rollout - 1 - lag), step):  # the versions it and the next ones sample from SRC
        if (src.weights(k), f"the {stage} of step {step}") not in needed:
            needed.append((src.weights(k), f"the rollout of step {k + 1 + lag} (trainer.staleness={lag})"))
    if warm:
        needed.append((src.weights(0), "the reference policy (the warm start)"))
    for key, what in needed:
        if not store.exists(f"{key}/{WEIGHTS_MANIFEST}"):
            raise ForkRefused(f"{store.url(key)} is no longer kept, and {what} needs it: a run keeps "
                              f"its latest weights, older ones only at multiples of trainer.save_freq "
                              f"(at most trainer.max_actor_ckpt_to_keep). "
                              f"Fork at a later step of {src.experiment}, or train the source with "
                              f"trainer.save_freq=1 to fork it at any step")
    return [(a, b) for a, b in pairs if store.exists(f"{a}/{WEIGHTS_MANIFEST}")]


def lock_run(store, layout: RunLayout, force: bool):
    """The experiment lock of a run whose objects a fork records (or `stagerl delete` removes);
    a lock left by a dead process on this host is taken over."""
    from storage.lock import process_alive
    from storage.lock import ExperimentLock, LockedError

    lock = ExperimentLock(store, layout, force=force, owner="fork")
    holder = lock.holder() or {}
    if holder.get("host") == socket.gethostname() and holder.get("pid") \
            and int(holder["pid"]) != os.getpid() and not process_alive(int(holder["pid"])):
        lock.force = True
    try:
        return lock.acquire()
    except LockedError as exc:
        raise ForkRefused(f"{layout.base} is being written by another process: {exc}") from None


def _owners(store, src: RunLayout, info: dict) -> list:
    """The runs other than SRC whose objects SRC's reused manifests and folders reference."""
    from storage.layout import WEIGHTS_MANIFEST
    from storage.lineage import folder_base

    keys = [e["path"] for s, st in info["reuse"]
            for e in (read_manifest(store, src, s, st).get("files") or {}).values()]
    keys += [folder_base(store.read_json(f"{a}/{WEIGHTS_MANIFEST}"), a) for a, _ in info["folders"]]
    return sorted({owner_base(k) for k in keys} - {src.base})


def preexisting_fork(store, cfg: dict, fork: dict) -> dict | None:
    """The lineage of NEW when it already is this fork (made by an earlier, maybe failed, run:
    the flow then resumes it); None when NEW does not exist or its making did not finish;
    ForkRefused when NEW exists as something else."""
    layout = RunLayout.from_config(cfg)
    step, stage = parse_at(fork["at"])
    old = read_run_json(store, layout)
    if old is None:
        return None
    lineage = old.get("lineage") or {}
    source = str(lineage.get("source") or "")
    if lineage.get("at") != f"{step}:{stage}" or str(fork["source"]) not in (source, source.split("/")[-1]):
        raise ForkRefused(f"experiment {layout.base} already exists"
                          + (f" (a fork of {source} at {lineage['at']})" if lineage else "")
                          + ": fork into a new experiment name")
    return lineage if lineage.get("created") else None


def create_fork(store: Store, cfg: dict, plan: dict, fork: dict, force_lock: bool = False) -> dict:
    """Make NEW (the run `cfg` names, whose lock the caller holds) a fork of fork['source'] at
    fork['at']; returns the lineage recorded in NEW's run.json. Idempotent for the same fork (a
    retried deployment run); refused when NEW already exists otherwise."""
    from flows.step import stage_fingerprint, stage_module
    from stages.context import StageContext

    layout = RunLayout.from_config(cfg)
    step, stage = parse_at(fork["at"])
    done = preexisting_fork(store, cfg, fork)
    if done:
        return done
    info = check_fork(store, cfg, plan, fork)
    src = info["src"]
    locks = [lock_run(store, src, force_lock)]
    try:
        info = check_fork(store, cfg, plan, fork)  # again, now that SRC cannot prune meanwhile
        for owner in _owners(store, src, info):  # SRC is a fork too: the runs holding its objects
            locks.append(lock_run(store, RunLayout(*owner.split("/")), force_lock))
        lineage = {"source": src.base, "at": f"{step}:{stage}", "step": step, "stage": stage,
                   "overrides": list(fork.get("overrides") or []), "created_at": time.time(),
                   "created": False}
        write_run_json(store, layout, dict(cfg), extra={"plan": plan, "lineage": lineage})
        objects = {}
        for s, st in info["reuse"]:
            ctx = StageContext(cfg=cfg, plan=plan, store=store, layout=layout, step=s)
            module = stage_module(st)
            objects.update(reference_stage(
                store, read_manifest(store, src, s, st), layout, s, st,
                fingerprint=stage_fingerprint(module, ctx),
                inputs=ctx.input_fingerprints(getattr(module, "INPUTS", ())), source=src.base))
        for a, b in info["folders"]:
            objects.update(reference_folder(store, a, b))
        owners = sorted({owner_base(o) for o in objects})
        lineage.update(owners=owners, created=True, objects=len(objects))
        for owner in owners:
            record_fork(store, owner, layout, {o: m for o, m in objects.items() if owner_base(o) == owner},
                        {k: lineage[k] for k in ("source", "at")})
        write_run_json(store, layout, dict(cfg), extra={"plan": plan, "lineage": lineage})
        print(f"fork {layout.base} of {src.base} at {step}:{stage}: {len(info['reuse'])} stage(s) and "
              f"{len(info['folders'])} folder(s) referenced ({len(objects)} objects, none copied)",
              flush=True)
        return lineage
    finally:
        for lock in locks:
            lock.release()
