"""A rollout worker: one process hosting one engine (one rollout replica), driven over a pipe.

    worker = EngineWorker(spec, log_dir)    # spawns `python -m stages.engines.worker <fd>`
    worker.send("start", spec)              # returns at once: the engine starts in the background
    worker.result()                         # waits for the reply (raises EngineError / WorkerDied)
    worker.call("load", model_dir)          # new weights in place
    worker.call("generate", {...})          # [(response_ids, finish_reason, log_probs)], timings
    worker.call("stream", {...})            # Engine.stream: [(key, response_ids, finish_reason, log_probs)], steps
    worker.call("end_stream")               # Engine.end_stream: the streamed batch is over
    worker.close()

Messages are pickled (multiprocessing.connection over a socketpair passed as an inherited fd, so
nothing is imported from the parent's __main__ and the parent's stdout stays clean). The worker's
own stdout/stderr (vLLM, transformers) go to a log file whose tail is attached to every error.
The worker exits when the pipe closes, i.e. when its owner exits or dies; it sets PDEATHSIG too.
After the engine starts and after each request it collects and freezes the garbage collector's
heap (gc.freeze), as the rank servers do: a full collection of torch's objects costs 0.1-0.5 s."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from stages.engines import EngineError

LOG_TAIL = 4000
REPO_ROOT = Path(__file__).resolve().parents[2]


class WorkerDied(EngineError):
    """The worker process ended without answering (killed, crashed, out of memory)."""


class EngineWorker:
    """The parent's handle on one worker process."""

    def __init__(self, spec, log_dir, env: dict | None = None, spawner=None):
        import socket
        from multiprocessing.connection import Connection

        from stages.engines import engine_class

        self.spec = spec
        self.loaded: str | None = None  # the weights folder the engine holds
        self.started = False
        self.asleep = False
        self.stopping = False  # "stop" sent (request_stop): close only waits
        self.log_path = Path(log_dir) / f"engine-{spec.engine}-replica{spec.replica}-{os.getpid()}-{id(self):x}.log"
        ours, theirs = socket.socketpair()
        env = dict(os.environ if env is None else env)
        env["OMP_NUM_THREADS"] = str(spec.threads)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env = engine_class(spec.engine).process_env(spec, env)
        forked = spawner is not None and spawner.forks_engine(spec)
        with self.log_path.open("ab") as log:
            if forked:  # from the run's fork server (stages.ranks.zygote): torch, transformers (vLLM) imported
                self.proc = spawner.popen("stages.engines.worker:main", ["{fd0}"], env, stdout=log, stderr=log,
                                          pass_fds=(theirs.fileno(),))
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "stages.engines.worker", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), env=env, cwd=os.getcwd(), stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT)
        theirs.close()
        self.conn = Connection(ours.detach())

    # ---- requests -----------------------------------------------------------------------------
    def send(self, op: str, arg=None) -> None:
        try:
            self.conn.send((op, arg))
        except OSError:
            raise WorkerDied(self._why("exited before a request could be sent")) from None

    def result(self):
        """The reply to the oldest request sent; waits while the process lives."""
        while not self.conn.poll(0.2):
            if self.proc.poll() is not None and not self.conn.poll(0):
                raise WorkerDied(self._why(f"exited with code {self.proc.returncode}"))
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            self.proc.wait(timeout=10)
            raise WorkerDied(self._why(f"exited with code {self.proc.returncode}")) from None
        if status == "error":
            raise EngineError(f"{self.spec.engine} engine (replica {self.spec.replica}) failed:\n{value}"
                              f"\n--- worker log tail ({self.log_path}) ---\n{self.log_tail()}")
        return value

    def call(self, op: str, arg=None):
        self.send(op, arg)
        return self.result()

    # ---- life cycle ---------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc.poll() is None

    def request_stop(self) -> None:
        """Ask the worker to stop without waiting (close waits): a run closes its workers at once,
        each tearing its engine down beside the others (a vLLM worker's takes seconds)."""
        if self.alive() and not self.stopping:
            try:
                self.conn.send(("stop", None))
                self.stopping = True
            except OSError:
                pass

    def close(self, timeout_s: float = 10) -> None:
        if self.alive():
            try:
                if not self.stopping:
                    self.conn.send(("stop", None))
                self.proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.conn.close()

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL:]
        except OSError:
            return ""

    def _why(self, what: str) -> str:
        return (f"{self.spec.engine} rollout worker (replica {self.spec.replica}, pid {self.proc.pid}) "
                f"{what}\n--- worker log tail ({self.log_path}) ---\n{self.log_tail()}")


