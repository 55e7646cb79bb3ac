"""Pipelined steps bench (issue 35): the 10-step wall of trainer.staleness=1 against staleness=0 on
the same work, the rollout engine pinned to one core and the training run to the other, against
the ideal max(R, U) / (R + U) computed from the s=0 runs' own stage times. Writes
bench/results/async.json.

    python bench/async.py [--rounds 3] [--steps 10] [--engine-cpus 0] [--train-cpus 1]
                          [--flow-cpus train|engine|both] [--server-cpus any|train|LIST]
                          [--max-load 0.5] [key=value ...]

The work: bench/peer_trl.py's (the demo's tiny model, flows.demo.MODEL_OPTIONS, random init, no
warm start; 60 single-digit addition prompts of 16 tokens x 12 samples = 720 rows per step; GRPO,
no KL; one optimizer step per RL step over micro-batches of 120 rows; fp32; no validation, no
checkpoints), 1 rank (trainer.n_gpus_per_node=1: a rank forked beside the engine), the
hf engine, and responses of up to 48 tokens (BATCH below: the random-init model samples them to
the end), where rollout and update take about the same time on one core each (at the peer's 16
tokens the rollout is ~0.65x the update); then the command-line overrides. Every run is a fresh
`stagerl train` process (bench/peer/stagerl_run.py: flows.train.train as `stagerl train` runs it,
recording when each step is logged) started as

    taskset -c <train-cpus> python bench/peer/stagerl_run.py ... \
        actor_rollout_ref.rollout.cpu_affinity=[<engine-cpus>] \
        actor_rollout_ref.actor.cpu_affinity=[<train-cpus>] trainer.staleness=<s>

so the hf engine's worker process (its own process whenever cpu_affinity is set, at s=0 too)
pins itself to the engine cores, the one rank the flow forks (the update: flows.train.training_cpus)
trains on the train cores, and the flow process (the Prefect task runs of both chains, the
reward, the stages' tables) runs on the train cores too. With --flow-cpus engine it runs on the
engine's cores instead, with --flow-cpus both (or --flow-anywhere) on both, as it does when a user
pins only the engine: the rank still trains on the train cores alone. One Prefect server serves all
runs, started before them (its start-up is in no figure), unpinned by default (--server-cpus).
s=0 and s=1 runs are interleaved, --rounds of each, the order alternating per round. Before each
run the bench waits (up to --max-wait-s) until the 1-minute load average is below --max-load and
records it, and, while the run ran, the machine's busy CPU seconds not spent by this bench's
processes or the server (cpu_s.others: other users of the machine).

The pinning is checked, not assumed: while a run runs, every 0.25 s the bench reads
/proc/<pid>/task/<tid>/status (Cpus_allowed_list) of every thread of every process under it and
records, per process, the lists seen and its CPU seconds; pinning.ok: exactly one process (the
engine worker) has threads on the engine cores besides the fork server it was forked from (which
runs there when it forks only the engine's workers: stages.ranks.zygote.engine_cpus), all of their
threads (as last seen) are there, every thread of the flow process is on its cores, and every
thread of every other process (the rank) is on the train cores.

Per run, from the flow's own step log (bench/peer_trl.py's timeline):
  wall_s       begin of step 1 -> end of step N (step k ends when the flow logs it; step 1 begins
               timing_s/step earlier): the Prefect server's and the flow's start-up excluded
  process_s    the process's whole life (imports, Prefect flow run, engine start: included)
  warm_step_s  (end of step N - end of step 1) / (N - 1)
  R, U         per step: R = timing_s/rollout + timing_s/reward, U = timing_s/logprob +
               timing_s/advantage + timing_s/update (each stage task's own seconds); means over
               steps 1..N (`mean`) and 2..N (`warm`)
  overlap_s    per step: timing_s/overlap (s>=1: seconds step k's rollout chain ran beside step
               k-1's trainer chain)
  rollout_chain  the stages the s>=1 run's rollout chain ran (flows.train.rollout_chain): rollout
               and reward, and the logprob and the advantage too where the logprob stage runs no
               pass (this work: the old log-probs come from the update's forward); the trainer
               chain ran the others
The contention probe (on by default): after the rounds, one more s=0 run with a loop of small
matmuls (BUSY_LOOP, one torch thread, not stagerl) pinned to the engine cores for the whole run;
contention_probe compares its update train loop (steps 2..N) with the s=0 runs' and with the s=1
runs', so the part of s=1's slower update that a busy neighbour core alone explains is measured.
The gap to the ideal is split four ways (figures.gap_split): step 1, which nothing overlaps (the
s=0 runs' schedule bound minus the ideal); the chains (the s=0 runs' bound with the s=1 runs' chain
membership minus it: negative where the rollout chain took stages off the trainer chain); the
stages' own slowdown when they overlap (the bound of the s=1 runs' own stage times minus that);
and the schedule's loss (the ratio minus that). figures.ideal_with_s1_chains is the ideal of the
s=0 stage times split as the s=1 runs' chains ran them (R = the rollout chain's stages): lower than
the issue's R and U give, shown beside it.
Medians are over the runs on a quiet machine (others' CPU at most --max-others of one core over the
run; the rest are listed under `excluded`). Figures: ratio = median wall_s at s=1 / median wall_s
at s=0 (target <= 0.75); ratio_per_round pairs each round's two runs; ideal =
max(R, U) / (R + U) from the s=0 runs' means (median over runs); ideal_n_steps = (R + U +
(N-1) max(R, U)) / (N (R + U)); ideal_schedule_bound = R_1 + sum_k max(U_k, R_k+1) + U_N from each
s=0 run's own per-step times, over its wall (step 1's cold start, which nothing can overlap,
included as it ran)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
PEER = REPO / "bench" / "peer"
ROLLOUT_STAGES, TRAIN_STAGES = ("rollout", "reward"), ("logprob", "advantage", "update")
# On top of the peer work (one core each, warm steps, s=0): at the peer's 16 response tokens R ~0.9 s,
# U ~1.4 s (a run beside other load); at 48, R ~1.8 s, U ~1.9 s (bench/results/async.json).
BATCH = ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", "data.max_response_length=48"]


def load_peer():
    spec = importlib.util.spec_from_file_location("peer_trl", REPO / "bench" / "peer_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpus_arg(text: str) -> list[int]:
    return sorted({int(c) for c in text.split(",") if c.strip()})


# ---- load and pinning -----------------------------------------------------------------------
def wait_for_quiet(max_load: float, max_wait_s: float) -> dict:
    t0 = time.time()
    while os.getloadavg()[0] >= max_load and time.time() - t0 < max_wait_s:
        time.sleep(5)
    return {"load_avg_1m": round(os.getloadavg()[0], 2), "waited_s": round(time.time() - t0, 1),
            "quiet": os.getloadavg()[0] < max_load}


def busy_jiffies() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def read_threads(pid: int) -> dict:
    """{tid: (thread name, Cpus_allowed_list)} of every thread of pid ({} if it is gone)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status if ":" in line)
        out[int(tid)] = (fields.get("Name", "").strip(), fields.get("Cpus_allowed_list", "").strip())
    return out


