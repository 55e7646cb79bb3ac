"""logprob stage: values equal a single full-batch forward (static and token-budget micro-batches,
1 and 2 real ranks), entropy, critic values, stored permutation, and clear errors."""
import pytest
import torch

from stages import batching, logprob, models
from stages.tiny_model import save_tiny_model
from storage.artifacts import read_table
from tests._logprob_rows import make_ctx, rollout_rows, write_rollout

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny", init_std=0.3)


@pytest.fixture(scope="module")
def rows(model_dir):
    return rollout_rows(models.load_tokenizer(model_dir), n_prompts=4, n=2, max_response=16, seed=0)


@pytest.fixture(scope="module")
def full_batch(model_dir, rows):
    """Reference values: one forward over all rows with full logits (no micro-batches)."""
    model = models.load_policy(model_dir)
    batch = batching.collate(rows, pad_id=0)
    with torch.no_grad():
        logp, logits = models.full_vocab_log_probs(model, batch)
        log_softmax = torch.log_softmax(logits, -1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        critic = models.load_critic(model_dir, seed=1)
        values = models.response_values(critic, batch)
    lengths = batch["response_lengths"]
    return {"old_log_probs": batching.unpad(logp, lengths), "entropy": batching.unpad(entropy, lengths),
            "values": batching.unpad(values, lengths)}


def assert_close(got, expected, tol=TOL):
    assert [len(r) for r in got] == [len(r) for r in expected]
    worst = max(abs(a - b) for g, e in zip(got, expected) for a, b in zip(g, e))
    assert worst <= tol, f"max abs difference {worst}"


def run_stage(tmp_path, model_dir, rows, overrides=(), ranks=1):
    ctx = make_ctx(tmp_path / "store", model_dir, overrides, ranks=ranks)
    write_rollout(ctx, rows)
    manifest = logprob.run(ctx)
    return ctx, manifest, read_table(ctx.store, ctx.layout, 1, "logprob")


DYNAMIC = ["actor_rollout_ref.actor.use_dynamic_bsz=true",
           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64"]


def test_static_one_rank_equals_full_batch(tmp_path, model_dir, rows, full_batch, capsys):
    ctx, manifest, table = run_stage(tmp_path, model_dir, rows)
    assert table.num_rows == 8
    assert_close(table.column("old_log_probs").to_pylist(), full_batch["old_log_probs"])
    assert_close(table.column("entropy").to_pylist(), full_batch["entropy"])
    # use_kl_loss is on in tiny-cpu: the reference is the same initial folder at step 1
    assert_close(table.column("ref_log_probs").to_pylist(), full_batch["old_log_probs"])
    assert "values" not in table.column_names
    loads = manifest["extra"]["loads"]["actor"]
    assert [(x["rows"], x["micro_batches"]) for x in loads] == [(8, 3)]  # 3 + 3 + 2 rows
    assert "logprob step 1 actor rank 0: 8 rows, 3 micro-batches" in capsys.readouterr().out
    assert manifest["extra"]["permutation"] == batching.balance_partitions(
        [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows], 1)[0]


def test_dynamic_one_rank_equals_full_batch(tmp_path, model_dir, rows, full_batch):
    ctx, manifest, table = run_stage(tmp_path, model_dir, rows, DYNAMIC)
    assert ctx.plan["rollout"]["log_prob_use_dynamic_bsz"] is True
    assert_close(table.column("old_log_probs").to_pylist(), full_batch["old_log_probs"])
    assert_close(table.column("entropy").to_pylist(), full_batch["entropy"])
    seqlens = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    load = manifest["extra"]["loads"]["actor"][0]
    expected = batching.token_budget_micro_batches(seqlens, 64)
    assert load["micro_batches"] == len(expected) > 1
    assert load["real_tokens"] == sum(seqlens)


PACKED = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]


def test_packed_static_one_rank_equals_full_batch(tmp_path, model_dir, rows, full_batch):
    """use_remove_padding: each micro-batch is one unpadded sequence; same values, no padding."""
    ctx, manifest, table = run_stage(tmp_path, model_dir, rows, PACKED)
    assert_close(table.column("old_log_probs").to_pylist(), full_batch["old_log_probs"])
    assert_close(table.column("entropy").to_pylist(), full_batch["entropy"])
    load = manifest["extra"]["loads"]["actor"][0]
    assert load["packed"] is True and load["padded_tokens"] == load["real_tokens"]
    assert load["padding_fraction"] == 0.0


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic-packed"])
def test_two_ranks_equal_full_batch(tmp_path, model_dir, rows, full_batch, dynamic):
    """Real torchrun with 2 gloo ranks; PPO (gae) so the critic's values come back too."""
    extra = ["algorithm.adv_estimator=gae", f"critic.model.path={model_dir}",
             "critic.ppo_micro_batch_size_per_gpu=2", "trainer.seed=1"] + (PACKED if dynamic else [])
    ctx, manifest, table = run_stage(tmp_path, model_dir, rows, (DYNAMIC if dynamic else []) + extra,
                                     ranks=2)
    assert manifest["extra"]["world"] == 2
    assert_close(table.column("old_log_probs").to_pylist(), full_batch["old_log_probs"])
    assert_close(table.column("entropy").to_pylist(), full_batch["entropy"])
    assert_close(table.column("ref_log_probs").to_pylist(), full_batch["old_log_probs"])
    assert_close(table.column("values").to_pylist(), full_batch["values"])
    seqlens = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    parts = batching.balance_partitions(seqlens, 2)
    assert manifest["extra"]["permutation"] == parts[0] + parts[1]
    assert table.column("rank").to_pylist() == [0 if i in parts[0] else 1 for i in range(8)]
    assert [x["rows"] for x in manifest["extra"]["loads"]["critic"]] == [4, 4]
    if dynamic:  # both ranks run the same (all-reduced) number of micro-batches
        counts = [x["micro_batches"] for x in manifest["extra"]["loads"]["actor"]]
        assert counts[0] == counts[1]


def test_temperature_divides_logits(tmp_path, model_dir, rows):
    ctx, _, table = run_stage(tmp_path, model_dir, rows, ["actor_rollout_ref.rollout.temperature=2.0"])
    model = models.load_policy(model_dir)
    batch = batching.collate(rows, pad_id=0)
    with torch.no_grad():
        logp, _ = models.full_vocab_log_probs(model, batch, temperature=2.0)
    assert_close(table.column("old_log_probs").to_pylist(), batching.unpad(logp, batch["response_lengths"]))


def test_chunked_log_probs_are_differentiable(model_dir, rows):
    model = models.load_policy(model_dir)
    batch = batching.collate(rows[:3], pad_id=0)
    chunked, _ = models.response_log_probs(model, batch, chunk_size=5)
    full, _ = models.full_vocab_log_probs(model, batch)
    chunked.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full.sum().backward()
    for g, p in zip(grads, model.parameters()):
        # float32 sums in another order: equal within 1e-5 of the largest gradient entry
        assert (g - p.grad).abs().max() <= 1e-5 * max(1.0, float(p.grad.abs().max()))


def test_token_budget_below_longest_sequence(tmp_path, model_dir, rows):
    ctx = make_ctx(tmp_path / "store", model_dir, DYNAMIC)
    write_rollout(ctx, rows)
    ctx.plan["rollout"]["log_prob_max_token_len_per_gpu"] = 20  # below any row (the plan refuses it too)
    seqlens = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    longest = max(seqlens)
    with pytest.raises(ValueError, match=rf"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=20 "
                                         rf"is below the longest sequence: row {seqlens.index(longest)} "
                                         rf"has {longest} tokens"):
        logprob.run(ctx)


def test_missing_model_folder(tmp_path, model_dir, rows):
    ctx = make_ctx(tmp_path / "store", tmp_path / "no-such-model")
    write_rollout(ctx, rows)
    with pytest.raises(FileNotFoundError, match="no-such-model does not exist"):
        logprob.run(ctx)
    with pytest.raises(FileNotFoundError, match="critic model folder .*nowhere does not exist"):
        models.load_critic(tmp_path / "nowhere")


def test_step_two_reads_actor_and_critic_weights_from_the_store(tmp_path, model_dir, rows):
    """Step k > 1: the actor is weights/step_{k-1}, the critic weights/critic_step_{k-1}."""
    from storage.weights import save_folder, save_weights

    critic_dir = tmp_path / "critic"
    models.load_critic(model_dir, seed=7).save_pretrained(critic_dir)
    extra = ["algorithm.adv_estimator=gae", f"critic.model.path={tmp_path / 'unused'}",
             "critic.ppo_micro_batch_size_per_gpu=2", "algorithm.use_kl_in_reward=false",
             "actor_rollout_ref.actor.use_kl_loss=false"]
    ctx = make_ctx(tmp_path / "store", model_dir, extra, step=2)
    save_weights(ctx.store, ctx.layout, 1, model_dir)
    save_folder(ctx.store, critic_dir, ctx.layout.critic_weights(1))
    write_rollout(ctx, rows)
    logprob.run(ctx)
    table = read_table(ctx.store, ctx.layout, 2, "logprob")
    assert "ref_log_probs" not in table.column_names
    batch = batching.collate(rows, pad_id=0)
    with torch.no_grad():
        values = models.response_values(models.load_critic(critic_dir), batch)
        fresh = models.response_values(models.load_critic(model_dir, seed=1), batch)
    assert_close(table.column("values").to_pylist(), batching.unpad(values, batch["response_lengths"]))
    assert not torch.allclose(values, fresh)


def test_vocab_projection_runs_in_chunks(model_dir, rows):
    """No call of the output layer sees more than chunk_size positions (no full-vocab logits of
    the whole micro-batch); the result equals the unchunked one."""
    model = models.load_policy(model_dir)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, inp, out: seen.append(out.shape))
    batch = batching.collate(rows, pad_id=0)
    with torch.no_grad():
        chunked, _ = models.response_log_probs(model, batch, chunk_size=7)
    hook.remove()
    assert seen and all(s[0] <= 7 for s in seen)
    assert sum(s[0] for s in seen) == batch["response_width"] * len(rows)
    with torch.no_grad():
        full, _ = models.full_vocab_log_probs(model, batch)
    assert torch.allclose(chunked, full, atol=TOL)


