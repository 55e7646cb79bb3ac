"""Every shipped config (configs/*.yaml but base.yaml) trains 2 steps on the CPU with the tiny
model in place of its model, through `stagerl train` against a real Prefect server.

Only what a CPU and a test cannot hold is substituted: the model folders (actor, critic), the data
files (tiny arithmetic data; GSM8K-format data for a GSM8K config, converted the way
`stagerl data gsm8k` does), the device and dtypes, and the shape (4 prompts x 2 samples, short
sequences, one rank). The algorithm is the config's own: estimator, critic, KL settings, rollout
engine. GRPO without KL and seed A's PPO with a critic (verl's defaults: no KL loss, no KL in
reward) once crashed in their first update with KeyError 'ref_log_probs'."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from _prefect_server import PrefectServer
from configs.loader import load_config
from storage.artifacts import read_manifest, read_table
from storage.layout import STAGES, RunLayout
from storage.store import Store

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml") if p.stem != "base")


def cpu_substitutions(assets: Path, root: Path, gsm8k: bool) -> list:
    data = "gsm8k" if gsm8k else "arith"
    return [f"actor_rollout_ref.model.path={assets}/model", f"critic.model.path={assets}/model",
            f"data.train_files={assets}/{data}-train.parquet", f"data.val_files={assets}/{data}-test.parquet",
            f"storage.root={root}", f"storage.cache_dir={root}/cache", "trainer.device=cpu",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.logger=[console]",
            "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "warmstart.enable=false",
            "actor_rollout_ref.actor.deepspeed.dtype=fp32", "actor_rollout_ref.rollout.dtype=float32",
            "actor_rollout_ref.rollout.enforce_eager=true", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.max_num_seqs=16", "actor_rollout_ref.rollout.max_num_batched_tokens=512",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=128",
            "data.truncation=left", "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "reward.num_workers=1"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from stages.data.tools import gsm8k_rows, write_arith_dataset, write_rows
    from stages.model.tiny import save_tiny_model

    base = tmp_path_factory.mktemp("shipped")
    save_tiny_model(base / "model")
    write_arith_dataset(base / "arith-train.parquet", n=16)
    write_arith_dataset(base / "arith-test.parquet", n=4, split="test")
    records = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}"} for a, b in
               [(3, 4), (5, 2), (7, 1), (2, 2), (6, 3), (1, 8), (4, 4), (9, 0)]]
    write_rows(gsm8k_rows(records, "train"), base / "gsm8k-train.parquet")
    write_rows(gsm8k_rows(records[:4], "test"), base / "gsm8k-test.parquet")
    return base


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with PrefectServer(tmp_path_factory.mktemp("prefect-home")) as srv:
        yield srv


@pytest.mark.parametrize("config, engine", [*((c, None) for c in CONFIGS), ("tiny-cpu", "hf")])
def test_shipped_config_trains_two_steps_on_cpu(config, engine, assets, server, tmp_path):
    """Each shipped config (tiny-cpu samples with the resident vLLM engine; and tiny-cpu with the
    hf fallback): 2 steps on the CPU."""
    gsm8k = "gsm8k" in str(load_config(config, [])["data"]["train_files"])
    overrides = cpu_substitutions(assets, tmp_path / "runs", gsm8k)
    if engine:
        overrides.append(f"actor_rollout_ref.rollout.name={engine}")
    dapo = load_config(config, overrides)["algorithm"]["filter_groups"]["enable"]
    if dapo:  # an untrained model gets every arithmetic answer wrong: every group would be filtered
        (tmp_path / "vary.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                          "    return float(len(solution_str) % 2)\n")
        overrides.append(f"custom_reward_function.path={tmp_path / 'vary.py'}")
    cfg = load_config(config, overrides)
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "--config", config, *overrides],
                            cwd=REPO, env=server.env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]
    store, layout = Store.from_config(cfg["storage"]), RunLayout.from_config(cfg)
    for step in (1, 2):
        for stage in STAGES:
            assert read_manifest(store, layout, step, stage), (step, stage, out[-3000:])
    assert read_manifest(store, layout, 2, "rollout")["extra"]["engine"] == cfg["actor_rollout_ref"]["rollout"]["name"]
    if dapo:  # dynamic sampling kept train_batch_size varied groups and stored every answer
        for step in (1, 2):
            extra = read_manifest(store, layout, step, "rollout")["extra"]["filter_groups"]
            assert extra["kept_prompts"] == 4 and extra["generated_rows"] >= 8, extra
    logprob = read_table(store, layout, 2, "logprob").schema.names
    kl = cfg["actor_rollout_ref"]["actor"]["use_kl_loss"] or cfg["algorithm"]["use_kl_in_reward"]
    assert ("ref_log_probs" in logprob) == bool(kl)  # no KL: no reference pass (as verl)
    critic = cfg["algorithm"]["adv_estimator"] == "gae" or cfg["critic"]["enable"]
    assert ("values" in logprob) == bool(critic)
    if critic:
        assert store.exists(f"{layout.critic_weights(2)}/_manifest.json")
