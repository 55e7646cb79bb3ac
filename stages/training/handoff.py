"""The update's new weights to the rollout engine in memory, and to the store in the background.

Step k's update ends with the actor's new weights (version k) in the ranks. Today's durable path
(a full fp32 export, hashed, then read back by the engine) is off the critical path:

- **memory** (one rank in the training process, the hf engine resident in the same process: the
  CPU default): every parameter is copied straight into the engine's model (`take_tensors`) in
  the engine's dtype. Nothing is written.
- **folder** (the engine in a worker process, e.g. vLLM, or the ranks in a rank pool, on the
  flow's host): rank 0 writes one safetensors file in the rollout dtype into a folder in shared
  memory (/dev/shm; the temp dir where it is missing or small) and the flow has the engines load
  it (`take_folder`).
- otherwise (ranks on other hosts, no run session, LoRA adapters to merge, trainer.staleness >= 1:
  the engine samples an older version while this one trains, and loads each by version from the
  local weights cache when its rollout starts): today's export.

Either way only rank 0 holds a gathered copy (ZeRO-3: one parameter at a time), the engine
records the version it holds (`weights_version`) and a rollout refuses to sample from another.
The version is then made durable by the update's background commit (`persist_version`): the
file is written into the local weights cache, hashed as it is written, and uploaded; the manifest
commits when it is done, as before. Both paths serialise the same tensors the same way
(`serialize`), so the stored file is byte for byte what the engine serves.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

from stages.engines import VERSION_FILE

WEIGHTS_FILE = "model.safetensors"
_SHM = Path("/dev/shm")


def persist_dtype(ctx) -> torch.dtype:
    """The dtype a version is served and stored in: the rollout's, where the logprob stage reads
    the same (a GPU run training and sampling in bf16), else float32 (every CPU run: the hf
    engine samples in float32 there, and fp32 weights keep the old log-probs exact)."""
    device = ctx.get("trainer.device") or "cpu"
    rollout = str(ctx.get("actor_rollout_ref.rollout.dtype") or "bfloat16")
    actor = ctx.get("actor_rollout_ref.actor.deepspeed.dtype")
    if device == "cuda" and rollout in ("bfloat16", "bf16", "auto") and actor == "bf16":
        return torch.bfloat16
    return torch.float32


def mode(ctx, world: int) -> str | None:
    """How step ctx.step's update hands its weights over: "memory", "folder" or None (export)."""
    session = getattr(ctx, "session", None)
    if (session is None or not ctx.get("orchestration.background_commit", True)
            or int(ctx.get("actor_rollout_ref.model.lora_rank") or 0) > 0 or ctx.extra.get("no_handoff")
            or int(ctx.get("trainer.nnodes") or 1) > 1 or ctx.get("trainer.hostfile")
            or int(ctx.get("trainer.staleness") or 0) > 0):
        return None  # no run session, adapters to merge, ranks on other hosts, or an engine that
        #              samples an older version meanwhile (trainer.staleness): the export
    engines = session.engines() if not session.closed else None
    if engines is None:
        return None
    if world == 1 and engines.local is not None and engines.local[1].device == "cpu":
        return "memory"
    return "folder"


# ---------------------------------------------------------------------------- the tensors
def rollout_tensors(engine, dtype: torch.dtype, rank: int):
    """(name, tensor) for every parameter of the trained module in `dtype`; a collective: every
    rank iterates, rank 0 gets the values, the others get None. Where the module's parameters
    hold the full master values (ZeRO 0-2 in the same dtype) they are given as they are, without
    a copy; otherwise each parameter's full fp32 master is gathered in turn (ZeRO-3, bf16
    training) and cast."""
    from deepspeed.utils import safe_get_full_fp32_param

    partitioned = engine.zero_optimization_stage() >= 3
    for name, param in engine.module.named_parameters():
        if not partitioned and param.dtype == dtype == torch.float32:
            value = param.detach()
        else:
            value = safe_get_full_fp32_param(param)
            value = (param.detach() if value is None else value).to(dtype)
        yield name, (value if rank == 0 else None)


