"""The transformers engine: `model.generate` in this process, batched with left padding.

Reproducibility: each replica's rows are cut into generation batches of a FIXED size
(actor_rollout_ref.rollout.hf_generate_batch_size prompts × n rows) and torch's RNG is reseeded
from (engine seed, replica, batch) before each batch, so the same seed gives the same tokens in any
process. Replicas run one after another here (on CPU a second process costs more in imports than
the tiny model's generation takes)."""
from __future__ import annotations

import time

from stages.engines import EngineOptions, Generation, Sampling, derive_seed, eos_token_ids, finish, replica_shares
from stages.progress import progress


def _generation_config(model, sampling: Sampling, eos_ids: list[int], pad_id: int):
    import copy

    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens = sampling.max_new_tokens
    config.min_new_tokens = None
    config.max_length = None
    config.eos_token_id = eos_ids
    config.pad_token_id = pad_id
    config.num_return_sequences = 1
    config.num_beams = 1
    if sampling.greedy:
        config.do_sample = False
        config.temperature, config.top_p, config.top_k = None, None, None
    else:
        config.do_sample = True
        config.temperature = sampling.temperature
        config.top_p = sampling.top_p
        config.top_k = sampling.top_k if sampling.top_k > 0 else 0  # 0: no top-k warper
    return config


def _left_pad(rows: list[list[int]], pad_id: int):
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


def _generate_batch(model, rows, config, sampling: Sampling, eos_ids, device) -> list[Generation]:
    import torch

    ids, mask = _left_pad(rows, config.pad_token_id)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                         return_dict_in_generate=True, output_logits=sampling.log_probs)
    new_tokens = out.sequences[:, ids.shape[1]:].cpu()
    log_probs = None
    if sampling.log_probs:
        # Raw logits / temperature (as the logprob stage scores them); greedy uses temperature 1.
        temp = 1.0 if sampling.greedy else sampling.temperature
        logits = torch.stack(out.logits, dim=1).float().cpu() / temp  # (rows, steps, vocab)
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    return [finish(new_tokens[i].tolist(), eos_ids, sampling.max_new_tokens,
                   None if log_probs is None else log_probs[i].tolist()) for i in range(len(rows))]


def hf_generate(prompt_ids: list[list[int]], row_seeds: list[int], sampling: Sampling,
                options: EngineOptions) -> list[Generation]:
    import torch

    from stages.models import load_policy

    batch_prompts = int(options.rollout.get("hf_generate_batch_size") or 64)
    if batch_prompts < 1:
        raise ValueError(f"actor_rollout_ref.rollout.hf_generate_batch_size must be >= 1, got {batch_prompts}")
    device = "cuda" if options.device == "cuda" else "cpu"
    dtype = options.rollout.get("dtype") or "float32"
    if device == "cpu" or dtype == "auto":
        dtype = "float32"  # bf16 matmuls on CPU are slow and make greedy output differ from vLLM's
    t0 = time.perf_counter()
    model = load_policy(options.model_dir, dtype=dtype, device=device)
    eos_ids = eos_token_ids(options.model_dir)
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = eos_ids[0]
    config = _generation_config(model, sampling, eos_ids, int(pad_id))
    options.timings["engine_start_s"] = round(time.perf_counter() - t0, 4)

    rows_per_batch = batch_prompts * sampling.n
    results: list[Generation] = [None] * len(prompt_ids)
    t1 = time.perf_counter()
    with torch.inference_mode(), progress("generate", total=len(prompt_ids), unit="seq") as bar:
        for replica, share in enumerate(replica_shares(len(prompt_ids), sampling.n, options.num_replicas,
                                                       options.prompts_per_replica)):
            for batch, start in enumerate(range(share.start, share.stop, rows_per_batch)):
                stop = min(start + rows_per_batch, share.stop)
                torch.manual_seed(derive_seed(options.engine_seed, replica, batch))
                gens = _generate_batch(model, prompt_ids[start:stop], config, sampling, eos_ids, device)
                results[start:stop] = gens
                bar.update(stop - start)
    options.timings["generate_s"] = round(time.perf_counter() - t1, 4)
    return results
