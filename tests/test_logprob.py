"""logprob stage: log-probs, entropy and critic values equal a single full-batch forward in every
micro-batch mode (static / token budget x padded / packed, stages.batches.binning) on 1 and 2 real ranks;
loads and micro-batch records count the bins' real and padded tokens; stored permutation; errors."""
import pytest
import torch

from stages.batches import batching, binning

from stages import logprob

from stages.model import models
from stages.model.tiny import save_tiny_model
from storage.artifacts import read_table
from tests._logprob_rows import make_ctx, rollout_rows, write_rollout

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny", init_std=0.3)


@pytest.fixture(scope="module")
def rows(model_dir):
    return rollout_rows(models.load_tokenizer(model_dir), n_prompts=4, n=2, max_response=40, seed=0)


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
           "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=200"]
PACKED = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]
MODES = {"static-padded": [], "static-packed": PACKED, "dynamic-padded": DYNAMIC, "dynamic-packed": DYNAMIC + PACKED}
CRITIC = ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2", "trainer.seed=1"]


def seqlens_of(rows):
    return [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]


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
    assert manifest["extra"]["permutation"] == batching.balance_partitions(seqlens_of(rows), 1)[0]
    # one sequence per tensor row, each micro-batch padded to its longest sequence
    lens = [seqlens_of(rows)[i] for i in manifest["extra"]["permutation"]]
    chunks = [lens[0:3], lens[3:6], lens[6:8]]
    assert loads[0]["padded_tokens"] == sum(len(c) * max(c) for c in chunks)
    assert loads[0]["packed"] is False and loads[0]["token_budget"] is None


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_one_rank_equals_full_batch(tmp_path, model_dir, rows, full_batch, mode):
    """Static / token budget x padded / packed: the same values as the reference forward; loads
    and records count the bins the stage ran (static packed bins here hold several sequences)."""
    ctx, manifest, table = run_stage(tmp_path, model_dir, rows, MODES[mode] + CRITIC + [f"critic.model.path={model_dir}"])
    for key in ("old_log_probs", "entropy", "values"):
        assert_close(table.column(key).to_pylist(), full_batch[key])
    assert_close(table.column("ref_log_probs").to_pylist(), full_batch["old_log_probs"])
    dynamic, packed = mode.startswith("dynamic"), mode.endswith("packed")
    lens = [seqlens_of(rows)[i] for i in manifest["extra"]["permutation"]]
    micro = binning.micro_batches(lens, rows_per_micro=3, budget=200, dynamic=dynamic, packed=packed)
    if mode == "static-packed":  # a token budget's runs share rows only where a sequence fits
        assert any(len(b) > 1 for mb in micro for b in mb)
    if not packed:
        assert all(len(b) == 1 for mb in micro for b in mb)
    expected = binning.micro_batch_load(lens, micro)
    for role in ("actor", "ref"):
        (load,) = manifest["extra"]["loads"][role]
        assert {k: load[k] for k in expected} == expected
        assert (load["packed"], load["token_budget"]) == (packed, 200 if dynamic else None)
        (records,) = manifest["extra"]["micro_batches"][role]
        assert records["rows"] == [[manifest["extra"]["permutation"][i] for i in binning.rows_of(mb)]
                                   for mb in micro]
        assert sum(records["padded_tokens"]) == load["padded_tokens"]
        assert sum(records["real_tokens"]) == load["real_tokens"] == sum(lens)
    if dynamic:
        assert all(p <= 200 for p in manifest["extra"]["micro_batches"]["actor"][0]["padded_tokens"])


@pytest.mark.parametrize("mode", list(MODES))
def test_two_ranks_equal_full_batch(tmp_path, model_dir, rows, full_batch, mode):
    """Real torchrun with 2 gloo ranks; PPO (gae) so the critic's values come back too."""
    extra = MODES[mode] + CRITIC + [f"critic.model.path={model_dir}"]
    ctx, manifest, table = run_stage(tmp_path, model_dir, rows, extra, ranks=2)
    assert manifest["extra"]["world"] == 2
    assert_close(table.column("old_log_probs").to_pylist(), full_batch["old_log_probs"])
    assert_close(table.column("entropy").to_pylist(), full_batch["entropy"])
    assert_close(table.column("ref_log_probs").to_pylist(), full_batch["old_log_probs"])
    assert_close(table.column("values").to_pylist(), full_batch["values"])
    parts = batching.balance_partitions(seqlens_of(rows), 2)
    assert manifest["extra"]["permutation"] == parts[0] + parts[1]
    assert table.column("rank").to_pylist() == [0 if i in parts[0] else 1 for i in range(8)]
    assert [x["rows"] for x in manifest["extra"]["loads"]["critic"]] == [4, 4]
    for rank, part in enumerate(parts):
        records = manifest["extra"]["micro_batches"]["actor"][rank]
        assert sorted(i for r in records["rows"] for i in r) == sorted(part)
        assert sum(records["real_tokens"]) == sum(seqlens_of(rows)[i] for i in part)
    # both ranks run the same (all-reduced when dynamic) number of micro-batches
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
    from stages.batches.binning import collate_bins, rows_of

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