class PinningMonitor:
    """Every `period` s: the processes under `root_pid`, each thread's Cpus_allowed_list and the
    process's CPU seconds (the last seen)."""

    def __init__(self, root_pid: int, period: float = 0.25):
        self.root, self.period, self.seen, self.stop = root_pid, period, {}, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                root = psutil.Process(self.root)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for proc in procs:
                try:
                    entry = self.seen.setdefault(proc.pid, {"cmd": " ".join(proc.cmdline())[-120:],
                                                            "ppid": proc.ppid(), "cpus_seen": set(), "threads": {}})
                    threads = read_threads(proc.pid)
                    entry["cpus_seen"].update(c for _, c in threads.values())
                    entry["threads"].update(threads)  # tid -> (name, the latest list seen)
                    times = proc.cpu_times()
                    entry["cpu_s"] = round(times.user + times.system, 2)
                except psutil.Error:
                    pass
            self.stop.wait(self.period)

    def finish(self, engine_cpus: list[int], train_cpus: list[int], flow_cpus: list[int] | None = None) -> dict:
        """The engine worker: the process with a thread on the engine cores; ok: all its threads
        (as last seen) there, every thread of every other process on the train cores, but the
        flow's own process (the root), which may be on `flow_cpus` (default: the train cores)."""
        self.stop.set()
        self.thread.join()
        engine_set, train_set = cpu_list(engine_cpus), cpu_list(train_cpus)
        flow_set = cpu_list(sorted(flow_cpus or train_cpus))
        procs = []
        for pid, e in self.seen.items():
            last = sorted({c for _, c in e["threads"].values()})
            names: dict = {}
            for name, cpus in e["threads"].values():
                names.setdefault(cpus, set()).add(name)
            procs.append({"pid": pid, "ppid": e["ppid"], "flow": pid == self.root, "cmd": e["cmd"], "cpu_s": e.get("cpu_s"), "threads": len(e["threads"]),
                          "cpus_allowed_last": last, "cpus_allowed_seen": sorted(e["cpus_seen"]),
                          "thread_names_by_cpus": {c: sorted(n) for c, n in names.items()}})
        engine = [p for p in procs if engine_set in p["cpus_allowed_last"] and not p["flow"]]
        parents = {p["ppid"] for p in engine}  # the fork server the worker was forked from, if there
        workers = [p for p in engine if p["pid"] not in parents]
        ok = (len(workers) == 1 and all(p["cpus_allowed_last"] == [engine_set] for p in engine)
              and all(p["cpus_allowed_last"] in ([flow_set if p["flow"] else train_set], [])
                      for p in procs if p not in engine))
        return {"ok": ok, "engine_cpus": engine_set, "train_cpus": train_set, "flow_cpus": flow_set,
                "engine_worker": workers,
                "fork_server_on_engine_cpus": [p for p in engine if p not in workers],
                "processes": [p for p in procs if p not in engine]}


