"""The models: loading policy/critic/tokenizer and their per-token forwards, real architectures
with random weights, the tiny in-process model, LoRA adapters, the supervised warm start.
"""