# ---- the worker process ---------------------------------------------------------------------------
def _set_death_signal() -> None:
    """Die with the parent even if the pipe stays open elsewhere (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _handle(engine, op: str, arg):
    """One request against the engine; returns the reply value."""
    from stages.engines import Sampling, engine_class

    if op == "start":
        import torch

        if getattr(arg, "cpus", ()):  # rollout.cpu_affinity: this process on its own cores
            os.sched_setaffinity(0, set(arg.cpus))
        torch.set_num_threads(max(1, int(arg.threads)))
        _TOKENIZER.clear()
        _TOKENIZER["dir"] = arg.model_dir
        engine = engine_class(arg.engine)()
        return engine, engine.start(arg)
    if engine is None:
        raise RuntimeError(f"request {op!r} before the engine was started")
    if op == "load":
        return engine, engine.load_weights(arg)
    if op == "generate":
        t0 = time.perf_counter()
        gens = engine.generate(arg["prompt_ids"], arg["seeds"], Sampling(**arg["sampling"]),
                               arg["replica"], arg["step_seed"], arg["rollout"])
        t1 = time.perf_counter()
        texts = (_decode(engine, [g.response_ids for g in gens], True)
                 if arg.get("decode") else [None] * len(gens))
        rows = [(g.response_ids, g.finish_reason, g.log_probs, text) for g, text in zip(gens, texts)]
        return engine, {"rows": rows, "generate_s": round(t1 - t0, 4),
                        "decode_s": round(time.perf_counter() - t1, 4)}
    if op == "stream":  # the agent loop's continuous batching (Engine.stream)
        t0 = time.perf_counter()
        done, steps = engine.stream(arg["add"], Sampling(**arg["sampling"]), arg.get("max_steps"),
                                    bool(arg.get("new_batch")))
        return engine, {"rows": [(key, g.response_ids, g.finish_reason, g.log_probs) for key, g in done],
                        "steps": steps, "generate_s": round(time.perf_counter() - t0, 4)}
    if op == "end_stream":
        engine.end_stream()
        return engine, None
    if op == "decode":
        return engine, _decode(engine, arg["ids"], arg["skip_special_tokens"])
    if op == "sleep":
        engine.sleep()
        return engine, None
    raise ValueError(f"unknown rollout worker request {op!r}")


_TOKENIZER: dict = {}  # this worker process's tokenizer: {"dir": model folder, "tokenizer": ...}


def _tokenizer(engine):
    """The tokenizer of the folder the engine started from (loaded once; every step's weights
    folder carries the same tokenizer files): responses are decoded here, next to the engine, so
    the training flow's process never loads transformers for a rollout."""
    if "tokenizer" not in _TOKENIZER:
        from stages.model.models import load_tokenizer

        _TOKENIZER["tokenizer"] = load_tokenizer(_TOKENIZER["dir"])
    return _TOKENIZER["tokenizer"]


def _decode(engine, id_lists, skip_special_tokens: bool) -> list[str]:
    from stages.model.models import decode_batch

    return decode_batch(_tokenizer(engine), id_lists, skip_special_tokens=skip_special_tokens)


def _child_pids() -> list[int] | None:
    """This process's children (from /proc; None where it cannot tell)."""
    me, out = os.getpid(), []
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return None
    for name in names:
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                    out.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def serve(fd: int) -> int:
    import gc
    from multiprocessing.connection import Connection

    _set_death_signal()
    conn = Connection(fd)
    engine = None
    while True:
        try:
            op, arg = conn.recv()
        except (EOFError, OSError):
            return 0  # the owner closed the pipe or died
        if op == "stop":
            if engine is not None and _child_pids() != []:  # (vLLM's tensor-parallel workers): in order
                engine.stop()
            sys.stdout.flush()
            sys.stderr.flush()
            conn.send(("ok", None))
            if engine is not None:
                os._exit(0)  # the engine holds nothing to hand back: the OS frees it at once, where
                #              vLLM's own shutdown (its process groups, caches) took ~2.5 s of a run's end
            return 0
        try:
            engine, value = _handle(engine, op, arg)
            reply = ("ok", value)
        except BaseException:  # noqa: BLE001 - reported to the owner, the worker goes on
            reply = ("error", traceback.format_exc())
        sys.stdout.flush()
        conn.send(reply)
        value = reply = None
        if op != "stream":  # a streamed batch answers many small requests: collected when it ends
            gc.collect()
            gc.freeze()


def main(args: list) -> int:
    """The entry point a fork server calls (stages.ranks.zygote): args = [fd]."""
    return serve(int(args[0]))


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
