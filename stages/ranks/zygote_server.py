"""The fork server's own process (`python -m stages.ranks.zygote_server FD PRELOAD`): it imports the
preload modules once, then forks a child for each request read from its socket (stages.ranks.zygote has
the owner's side, the protocol and what a child gets), reaps them and reports their exit codes; a
group request forks a leader that starts the ranks as torchrun would."""
from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import socket
import sys
import traceback

from stages.ranks.zygote import MAX_FDS, MAX_MESSAGE


def _set_death_signal(parent: int, sig=signal.SIGKILL) -> None:
    """Die with `parent` (the process that forked this one). A parent that died between the fork
    and this call sends no signal any more (the child would outlive it, reparented to init): then
    the child ends itself the same way."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _call(target: str, args: list) -> int:
    module, _, function = target.partition(":")
    code = getattr(importlib.import_module(module), function)(args)
    return int(code or 0)


def _child(request: dict, fds: list, sock: socket.socket, others: list, parent: int) -> None:
    """In the forked child: become the process `request` asks for, run it, exit."""
    code = 1
    try:
        _set_death_signal(parent)
        sock.close()
        for fd in others:
            os.close(fd)
        if request["new_session"]:
            os.setsid()
        fds = list(fds)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for target_fd, wanted in ((1, request["has_out"]), (2, request["has_err"])):
            if wanted:
                fd = fds.pop(0)
                os.dup2(fd, target_fd)
                os.close(fd)
        passed = fds[:request["n_pass"]]
        if request.get("cpus"):  # the cores asked for, not the server's (a pinned engine's)
            try:
                os.sched_setaffinity(0, request["cpus"])
            except OSError:  # a core this machine lacks: it runs on the server's
                pass
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        args = [a.format(**{f"fd{i}": fd for i, fd in enumerate(passed)}) if "{fd" in a else a
                for a in request["args"]]
        if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            sys.modules["torch"].set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        group = request.get("group")
        sys.argv = [request["target"], *args]
        code = _lead_group(group, request["target"], args) if group else _call(request["target"], args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's traceback on its stderr, exit 1
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _lead_group(group: dict, target: str, args: list) -> int:
    """torchrun --standalone's job: fork the ranks, wait; the first failure stops the others."""
    world = group["world"]
    ranks, parent = {}, os.getpid()
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _set_death_signal(parent)
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), GROUP_RANK="0",
                                  LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(group["master_port"]))
                code = _call(target, args)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        ranks[pid] = rank

    def stop_ranks(*_):
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    signal.signal(signal.SIGTERM, lambda *a: (stop_ranks(), os._exit(143)))
    result = 0
    while ranks:
        pid, status = os.wait()
        if pid not in ranks:
            continue
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and result == 0:  # the line stages.ranks.procs.dead_rank reads
            result = code if code > 0 else 128 - code
            print(f"zygote group: rank {rank} (pid {pid}, host {socket.gethostname()}) exited with code {code}; "
                  f"stopping the others", file=sys.stderr, flush=True)
            stop_ranks()
    return result


def serve(fd: int, preload: list) -> int:
    _set_death_signal(os.getppid())  # die with the owner that started the server
    sock = socket.socket(fileno=fd)
    import gc

    gc.disable()  # ~20 % of these imports' CPU went to collections that found next to nothing
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the child that needs it fails with the error
            pass
    gc.collect()
    gc.freeze()  # children share these pages; their collections skip them
    gc.enable()
    children: dict[int, int] = {}  # pid -> write end of its status pipe
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            fd_w = children.pop(pid, None)
            if fd_w is not None:
                os.write(fd_w, str(os.waitstatus_to_exitcode(status)).encode())
                os.close(fd_w)
        if not ready:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:  # the owner closed its end (or died): stop; children die with us
            return 0
        request = pickle.loads(data)
        status_r, status_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(status_r)
            _child(request, fds, sock, [status_w, *children.values()], parent)
        for fd in fds:
            os.close(fd)
        try:
            socket.send_fds(sock, [pickle.dumps({"pid": pid})], [status_r])
        finally:
            os.close(status_r)
        children[pid] = status_w


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), [m for m in sys.argv[2].split(",") if m]))
