"""The transformers engine: its own continuous-batching decode loop over a transformers model.

StreamBatch keeps every running row's KV cache in one left-padded cache: rows join at any decode
step (their context prefilled, their cache merged in) and leave as soon as they end, so no row
waits for the longest of a static batch (transformers' `generate` decodes every row until the last
one stops). generate() runs a call's rows through it with at most hf_generate_batch_size prompts × n
rows decoding at once, a row that ends handing its place to the next; stream() is the multi-turn
agent loop's continuous batch across turns.

Reproducibility: each row samples from its own seed and token index (sample_rows: a counter-based
uniform, inverse CDF after transformers' temperature / top-k / top-p), never from a shared RNG, so
the same seeds give the same tokens whichever rows share a step, in any process, whether the engine
was just started or has served earlier steps; greedy rows equal `generate`'s. New weights are
copied into the loaded model in place (load_weights: safetensors -> load_state_dict), so a run
loads the model once; on a GPU, sleep() moves it to host memory while the update trains."""
from __future__ import annotations

import functools
import time
from pathlib import Path

from stages.engines import Engine, EngineSpec, Generation, Sampling, derive_seed, eos_token_ids, finish
from stages.progress import progress


def _left_pad(rows: list[list[int]], pad_id: int):
    """(ids, mask) of rows right-aligned in a (rows, longest) tensor (numpy's masked assignment:
    torch's runs an OpenMP region, slow beside other work on a small CPU)."""
    import itertools

    import numpy as np
    import torch

    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max())
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.arange(width)[None, :] >= (width - lengths)[:, None]  # each row's last len(r) cells
    ids[mask] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))


class HFEngine(Engine):
    START_KEYS = ("dtype", "free_cache_engine")
    STREAMS = True

    def __init__(self):
        self.model = None
        self.batch: StreamBatch | None = None  # stream()'s running batch
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
        """One Generation per row, row i sampled from seeds[i] (None: seeds from (step_seed,
        replica, row)); at most hf_generate_batch_size prompts × n rows decode at once, in row order."""
        import torch

        batch_prompts = int(rollout.get("hf_generate_batch_size") or 64)
        if batch_prompts < 1:
            raise ValueError(f"actor_rollout_ref.rollout.hf_generate_batch_size must be >= 1, got {batch_prompts}")
        self.wake()
        if seeds is None:
            seeds = [derive_seed(step_seed, replica, row) for row in range(len(prompt_ids))]
        room = batch_prompts * sampling.n
        batch = StreamBatch(self.model, self.eos_ids, self.pad_id, self.device)
        results: list[Generation] = [None] * len(prompt_ids)
        waiting = 0  # the next row to join
        with torch.inference_mode(), progress("generate", total=len(prompt_ids), unit="seq") as bar:
            while waiting < len(prompt_ids) or batch.busy():
                while waiting < len(prompt_ids) and batch.running() < room:
                    batch.add(waiting, prompt_ids[waiting], seeds[waiting], sampling.max_new_tokens)
                    waiting += 1
                done = batch.step(sampling)
                for row, gen in done:
                    results[row] = gen
                bar.update(len(done))
        return results

    def stream(self, add, sampling: Sampling, max_steps: int | None = None, new_batch: bool = False) -> tuple[list, int]:
        """Continuous batching across the agent loop's turns (stages.engines.agent_loop), as
        VLLMEngine.stream: add the requests `add` [(key, prompt ids, seed, max new tokens)], then
        step until one request or more has finished, or for max_steps steps; returns ([(key,
        Generation)] of those, in key order, the steps taken). A request joins at the next step
        (its context prefilled, its cache merged into the running batch) and leaves when it ends,
        so no row waits for a round's slowest. Each row samples from its own seed and token index
        (sample_rows), never from a shared RNG: which rows share a step changes only the float
        sums. `new_batch`: rows left over from a batch that failed are dropped first."""
        import torch

        self.wake()
        if new_batch or self.batch is None:
            self.batch = StreamBatch(self.model, self.eos_ids, self.pad_id, self.device, keep_finished=True)
        for key, ids, seed, max_new in add:
            self.batch.add(key, ids, seed, max_new)
        done, steps = [], 0
        with torch.inference_mode():
            while not done and self.batch.busy() and (max_steps is None or steps < max_steps):
                steps += 1
                done = self.batch.step(sampling)
        return sorted(done, key=lambda item: item[0]), steps

    def end_stream(self) -> None:
        """The agent loop's batch is over: drop its rows' kept turn caches (at real size, GBs)."""
        self.batch = None

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
        self.model = self.batch = None