def cpu_list(cpus: list[int]) -> str:
    """As the kernel writes Cpus_allowed_list: 0-3, 1, 0,2."""
    if len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


# A stand-in for the engine's generation that is not stagerl: small matmuls on one thread, forever.
BUSY_LOOP = ("import torch\ntorch.set_num_threads(1)\nx, w = torch.randn(64, 256), torch.randn(256, 256) * 0.05\n"
             "while True:\n    x = torch.tanh(x @ w)\n")


def busy_neighbour(cpus: list[int]):
    """BUSY_LOOP pinned to `cpus` (the contention probe: what a busy engine core alone costs the
    training core, with no Python, Prefect or GIL of the run's shared between them)."""
    import subprocess

    return subprocess.Popen(["taskset", "-c", cpu_list(cpus), sys.executable, "-c", BUSY_LOOP], cwd=str(REPO),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def flow_cpus(args) -> list[int]:
    """The cores the stagerl process runs on (--flow-cpus): the train cores, the engine's, or both
    (the run pins its engine to the engine cores and its one rank to the train cores:
    actor_rollout_ref.actor.cpu_affinity, flows.train.training_cpus)."""
    mode = "both" if args.flow_anywhere else args.flow_cpus
    return sorted({"train": set(args.train_cpus), "engine": set(args.engine_cpus),
                   "both": set(args.train_cpus) | set(args.engine_cpus)}[mode])


# ---- one run --------------------------------------------------------------------------------
def run_once(s: int, rnd: int, ctx: dict, neighbour: bool = False) -> dict:
    """One run; with `neighbour`, busy_neighbour on the engine cores while it runs (the probe)."""
    import subprocess

    args, work, peer = ctx["args"], ctx["work"], ctx["peer"]
    name = f"s{s}-r{rnd}" + ("-busy-neighbour" if neighbour else "")
    out_json, log = work / f"{name}.json", work / f"{name}.log"
    quiet = wait_for_quiet(args.max_load, args.max_wait_s)
    busy = busy_neighbour(args.engine_cpus) if neighbour else None
    cmd = ["taskset", "-c", ",".join(map(str, flow_cpus(args))), sys.executable, str(PEER / "stagerl_run.py"),
           "--out", str(out_json), "--experiment", f"async-{name}", *ctx["overrides"],
           f"actor_rollout_ref.rollout.cpu_affinity=[{','.join(map(str, args.engine_cpus))}]",
           f"actor_rollout_ref.actor.cpu_affinity=[{','.join(map(str, args.train_cpus))}]", f"trainer.staleness={s}"]
    env = peer.child_env(len(args.train_cpus), ctx["prefect"])
    server_cpu = peer.process_cpu_s(ctx["server_pid"])
    busy0, ours0 = busy_jiffies(), resource.getrusage(resource.RUSAGE_CHILDREN)
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd + ["--t0", repr(t0)], cwd=str(REPO), env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        monitor = PinningMonitor(proc.pid)
        try:
            code = proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code = proc.wait()
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    t_exit = time.time()
    pinning = monitor.finish(args.engine_cpus, args.train_cpus, flow_cpus(args))
    hz = os.sysconf("SC_CLK_TCK")
    ours1, self1 = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
    server_s = peer.process_cpu_s(ctx["server_pid"]) - server_cpu
    ours_s = (ours1.ru_utime + ours1.ru_stime - ours0.ru_utime - ours0.ru_stime
              + self1.ru_utime + self1.ru_stime - self0.ru_utime - self0.ru_stime)
    busy_s = (busy_jiffies() - busy0) / hz
    result = {"run": name, "staleness": s, "round": rnd, "returncode": code, "before": quiet,
              "cpu_s": {"machine_busy": round(busy_s, 2), "this_run": round(ours_s, 2),
                        "prefect_server": round(server_s, 2),
                        "others": round(busy_s - ours_s - server_s, 2)},
              "load_avg_1m_after": round(os.getloadavg()[0], 2), "pinning": pinning}
    try:
        raw = json.loads(out_json.read_text())
        result.update(summarize(raw, t_exit, peer))
        result["stage_detail_s"] = stage_detail(work / "runs", f"async-{name}", len(result["per_step"]))
        result["rollout_chain"] = list(run_chain(work / "runs", f"async-{name}", s))
        if raw.get("error"):
            result["error"] = raw["error"][-4000:]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        result["error"] = f"no usable result ({type(exc).__name__}: {exc}); log tail:\n" + \
            (log.read_text(errors="replace")[-4000:] if log.exists() else "")
    ok = "error" not in result and code == 0
    print(f"[{name}] " + (f"wall {result['wall_s']} s (process {result['process_s']} s), R {result['mean']['R']} "
                          f"U {result['mean']['U']} s/step, overlap {result['overlap_s']}, load before "
                          f"{quiet['load_avg_1m']}, others' CPU {result['cpu_s']['others']} s, pinned ok "
                          f"{pinning['ok']}" if ok else f"FAILED (exit {code}): {result.get('error', '')[-2000:]}"),
          flush=True)
    return result


def summarize(raw: dict, t_exit: float, peer) -> dict:
    steps = [e for e in raw["steps"] if "timing_s/step" in e["metrics"]]
    begin_1 = steps[0]["logged_at"] - steps[0]["metrics"]["timing_s/step"]
    line = peer.timeline(begin_1, [e["logged_at"] for e in steps], raw["t0"], t_exit)
    stage = lambda e, names: sum(float(e["metrics"].get(f"timing_s/{n}", 0.0)) for n in names)
    per_step = [{"step": e["step"], "R": round(stage(e, ROLLOUT_STAGES), 3), "U": round(stage(e, TRAIN_STAGES), 3),
                 **{n: e["metrics"].get(f"timing_s/{n}") for n in (*ROLLOUT_STAGES, *TRAIN_STAGES, "step", "overlap")}}
                for e in steps]
    mean = lambda rows, key: round(sum(r[key] for r in rows) / len(rows), 3)
    pick = lambda e, *keys: next((e["metrics"][k] for k in keys if k in e["metrics"]), None)
    return {**line, "per_step": per_step,
            "mean": {"R": mean(per_step, "R"), "U": mean(per_step, "U")},
            "warm": {"R": mean(per_step[1:] or per_step, "R"), "U": mean(per_step[1:] or per_step, "U")},
            "overlap_s": [r["overlap"] for r in per_step],
            "reward_mean": [pick(e, "reward/score/mean", "critic/score/mean") for e in steps],
            "threads": raw.get("threads"), "versions": raw.get("versions")}


def stage_detail(root: Path, experiment: str, steps: int) -> dict:
    """Each stage manifest's own timings (numbers), mean over steps 2..N (bench/step.py's
    stage_detail_s): where a stage's seconds went (rollout: weights load, generation, table)."""
    from storage.artifacts import read_manifest
    from storage.layout import STAGES, RunLayout
    from storage.store import Store

    store, layout = Store.from_config({"root": str(root)}), RunLayout("stagerl", experiment)
    out = {}
    for stage in STAGES:
        rows = [(read_manifest(store, layout, k, stage) or {}).get("timings") or {} for k in range(2, steps + 1)]
        keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float))})
        out[stage] = {k: round(sum(float(r.get(k) or 0.0) for r in rows) / max(1, len(rows)), 4) for k in keys}
    return out


