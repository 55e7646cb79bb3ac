"""update stage: DeepSpeed ZeRO job, exact loss scaling, state continuity, metrics (issue 6).

Inputs are built by hand (tests/_update_inputs.py): a tiny model and random responses with skewed
lengths. One 2-rank launch in this file (it costs 6-13 s); everything else runs in-process."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from _update_inputs import make_ctx, write_inputs
from stages import update
from stages.model.tiny import save_tiny_model
from storage.artifacts import read_file, read_table

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(__import__("stages.ranks.deepspeed_ops", fromlist=["x"]).DEFAULT_DIR))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def run_update(tmp_path, model_dir, overrides=(), step=1, critic=False, **inputs):
    ctx = make_ctx(tmp_path, model_dir, step, overrides)
    write_inputs(ctx, critic=critic, **inputs)
    manifest = update.run(ctx)
    metrics = read_file(ctx.store, ctx.layout, step, "update", "update/metrics.json")
    weights = ctx.store.path(ctx.layout.weights(step))
    return ctx, manifest, metrics, load_file(os.path.join(weights, "model.safetensors"))


# The key bias's exact gradient is 0 (softmax is invariant to adding q.b to every score of a row),
# so its computed gradient is float noise (~1e-10) that Adam's first step normalises to +-lr:
# it is compared only inside the all-parameter norm.
ZERO_GRADIENT = "self_attn.k_proj.bias"


def rel_diff(a: dict, b: dict) -> float:
    """Largest per-tensor ||a - b|| / ||b|| (tensors with a real gradient)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a if ZERO_GRADIENT not in k)


def global_rel_diff(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all parameters together."""
    va, vb = (torch.cat([t[k].flatten() for k in sorted(a)]) for t in (a, b))
    return float((va - vb).norm() / vb.norm())


def update_diff(a: dict, b: dict, init: dict) -> float:
    """Relative difference of the parameter updates a - init vs b - init (all tensors together)."""
    da = torch.cat([(a[k] - init[k]).flatten() for k in init])
    db = torch.cat([(b[k] - init[k]).flatten() for k in init])
    return float((da - db).norm() / db.norm())


STATIC_1 = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]
STATIC_3 = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
BUDGET = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=45"]


PACKED = ["actor_rollout_ref.model.use_remove_padding=true"]


def test_gradient_invariance_micro_batches_and_ranks(tmp_path, model_dir):
    """token-mean: 1 micro-batch == static micro-batches (padded, and packed into bins with
    use_remove_padding) == token-budget micro-batches == 2 ranks."""
    init = load_file(str(model_dir / "model.safetensors"))
    runs = {}
    for name, ov in (("one", STATIC_1), ("static", STATIC_3), ("static_packed", STATIC_3 + PACKED),
                     ("budget", BUDGET), ("two_ranks", BUDGET + ["trainer.n_gpus_per_node=2"])):
        ctx, _, metrics, weights = run_update(tmp_path / name, model_dir, ov)
        table = read_table(ctx.store, ctx.layout, 1, "update").to_pydict()
        runs[name] = (metrics, weights, table)
    one_metrics, one_weights, one_table = runs["one"]
    assert len(one_table["micro_batch"]) == 1
    assert len(runs["static"][2]["micro_batch"]) == 2
    # packed: the same rows per micro-batch (in bin order), no more padded tokens than one per row
    static, packed = runs["static"][2], runs["static_packed"][2]
    assert [sorted(r) for r in packed["rows"]] == [sorted(r) for r in static["rows"]]
    assert sum(packed["padded_tokens"]) <= sum(static["padded_tokens"])
    assert packed["real_tokens"] == static["real_tokens"]
    budget_rows = runs["budget"][2]["rows"]
    assert len(budget_rows) >= 2 and sorted(sum(budget_rows, [])) == list(range(8))
    assert set(runs["two_ranks"][2]["rank"]) == {0, 1}
    # the splits differ in tokens per row, so a row-weighted (verl legacy) mean would differ
    for name in ("static", "static_packed", "budget", "two_ranks"):
        metrics, weights, _ = runs[name]
        assert math.isclose(metrics["actor/grad_norm"], one_metrics["actor/grad_norm"], rel_tol=1e-5), name
        assert math.isclose(metrics["actor/pg_loss"], one_metrics["actor/pg_loss"], rel_tol=1e-5, abs_tol=1e-7), name
        assert global_rel_diff(weights, one_weights) <= 1e-5, name
        assert rel_diff(weights, one_weights) <= 1e-5, name
        assert update_diff(weights, one_weights, init) <= 1e-3, name


def test_every_parameter_changes_and_metrics(tmp_path, model_dir):
    """PPO with a critic on ZeRO-3: every actor parameter moves; verl's metric names are present."""
    ov = STATIC_3 + ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4",
                     "actor_rollout_ref.actor.deepspeed.zero_stage=3", "actor_rollout_ref.actor.use_kl_loss=true",
                     "actor_rollout_ref.actor.entropy_coeff=0.01"]
    ctx, manifest, metrics, weights = run_update(tmp_path, model_dir, ov, critic=True)
    init = load_file(str(model_dir / "model.safetensors"))
    assert weights.keys() == init.keys()
    for name, tensor in init.items():
        assert tensor.shape == weights[name].shape
        assert not torch.equal(tensor, weights[name]), f"{name} did not change"
        assert weights[name].dtype == torch.float32
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy",
                "actor/kl_loss", "actor/grad_norm", "actor/lr", "actor/skipped_steps", "critic/vf_loss",
                "critic/vf_clipfrac", "critic/grad_norm", "critic/lr", "timing/launch_s", "timing/rank_train_s",
                "update/micro_batch_loads"):
        assert key in metrics, key
    assert metrics["actor/lr"] == pytest.approx(1e-3) and metrics["actor/skipped_steps"] == 0
    assert metrics["actor/ppo_kl"] == 0.0  # on-policy shortcut: ratio == 1 exactly
    assert metrics["actor/entropy"] > 0 and metrics["critic/vf_loss"] > 0
    assert set(metrics["update/micro_batch_loads"]) == {"actor/rank_0", "critic/rank_0"}
    store = ctx.store
    for key in (ctx.layout.critic_weights(1), f"{ctx.layout.train_state}/step_000001/actor",
                f"{ctx.layout.train_state}/step_000001/critic"):
        assert store.exists(f"{key}/_manifest.json"), key
    exported = store.read_bytes(f"{ctx.layout.weights(1)}/tokenizer.json")  # the tokenizer goes along
    assert exported == (model_dir / "tokenizer.json").read_bytes()
    table = read_table(store, ctx.layout, 1, "update").to_pydict()
    assert sum(table["real_tokens"]) == 2 * metrics["update/micro_batch_loads"]["actor/rank_0"]["real_tokens"]
    assert all(p >= r for p, r in zip(table["padded_tokens"], table["real_tokens"]))
    assert manifest["stage"] == "update"


