"""Update base-cost profile: where the 720-row GRPO update of the peer bench's work spends its time,
stagerl's train step (stages.training.worker.UpdateJob.train_step: reading the rows, forward and
loss, DeepSpeed backward, optimizer step) beside a plain PyTorch loop of the same math (what TRL's
trainer runs: padded batch, forward, log-softmax gather, clipped loss, backward, clip, AdamW),
in one process, interleaved, fastest and median of --repeat. Writes bench/results/update_profile.json.

    python bench/update_profile.py [--repeat 5] [--micro-batches 120 360 720] [--zero 0 1 2]

The work: the demo's tiny model (flows.demo.MODEL_OPTIONS), 720 rows of 16 prompt + 16 response
tokens, one mini-batch, token-mean loss, no KL, fp32, one rank, OMP_NUM_THREADS=2 (as the peer
bench). --zero runs stagerl's engine at other ZeRO stages too (0: DeepSpeed without ZeRO), to
show what ZeRO's bookkeeping costs at world 1. --torch-profile prints torch.profiler's table of
one stagerl train step at the largest micro-batch."""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
ROWS, PROMPT, RESPONSE = 720, 16, 16


def overrides(micro: int) -> list[str]:
    a = "actor_rollout_ref.actor"
    return [f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}", "data.train_batch_size=60",
            "actor_rollout_ref.rollout.n=12", f"{a}.ppo_mini_batch_size=60", f"{a}.ppo_micro_batch_size_per_gpu={micro}",
            f"{a}.use_kl_loss=false", "algorithm.use_kl_in_reward=false", f"{a}.loss_agg_mode=token-mean",
            f"{a}.entropy_coeff=0.0", f"{a}.deepspeed.dtype=fp32", "trainer.n_gpus_per_node=1",
            "algorithm.adv_estimator=grpo", f"{a}.ppo_epochs=1", f"{a}.grad_clip=1.0"]


def stagerl_job(work: Path, model: Path, micro: int, zero: int):
    import numpy as np

    import stages.training.engine as engine_mod
    from _update_inputs import make_ctx, write_inputs
    from stages.training.worker import UpdateJob

    ctx = make_ctx(work / f"mb{micro}-z{zero}", model, 1, overrides(micro))
    write_inputs(ctx, seed=7, response_lengths=lambda rng, rows, m: np.full(rows, RESPONSE))
    configured = engine_mod.deepspeed_config

    def at_stage(*args, **kwargs):
        cfg = configured(*args, **kwargs)
        cfg["zero_optimization"] = {"stage": 0} if zero == 0 else {**cfg["zero_optimization"], "stage": zero}
        return cfg

    engine_mod.deepspeed_config = at_stage
    try:
        job = UpdateJob(ctx, 0, 1)
    finally:
        engine_mod.deepspeed_config = configured
    parts = collections.defaultdict(float)

    def timed(obj, name, key):
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                parts[key] += time.perf_counter() - t
        setattr(obj, name, wrapper)

    engine = job.actor.engine
    timed(engine, "backward", "backward")
    timed(engine, "step", "optimizer_step")
    timed(job.actor, "loss", "forward_and_loss")
    timed(job, "rank_rows", "read_rows")
    job.train_step(ctx)  # warm-up
    parts.clear()

    def step():
        parts["_calls"] += 1
        job.train_step(ctx)
    return step, parts, job, ctx


def plain_loop(model: Path, micro: int):
    """TRL's math in plain PyTorch: padded [rows, 32], forward, gather, clipped loss, backward,
    clip_grad_norm_, AdamW (torch's default implementation on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    ids = torch.randint(10, 500, (ROWS, PROMPT + RESPONSE))
    mask = torch.ones_like(ids)
    adv = torch.randn(ROWS, 1)

    def step():
        for s in range(0, ROWS, micro):
            sl = slice(s, s + micro)
            logits = m(input_ids=ids[sl], attention_mask=mask[sl], logits_to_keep=RESPONSE + 1).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[sl, PROMPT:, None]).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())
            loss = -torch.min(ratio * adv[sl], torch.clamp(ratio, 0.8, 1.2) * adv[sl])
            (loss.sum() / (ROWS * RESPONSE)).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    step()
    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[120, 360, 720])
    parser.add_argument("--zero", type=int, nargs="+", default=[2], help="stagerl ZeRO stages (0: none)")
    parser.add_argument("--torch-profile", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "update_profile.json")
    args = parser.parse_args()
    import torch

    from flows.demo import MODEL_OPTIONS
    from stages.model.tiny import save_tiny_model
    from stages.ranks.launch import init_distributed

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    init_distributed("cpu")
    work = Path(tempfile.mkdtemp(prefix="stagerl-update-profile-"))
    model = save_tiny_model(work / "model", **MODEL_OPTIONS)
    out = {"bench": "update_profile", "rows": ROWS, "tokens_per_row": PROMPT + RESPONSE,
           "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
           "machine": f"{os.cpu_count()} CPUs", "load_avg_1m_start": round(os.getloadavg()[0], 2), "results": {}}
    for micro in args.micro_batches:
        sides = {"plain_torch": (plain_loop(model, micro), None)}
        for zero in args.zero:
            step, parts, job, ctx = stagerl_job(work, model, micro, zero)
            sides[f"stagerl_zero{zero}"] = (step, parts)
        times = {name: [] for name in sides}
        for _ in range(args.repeat):  # interleaved
            for name, (step, _) in sides.items():
                t = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t)
        row = {}
        for name, (step, parts) in sides.items():
            row[name] = {"median_s": round(statistics.median(times[name]), 4), "min_s": round(min(times[name]), 4)}
            if parts:
                calls = parts.pop("_calls")
                row[name]["parts_s"] = {k: round(v / calls, 4) for k, v in parts.items()}
        base = row["plain_torch"]["median_s"]
        for name in row:
            row[name]["ratio_vs_plain"] = round(row[name]["median_s"] / base, 3)
        out["results"][f"mb{micro}"] = row
        print(f"micro-batch {micro}: " + json.dumps(row), flush=True)
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            job.train_step(ctx)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    out["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
