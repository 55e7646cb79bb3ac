"""LoRA for the update (verl's `model.lora_rank`, `lora_alpha`, `target_modules`), with PEFT.

- `add_adapters(model, model_cfg)`: inject LoRA layers (r = lora_rank, scale lora_alpha / r, no
  dropout) into the plain Hugging Face model in place (peft.inject_adapter_in_model) and freeze
  every other parameter, so the DeepSpeed optimizer holds AdamW states for the adapters only. The
  model stays a transformers model: every forward helper (stages/model/models.py) works unchanged. A
  critic's value head (`score`) is not adapted but stays trainable: it starts from random.
- The adapters start as an identity (PEFT initialises lora_B to zero), so step 1 samples from the
  base model and the reference policy (the base model, adapters off) is the initial weights
  folder the logprob stage already reads (ctx.reference_weights()): no second copy is trained or kept.
- `merge_adapters(state, model)`: the exported HF folder has merged weights W + (alpha/r)·B·A under
  the base model's own names, so the rollout engines (hf and vLLM) and every later stage load a
  plain model. train_state keeps the unmerged module and the adapters' optimizer states: resume
  continues exactly.
"""
from __future__ import annotations

VALUE_HEAD = "score"  # transformers' *ForTokenClassification head: the critic's value head


def lora_rank(model_cfg: dict) -> int:
    return int((model_cfg or {}).get("lora_rank") or 0)


def add_adapters(model, model_cfg: dict):
    """`model` with LoRA layers injected (in place) and only they (and a value head) trainable."""
    from peft import LoraConfig, inject_adapter_in_model

    rank = lora_rank(model_cfg)
    targets = model_cfg.get("target_modules") or "all-linear"
    config = LoraConfig(r=rank, lora_alpha=model_cfg.get("lora_alpha", 16), target_modules=targets,
                        lora_dropout=0.0, bias="none",
                        exclude_modules=[VALUE_HEAD] if hasattr(model, VALUE_HEAD) else None)
    model = inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad = ".lora_" in name or name.startswith(f"{VALUE_HEAD}.")
    if not any(".lora_" in name for name, _ in model.named_parameters()):
        raise ValueError(f"target_modules={targets!r} matched no module of the model: no LoRA adapter was added")
    return model


def adapter_scalings(model) -> dict:
    """{module name: alpha / r} of every LoRA layer of `model`."""
    out = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and "default" in scaling and hasattr(module, "lora_A"):
            out[name] = float(scaling["default"])
    return out


def merge_adapters(state: dict, scalings: dict) -> dict:
    """A state dict under the base model's names with every adapter merged into its weight:
    `X.base_layer.weight` + scaling(X) · `X.lora_B.default.weight` @ `X.lora_A.default.weight`
    becomes `X.weight`; `X.base_layer.bias` becomes `X.bias`; the lora_* tensors are dropped."""
    if not scalings:
        return state
    out = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." in key:
            module, _, leaf = key.partition(".base_layer.")
            if leaf == "weight":
                a, b = state[f"{module}.lora_A.default.weight"], state[f"{module}.lora_B.default.weight"]
                value = value + scalings[module] * (b.float() @ a.float()).to(value.dtype)
            key = f"{module}.{leaf}"
        out[key] = value
    return out