def test_two_updates_from_train_state_equal_one_process(tmp_path, model_dir):
    """Step 1 and step 2 as two jobs (state through train_state/) == both in one process, bit for bit."""
    from stages.ranks.launch import init_distributed
    from stages.training.worker import UpdateJob

    ov = STATIC_3 + ["actor_rollout_ref.actor.optim.warmup_style=cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps=0"]
    # two jobs
    run_update(tmp_path / "jobs", model_dir, ov, step=1)
    ctx2, _, metrics2, two_jobs = run_update(tmp_path / "jobs", model_dir, ov, step=2)
    # one process, the same inputs
    c1 = make_ctx(tmp_path / "one", model_dir, 1, ov)
    c2 = make_ctx(tmp_path / "one", model_dir, 2, ov)
    write_inputs(c1)
    write_inputs(c2)
    init_distributed("cpu")
    job = UpdateJob(c1, 0, 1)
    first = job.train_step(c1)["metrics"]
    second = job.train_step(c2)["metrics"]
    job.export(tmp_path / "one" / "export")
    one_process = load_file(str(tmp_path / "one" / "export" / "actor_hf" / "model.safetensors"))
    assert first["actor/lr"] == 1e-3 and second["actor/lr"] == pytest.approx(1e-3 * (1 + math.cos(math.pi / 10)) / 2)
    assert metrics2["actor/lr"] == second["actor/lr"]
    assert metrics2["actor/grad_norm"] == second["actor/grad_norm"]
    for name in one_process:
        assert torch.equal(one_process[name], two_jobs[name]), name


def test_non_finite_gradient_skips_the_step(tmp_path, model_dir):
    ctx, _, metrics, weights = run_update(tmp_path, model_dir, STATIC_3, nan_advantage=True)
    assert metrics["actor/skipped_steps"] == 1
    init = load_file(str(model_dir / "model.safetensors"))
    assert all(torch.equal(init[k], weights[k]) for k in init)