# ---- continuous batching for the agent loop (Engine.stream) --------------------------------------
_M32 = 0xFFFFFFFF


def _mix32(x):
    """lowbias32 (Chris Wellons' integer hash) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_uniforms(seeds, counters):
    """One uniform in [0, 1) per row from (the row's seed, its token index): a counter-based draw,
    so a row samples the same way whichever rows share its batch (float64, 53 random bits)."""
    import torch

    x = _mix32((seeds * 0x9E3779B1 + counters * 0x85EBCA77 + 0x165667B1) & _M32)
    y = _mix32(x ^ 0x27D4EB2F)
    return ((x >> 5) * (1 << 26) + (y >> 6)).to(torch.float64) / float(1 << 53)


def sample_rows(logits, sampling: Sampling, seeds, counters):
    """The next token of each row (logits: (rows, vocab), float) as transformers' warpers pick it
    (temperature, then top-k, then top-p), drawn by inverse CDF from row_uniforms: a function of
    the row's own seed and token index only. Greedy: the arg max."""
    import torch

    if sampling.greedy:
        return logits.argmax(dim=-1)
    scores = logits.double() / sampling.temperature
    top_k = sampling.top_k if sampling.top_k > 0 else 0
    if top_k or sampling.top_p < 1.0:
        k = min(top_k or scores.shape[-1], scores.shape[-1])
        scores, order = torch.topk(scores, k, dim=-1)  # descending
        probs = torch.softmax(scores, dim=-1)
        if sampling.top_p < 1.0:  # keep the smallest head whose mass reaches top_p (at least one)
            before = torch.cumsum(probs, dim=-1) - probs
            probs = probs.masked_fill(before >= sampling.top_p, 0.0)
    else:
        order, probs = None, torch.softmax(scores, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = row_uniforms(seeds, counters).unsqueeze(-1) * cdf[:, -1:]
    pick = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
    return pick if order is None else order.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


class _StreamRow:
    __slots__ = ("key", "seed", "max_new", "ids", "tokens", "log_probs", "done")

    def __init__(self, key, ids, seed, max_new):
        self.key, self.seed, self.max_new, self.ids = key, int(seed), int(max_new), list(ids)
        self.done = False  # finished: still in the cache until the batch drops its finished rows
        self.tokens: list[int] = []
        self.log_probs: list[float] = []


class StreamBatch:
    """The running batch of HFEngine.stream and generate: each row's KV cache in one left-padded
    DynamicCache (rows, heads, columns, head dim) with its attention mask. A step feeds every
    running row its last sampled token (one forward), prefills the rows that join (one forward)
    and merges their caches in, samples one token per row, and drops the rows that finished (and
    the cache columns no row uses any more): not at once, since each drop copies the whole cache,
    but once finished rows are DROP_FINISHED's share of it or when rows join (the merge's copy).

    `keep_finished` (the agent loop's stream): a finished row's cache is kept under its key, and
    when a request of that key joins again with a context that extends it (the turn's tokens, then
    the tool response), only the new tokens are prefilled over the kept cache, so a later turn
    never prefills its whole context again; positions count real tokens only.

    After rows join or leave, the cache is re-packed (_repack) to the width of its longest row, so
    padding never piles up; a decode step writes its column into the cache's spare room
    (room_cache) instead of copying the cache."""

    def __init__(self, model, eos_ids, pad_id: int, device, keep_finished: bool = False):
        self.model, self.eos, self.pad_id, self.device = model, set(eos_ids), int(pad_id), device
        self.keep_finished = keep_finished
        self.kept: dict = {}  # key -> (the ids its cache holds, [(keys, values)] per layer: (1, heads, len, dim))
        self.prefilled = 0  # context tokens fed through prefills (a join over a kept cache: only the new ones)
        self.rows: list[_StreamRow] = []  # the cache's rows, finished ones (done) until dropped
        self.finished = 0  # rows of self.rows that are done
        self.joining: list[_StreamRow] = []
        self.cache = None
        self.mask = None     # (rows, columns) long: 1 where the cache holds a real token
        self.lengths = None  # (rows,) real tokens in the cache per row

    def add(self, key, ids, seed, max_new) -> None:
        self.joining.append(_StreamRow(key, ids, seed, max_new))

    def busy(self) -> bool:
        return bool(self.finished < len(self.rows) or self.joining)

    def running(self) -> int:
        return len(self.rows) - self.finished + len(self.joining)

    def _unfinished(self) -> list:
        """Indices of the cache's rows that have not finished."""
        return [i for i, row in enumerate(self.rows) if not row.done]

    def step(self, sampling: Sampling) -> list:
        """One engine step; returns [(key, Generation)] of the rows that finished in it."""
        import torch

        parts = []
        if self.rows:
            last = torch.tensor([[r.tokens[-1]] for r in self.rows], dtype=torch.long)
            self.mask = torch.cat([self.mask, torch.ones(len(self.rows), 1, dtype=torch.long)], dim=1)
            out = self.model(input_ids=last.to(self.device), attention_mask=self.mask.to(self.device),
                             position_ids=self.lengths.unsqueeze(-1).to(self.device), past_key_values=self.cache,
                             use_cache=True, logits_to_keep=1)
            self.lengths = self.lengths + 1
            parts.append(out.logits[:, -1, :])
        if self.joining:
            if parts and self.finished:  # the merge drops the finished rows from the batch
                parts[0] = parts[0][self._unfinished()]
            parts.append(self._join())
        logits = (parts[0] if len(parts) == 1 else torch.cat(parts)).float().cpu()
        seeds = torch.tensor([r.seed for r in self.rows], dtype=torch.long)
        counters = torch.tensor([len(r.tokens) for r in self.rows], dtype=torch.long)
        tokens = sample_rows(logits, sampling, seeds, counters).tolist()
        lps = None
        if sampling.log_probs:  # raw logits / temperature, as the logprob stage scores them
            temp = 1.0 if sampling.greedy else sampling.temperature
            lps = torch.log_softmax(logits / temp, dim=-1).gather(
                -1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()
        done = []
        for i, (row, tok) in enumerate(zip(self.rows, tokens)):
            if row.done:
                continue
            row.tokens.append(int(tok))
            if lps is not None:
                row.log_probs.append(float(lps[i]))
            if int(tok) in self.eos or len(row.tokens) >= row.max_new:
                done.append((row.key, finish(row.tokens, list(self.eos), row.max_new,
                                             row.log_probs if lps is not None else None)))
                if self.keep_finished:  # its cache holds its ids and all its tokens but the last
                    real = self.mask[i].bool()
                    self.kept[row.key] = (row.ids + row.tokens[:-1],
                                          [(layer.keys[i:i + 1, :, real], layer.values[i:i + 1, :, real])
                                           for layer in self.cache.layers])
                row.done = True
                self.finished += 1
        if self.finished and self.finished * DROP_FINISHED >= len(self.rows):
            self._keep(self._unfinished())
        return done

    def _join(self):
        """Prefill the joining rows (over their kept caches where they extend one) and merge their
        caches into the running batch; returns their last-position logits, in joining order."""
        import torch

        new, self.joining = self.joining, []
        resumed = []  # (row, its kept cache), prefilled from the end of that cache
        fresh = []
        for row in new:
            kept = self.kept.pop(row.key, None)
            if kept is not None and len(row.ids) > len(kept[0]) and row.ids[:len(kept[0])] == kept[0]:
                resumed.append((row, kept[1]))
            else:
                fresh.append(row)
        logits = []
        if fresh:
            ids, mask = _left_pad([r.ids for r in fresh], self.pad_id)
            positions = (mask.cumsum(-1) - 1).clamp_(min=0)
            cache = room_cache()
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=positions.to(self.device), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
            self._merge(cache, mask, mask.sum(-1), fresh)
            self.prefilled += int(mask.sum())
            logits.append(out.logits[:, -1, :])
        if resumed:
            width = max(kv[0][0].shape[2] for _, kv in resumed)
            cache = room_cache()
            for layer in range(len(resumed[0][1])):
                cache.update(torch.cat([_pad_left(kv[layer][0], width) for _, kv in resumed]),
                             torch.cat([_pad_left(kv[layer][1], width) for _, kv in resumed]), layer)
            past = torch.cat([_pad_left(torch.ones(1, kv[0][0].shape[2], dtype=torch.long), width) for _, kv in resumed])
            held = past.sum(-1)
            ids, mask = _left_pad([row.ids[int(n):] for (row, _), n in zip(resumed, held)], self.pad_id)
            positions = (held.unsqueeze(-1) + mask.cumsum(-1) - 1).clamp_(min=0)
            full = torch.cat([past, mask], dim=1)
            out = self.model(input_ids=ids.to(self.device), attention_mask=full.to(self.device),
                             position_ids=positions.to(self.device), past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
            self._merge(cache, full, full.sum(-1), [row for row, _ in resumed])
            self.prefilled += int(mask.sum())
            logits.append(out.logits[:, -1, :])
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _merge(self, cache, mask, lengths, rows) -> None:
        """Append rows (their cache, mask and real lengths) to the running batch."""
        import torch

        if self.cache is None or not self.rows:
            self.cache, self.mask, self.lengths = cache, mask, lengths
        else:
            width = max(self.mask.shape[1], mask.shape[1])
            for mine, theirs in zip(self.cache.layers, cache.layers):
                mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
                mine.values = torch.cat([_pad_left(mine.values, width), _pad_left(theirs.values, width)])
            self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
            self.lengths = torch.cat([self.lengths, lengths])
        self.rows += rows
        if self.finished:  # the re-pack's copy drops them
            self._keep(self._unfinished())
        else:
            self._repack()

    def _keep(self, keep: list) -> None:
        """Only the rows `keep` (indices) go on (the cache re-packed to their longest)."""
        import torch

        self.rows = [self.rows[i] for i in keep]
        self.finished = sum(row.done for row in self.rows)
        if not keep:
            self.cache = self.mask = self.lengths = None
            return
        index = torch.tensor(keep, dtype=torch.long)
        self.mask, self.lengths = self.mask[index], self.lengths[index]
        self._repack(index)

    def _repack(self, rows=None) -> None:
        """Keep the cache rows `rows` (None: all) and make it as wide as its longest row: each row's
        real columns, in order, at its right end. Rows that joined with contexts of other lengths,
        or over kept caches (whose padding sits before the new tokens), leave columns that are
        padding in every row or holes inside a row; a decode step's cost grows with the width, so
        they are dropped. Padding stays masked out: positions and outputs do not change. One
        row-and-column selection per tensor, into a buffer with room for the next steps."""
        import torch

        width = int(self.lengths.max())
        columns = None
        if width < self.mask.shape[1]:  # per row: its padding columns first, then its real ones in order
            columns = torch.argsort(self.mask, dim=1, stable=True)[:, -width:]
            self.mask = self.mask.gather(1, columns)
        elif rows is None:
            return
        for layer in self.cache.layers:
            held, buffers = layer.keys.shape[2], _buffers_of(layer)
            if columns is None and buffers is not None:  # rows only: select them, room and all
                layer.buffers = tuple(b.index_select(0, rows.to(b.device)) for b in buffers)
                layer.keys, layer.values = layer.buffers[0][:, :, :held], layer.buffers[1][:, :, :held]
                continue
            room = room_for(width) if hasattr(layer, "buffers") else 0
            keys = _select(layer.keys, rows, columns, room)
            values = _select(layer.values, rows, columns, room)
            if room:
                layer.buffers = (keys, values)
                keys, values = keys[:, :, :width], values[:, :, :width]
            layer.keys, layer.values = keys, values


def _select(t, rows, columns, room: int = 0):
    """out[i, h, j] = t[rows[i], h, columns[i, j]] for a cache tensor t (rows, heads, columns, head
    dim) whose head dim is contiguous (rows None: all; columns None: all), then `room` columns more
    (unset): one index_select over t's storage seen as (positions, head dim) rows (torch.gather
    along the column axis is ~20x slower on the CPU)."""
    import torch

    n_rows, heads, width, dim = t.shape
    if t.stride(3) != 1 or t.stride(2) != dim or t.stride(1) % dim or t.stride(0) % dim:
        t = t.contiguous()
    at_row, at_head = t.stride(0) // dim, t.stride(1) // dim
    device = t.device
    rows = torch.arange(n_rows, device=device) if rows is None else rows.to(device)
    columns = (torch.arange(width, device=device).expand(len(rows), width) if columns is None
               else columns.to(device))
    if room:
        columns = torch.cat([columns, columns.new_zeros(len(rows), room)], dim=1)
    flat = t.as_strided(((n_rows - 1) * at_row + (heads - 1) * at_head + width, dim), (dim, 1))
    index = (rows[:, None, None] * at_row + torch.arange(heads, device=device)[None, :, None] * at_head
             + columns[:, None, :])
    return flat.index_select(0, index.reshape(-1)).view(len(rows), heads, columns.shape[1], dim)


def _buffers_of(layer):
    """A RoomLayer's (keys, values) buffers when its keys are the first columns of them (room
    after), else None: a plain DynamicLayer, or tensors set from outside (StreamBatch's merges)."""
    bufs = getattr(layer, "buffers", None)
    keys = layer.keys
    if (bufs is None or keys.dim() != 4 or keys.data_ptr() != bufs[0].data_ptr()
            or keys.shape[:2] != bufs[0].shape[:2] or keys.stride() != bufs[0].stride()):
        return None
    return bufs


DROP_FINISHED = 4  # finished rows leave the cache once they are 1/4 of its rows (or when rows join)


def room_for(width: int) -> int:
    """Spare cache columns a buffer gets beyond `width` (room_cache)."""
    return max(64, width // 4)


def room_cache():
    """A DynamicCache whose layers append a step's keys and values in place, into spare columns
    (room_layer), instead of copying the whole cache with torch.cat at every decode step."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = room_layer()
    return cache


@functools.lru_cache(maxsize=1)
def room_layer():
    """The RoomLayer class (a transformers DynamicLayer; defined on first use, as transformers is
    imported lazily here)."""
    from transformers.cache_utils import DynamicLayer

    class RoomLayer(DynamicLayer):
        """`keys` / `values` are views of the first columns of larger buffers (`buffers`); a step
        writes its columns after them. Tensors set from outside without their buffers (StreamBatch's
        merges) are copied into new buffers at the next update, with room_for() more columns."""
        buffers = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            held = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            new, bufs = key_states.shape[-2], _buffers_of(self)
            if bufs is None or held + new > bufs[0].shape[-2]:
                shape = (*key_states.shape[:2], held + new + room_for(held + new), key_states.shape[-1])
                bufs = self.buffers = (key_states.new_empty(shape), value_states.new_empty(shape))
                if held:
                    bufs[0][:, :, :held] = self.keys
                    bufs[1][:, :, :held] = self.values
            bufs[0][:, :, held:held + new] = key_states
            bufs[1][:, :, held:held + new] = value_states
            self.keys, self.values = bufs[0][:, :, :held + new], bufs[1][:, :, :held + new]
            return self.keys, self.values

    return RoomLayer


def _pad_left(t, width: int):
    """`t` (rows, ...) with its column axis (dim 2 of a cache tensor, dim 1 of a mask) left-padded
    with zeros to `width`."""
    import torch

    axis = 1 if t.dim() == 2 else 2
    extra = width - t.shape[axis]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[axis] = extra
    return torch.cat([t.new_zeros(shape), t], dim=axis)
