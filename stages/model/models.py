"""Loading the policy, tokenizer and critic from local HF folders, and the per-token forward passes
every stage shares (log-probs, entropy, values) on batches laid out by stages.batches.binning.collate_bins
(every stage's micro-batches) or stages.batches.batching.collate (verl's padded layout, the reference).

Alignment (verl): the logit at position t predicts token t+1, so response token j (column P+j)
is scored by the hidden state at column P+j-1; values use the same position (dp_critic:
values[:, -R-1:-1])."""
from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
DEFAULT_CHUNK = 1024  # positions per vocab projection


def _dtype(dtype):
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_model_folder(path, what: str = "model") -> Path:
    """The folder as a Path, or FileNotFoundError naming it (and what is missing)."""
    folder = Path(str(path)).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{what} folder {folder} does not exist (set the {what} path to a local "
                                f"Hugging Face folder, e.g. one made by `stagerl model tiny --out DIR`)")
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{what} folder {folder} has no config.json: not a Hugging Face model folder")
    return folder


def _quiet_transformers():
    """No per-load progress bars or 'newly initialised head' reports in stage logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_tokenizer(path):
    from transformers import AutoTokenizer

    folder = check_model_folder(path, "tokenizer")
    tok = AutoTokenizer.from_pretrained(str(folder))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def decode_batch(tokenizer, id_lists, skip_special_tokens: bool) -> list[str]:
    """tokenizer.batch_decode(id_lists, skip_special_tokens=...), the same strings, through the
    Rust tokenizer's own batch decode when the Python layer would add nothing to it (a fast
    tokenizer, no clean-up of tokenization spaces): batch_decode converts and checks every id
    in Python first, ~2x the whole decode of a step's 720 short responses."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if getattr(tokenizer, "clean_up_tokenization_spaces", True) or not hasattr(backend, "decode_batch"):
        return tokenizer.batch_decode(id_lists, skip_special_tokens=skip_special_tokens)
    return backend.decode_batch([list(ids) for ids in id_lists], skip_special_tokens=skip_special_tokens)


def load_policy(path, dtype="float32", device="cpu"):
    """AutoModelForCausalLM from a local folder, in eval mode."""
    from transformers import AutoModelForCausalLM

    folder = check_model_folder(path, "policy model")
    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=_dtype(dtype))
    return model.to(device).eval()