def test_bf16_exports_fp32_master_weights_and_refuses_bad_offload(tmp_path, model_dir):
    _, _, metrics, weights = run_update(tmp_path, model_dir, STATIC_3 + ["actor_rollout_ref.actor.deepspeed.dtype=bf16"])
    assert all(t.dtype == torch.float32 for t in weights.values())
    config = json.loads(open(os.path.join(tmp_path, "store", "stagerl", "tiny-cpu", "weights", "step_000001",
                                          "config.json")).read())
    assert config["dtype"] == "float32"
    # fp32 master weights are not bf16-representable values everywhere
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in weights.values())
    ctx = make_ctx(tmp_path / "bad", model_dir, 1, STATIC_3 + ["actor_rollout_ref.actor.fsdp_config.param_offload=true"])
    write_inputs(ctx)
    with pytest.raises(ValueError, match="param_offload=true needs ZeRO-3"):
        update.run(ctx)


def test_lr_schedule_matches_verl():
    from stages.training.engine import lr_factor, step_lr

    assert lr_factor(0, "constant", 4, None) == 0.0 and lr_factor(2, "constant", 4, None) == 0.5
    assert lr_factor(9, "constant", 4, None) == 1.0 and lr_factor(0, "constant", 0, None) == 1.0
    # cosine, 2 warm-up of 10 steps, floor 0.1: halfway through the decay -> (1 + 0.1) / 2
    assert lr_factor(6, "cosine", 2, 10, 0.1) == pytest.approx(0.55)
    assert lr_factor(10, "cosine", 2, 10, 0.1) == pytest.approx(0.1)
    optim = {"lr": 2.0, "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.5, "warmup_style": "constant"}
    assert step_lr(optim, 2, 4, "x.optim") == 1.0  # warm-up 2 steps; step 2 is position 1
    with pytest.raises(ValueError, match="trainer.total_training_steps"):
        step_lr(optim, 1, None, "x.optim")


def test_microbatches_parquet_holds_the_logprob_stage_micro_batches(tmp_path, model_dir, capsys):
    """The logprob stage's micro-batches (per role, per rank) land in microbatches.parquet as role
    logprob/<role>; their sums are the logprob manifest's per-rank loads (its load line). Two
    mini-batches, so the plan keeps the old-log-prob (actor) pass."""
    from stages import logprob

    ov = STATIC_3 + ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                     "actor_rollout_ref.actor.use_kl_loss=true",
                     "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                     "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=64",
                     "critic.forward_micro_batch_size_per_gpu=3"]
    ctx = make_ctx(tmp_path, model_dir, 1, ov)
    write_inputs(ctx, critic=True)
    lp_manifest = logprob.run(ctx)  # replaces the hand-made logprob table (one rank, in-process)
    update.run(ctx)
    rollout = read_table(ctx.store, ctx.layout, 1, "rollout").to_pydict()
    seqlen = [len(p) + len(r) for p, r in zip(rollout["prompt_ids"], rollout["response_ids"])]
    table = read_table(ctx.store, ctx.layout, 1, "update").to_pylist()
    assert {r["role"] for r in table} == {"actor", "critic", "logprob/actor", "logprob/ref", "logprob/critic"}
    lines = capsys.readouterr().out
    for role in ("actor", "ref", "critic"):
        recs = [r for r in table if r["role"] == f"logprob/{role}"]
        assert all(r["epoch"] == 0 and r["mini_batch"] is None and r["rank"] == 0 for r in recs)
        assert [r["micro_batch"] for r in recs] == list(range(len(recs)))
        assert sorted(i for r in recs for i in r["rows"]) == list(range(8))
        for r in recs:
            assert r["real_tokens"] == sum(seqlen[i] for i in r["rows"]) <= r["padded_tokens"]
        (load,) = lp_manifest["extra"]["loads"][role]
        assert load["rows"] == 8 and load["micro_batches"] == len(recs)
        assert load["real_tokens"] == sum(r["real_tokens"] for r in recs) == sum(seqlen)
        assert load["padded_tokens"] == sum(r["padded_tokens"] for r in recs)
        assert load["max_tokens_per_micro_batch"] == max(r["padded_tokens"] for r in recs)
        assert f"logprob step 1 {role} rank 0: 8 rows, {len(recs)} micro-batches, {sum(seqlen):,} tokens" in lines
    sizes = lambda role: [len(r["rows"]) for r in table if r["role"] == role]  # noqa: E731
    assert sizes("logprob/ref") == [8] and sizes("logprob/critic") == [3, 3, 2]  # static micro-batches
    assert all(r["padded_tokens"] <= 64 for r in table if r["role"] == "logprob/actor")  # token budget
    assert len(sizes("logprob/actor")) >= 2


