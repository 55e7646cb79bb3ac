"""Running a stage's `rank_main(ctx, rank, world)` on N ranks (logprob, update).

    results = run_ranks("stages.logprob", ctx, world=2)     # [rank 0's return value, rank 1's, ...]

- world == 1: called in this process (a launch costs 6-13 s on CPU; single-rank jobs skip it).
  `init_distributed` then makes a one-process group on a free port if a rank needs one.
- world > 1 with an active rank pool of that world and device (stages.rank_pool.activate):
  the job is submitted to the pool's long-lived ranks (no launch, no re-import, the update
  engine kept between steps).
- world > 1 on one machine otherwise: `python -m torch.distributed.run --standalone --nproc_per_node=W
  -m stages.rank_entry <module> <ctx.json>` in a subprocess, with OMP_NUM_THREADS=1 per rank and
  TORCH_EXTENSIONS_DIR passed on (DeepSpeed's prebuilt ops). Each rank writes its return value
  (JSON) to result_<rank>.json in a temporary folder; a failing rank writes error_<rank>.txt
  (its traceback) and run_ranks raises RuntimeError with that traceback and the tail of stderr.
  The ranks' stdout (load lines) is relayed to this process's stdout.

Multi-node (trainer.nnodes > 1): the ranks are started on every node by a launcher instead of
this function, each running the same entry point with the same ctx.json (put it on shared storage
or pass the run's store URI and rebuild the context from run.json):
  * torchrun on each node:
      python -m torch.distributed.run --nnodes=$NNODES --node_rank=$NODE_RANK \\
          --nproc_per_node=$GPUS_PER_NODE --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \\
          -m stages.rank_entry stages.logprob ctx.json
  * or DeepSpeed's launcher with a hostfile (`node-1 slots=8` per line), from the head node:
      deepspeed --hostfile hostfile --master_addr $HEAD --module stages.rank_entry stages.update ctx.json
Results are then read from each rank's result_<rank>.json next to ctx.json (rank_entry writes
them beside the ctx file), and the stage's rank 0 writes the artifact to the store.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STDERR_TAIL = 4000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def context_payload(ctx) -> dict:
    """What a rank process needs to rebuild `ctx`: a StageContext, or any JSON-able object."""
    if hasattr(ctx, "to_json"):
        return {"kind": "stage_context", "data": json.loads(ctx.to_json())}
    return {"kind": "json", "data": ctx}


def context_from_payload(payload: dict):
    if payload["kind"] == "stage_context":
        from stages.context import StageContext

        return StageContext.from_json(json.dumps(payload["data"]))
    return payload["data"]


def run_ranks(module: str, ctx, world: int, device: str = "cpu", timeout_s: float = 1800) -> list:
    """Run `module.rank_main(ctx, rank, world)` on `world` ranks; their return values by rank."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if world == 1:
        mod = importlib.import_module(module)
        return [mod.rank_main(ctx, 0, 1)]
    from stages.rank_pool import active_pool

    pool = active_pool()
    if pool is not None and pool.world == world and pool.device == str(device):
        return pool.submit(module, ctx, timeout_s=timeout_s)
    with tempfile.TemporaryDirectory(prefix="stagerl-ranks-") as tmp:
        ctx_file = Path(tmp) / "ctx.json"
        payload = context_payload(ctx)
        payload["device"] = device
        ctx_file.write_text(json.dumps(payload))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", "-m", "stages.rank_entry", module, str(ctx_file)]
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"
        env["MASTER_PORT"] = str(free_port())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.pop("STAGERL_RANK_POOL", None)
        out_f, err_f = Path(tmp) / "stdout.txt", Path(tmp) / "stderr.txt"
        with out_f.open("wb") as out, err_f.open("wb") as err:
            proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=env, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise RuntimeError(f"{module} on {world} ranks did not finish in {timeout_s} s; "
                                   f"stderr tail:\n{_tail(err_f)}") from None
        sys.stdout.write(_rank_stdout(out_f))
        sys.stdout.flush()
        errors = sorted(Path(tmp).glob("error_*.txt"))
        if rc != 0 or errors:
            detail = "".join(f"--- {e.stem.replace('_', ' ')} ---\n{e.read_text()[-STDERR_TAIL:]}\n"
                             for e in errors)
            raise RuntimeError(f"{module} failed on {world} ranks (exit code {rc}).\n{detail}"
                               f"--- stderr tail ---\n{_tail(err_f)}")
        results = []
        for rank in range(world):
            f = Path(tmp) / f"result_{rank}.json"
            if not f.exists():
                raise RuntimeError(f"{module}: rank {rank} exited without a result; stderr tail:\n{_tail(err_f)}")
            results.append(json.loads(f.read_text()))
        return results


def _rank_stdout(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-STDERR_TAIL:] if path.exists() else ""


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the launcher and its rank processes (their own session, started by us)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def init_distributed(device: str = "cpu"):
    """Initialise torch.distributed for this rank (gloo on CPU, nccl on CUDA), once. Inside a
    torchrun/deepspeed launch the env (RANK, WORLD_SIZE, MASTER_*) is already set; in-process
    (world 1) a one-process group on a free local port is made. Returns (rank, world)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cuda = str(device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size()


def rank_device(device: str = "cpu") -> str:
    """This rank's device string: cuda:LOCAL_RANK on GPU, else cpu."""
    if str(device).startswith("cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