def run_chain(root: Path, experiment: str, s: int) -> tuple:
    """The stages the run's rollout chain ran (flows.train.rollout_chain): at s >= 1 the logprob
    and advantage too where the logprob stage ran no forward pass (its manifest's extra.passes);
    ROLLOUT_STAGES at s=0 (no chains: the issue's R)."""
    from flows.train import rollout_chain
    from storage.artifacts import read_manifest
    from storage.layout import RunLayout
    from storage.store import Store

    if s < 1:
        return ROLLOUT_STAGES
    manifest = read_manifest(Store.from_config({"root": str(root)}), RunLayout("stagerl", experiment), 1, "logprob")
    return rollout_chain(bool(((manifest or {}).get("extra") or {}).get("passes", True)))


# ---- figures --------------------------------------------------------------------------------
def chains(per_step: list[dict], chain=ROLLOUT_STAGES) -> tuple[list, list]:
    """Per step, the seconds of the rollout chain's stages (`chain`) and of the trainer chain's
    (the other stages)."""
    stages = (*ROLLOUT_STAGES, *TRAIN_STAGES)
    R = [sum(p[n] or 0.0 for n in stages if n in chain) for p in per_step]
    U = [sum(p[n] or 0.0 for n in stages if n not in chain) for p in per_step]
    return R, U