def test_update_forward_replaces_the_old_log_prob_pass(tmp_path, model_dir):
    """One mini-batch, one epoch, no KL in reward: the plan drops the logprob stage's actor pass
    and the update uses its own forward, detached, as old log-probs (verl's and TRL's on-policy
    path). Against the two-pass version (a real logprob-stage pass first, its old_log_probs read
    by the update) the losses, gradient norm and new weights agree within 1e-6, and the old
    log-probs the update stored equal the pass's."""
    from stages import logprob

    fused_ctx = make_ctx(tmp_path / "fused", model_dir, overrides=STATIC_3)
    assert fused_ctx.plan["rollout"]["old_log_prob_pass"] is False and fused_ctx.plan["ref"] is None
    write_inputs(fused_ctx)
    two_ctx = make_ctx(tmp_path / "two", model_dir, overrides=STATIC_3)
    two_ctx.plan["rollout"]["old_log_prob_pass"] = True  # force the separate pass ...
    two_ctx.plan["actor"]["on_policy"] = False  # ... and make the update read its output
    write_inputs(two_ctx)
    logprob.run(two_ctx)  # the real pass replaces the inputs' random old log-probs

    fused = update.run(fused_ctx)
    two = update.run(two_ctx)
    assert "update/log_probs.parquet" in fused["files"] and "update/log_probs.parquet" not in two["files"]
    m_fused, m_two = (read_file(c.store, c.layout, 1, "update", "update/metrics.json") for c in (fused_ctx, two_ctx))
    assert abs(m_fused["actor/pg_loss"] - m_two["actor/pg_loss"]) <= 1e-6
    assert math.isclose(m_fused["actor/grad_norm"], m_two["actor/grad_norm"], rel_tol=1e-6)
    assert m_fused["actor/ppo_kl"] == 0.0 and abs(m_two["actor/ppo_kl"]) <= 1e-6
    w_fused, w_two = (load_file(os.path.join(c.store.path(c.layout.weights(1)), "model.safetensors"))
                      for c in (fused_ctx, two_ctx))
    assert global_rel_diff(w_fused, w_two) <= 1e-6

    stored = read_file(fused_ctx.store, fused_ctx.layout, 1, "update", "update/log_probs.parquet").to_pydict()
    passed = read_table(two_ctx.store, two_ctx.layout, 1, "logprob").to_pydict()
    flat = lambda col: torch.tensor([v for row in col for v in row])
    assert torch.allclose(flat(stored["old_log_probs"]), flat(passed["old_log_probs"]), atol=1e-5)
    assert torch.allclose(flat(stored["entropy"]), flat(passed["entropy"]), atol=1e-5)
    # the logprob stage of the fused run ran no pass: its table has only each row's rank ...
    assert logprob.run(fused_ctx)["extra"]["passes"] == []
    assert read_table(fused_ctx.store, fused_ctx.layout, 1, "logprob").schema.names == ["rank"]
    # ... and inspect / show / query read the update's old log-probs as the step's logprob table
    from storage.query import connect
    from storage.run_view import RunView

    view = RunView(fused_ctx.store, fused_ctx.layout)
    assert view.table(1, "logprob").column("old_log_probs").to_pylist() == stored["old_log_probs"]
    con = connect(view)
    n = con.sql("select count(*) from logprob where len(old_log_probs) = len(entropy)").fetchall()[0][0]
    assert n == fused_ctx.plan["rows_per_step"]


