"""Optional supervised warm start (`warmstart.enable`): a short fine-tune of the initial model on the
training prompts with their ground-truth answers as responses, run once before step 1.

It is a stage like the others, recorded under step 0: it writes weights/step_000000 (what step 1
samples from, and the reference policy) and then its manifest (warmstart/metrics.json), so a
resumed run skips it when it is complete. A from-scratch tiny model cannot produce the answer
format at all; a few hundred supervised steps teach the format and some answers, and RL does the
rest (`make demo`).

Multi-turn (actor_rollout_ref.rollout.multi_turn.enable): a row whose extra_info holds a
demonstration (`warmstart.demonstration_key`: its assistant turns, e.g. a tool call, then the
answer) is trained on as a whole trajectory, built exactly as the agent loop builds one
(stages.engines.agent_loop.demonstrations): the tool calls are run by the real tools of
multi_turn.tool_config_path and their tool turns appended as the loop appends them, with the loss
on the assistant tokens only (`configs/tools-tiny-cpu.yaml`). Other rows use response_template."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

STAGE = "warmstart"
INPUTS = ()
CONFIG_KEYS = ("warmstart", "data", "actor_rollout_ref.model", "trainer.seed")
MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"
STEP = 0


def stage_fingerprint(ctx) -> str:
    if not _multi_turn(ctx):  # (only when on: a single-turn warm start keeps its fingerprint)
        return ctx.fingerprint(STAGE, CONFIG_KEYS, INPUTS)
    from stages.rollout import _tool_config_digest
    from storage.artifacts import fingerprint as hash_obj

    base = ctx.fingerprint(STAGE, CONFIG_KEYS + (MULTI_TURN, "data.max_response_length"), INPUTS)
    return hash_obj({"base": base, "tool_config": _tool_config_digest(ctx)})  # the tools' file content


def _multi_turn(ctx) -> bool:
    return bool(ctx.get(f"{MULTI_TURN}.enable"))


def _examples(ctx, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(ids, labels: -100 where no loss) for every training prompt that has a ground truth: the
    prompt + response_template + EOS, or (multi-turn) the row's demonstrated trajectory."""
    from stages.data.dataset import RLDataset

    dataset = RLDataset(ctx.cfg["data"], tokenizer, split="train", fallback_seed=ctx.get("trainer.seed"),
                        chat_template=ctx.get("actor_rollout_ref.model.custom_chat_template"))
    template = ctx.get("warmstart.response_template")
    demo_key = ctx.get("warmstart.demonstration_key") if _multi_turn(ctx) else None
    eos = tokenizer.eos_token_id
    out, demos = [], []
    for row in dataset.rows:
        if demo_key and row.extra_info.get(demo_key):
            demos.append(row)
            continue
        if row.ground_truth is None:
            continue
        response = tokenizer.encode(template.format(ground_truth=row.ground_truth), add_special_tokens=False)
        prompt = list(row.prompt_ids)
        out.append((prompt + response + [eos], [-100] * len(prompt) + response + [eos]))
    if demos:
        out += _trajectories(ctx, tokenizer, demos, demo_key, eos)
    if not out:
        raise ValueError(f"warmstart: no training row of {ctx.get('data.train_files')} has a ground truth")
    return out


def _trajectories(ctx, tokenizer, rows, key: str, eos: int) -> list:
    """The demonstrated trajectories of `rows` (extra_info[key]: the assistant turns), their tool
    turns answered by the run's tools as the agent loop's are."""
    from stages.engines.agent_loop import LoopSettings, demonstrations
    from stages.rollout import ROLLOUT, rollout_tools

    template_kwargs = dict(ctx.get("data.apply_chat_template_kwargs") or {})
    if ctx.get("actor_rollout_ref.model.custom_chat_template"):
        template_kwargs["chat_template"] = ctx.get("actor_rollout_ref.model.custom_chat_template")
    settings = LoopSettings.from_rollout(dict(ctx.get(ROLLOUT) or {}), int(ctx.get("data.max_response_length")))
    turns = []
    for row in rows:
        value = row.extra_info[key]
        turns.append([value] if isinstance(value, str) else list(value))
    tools, owned = rollout_tools(ctx)
    try:
        return demonstrations(tokenizer, [r.prompt_ids for r in rows], turns, tools, settings, eos,
                              tools_kwargs=[dict(r.extra_info.get("tools_kwargs") or {}) for r in rows],
                              template_kwargs=template_kwargs, keys=[f"warmstart-{r.row}" for r in rows])
    finally:
        if owned:
            tools.close()


def _lm_batch(examples, pad_id: int):
    import torch

    width = max(len(seq) for seq, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (seq, target) in enumerate(examples):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, :len(seq)] = torch.tensor(target)
    return ids, mask, labels


def run(ctx) -> dict:
    import torch

    from stages.model.models import load_policy, load_tokenizer
    from storage.artifacts import write_stage
    from storage.weights import save_weights

    t0 = time.perf_counter()
    seed = ctx.seed(STAGE)
    torch.manual_seed(seed)
    source = ctx.reference_weights(initial=True)
    tokenizer = load_tokenizer(source)
    model = load_policy(source)
    model.train()
    examples = _examples(ctx, tokenizer)
    steps, batch_size = ctx.get("warmstart.steps"), ctx.get("warmstart.batch_size")
    optimizer = torch.optim.AdamW(model.parameters(), lr=ctx.get("warmstart.lr"), weight_decay=0.0)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        picked = rng.choice(len(examples), size=min(batch_size, len(examples)), replace=False)
        ids, mask, labels = _lm_batch([examples[i] for i in picked], tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model"
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        gen = Path(source) / "generation_config.json"
        if gen.exists() and not (out / "generation_config.json").exists():
            (out / "generation_config.json").write_bytes(gen.read_bytes())
        save_weights(ctx.store, ctx.layout, STEP, out)
    metrics = {"warmstart/loss_first": losses[0], "warmstart/loss_last": losses[-1],
               "warmstart/steps": steps, "warmstart/examples": len(examples)}
    return write_stage(ctx.store, ctx.layout, STEP, STAGE, {"warmstart/metrics.json": metrics},
                       fingerprint=stage_fingerprint(ctx),
                       timings={"compute_s": round(time.perf_counter() - t0, 3)}, extra={"metrics": metrics})


def enabled(cfg) -> bool:
    return bool(cfg.get("warmstart", {}).get("enable"))


if __name__ == "__main__":  # pragma: no cover - manual use: python -m stages.model.warmstart CONFIG [overrides]
    import sys

    from configs.loader import load_config
    from configs.suggest import make_plan
    from stages.context import StageContext

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = load_config(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2:])
    print(run(StageContext.create(cfg, make_plan(cfg), STEP))["extra"])