def schedule_bound(per_step: list[dict], chain=ROLLOUT_STAGES) -> float:
    """The shortest wall a two-chain schedule of these per-step stage times allows: step 1's
    rollout chain, then each step's trainer chain beside the next step's rollout chain, then the
    last trainer chain: R_1 + sum_k max(U_k, R_k+1) + U_N (orchestration between stages not
    counted). `chain`: the rollout chain's stages (default the issue's R: rollout and reward)."""
    R, U = chains(per_step, chain)
    return R[0] + sum(max(U[k], R[k + 1]) for k in range(len(R) - 1)) + U[-1]


def ideal(R: float, U: float, n: int) -> dict:
    return {"max_over_sum": round(max(R, U) / (R + U), 3),
            "n_steps": round((R + U + (n - 1) * max(R, U)) / (n * (R + U)), 3)}


def quiet(run: dict, max_others: float) -> bool:
    """Other users of the machine took at most `max_others` of a core while the run ran."""
    return run["cpu_s"]["others"] <= max_others * run.get("process_s", 0.0)


def aggregate(results: list[dict], steps: int, max_others: float = 0.05) -> dict:
    """Medians over the runs that completed on a quiet machine (`quiet`); the others are listed
    under excluded (a staleness without a quiet run falls back to all of its runs)."""
    ok = [r for r in results if "error" not in r and r["returncode"] == 0]
    good = {}
    for s in sorted({r["staleness"] for r in results}):
        mine = [r for r in ok if r["staleness"] == s]
        good[s] = [r for r in mine if quiet(r, max_others)] or mine
    used = {r["run"] for rows in good.values() for r in rows}
    med = lambda rows, f: round(statistics.median(f(r) for r in rows), 3) if rows else None
    out = {"by_staleness": {}, "runs_used": sorted(used),
           "excluded": {r["run"]: ("failed" if r not in ok else f"others' CPU {r['cpu_s']['others']} s > "
                                   f"{max_others:.0%} of the run's {r.get('process_s')} s")
                        for r in results if r["run"] not in used}}
    for s, rows in good.items():
        out["by_staleness"][s] = {
            "runs_ok": len(rows), "wall_s": med(rows, lambda r: r["wall_s"]),
            "wall_s_runs": [r["wall_s"] for r in rows], "process_s": med(rows, lambda r: r["process_s"]),
            "startup_s": med(rows, lambda r: r["startup_s"]),
            "R_mean": med(rows, lambda r: r["mean"]["R"]), "U_mean": med(rows, lambda r: r["mean"]["U"]),
            "R_warm": med(rows, lambda r: r["warm"]["R"]), "U_warm": med(rows, lambda r: r["warm"]["U"]),
            "stage_s_mean": {n: med(rows, lambda r: sum(p[n] or 0.0 for p in r["per_step"]) / len(r["per_step"]))
                             for n in (*ROLLOUT_STAGES, *TRAIN_STAGES, "step")},
            "stage_s_mean_warm": {n: med(rows, lambda r: sum(p[n] or 0.0 for p in r["per_step"][1:])
                                         / max(1, len(r["per_step"]) - 1))
                                  for n in (*ROLLOUT_STAGES, *TRAIN_STAGES, "step")},
            "overlap_s_mean_steps_2_on": med(rows, lambda r: sum(x or 0.0 for x in r["overlap_s"][1:])
                                                             / max(1, len(r["overlap_s"]) - 1)),
            "warm_step_s": med(rows, lambda r: r["warm_step_s"]),
            "engine_generate_s": med(rows, lambda r: r["stage_detail_s"]["rollout"].get("generate_s", 0.0)),
            "update_rank_train_s": med(rows, lambda r: r["stage_detail_s"]["update"].get("timing/rank_train_s", 0.0)),
            "pinning_ok": all(r["pinning"]["ok"] for r in rows)}
    s0, s1 = out["by_staleness"].get(0), out["by_staleness"].get(1)
    if s0 and s1 and s0["wall_s"] and s1["wall_s"]:
        R, U = s0["R_mean"], s0["U_mean"]
        ideal_all = ideal(R, U, steps)
        ratio = round(s1["wall_s"] / s0["wall_s"], 3)
        by_round = {(r["staleness"], r["round"]): r for rows in good.values() for r in rows}
        paired = [round(by_round[(1, k)]["wall_s"] / by_round[(0, k)]["wall_s"], 3)
                  for k in sorted({r["round"] for r in results}) if (0, k) in by_round and (1, k) in by_round]
        ratio_process = round(s1["process_s"] / s0["process_s"], 3)
        bound = [round(schedule_bound(r["per_step"]) / r["wall_s"], 3) for r in good[0]]
        s0_bound = statistics.median(bound)
        warm_ratio = round(s1["warm_step_s"] / s0["warm_step_s"], 3)
        own_bound = round(statistics.median(schedule_bound(r["per_step"], r.get("rollout_chain") or ROLLOUT_STAGES)
                                            for r in good[1]) / s0["wall_s"], 3)
        chain = tuple(good[1][0].get("rollout_chain") or ROLLOUT_STAGES)
        s0_chains = [chains(r["per_step"], chain) for r in good[0]]  # s=0's stage times, split as s=1 ran them
        R1 = statistics.median(sum(c[0]) / len(c[0]) for c in s0_chains)
        U1 = statistics.median(sum(c[1]) / len(c[1]) for c in s0_chains)
        chain_bound = statistics.median(schedule_bound(r["per_step"], chain) / r["wall_s"] for r in good[0])
        out["figures"] = {
            "ratio_wall_s1_over_s0": ratio, "ratio_per_round": paired,
            # each round's two runs ran back to back: their ratio is free of the host's drift
            # between rounds (its speed moved up to 1.6x within an hour here), the median of
            # those a second estimate beside the ratio of the medians above
            "ratio_per_round_median": round(statistics.median(paired), 3) if paired else None,
            "gap_to_ideal_per_round_median": (round(statistics.median(paired) - ideal_all["max_over_sum"], 3)
                                              if paired else None),
            "ratio_process_s1_over_s0 (start-up included)": ratio_process,
            "ratio_warm_step_s1_over_s0 (steps 2..N)": warm_ratio,
            "R_s0": R, "U_s0": U, "R_over_U": round(R / U, 3), "within_2x": max(R, U) <= 2 * min(R, U),
            "ideal_max_over_sum": ideal_all["max_over_sum"], "ideal_n_steps": ideal_all["n_steps"],
            "ideal_from_warm_steps": ideal(s0["R_warm"], s0["U_warm"], steps)["max_over_sum"],
            "ideal_schedule_bound": round(s0_bound, 3), "ideal_schedule_bound_per_s0_run": bound,
            "old_log_prob_recompute_s_per_step (s1 logprob - s0 logprob, steps 2..N)": round(
                s1["stage_s_mean_warm"]["logprob"] - s0["stage_s_mean_warm"]["logprob"], 3),
            # where the gap to the ideal goes: step 1 (the s=0 bound), the stages' own slowdown
            # when they overlap (the bound of s=1's own stage times), and the rest (scheduling)
            "slowdown_when_overlapped (s1 / s0, steps 2..N)": {
                "engine_generate": round(s1["engine_generate_s"] / s0["engine_generate_s"], 3)
                if s0["engine_generate_s"] else None,
                "update_train_loop": round(s1["update_rank_train_s"] / s0["update_rank_train_s"], 3)
                if s0["update_rank_train_s"] else None},
            "schedule_bound_of_s1_stage_times": own_bound,
            # the s=1 runs' chains: the rollout chain also ran the logprob and the advantage where
            # the logprob stage had no pass (flows.train.rollout_chain); the s=0 stage times split
            # that way give a lower ideal than the R and U (the criterion above): both shown
            "s1_rollout_chain": list(chain),
            "ideal_with_s1_chains": {"R": round(R1, 3), "U": round(U1, 3), **ideal(R1, U1, steps),
                                     "schedule_bound": round(chain_bound, 3),
                                     "gap_to_it": round(ratio - ideal(R1, U1, steps)["max_over_sum"], 3)},
            "gap_split": {"step_1 (s0 bound - ideal)": round(s0_bound - ideal_all["max_over_sum"], 3),
                          "chains (s0 bound with s=1's chains - s0 bound)": round(chain_bound - s0_bound, 3),
                          "slower stages (s1's bound - s0's bound with s=1's chains)": round(own_bound - chain_bound, 3),
                          "scheduling (ratio - s1's bound)": round(ratio - own_bound, 3)},
            "target_ratio": 0.75, "meets_target": ratio <= 0.75,
            "gap_to_ideal": round(ratio - ideal_all["max_over_sum"], 3),
            "within_0.10_of_ideal": abs(ratio - ideal_all["max_over_sum"]) <= 0.10}
    return out