def test_forward_values_travel_as_float32_bytes_and_come_back_in_row_order():
    """A rank's forward values (stages.training.forward_values) go through its JSON result as
    float32 bytes: the table puts them back in rollout row order, every value as the float32 it
    was, and refuses a row no rank sent."""
    import numpy as np

    from stages.training.forward_values import pack, table

    values = {row: np.float32([0.1 * row + k / 7 for k in range(row % 3 + 1)]) for row in range(5)}
    ranks = [[3, 0, 4], [1, 2]]  # balanced partitions need not be in order
    results = [{"log_probs": json.loads(json.dumps(pack(rows, [values[r] for r in rows], [-values[r] for r in rows])))}
               for rows in ranks]
    got = table(results, 5).to_pydict()
    assert got["old_log_probs"] == [values[r].tolist() for r in range(5)]
    assert got["entropy"] == [(-values[r]).tolist() for r in range(5)]
    assert [len(v) for v in got["old_log_probs"]] == [1, 2, 3, 1, 2]
    with pytest.raises(RuntimeError, match=r"rows \[4\] got no forward log-probs"):
        table([{"log_probs": pack([3, 0], [values[3], values[0]], [values[3], values[0]])}, results[1]], 5)


def test_gradient_checkpointing_is_on_and_changes_no_result(tmp_path, model_dir):
    """model.enable_gradient_checkpointing (actor and critic): the trained modules recompute their
    layers in backward (transformers' non-reentrant checkpointing), and weights and metrics equal
    those of a run without it, bit for bit."""
    from stages.ranks.launch import init_distributed
    from stages.training.worker import UpdateJob

    ov = STATIC_3 + ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4"]
    on = ["actor_rollout_ref.model.enable_gradient_checkpointing=true", "critic.model.enable_gradient_checkpointing=true"]
    off = ["actor_rollout_ref.model.enable_gradient_checkpointing=false", "critic.model.enable_gradient_checkpointing=false"]
    ctx = make_ctx(tmp_path / "probe", model_dir, 1, ov + on)
    init_distributed("cpu")
    job = UpdateJob(ctx, 0, 1)
    assert [(r.name, r.engine.module.is_gradient_checkpointing) for r in job.roles] == [("critic", True), ("actor", True)]
    assert not any(r.engine.module.is_gradient_checkpointing for r in UpdateJob(make_ctx(tmp_path / "p2", model_dir, 1, ov + off), 0, 1).roles)
    ctx_on, _, m_on, w_on = run_update(tmp_path / "on", model_dir, ov + on, critic=True)
    ctx_off, _, m_off, w_off = run_update(tmp_path / "off", model_dir, ov + off, critic=True)
    assert w_on.keys() == w_off.keys() and all(torch.equal(w_on[k], w_off[k]) for k in w_on)
    critic_on, critic_off = (load_file(os.path.join(c.store.path(c.layout.critic_weights(1)), "model.safetensors"))
                             for c in (ctx_on, ctx_off))
    assert all(torch.equal(critic_on[k], critic_off[k]) for k in critic_on)
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert m_on[key] == m_off[key], key


MUON_CHECK = r"""
import sys, torch
from stages.ranks.launch import init_distributed
from stages.training.engine import MUON_MODULES, deepspeed_config, make_engine

def train(stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    engine, _ = make_engine(model, {"lr": 0.05}, deepspeed_config(stage, "fp32", 1.0, False, False, "t"))
    for i in range(3):
        x = torch.linspace(-1, 1, 24).reshape(4, 6) * (i + 1)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    return [p.detach().clone() for p in model.parameters()]

init_distributed("cpu")
with_stand_in = {stage: train(stage) for stage in (1, 2)}
print("stand-in", type(sys.modules[MUON_MODULES[0]].MuonWithAuxAdam).__name__,
      sys.modules[MUON_MODULES[0]].__doc__.startswith("stagerl"), "torch._inductor.compile_fx" in sys.modules)
for name in MUON_MODULES:  # now DeepSpeed's own Muon modules, as without the stand-in
    del sys.modules[name]
import deepspeed.runtime.zero.muon.muon_optimizer
for stage in (1, 2):
    real = train(stage)
    assert all(torch.equal(a, b) for a, b in zip(with_stand_in[stage], real)), stage
    torch.manual_seed(0)
    initial = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    assert not any(torch.equal(a, b) for a, b in zip(real, initial.parameters())), "nothing trained"
print("equal", "torch._inductor.compile_fx" in sys.modules)
"""


def test_engines_skip_deepspeeds_muon_import_and_train_the_same(tmp_path):
    """stages.training.engine.stand_in_for_muon: the ZeRO-1/2 engines never import DeepSpeed's Muon
    modules (whose torch.compile decorators import torch._inductor's compiler: seconds in step 1),
    and train bit-identically to engines that did import them."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-c", MUON_CHECK], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("stand-in", "equal"))]
    assert lines == ["stand-in type True False", "equal True"], out.stdout[-2000:]
