"""The transformers engine: `model.generate`, batched with left padding.

Reproducibility: a replica's rows are cut into generation batches of a FIXED size
(actor_rollout_ref.rollout.hf_generate_batch_size prompts × n rows) and torch's RNG is reseeded
from (engine seed, replica, batch) before each batch, so the same seed gives the same tokens in any
process, whether the engine was just started or has served earlier steps. New weights are copied
into the loaded model in place (load_weights: safetensors -> load_state_dict), so a run loads the
model once; on a GPU, sleep() moves it to host memory while the update trains."""
from __future__ import annotations

import time
from pathlib import Path

from stages.engines import Engine, EngineSpec, Generation, Sampling, derive_seed, eos_token_ids, finish
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

    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(lengths.max())
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]  # each row's last len(r) cells
    ids[mask] = torch.tensor([t for r in rows for t in r], dtype=torch.long)  # row-major: in order
    return ids, mask.long()


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


class HFEngine(Engine):
    START_KEYS = ("dtype", "free_cache_engine")

    def __init__(self):
        self.model = None
        self.device = "cpu"
        self.eos_ids: list[int] = []
        self.pad_id = 0
        self.asleep = False

    def start(self, spec: EngineSpec) -> dict:
        from stages.model.models import load_policy

        t0 = time.perf_counter()
        self.device = "cuda" if spec.device == "cuda" else "cpu"
        dtype = spec.setting("dtype") or "float32"
        if self.device == "cpu" or dtype == "auto":
            dtype = "float32"  # bf16 matmuls on CPU are slow and make greedy output differ from vLLM's
        self.model = load_policy(spec.model_dir, dtype=dtype, device=self.device)
        self._read_ids(spec.model_dir)
        return {"engine_start_s": round(time.perf_counter() - t0, 4)}

    def _read_ids(self, model_dir) -> None:
        self.eos_ids = eos_token_ids(model_dir)
        pad = self.model.generation_config.pad_token_id
        self.pad_id = int(self.eos_ids[0] if pad is None else pad)

    def load_weights(self, model_dir) -> dict:
        """Copy the folder's tensors into the loaded model (same architecture: the config and the
        parameter names must match; a mismatch raises naming the folder)."""
        import torch
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        state = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            state.update(load_file(str(file)))
        if not state:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors weights to load")
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: the embedding is the head
        with torch.no_grad():
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"{model_dir}: weights do not fit the running model (missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}): another architecture "
                             f"needs a new engine")
        self._read_ids(model_dir)
        return {"load_weights_s": round(time.perf_counter() - t0, 4)}

    def load_tensors(self, named) -> dict:
        """Copy (name, tensor) pairs, the trainer's parameters, into the loaded model in place (the
        update's memory handoff, stages.training.handoff): every parameter must be given once."""
        import torch

        t0 = time.perf_counter()
        params = dict(self.model.named_parameters())
        seen = set()
        with torch.no_grad():
            for name, value in named:
                if name not in params:
                    raise ValueError(f"handed-over weight {name!r} is not a parameter of the running model "
                                     f"(another architecture needs a new engine)")
                params[name].copy_(value)
                seen.add(name)
        if seen != set(params):
            raise ValueError(f"the handed-over weights miss {sorted(set(params) - seen)[:5]}")
        return {"load_weights_s": round(time.perf_counter() - t0, 4)}

    def named_weights(self) -> dict:
        """The served parameters by name (what a stored version of them holds)."""
        return dict(self.model.named_parameters())

    def generate(self, prompt_ids, seeds, sampling: Sampling, replica: int, step_seed: int,
                 rollout: dict) -> list[Generation]:
        import torch

        batch_prompts = int(rollout.get("hf_generate_batch_size") or 64)
        if batch_prompts < 1:
            raise ValueError(f"actor_rollout_ref.rollout.hf_generate_batch_size must be >= 1, got {batch_prompts}")
        self.wake()
        config = _generation_config(self.model, sampling, self.eos_ids, self.pad_id)
        rows_per_batch = batch_prompts * sampling.n
        results: list[Generation] = []
        with torch.inference_mode(), progress("generate", total=len(prompt_ids), unit="seq") as bar:
            for batch, start in enumerate(range(0, len(prompt_ids), rows_per_batch)):
                stop = min(start + rows_per_batch, len(prompt_ids))
                torch.manual_seed(derive_seed(step_seed, replica, batch))
                results += _generate_batch(self.model, prompt_ids[start:stop], config, sampling,
                                           self.eos_ids, self.device)
                bar.update(stop - start)
        return results

    def sleep(self) -> None:
        if self.device == "cuda" and not self.asleep:
            import torch

            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.model.to(self.device)
            self.asleep = False

    def stop(self) -> None:
        self.model = None
