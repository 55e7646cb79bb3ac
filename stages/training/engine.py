"""DeepSpeed engines of the update job: config, learning-rate schedule, state and HF export.

- ZeRO stage and precision from actor_rollout_ref.actor.deepspeed.{zero_stage,dtype} (the critic
  uses the same); bf16 keeps fp32 master weights in the ZeRO optimizer.
- verl's fsdp_config.param_offload -> zero_optimization.offload_param (ZeRO-3 only: refused
  otherwise), optimizer_offload -> offload_optimizer; the torch AdamW is kept
  (zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer off).
- gradient_accumulation_steps is 1 and the accumulation boundary is set by the caller
  (set_gradient_accumulation_boundary), so DeepSpeed never divides a loss by a step count.
- The learning rate is a pure function of the training step (verl steps its scheduler once per
  training step): it is written into the optimizer's param groups before the step's updates,
  so no scheduler state needs to be saved.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import types
from pathlib import Path

import torch

CHECKPOINT_TAG = "state"


def lr_factor(index: int, warmup_style: str, warmup_steps: int, total_steps: int | None,
              min_lr_ratio: float | None = 0.0, num_cycles: float = 0.5) -> float:
    """verl's schedules (utils/torch_functional.py) at scheduler position `index` (0 for step 1).

    constant: min(1, index / max(1, warmup)); cosine: linear warm-up, then
    max(min_lr_ratio, cos(pi * num_cycles * 2 * progress) * (1 - m)/2 + (1 + m)/2)."""
    if warmup_style == "constant":
        return min(1.0, index / max(1, warmup_steps)) if warmup_steps > 0 else 1.0
    if warmup_style != "cosine":
        raise ValueError(f"optim.warmup_style={warmup_style!r}: expected constant or cosine")
    m = 0.0 if min_lr_ratio is None else float(min_lr_ratio)
    if index < warmup_steps:
        return index / max(1, warmup_steps)
    progress = (index - warmup_steps) / max(1, total_steps - warmup_steps)
    x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
    return max(m, x * (1 - m) * 0.5 + (1 + m) * 0.5)


def step_lr(optim_cfg: dict, step: int, total_steps: int | None, key: str) -> float:
    """The learning rate of training step `step` (1-based) for an optim config section `key`."""
    from stages.training.state import total_key

    style = optim_cfg.get("warmup_style", "constant")
    warmup = optim_cfg.get("lr_warmup_steps", -1)
    ratio = optim_cfg.get("lr_warmup_steps_ratio", 0.0) or 0.0
    if total_key(optim_cfg) and not (total_steps and total_steps > 0):
        raise ValueError(f"{key}.warmup_style={style} / lr_warmup_steps_ratio={ratio} needs the number of "
                         f"training steps: set trainer.total_training_steps (got {total_steps!r})")
    if warmup is None or warmup < 0:
        warmup = int(ratio * total_steps) if ratio > 0 else 0
    factor = lr_factor(step - 1, style, warmup, total_steps, optim_cfg.get("min_lr_ratio"),
                       optim_cfg.get("num_cycles", 0.5))
    return float(optim_cfg["lr"]) * factor


def deepspeed_config(zero_stage: int, dtype: str, grad_clip: float, param_offload: bool,
                     optimizer_offload: bool, where: str) -> dict:
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"actor_rollout_ref.actor.deepspeed.zero_stage={zero_stage}: expected 1, 2 or 3")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"actor_rollout_ref.actor.deepspeed.dtype={dtype!r}: expected fp32 or bf16")
    if param_offload and zero_stage != 3:
        raise ValueError(f"{where}.param_offload=true needs ZeRO-3 (DeepSpeed offloads parameters only "
                         f"at stage 3); actor_rollout_ref.actor.deepspeed.zero_stage is {zero_stage}")
    zero = {"stage": zero_stage, "overlap_comm": False, "contiguous_gradients": True}
    if optimizer_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if param_offload:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(grad_clip) if grad_clip else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16", "check_grad_overflow": True},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def make_engine(model, optim_cfg: dict, ds_config: dict):
    """(engine, torch AdamW) over `model`'s trainable parameters."""
    import deepspeed

    from stages.ranks.deepspeed_ops import op_build_env

    op_build_env()  # DeepSpeed may load or build an op here: the prebuilt one, the environment's ninja

    params = [p for p in model.parameters() if p.requires_grad]
    betas = tuple(optim_cfg.get("betas", (0.9, 0.999)))
    optimizer = torch.optim.AdamW(params, lr=float(optim_cfg["lr"]), betas=betas,
                                  weight_decay=float(optim_cfg.get("weight_decay", 0.01)))
    stand_in_for_muon()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine, optimizer


MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


class _NotMuon:
    """Stands in for DeepSpeed's MuonWithAuxAdam: no optimizer here is one (see stand_in_for_muon)."""


def _no_muon_update(*args, **kwargs):
    raise RuntimeError("stagerl's update runs torch's AdamW: DeepSpeed's Muon update is not loaded")


def stand_in_for_muon() -> None:
    """Let engines be made and run without importing DeepSpeed's Muon optimizer modules.

    DeepSpeed's ZeRO code imports them to ask whether the optimizer is its MuonWithAuxAdam: at
    engine creation (zero.utils.is_zero_supported_optimizer) and in every gradient reduction
    (stage_1_and_2.average_tensor, _get_flat_partition_unpadded), whatever the optimizer. Those
    modules apply torch.compile decorators at import, which import torch._dynamo's compiler and
    torch._inductor: 2-2.5 s of CPU in step 1 of every run on the 2-core machine, in each rank.
    Our optimizer is always torch's AdamW, so the answer is always no: while no real Muon module
    is loaded, stand-in modules answer it (a MuonWithAuxAdam no object is an instance of; a
    muon_update that is only called for Muon parameter groups and raises). They stay for the
    process, as the reduction asks every step."""
    if not any(name in sys.modules for name in MUON_MODULES):
        optimizer, update = (types.ModuleType(name, "stagerl's stand-in: no optimizer here is Muon")
                             for name in MUON_MODULES)
        optimizer.MuonWithAuxAdam = update.MuonWithAuxAdam = _NotMuon
        update.muon_update = update.adam_update = _no_muon_update
        sys.modules.update(zip(MUON_MODULES, (optimizer, update)))


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


def rng_state() -> dict:
    """This process's RNG states (CPU, and every CUDA device when there is one): what a step
    saves into train_state and what a rank keeps beside a kept engine."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict) -> None:
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def save_state(engine, folder: Path, rank: int) -> None:
    """DeepSpeed checkpoint (module, optimizer partitions) + this rank's RNG states."""
    engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG)
    torch.save(rng_state(), Path(folder) / f"rng_rank{rank}.pt")


def load_state(engine, folder: Path, rank: int) -> None:
    folder = Path(folder)
    if not (folder / CHECKPOINT_TAG).is_dir():
        raise FileNotFoundError(f"train state {folder} has no DeepSpeed checkpoint '{CHECKPOINT_TAG}/' "
                                f"(written by the update of the previous step)")
    path, _ = engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                     load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {folder} (world size changed?)")
    rng_file = folder / f"rng_rank{rank}.pt"
    if rng_file.exists():
        restore_rng(torch.load(rng_file, weights_only=False))


def full_fp32_state_dict(engine) -> dict:
    """Every parameter's full fp32 master value (a collective: all ranks call it in order)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, param in engine.module.named_parameters():
        value = safe_get_full_fp32_param(param)
        if value is None:  # no ZeRO partitioning of this parameter
            value = param.detach()
        out[name] = value.detach().float().cpu().clone()
    return out


def export_hf(engine, out_dir: Path, rank: int, tokenizer_from=None) -> None:
    """Write an HF folder (fp32 weights, config, tokenizer) on rank 0; all ranks must call it.
    LoRA adapters (stages.model.lora) are merged into their weights: the folder is a plain model."""
    from stages.model.lora import adapter_scalings, merge_adapters

    state = merge_adapters(full_fp32_state_dict(engine), adapter_scalings(engine.module))
    if rank != 0:
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    engine.module.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
    write_model_files(out_dir, "float32", tokenizer_from)


def write_model_files(out_dir: Path, dtype: str, tokenizer_from=None) -> None:
    """After save_pretrained: config.json's dtype set to the stored tensors' (whatever the training
    dtype), the tokenizer and the generation config of the folder `tokenizer_from`."""
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer_from is not None:
        from stages.model.models import load_tokenizer

        load_tokenizer(tokenizer_from).save_pretrained(str(out_dir))
        gen = Path(os.path.expanduser(str(tokenizer_from))) / "generation_config.json"
        if gen.exists() and not (out_dir / "generation_config.json").exists():
            shutil.copy(gen, out_dir / "generation_config.json")