def contention(probe: dict, summary: dict) -> dict:
    """The contention probe against the rounds: the update's train loop (steps 2..N) of an s=0 run
    with a busy neighbour on the engine cores over the s=0 runs' median, beside the same ratio of
    the s=1 runs (whose neighbour is the engine sampling the next step). A like slowdown says the
    s=1 update is slower because the other core is busy, not because of what the run shares
    (its process, Prefect, the GIL): the ideal's U assumes neither."""
    out = {"run": probe["run"], "returncode": probe["returncode"],
           "what": "s=0 run with bench/async.py BUSY_LOOP (one torch thread of small matmuls) pinned to the engine cores",
           "run_result": probe}
    if "error" in probe or probe["returncode"] != 0:
        return {**out, "error": probe.get("error", f"exit {probe['returncode']}")}
    s0, s1 = summary["by_staleness"].get(0), summary["by_staleness"].get(1)
    train = probe["stage_detail_s"]["update"].get("timing/rank_train_s")
    base = (s0 or {}).get("update_rank_train_s")
    at_s1 = (summary.get("figures") or {}).get("slowdown_when_overlapped (s1 / s0, steps 2..N)") or {}
    out.update({"update_train_loop_s": train, "s0_update_train_loop_s": base,
                "slowdown_with_busy_neighbour": round(train / base, 3) if train and base else None,
                "s1_update_train_loop_s": (s1 or {}).get("update_rank_train_s"),
                "slowdown_at_s1": at_s1.get("update_train_loop")})
    return out


