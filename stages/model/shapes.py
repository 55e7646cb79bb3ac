"""Models of a real architecture with random weights, built without a hub (`stagerl model NAME`).

What a GPU user runs is a 0.5B-72B model; a tiny model says nothing about memory or speed at that
size. These are the published shapes (each model's config.json on its Hugging Face model card),
built as a Qwen2ForCausalLM with random weights (normal, std = initializer_range) and the tiny BPE
tokenizer (stages/model/tiny.py), whose ids fit any of these vocabularies, so every stage runs on
them; only the text is meaningless. Real weights go in by path: `actor_rollout_ref.model.path`
pointing at a downloaded HF folder (e.g. `huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct`).
"""
from __future__ import annotations

from pathlib import Path

# name -> Qwen2Config fields (hidden size, layers, heads, KV heads, MLP width, vocabulary rows,
# tied input/output embeddings, RoPE base, context, norm epsilon), from the Qwen2.5 model cards
ARCHITECTURES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6),
}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def shaped_config(name: str, tokenizer=None, num_layers: int | None = None):
    """The Qwen2Config of architecture `name` (num_layers: fewer layers, same widths)."""
    from transformers import Qwen2Config

    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    fields = dict(ARCHITECTURES[name])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1, got {num_layers}")
        fields["num_hidden_layers"] = num_layers
    ids = {}
    if tokenizer is not None:
        from stages.model.tiny import ENDOFTEXT, IM_END

        ids = dict(eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
                   pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT), bos_token_id=None)
    return Qwen2Config(**fields, **ids, head_dim=fields["hidden_size"] // fields["num_attention_heads"],
                       use_sliding_window=False, max_window_layers=fields["num_hidden_layers"],
                       initializer_range=0.02)


def parameter_count(name: str, num_layers: int | None = None) -> int:
    """Parameters of the architecture (counted on the meta device: no memory, no time)."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(shaped_config(name, num_layers=num_layers))
    return sum(p.numel() for p in model.parameters())


def save_shaped_model(name: str, out_dir, dtype: str = "bf16", seed: int = 0,
                      num_layers: int | None = None) -> Path:
    """Build architecture `name` with random weights in `dtype` (bf16 | fp32) and the tiny
    tokenizer, and write an HF folder."""
    import torch
    from transformers import Qwen2ForCausalLM

    from stages.model.tiny import ENDOFTEXT, IM_END, train_tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    tokenizer = train_tokenizer()
    config = shaped_config(name, tokenizer, num_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(getattr(torch, DTYPES[dtype]))
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(IM_END),
                                            tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    model.generation_config.bos_token_id = None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def describe(name: str, model_dir) -> str:
    """One line about a saved folder: parameters and dtype read from the safetensors headers."""
    import json

    from stages.model.tiny import safetensors_summary

    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text())
    n_params, dtypes, size = safetensors_summary(folder)
    return (f"{name} (random weights) in {folder}: {n_params:,} params, {'/'.join(sorted(dtypes))}, "
            f"{size / 2**30:.2f} GiB; hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
            f"{config['num_attention_heads']} heads / {config['num_key_value_heads']} KV heads, "
            f"vocab {config['vocab_size']}, tied embeddings {config['tie_word_embeddings']}")
