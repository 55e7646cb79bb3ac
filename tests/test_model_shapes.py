"""Real architectures with random weights (`stagerl model qwen2.5-0.5b`): the published sizes, and a
folder every stage can load (checked here with one layer: the same code path, 0.3 GB instead of 1)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from stages.model.shapes import ARCHITECTURES, parameter_count

REPO = Path(__file__).resolve().parent.parent


def qwen_parameters(hidden, inter, layers, heads, kv_heads, vocab, tied):
    """Embedding (+ LM head when untied) + per layer: q,k,v with biases, o without, gate/up/down,
    2 RMSNorms; + the final norm."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden + 3 * hidden * inter + 2 * hidden
    return vocab * hidden * (1 if tied else 2) + layers * layer + hidden


def test_published_sizes():
    # Qwen2.5's model cards: 0.49B, 1.54B, 7.61B parameters
    assert parameter_count("qwen2.5-0.5b") == qwen_parameters(896, 4864, 24, 14, 2, 151936, True) == 494_032_768
    assert parameter_count("qwen2.5-1.5b") == qwen_parameters(1536, 8960, 28, 12, 2, 151936, True) == 1_543_714_304
    assert parameter_count("qwen2.5-7b") == qwen_parameters(3584, 18944, 28, 28, 4, 152064, False) == 7_615_616_512
    assert parameter_count("qwen2.5-0.5b", num_layers=1) == qwen_parameters(896, 4864, 1, 14, 2, 151936, True)


def test_cli_writes_a_folder_the_stages_load(tmp_path):
    from stages.model.models import load_policy, load_tokenizer

    out = tmp_path / "qwen-1-layer"
    run = subprocess.run([sys.executable, "-m", "flows.cli", "model", "qwen2.5-0.5b", "--out", str(out),
                          "--num-layers", "1", "--dtype", "bf16"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"qwen2.5-0.5b (random weights) in {out}: 151,047,936 params, BF16" in run.stdout
    config = json.loads((out / "config.json").read_text())
    shape = ARCHITECTURES["qwen2.5-0.5b"]
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                   "vocab_size", "tie_word_embeddings")} == {
        k: shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                              "vocab_size", "tie_word_embeddings")}
    assert config["num_hidden_layers"] == 1
    tokenizer = load_tokenizer(out)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < config["vocab_size"] and tokenizer.pad_token_id is not None
    model = load_policy(out, "bf16")
    assert model.dtype == torch.bfloat16
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 151936) and torch.isfinite(logits).all()
    bad = subprocess.run([sys.executable, "-m", "flows.cli", "model", "qwen2.5-0.5b", "--out", str(tmp_path / "x"),
                          "--num-layers", "0"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert bad.returncode == 2 and "--num-layers must be >= 1, got 0" in bad.stderr
