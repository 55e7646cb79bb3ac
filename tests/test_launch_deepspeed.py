"""N-rank jobs through DeepSpeed's launcher (trainer.launcher=deepspeed, trainer.hostfile): the
update stage gives bit-identical weights to the torchrun launch, rank_entry shares the context and
gathers results over the process group, a failing rank's traceback comes back, and bad hostfiles
are refused by name. Real launches (a deepspeed launch costs ~8-15 s here, torchrun 3-13 s): four."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _update_inputs import make_ctx, write_inputs
from configs.loader import load_config
from configs.plan import PlanError
from configs.suggest import make_plan
from stages.ranks import launch
from stages import update
from stages.ranks.launch import deepspeed_command, run_ranks
from stages.model.tiny import save_tiny_model
from storage.artifacts import read_file

REPO = Path(__file__).resolve().parent.parent

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(__import__("stages.ranks.deepspeed_ops", fromlist=["x"]).DEFAULT_DIR))

TWO_RANKS = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=45",
             "trainer.n_gpus_per_node=2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def hostfile(tmp_path, text: str, name: str = "hostfile") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run_update(tmp_path, model_dir, overrides):
    ctx = make_ctx(tmp_path, model_dir, 1, TWO_RANKS + overrides)
    write_inputs(ctx)
    update.run(ctx)
    metrics = read_file(ctx.store, ctx.layout, 1, "update", "update/metrics.json")
    weights = load_file(os.path.join(ctx.store.path(ctx.layout.weights(1)), "model.safetensors"))
    return dict(launch.LAST_LAUNCH), metrics, weights


def test_update_through_deepspeed_launcher_equals_torchrun(tmp_path, model_dir):
    """The same update on 2 ranks, launched by torchrun and by `deepspeed --hostfile`: equal bits."""
    hosts = hostfile(tmp_path, "# one node\nlocalhost slots=2\n")
    ds_launch, ds_metrics, ds_weights = run_update(
        tmp_path / "deepspeed", model_dir, ["trainer.launcher=deepspeed", f"trainer.hostfile={hosts}"])
    tr_launch, tr_metrics, tr_weights = run_update(tmp_path / "torchrun", model_dir, [])
    assert ds_launch["launcher"] == "deepspeed" and ds_launch["cmd"][0].endswith("/deepspeed")
    assert ds_launch["cmd"][ds_launch["cmd"].index("--hostfile") + 1] == hosts
    assert "--no_ssh_check" in ds_launch["cmd"] and ds_launch["cmd"][-4:-2] == ["stages.ranks.entry",
                                                                                 "stages.training.worker"]
    assert tr_launch["launcher"] == "torchrun" and "torch.distributed.run" in tr_launch["cmd"]
    assert ds_weights.keys() == tr_weights.keys()
    init = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in tr_weights.items():
        assert torch.equal(ds_weights[name], tensor), name
    assert any(not torch.equal(init[k], tr_weights[k]) for k in init)  # the update did move the weights
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac"):
        assert ds_metrics[key] == tr_metrics[key], key
    # both ranks' results came back (gathered to rank 0) in rank order
    assert set(ds_metrics["update/micro_batch_loads"]) == {"actor/rank_0", "actor/rank_1"}
    assert ds_metrics["update/micro_batch_loads"] == tr_metrics["update/micro_batch_loads"]


def test_deepspeed_launch_shares_context_gathers_results_and_reports_failures(tmp_path):
    hosts = hostfile(tmp_path, "localhost slots=2\n")
    results = run_ranks("tests._launch_ranks", {"job": "sum"}, 2, launcher="deepspeed", hostfile=hosts)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["sum"] for r in results] == [3.0, 3.0] and {r["world"] for r in results} == {2}
    # started by DeepSpeed's launcher (LOCAL_SIZE), not torchrun (TORCHELASTIC_*), one thread per rank
    assert {(r["local_size"], r["torchelastic"], r["omp_threads"]) for r in results} == {("2", False, "1")}
    # a context held by rank 1 only (as on another host) reaches rank 0, and rank 1 is the writer
    assert [r["shared"] for r in results] == [{"held_by": 1}, {"held_by": 1}]
    assert [r["writer"] for r in results] == [1, 1]
    with pytest.raises(RuntimeError) as err:
        run_ranks("tests._launch_ranks", {"fail_rank": 1}, 2, launcher="deepspeed", hostfile=hosts)
    text = str(err.value)
    assert "(deepspeed, exit code 1)" in text
    assert "--- error 1 ---" in text and "ValueError: rank 1 fails on purpose" in text
    assert text.index("--- error 1 ---") < text.index("--- stderr tail ---")


def plan_for(overrides):
    cfg = load_config("tiny-cpu", ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=15"] + overrides)
    return make_plan(cfg)


def test_bad_hostfiles_refused_by_key_and_file(tmp_path, monkeypatch):
    ds = "trainer.launcher=deepspeed"
    two = hostfile(tmp_path, "node-a slots=2\nnode-b slots=2  # comment after\n")
    plan = plan_for([ds, f"trainer.hostfile={two}", "trainer.nnodes=2"])
    assert plan["n_gpus"] == 4 and plan["nnodes"] == 2
    three = hostfile(tmp_path, "localhost slots=3\n", "three")
    bad_line = hostfile(tmp_path, "localhost 2\n", "bad_line")
    twice = hostfile(tmp_path, "h slots=1\nh slots=1\n", "twice")
    refusals = {
        "missing": ([ds, f"trainer.hostfile={tmp_path / 'nope'}"], ["trainer.hostfile=", "nope: no such file"]),
        "slots": ([ds, f"trainer.hostfile={three}"],
                  ["lists 1 host(s) with 3 slots (localhost slots=3)",
                   "trainer.nnodes × trainer.n_gpus_per_node = 1 × 2", "2 slots in all"]),
        "hosts": ([ds, f"trainer.hostfile={two}"], ["lists 2 host(s) with 4 slots", "must list 1 host(s)"]),
        "line": ([ds, f"trainer.hostfile={bad_line}"], ["line 1: 'localhost 2' is not `host slots=N`"]),
        "twice": ([ds, "trainer.nnodes=2", f"trainer.hostfile={twice}"], ["line 2: host h is listed twice"]),
        "torchrun": ([f"trainer.hostfile={two}"], ["is read by DeepSpeed's launcher only, but trainer.launcher=torchrun"]),
        "no_file": ([ds, "trainer.nnodes=2"], ["trainer.nnodes=2 with trainer.launcher=deepspeed needs trainer.hostfile"]),
    }
    for name, (overrides, parts) in refusals.items():
        with pytest.raises(PlanError) as err:
            plan_for(overrides)
        for part in parts:
            assert part in str(err.value), (name, str(err.value))
        assert "trainer.hostfile" in str(err.value), name
    # the command for two hosts: pdsh over ssh (ssh check kept), rendezvous on the first host
    entry = ["stages.ranks.entry", "stages.training.worker", "/x/ctx.json", "cuda"]
    cmd = deepspeed_command(entry, 4, two, tmp_path, 29555)
    assert cmd[1:9] == ["--hostfile", two, "--master_addr", "node-a", "--master_port", "29555", "--no_local_rank",
                        "--log_level"]
    assert "--no_ssh_check" not in cmd and "--num_gpus" not in cmd and cmd[-5:] == ["--module"] + entry
    monkeypatch.setenv("STAGERL_MASTER_ADDR", "10.0.0.7")
    cmd = deepspeed_command(entry, 2, two, tmp_path, 29555)  # 2 ranks on 2 hosts of 2 slots: 1 per host
    assert cmd[cmd.index("--master_addr") + 1] == "10.0.0.7" and cmd[cmd.index("--num_gpus") + 1] == "1"
    with pytest.raises(ValueError, match="3 ranks do not fit"):
        deepspeed_command(entry, 3, two, tmp_path, 29555)


def test_in_process_group_binds_no_port():
    """init_distributed's one-process group uses an in-memory store: even when the port it names
    in MASTER_PORT is taken (the race between choosing a free port and binding it, which failed CI
    twice beside vLLM tests and parallel workers), the group forms; a second group in the same
    process after the first is destroyed forms too. Run in a child: a process group is process-wide."""
    code = r'''
import os, socket
import torch, torch.distributed as dist
from stages.ranks import launch
taken = socket.socket(); taken.bind(("", 0)); taken.listen(1)
launch.free_port = lambda: taken.getsockname()[1]  # every port it would name is taken
for _ in range(2):
    print(launch.init_distributed("cpu"))
    t = torch.ones(2); dist.all_reduce(t); print(t.tolist())
    dist.destroy_process_group()
'''
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_PORT", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:4] == ["(0, 1)", "[1.0, 1.0]"] * 2