def serialize(named: dict) -> bytes:
    """The version's weights file: safetensors with the tensors by name (byte-identical for the
    same tensors, whichever path made them)."""
    from safetensors.torch import save

    return save(_cpu_tensors(named), metadata={"format": "pt"})


def write_weights(path: Path, named: dict) -> None:
    """serialize(named) written to `path` (through a temporary name, then renamed) straight from
    the tensors: safetensors' save_file builds no copy of the whole file in memory first (at
    Qwen2.5-0.5B's size 0.9 s against 4.6 s: bench/handoff.py)."""
    from safetensors.torch import save_file

    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    save_file(_cpu_tensors(named), str(tmp), metadata={"format": "pt"})
    tmp.rename(path)


def _cpu_tensors(named: dict) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in named.items()}


def write_small_files(out_dir: Path, module, init_path, dtype: torch.dtype) -> None:
    """config.json (with the served dtype), generation_config.json and the tokenizer of a version
    folder: what a reader of the folder needs besides the weights, the same files the fp32 export
    (stages.training.engine.export_hf) writes, so a version's folder checksum is the same either way."""
    from stages.training.engine import write_model_files

    out_dir.mkdir(parents=True, exist_ok=True)
    empty = out_dir / ".empty"
    module.save_pretrained(str(empty), state_dict={}, safe_serialization=True)  # config, generation config
    for f in empty.iterdir():
        if f.suffix == ".json" and not f.name.startswith("model.safetensors"):
            shutil.move(str(f), out_dir / f.name)
    shutil.rmtree(empty)
    write_model_files(out_dir, str(dtype).removeprefix("torch."), init_path)


def shm_dir(tag: str) -> Path:
    """A scratch folder in shared memory for a version file (the temp dir when /dev/shm is
    missing, or too small for it, e.g. Docker's default 64 MB)."""
    from stages.scratch import scratch_prefix

    base = None
    try:
        if _SHM.is_dir() and os.statvfs(_SHM).f_bavail * os.statvfs(_SHM).f_frsize > (1 << 30):
            base = _SHM
    except OSError:
        base = None
    return Path(tempfile.mkdtemp(prefix=scratch_prefix("update", tag), dir=base))


# ---------------------------------------------------------------------------- durability
def persist_version(source: Path, cache_dir, weights: bytes | None = None) -> tuple[Path, tuple]:
    """Copy a version folder into the local weights cache as `folders/<checksum>`, hashing every
    file as it is written (`weights`: the weights file's bytes, for a memory handoff whose folder
    holds only the small files). Returns (the cached folder, (entries, checksum)) as
    storage.weights.folder_hashes gives them, so the upload needs no second read."""
    from storage.artifacts import fingerprint
    from storage.layout import WEIGHTS_MANIFEST
    from storage.weights import adopt_folder

    cache = Path(cache_dir) / "folders"
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".tmp-version-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    entries = {}
    try:
        files = {p.relative_to(source).as_posix(): p for p in sorted(Path(source).rglob("*")) if p.is_file()}
        files.pop(VERSION_FILE, None)
        if weights is not None:
            files[WEIGHTS_FILE] = weights
        for rel in sorted(files):
            if rel in (WEIGHTS_MANIFEST, ".complete"):
                continue
            entries[rel] = _write_hashed(tmp / rel, files[rel])
        checksum = fingerprint({k: v["sha256"] for k, v in entries.items()})
        target = adopt_folder(tmp, checksum, cache_dir) or cache / checksum
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, (entries, checksum)


def _write_hashed(path: Path, source) -> dict:
    """Write `source` (bytes, or a file to copy) to `path`, hashing the bytes as they are written."""
    h, size = hashlib.sha256(), 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        if isinstance(source, (bytes, bytearray, memoryview)):
            view = memoryview(source)
            for start in range(0, len(view), 8 << 20):
                chunk = view[start:start + (8 << 20)]
                out.write(chunk)
                h.update(chunk)
            size = len(view)
        else:
            with open(source, "rb") as f:
                for chunk in iter(lambda: f.read(8 << 20), b""):
                    out.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}