def test_binned_layout_equals_the_full_batch(model_dir, rows, full_batch):
    """binning.collate_bins (the update's token-budget layout: several whole sequences per tensor
    row, positions restarting per sequence) gives the same log-probs, entropy and values as the
    reference forward; bins do hold more than one sequence here."""
    from stages.binning import collate_bins, rows_of

    model, critic = models.load_policy(model_dir), models.load_critic(model_dir, seed=1)
    assert len(rows) == 8
    micro = [[[0, 1, 2], [3]], [[4, 5], [6, 7]]]  # micro-batches of bins of row indices
    got = {"old_log_probs": {}, "entropy": {}, "values": {}}
    for mb in micro:
        batch = collate_bins([[rows[i] for i in b] for b in mb], pad_id=0)
        assert batch["padded_tokens"] == batch["input_ids"].numel()
        assert batch["real_tokens"] == sum(len(rows[i]["prompt_ids"]) + len(rows[i]["response_ids"])
                                           for i in rows_of(mb))
        with torch.no_grad():
            logp, entropy = models.response_log_probs(model, batch, with_entropy=True, chunk_size=7)
            values = models.response_values(critic, batch)
        n = batch["response_lengths"]
        for key, t in (("old_log_probs", logp), ("entropy", entropy), ("values", values)):
            got[key].update(zip(rows_of(mb), batching.unpad(t, n)))
    for key in got:
        assert_close([got[key][i] for i in range(len(rows))], full_batch[key])