def code_state() -> dict:
    """The commit the runs ran and the product files that differed from it (uncommitted edits)."""
    import subprocess

    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--", "stages", "flows", "configs", "storage", "bench/peer")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted": dirty.splitlines()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--engine-cpus", type=cpus_arg, default=[0], help="e.g. 0 or 0,1")
    parser.add_argument("--train-cpus", type=cpus_arg, default=[1])
    parser.add_argument("--flow-cpus", choices=("train", "engine", "both"), default="train",
                        help="the cores the stagerl process (Prefect's task runs, the reward, the stages' tables) is "
                             "tasksetted onto: the train cores (the default), the engine's, or both; the run keeps the "
                             "engine and its one rank on their own cores either way")
    parser.add_argument("--flow-anywhere", action="store_true", help="the same as --flow-cpus both")
    parser.add_argument("--server-cpus", default="any",
                        help="the Prefect server's cores: any (unpinned, the default), train, or a list")
    parser.add_argument("--max-load", type=float, default=0.5, help="wait for a 1-minute load below this")
    parser.add_argument("--max-wait-s", type=float, default=600.0, help="then run anyway (recorded)")
    parser.add_argument("--max-others", type=float, default=0.05,
                        help="a run where other processes used more than this share of a core is left out of the medians")
    parser.add_argument("--run-timeout", type=float, default=900.0)
    parser.add_argument("--contention-probe", action=argparse.BooleanOptionalAction, default=True,
                        help="after the rounds, one more s=0 run with a busy loop (not stagerl) on the engine "
                             "cores: the update's train loop beside it against the s=0 runs' (contention_probe)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "async.json")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, runs)")
    parser.add_argument("overrides", nargs="*", help="key=value for every run, after the bench's own")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2")
    if set(args.engine_cpus) & set(args.train_cpus):
        raise SystemExit("--engine-cpus and --train-cpus must not share a core")
    if not shutil.which("taskset"):
        raise SystemExit("taskset (util-linux) not found")
    peer = load_peer()
    os.environ.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    every = os.sched_getaffinity(0)
    if args.server_cpus != "any":  # the Prefect server (and this process, whose child it is)
        os.sched_setaffinity(0, set(args.train_cpus if args.server_cpus == "train" else cpus_arg(args.server_cpus)))
    work = Path(tempfile.mkdtemp(prefix="stagerl-bench-async-"))
    from flows.prefect_server import local_server

    load_start = os.getloadavg()[0]
    results: list[dict] = []
    try:
        inputs = peer.build_inputs(work)
        spec = {"side": "stagerl", "engine": "hf", "ranks": 1, "step_subflow": False,
                "micro_batch": peer.WORK["micro_batch"], "base": "stagerl-hf-1rank"}
        overrides = [*peer.stagerl_overrides(spec, inputs, work, args.steps), *BATCH, *args.overrides]
        with local_server(work / "prefect") as server:
            server.wait_healthy()
            os.sched_setaffinity(0, every)  # the server keeps its cores; this process polls from any
            prefect = {"PREFECT_API_URL": server.api_url, "PREFECT_HOME": str(work / "prefect"),
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
            ctx = {"args": args, "work": work, "peer": peer, "overrides": overrides, "prefect": prefect,
                   "server_pid": server.proc.pid}
            for rnd in range(args.rounds):  # interleaved; the order alternates per round
                for s in (args.staleness if rnd % 2 == 0 else args.staleness[::-1]):
                    results.append(run_once(s, rnd, ctx))
            probe = run_once(0, args.rounds, ctx, neighbour=True) if args.contention_probe and 0 in args.staleness else None
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = aggregate(results, args.steps, args.max_others)
    if probe is not None:
        summary["contention_probe"] = contention(probe, summary)
    out = {"bench": "async", "steps": args.steps, "rounds": args.rounds,
           "command": "python bench/async.py " + " ".join(sys.argv[1:]),
           "work": {**peer.WORK, "rows_per_step": peer.WORK["prompts"] * peer.WORK["n"], "ranks": 1, "engine": "hf",
                    "model": "flows.demo.MODEL_OPTIONS", "prompt_tokens": inputs["prompt_tokens"]},
           "overrides": overrides[len(overrides) - len(BATCH) - len(args.overrides):],
           "pinning": {"engine_cpus": args.engine_cpus, "train_cpus": args.train_cpus, "flow_cpus": flow_cpus(args),
                       "prefect_server_cpus": args.server_cpus,
                       "how": "taskset -c FLOW on the stagerl process (--flow-cpus: TRAIN, ENGINE or both); "
                              "actor_rollout_ref.rollout.cpu_affinity=[ENGINE] (the engine worker and the fork server); "
                              "the one rank forked onto actor_rollout_ref.actor.cpu_affinity=[TRAIN] "
                              "(flows.train.training_cpus); "
                              "checked per thread in /proc/<pid>/task/*/status while each run ran"},
           "prefect_startup": "excluded from wall_s (server started once before all runs; flow start-up before "
                              "step 1 begins); included in process_s",
           **summary, "order": [r["run"] for r in results], "per_run": results,
           "machine": f"{os.cpu_count()} CPUs",
           "load_avg_1m": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2),
                           "before_each_run": {r["run"]: r["before"]["load_avg_1m"] for r in results}},
           "date": time.strftime("%Y-%m-%d %H:%M"), "code": code_state()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"figures": out.get("figures"), "contention_probe": {k: v for k, v in (out.get("contention_probe") or {}).items()
                                                                          if k != "run_result"},
                      "by_staleness": out["by_staleness"],
                      "load_avg_1m": out["load_avg_1m"]}, indent=1))
    return 0 if all("error" not in r and r["returncode"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