def load_critic(path, dtype="float32", device="cpu", seed=0):
    """AutoModelForTokenClassification(num_labels=1) as verl's critic (no classifier dropout).
    From a causal-LM folder the value head is new: it is initialised here from `seed` (normal,
    std = initializer_range, bias 0) so the same folder and seed give the same critic."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    folder = check_model_folder(path, "critic model")
    _quiet_transformers()
    config = AutoConfig.from_pretrained(str(folder))
    config.num_labels = 1
    config.classifier_dropout = 0.0
    if hasattr(config, "dropout"):
        config.dropout = 0.0
    model, info = AutoModelForTokenClassification.from_pretrained(
        str(folder), config=config, dtype=_dtype(dtype), output_loading_info=True)
    head = _value_head(model)
    missing = set(info.get("missing_keys", ()))
    if head is not None and any(k.split(".")[0] == _head_name(model) for k in missing):
        gen = torch.Generator().manual_seed(int(seed))
        std = getattr(config, "initializer_range", 0.02)
        with torch.no_grad():
            w = torch.randn(head.weight.shape, generator=gen, dtype=torch.float32) * std
            head.weight.copy_(w.to(head.weight.dtype))
            if head.bias is not None:
                head.bias.zero_()
    return model.to(device).eval()


def _head_name(model) -> str:
    for name in ("score", "classifier"):
        if hasattr(model, name):
            return name
    return ""


def _value_head(model):
    name = _head_name(model)
    return getattr(model, name) if name else None


# ---- forward passes --------------------------------------------------------------------------
def _hidden_states(model, batch):
    """Last hidden states (bs, L, H) of the decoder without the vocab projection."""
    base = getattr(model, model.base_model_prefix, None)
    out = base(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
               position_ids=batch["position_ids"], use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _chunk_stats(head, hidden, targets, temperature: float, with_entropy: bool, with_sum_pi_squared: bool = False,
                 entropy_grad: bool = True):
    logits = head(hidden).float() / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    # Σ_v π_v² = exp(logsumexp(2·logits) - 2·logsumexp(logits)) (verl calculate_sum_pi_squared_from_logits)
    sum_pi_squared = torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * lse) if with_sum_pi_squared else None
    return logp, entropy, sum_pi_squared


def response_log_probs(model, batch, temperature: float = 1.0, with_entropy: bool = False,
                       chunk_size: int = DEFAULT_CHUNK, entropy_grad: bool = True):
    """(log_probs, entropy or None): response_stats without Σπ²."""
    log_probs, entropy, _ = response_stats(model, batch, temperature, with_entropy, chunk_size=chunk_size,
                                           entropy_grad=entropy_grad)
    return log_probs, entropy


def response_stats(model, batch, temperature: float = 1.0, with_entropy: bool = False,
                   chunk_size: int = DEFAULT_CHUNK, with_sum_pi_squared: bool = False, entropy_grad: bool = True):
    """(log_probs (bs, R), entropy (bs, R) or None, Σ_v π_v² (bs, R) or None) of the response
    tokens under `model`, logits divided by `temperature`. The vocab projection runs over at most
    `chunk_size` positions at a time (never a full-vocab log-softmax of the whole micro-batch); with gradients each chunk is
    recomputed in backward (activation checkpointing), so memory follows the chunk.
    entropy_grad=False: the entropy is a metric only (no entropy term in the loss), computed
    outside the autograd graph. Padded
    response positions are 0. `batch` from binning.collate_bins (whole sequences in tensor rows,
    attention kept inside each sequence by restarting position_ids) or batching.collate."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if batch.get("flat"):  # binning.collate_bins: sequences back to back in rows, positions vary
        hidden = _hidden_states(model, batch)
        flat_h = hidden.reshape(-1, hidden.shape[-1])[batch["pred_index"]]
        flat_t = batch["targets"]
    else:
        P, R = batch["prompt_width"], batch["response_width"]
        hidden = _hidden_states(model, batch)[:, P - 1:P + R - 1]  # predicts columns P..P+R-1
        flat_h = hidden.reshape(-1, hidden.shape[-1])
        flat_t = batch["input_ids"][:, P:P + R].reshape(-1)
    head = model.get_output_embeddings()
    use_ckpt = torch.is_grad_enabled() and flat_h.requires_grad
    step = max(1, int(chunk_size))
    logps, ents, pi2s = [], [], []
    for s in range(0, flat_h.shape[0], step):
        h, t = flat_h[s:s + step], flat_t[s:s + step]
        if use_ckpt:
            from torch.utils.checkpoint import checkpoint

            lp, en, p2 = checkpoint(_chunk_stats, head, h, t, temperature, with_entropy, with_sum_pi_squared,
                                    entropy_grad, use_reentrant=False)
        else:
            lp, en, p2 = _chunk_stats(head, h, t, temperature, with_entropy, with_sum_pi_squared, entropy_grad)
        logps.append(lp)
        if with_entropy:
            ents.append(en)
        if with_sum_pi_squared:
            pi2s.append(p2)
    if not logps:  # no response tokens at all
        logps = ents = pi2s = [flat_h.new_zeros(0, dtype=torch.float32)]
    log_probs = _to_rows(torch.cat(logps), batch)
    entropy = _to_rows(torch.cat(ents), batch) if with_entropy else None
    sum_pi_squared = _to_rows(torch.cat(pi2s), batch) if with_sum_pi_squared else None
    return log_probs, entropy, sum_pi_squared


def _to_rows(flat, batch):
    """(bs, R) from per-position values: padded layout -> reshape and mask; flat -> scattered into rows."""
    lengths, R = batch["response_lengths"], batch["response_width"]
    if not batch.get("flat"):
        return torch.where(batch["response_mask"].bool(), flat.reshape(len(lengths), R), 0.0)
    # rows in order, each row's tokens first: the mask's True cells in row-major order (one op,
    # not a pad per row)
    mask = torch.arange(R, device=flat.device)[None, :] < torch.tensor(lengths, device=flat.device)[:, None]
    return flat.new_zeros(len(lengths), R).masked_scatter(mask, flat)


def response_values(critic, batch):
    """(bs, R) values of a token-classification critic, aligned as verl's dp_critic (the value
    of the position that predicts each response token); padded positions are 0. `batch` from
    binning.collate_bins or batching.collate."""
    out = critic(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                 position_ids=batch["position_ids"], use_cache=False)
    if batch.get("flat"):
        return _to_rows(out.logits[..., 0].reshape(-1)[batch["pred_index"]].float(), batch)
    P, R = batch["prompt_width"], batch["response_width"]
    values = out.logits[:, P - 1:P + R - 1, 0].float()
    return torch.where(batch["response_mask"].bool(), values, 0.0)


def full_vocab_log_probs(model, batch, temperature: float = 1.0):
    """Reference implementation for tests: one forward with full logits and log_softmax."""
    P, R = batch["prompt_width"], batch["response_width"]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)
    logits = out.logits[:, P - 1:P + R - 1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, P:].unsqueeze(-1)).squeeze(-1)
    return torch.where(batch["response_mask"].bool(), logp, 0.0), logits
