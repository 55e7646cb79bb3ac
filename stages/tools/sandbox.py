"""Run a Python snippet in a sandboxed subprocess.

`run_python(code, limits)` starts a small launcher (the running interpreter, `-I -S`, code from
this module) in its own session. The launcher enters new mount, network and PID namespaces and
forks the namespace's first process, which

- makes the whole mount tree read-only (`mount_setattr(2)`, recursive; the tree is made private
  first, so nothing reaches the host's mounts), after re-exposing the interpreter's directories
  where an ancestor is closed to other users (e.g. a Python under /root: a tmpfs over /root holding
  only that path, so the rest of /root stays hidden);
- mounts a fresh tmpfs of `disk_mb` (owned by the snippet's uid) on the snippet's own temporary
  directory, its cwd, HOME and TMPDIR: the only writable place, gone with the namespace;
- forks the snippet: rlimits (CPU time, address space, file size, processes, open files, no core
  files), no supplementary groups, uid/gid 65534 ('nobody': RLIMIT_NPROC counts per uid, and a
  non-root uid cannot write the read-only tree back to writable), then `exec` of the interpreter
  on `snippet.py` (`-I`: no PYTHON* variables, no user site, no cwd on sys.path).

The new network namespace has only a loopback that is down: every connect fails. When the
namespace's first process ends (the snippet finished, or the launcher's process group was killed
at the wall-time or output limit) the kernel kills every process left in the namespace, so
nothing a snippet forks (a fork bomb, a daemon that called setsid) outlives its run.

The parent reads stdout and stderr (at most `max_output_bytes` together, then kills), enforces
the wall time by killing the process group, and gets the snippet's exit status and CPU time from
the namespace's first process over a private pipe. Where the machine cannot provide this (not
root, no namespaces, no mount_setattr) `run_python` raises `SandboxUnavailable` naming what is
missing: code never runs unsandboxed.

Known limits: processes of uid 65534 outside the sandbox (or in another sandbox running at the same
time) count against RLIMIT_NPROC; /proc shows the host's processes (read-only); memory is bounded
per process (RLIMIT_AS), not per sandbox.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# Exit code and status-pipe protocol shared with the launcher below.
_SETUP_FAILED = 111
CAP_SETGID, CAP_SETUID, CAP_SYS_ADMIN = 6, 7, 21
MOUNT_SETATTR = {"x86_64": 442, "aarch64": 442}  # the syscall number (asm-generic and x86_64 agree)


class SandboxUnavailable(RuntimeError):
    """The machine cannot isolate a snippet (the message says what is missing): nothing was run."""

    tool_error_kind = "sandbox"


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one snippet may use. Defaults follow verl's sandbox tool (30 s, 1024 MB)."""

    wall_time_s: float = 30.0
    cpu_time_s: float = 30.0
    memory_mb: int = 1024          # RLIMIT_AS of each process
    max_output_bytes: int = 65536  # stdout and stderr together; beyond this the snippet is killed
    max_processes: int = 32        # RLIMIT_NPROC of the snippet's uid (threads count too)
    max_file_mb: int = 16          # RLIMIT_FSIZE: the largest file it may write
    disk_mb: int = 64              # size of its temporary directory (a tmpfs)
    max_open_files: int = 256
    max_code_bytes: int = 1 << 20
    uid: int = 65534
    gid: int = 65534
    python: str | None = None      # the interpreter that runs snippets; default: this one

    def __post_init__(self):
        for field in ("wall_time_s", "cpu_time_s"):
            if not float(getattr(self, field)) > 0:
                raise ValueError(f"sandbox {field} must be > 0, got {getattr(self, field)!r}")
        for field in ("memory_mb", "max_output_bytes", "max_processes", "max_file_mb", "disk_mb",
                      "max_open_files", "max_code_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox {field} must be a positive integer, got {value!r}")
        if self.uid == 0 or self.gid == 0:
            raise ValueError("the sandbox never runs snippets as root (uid/gid 0)")


@dataclasses.dataclass
class SandboxResult:
    """How a snippet ended. status: "ok" (exit 0), "error" (another exit code), "cpu_time",
    "wall_time", "memory" (a MemoryError ended it), "output_limit", or "killed" (another signal)."""

    status: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float | None
    limits: SandboxLimits

    @property
    def text(self) -> str:
        """The tool's response: stdout then stderr (as verl's sandbox tool returns them), and a
        line saying which limit stopped the snippet, if one did."""
        note = {
            "cpu_time": f"CPU-time limit of {self.limits.cpu_time_s:g} s reached",
            "wall_time": f"wall-time limit of {self.limits.wall_time_s:g} s reached",
            "memory": f"memory limit of {self.limits.memory_mb} MB reached",
            "output_limit": f"output limit of {self.limits.max_output_bytes} bytes reached, the rest was discarded",
            "killed": f"killed by {signal.Signals(self.signal).name if self.signal else 'a signal'}",
        }.get(self.status)
        text = self.stdout + self.stderr
        if note:
            text += ("" if not text or text.endswith("\n") else "\n") + f"[sandbox: stopped: {note}]"
        return text

    def metrics(self) -> dict:
        return {"status": self.status, "exit_code": self.exit_code, "wall_s": round(self.wall_s, 4),
                "cpu_s": None if self.cpu_s is None else round(self.cpu_s, 4)}


# ---------------------------------------------------------------------------------------------
# The launcher: runs as root in a fresh interpreter (-I -S: no site, nothing of ours imported).
# argv[1] is its settings (JSON); the snippet's code comes on stdin; fd `status_fd` carries JSON
# lines back: {"error": ...} from any setup step, {"exit"|"signal": ..., "cpu_s": ...} at the end.

_LAUNCHER = r'''
import ctypes, json, os, resource, signal, stat, struct, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.syscall.restype = ctypes.c_long
MS_NOSUID, MS_NODEV, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 2, 4, 4096, 8192, 16384, 1 << 18
CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
status_fd = cfg["status_fd"]

def report(**record):
    os.write(status_fd, (json.dumps(record) + "\n").encode())

def fail(message):
    try:
        report(error=message)
    finally:
        os._exit(111)

def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        fail(f"{what} failed: {os.strerror(err)} (errno {err})")

def pdeathsig():
    check(libc.prctl(1, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")

def mount(source, target, fstype, flags, data, what):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), what)

def expose(paths, stash):
    """Make every directory on the way to `paths` searchable by the snippet's uid: a directory
    closed to others (no o+x) is covered by a tmpfs holding only the entries on those paths,
    bind-mounted back from the original."""
    for _ in range(16):
        hidden = {}
        for path in paths:
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts)):
                parent = "/" + "/".join(parts[:depth])
                if not os.stat(parent).st_mode & stat.S_IXOTH:
                    hidden.setdefault(parent, set()).add(parts[depth])
                    break
        if not hidden:
            return
        mount("tmpfs", stash, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0700", "mount of a staging tmpfs")
        moves = []
        for parent, names in sorted(hidden.items()):
            for name in sorted(names):
                original = os.path.join(parent, name)
                staged = os.path.join(stash, str(len(moves)))
                is_dir = os.path.isdir(original)
                os.mkdir(staged) if is_dir else open(staged, "w").close()
                mount(original, staged, None, MS_BIND | MS_REC, None, f"bind mount of {original}")
                moves.append((parent, name, staged, is_dir))
        for parent in sorted(hidden):
            mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755", f"tmpfs over {parent}")
        for parent, name, staged, is_dir in moves:
            target = os.path.join(parent, name)
            os.mkdir(target) if is_dir else open(target, "w").close()
            mount(staged, target, None, MS_MOVE, None, f"re-exposing {target}")
        check(libc.umount2(stash.encode(), 2), "unmount of the staging tmpfs")
    fail(f"could not make the interpreter's directories reachable: {paths}")

def read_only_root():
    number = cfg["mount_setattr"]
    attr = struct.pack("QQQQ", 1, 0, 0, 0)  # MOUNT_ATTR_RDONLY
    buf = ctypes.create_string_buffer(attr, len(attr))
    result = libc.syscall(number, -100, b"/", 0x8000, buf, len(attr))  # AT_FDCWD, "/", AT_RECURSIVE
    if result != 0:
        err = ctypes.get_errno()
        fail(f"mount_setattr (read-only mount tree) failed: {os.strerror(err)} (errno {err}); "
             "the sandbox needs Linux >= 5.12")

def snippet():
    """The snippet's process: limits, its directory, uid nobody, then exec."""
    for name, value in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    os.chdir(cfg["workdir"])
    os.setgroups([])
    os.setgid(cfg["gid"])
    os.setuid(cfg["uid"])
    if os.getuid() == 0 or os.geteuid() == 0:
        fail("could not drop root")
    pdeathsig()
    try:
        os.execve(cfg["python"], [cfg["python"], "-I", "-u", "snippet.py"], cfg["env"])
    except OSError as exc:
        fail(f"could not start the interpreter {cfg['python']} as uid {cfg['uid']}: {exc}")

def init(code):
    """The namespace's first process: mounts, then the snippet; its exit ends the namespace."""
    pdeathsig()
    workdir = cfg["workdir"]
    expose(cfg["expose"], workdir)
    read_only_root()
    mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={cfg['disk_mb']}m,mode=0700,uid={cfg['uid']},gid={cfg['gid']}", "tmpfs for the snippet")
    with open(os.path.join(workdir, "snippet.py"), "wb") as f:
        f.write(code)
    os.set_inheritable(status_fd, False)  # the snippet's exec closes it
    pid = os.fork()
    if pid == 0:
        try:
            snippet()
        except BaseException as exc:
            fail(f"{type(exc).__name__}: {exc}")
    _, status, usage = os.wait4(pid, 0)
    record = {"cpu_s": usage.ru_utime + usage.ru_stime, "max_rss_kb": usage.ru_maxrss}
    if os.WIFSIGNALED(status):
        record["signal"] = os.WTERMSIG(status)
    else:
        record["exit"] = os.WEXITSTATUS(status)
    report(**record)
    os._exit(0)

pdeathsig()
if os.getppid() != cfg["parent"]:
    os._exit(111)
code = sys.stdin.buffer.read()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare(mount, network, PID namespaces)")
mount(None, "/", None, MS_REC | MS_PRIVATE, None, "making the mount tree private")
pid = os.fork()
if pid == 0:
    try:
        init(code)
    except BaseException as exc:
        fail(f"{type(exc).__name__}: {exc}")
_, status = os.waitpid(pid, 0)
os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
'''


# ---------------------------------------------------------------------------------------------
# What the machine offers

_PROBED: dict[str, str | None] = {}  # interpreter -> the probe's refusal (None: it worked)


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def sandbox_problems(probe: bool = True, limits: SandboxLimits | None = None) -> list[str]:
    """What stops this machine from sandboxing snippets (empty: nothing). With probe=True a
    trivial snippet is run once per interpreter (cached) to prove namespaces and mounts work."""
    problems = []
    if not sys.platform.startswith("linux"):
        return [f"the sandbox needs Linux (namespaces, mount_setattr, rlimits); this is {sys.platform}"]
    if os.geteuid() != 0:
        problems.append(
            f"not running as root (uid {os.geteuid()}): the sandbox needs root to enter new network, "
            "PID and mount namespaces and to switch the snippet to uid 65534; refusing to run code unsandboxed")
    else:
        caps = _effective_caps()
        missing = [name for bit, name in ((CAP_SYS_ADMIN, "CAP_SYS_ADMIN"), (CAP_SETUID, "CAP_SETUID"),
                                          (CAP_SETGID, "CAP_SETGID")) if not caps >> bit & 1]
        if missing:
            problems.append(f"root without {', '.join(missing)} (a restricted container?): the sandbox "
                            "cannot enter namespaces or switch users")
    if platform.machine() not in MOUNT_SETATTR:
        problems.append(f"no mount_setattr syscall number known for {platform.machine()}")
    if problems or not probe:
        return problems
    limits = limits or SandboxLimits(wall_time_s=30.0, cpu_time_s=10.0, memory_mb=512)
    python = limits.python or sys.executable
    if python not in _PROBED:
        try:
            result = run_python("print('ok')", dataclasses.replace(limits, python=python), _check=False)
            _PROBED[python] = None if result.stdout == "ok\n" else (
                f"the sandbox probe printed {result.stdout!r} (status {result.status}): {result.stderr[-500:]}")
        except SandboxUnavailable as exc:
            _PROBED[python] = str(exc)
    return [_PROBED[python]] if _PROBED[python] else []


def _exposed_paths(python: str) -> list[str]:
    """The paths the snippet's interpreter needs to reach (its binary, its prefix and venv)."""
    real = os.path.realpath(python)
    paths = {python, real, os.path.dirname(os.path.dirname(real))}
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return sorted(os.path.abspath(p) for p in paths)


# ---------------------------------------------------------------------------------------------
# Running a snippet

def run_python(code: str, limits: SandboxLimits | None = None, *, _check: bool = True) -> SandboxResult:
    """Run `code` as a script in the sandbox and return how it ended (never raises for what the
    snippet does). Raises SandboxUnavailable when the sandbox cannot be set up."""
    limits = limits or SandboxLimits()
    if _check:
        problems = sandbox_problems(probe=False)
        if problems:
            raise SandboxUnavailable("; ".join(problems))
    data = code.encode("utf-8", "surrogateescape")
    if len(data) > limits.max_code_bytes:
        raise ValueError(f"the snippet has {len(data)} bytes, more than the limit of {limits.max_code_bytes}")
    python = os.path.abspath(limits.python or sys.executable)
    workdir = tempfile.mkdtemp(prefix="stagerl-sandbox-")
    os.chmod(workdir, 0o711)  # only a mount point: the snippet's tmpfs covers it
    cpu = max(1, int(-(-limits.cpu_time_s // 1)))
    status_r, status_w = os.pipe()
    settings = {
        "parent": os.getpid(), "status_fd": status_w, "workdir": workdir, "python": python,
        "uid": limits.uid, "gid": limits.gid, "disk_mb": limits.disk_mb,
        "mount_setattr": MOUNT_SETATTR.get(platform.machine(), -1), "expose": _exposed_paths(python),
        "rlimits": {"RLIMIT_CPU": [cpu, cpu + 1], "RLIMIT_AS": [limits.memory_mb << 20] * 2,
                    "RLIMIT_FSIZE": [limits.max_file_mb << 20] * 2, "RLIMIT_NPROC": [limits.max_processes] * 2,
                    "RLIMIT_NOFILE": [limits.max_open_files] * 2, "RLIMIT_CORE": [0, 0]},
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
                "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    }
    started = time.monotonic()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(settings)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(status_w,), start_new_session=True, close_fds=True)
    except BaseException:
        os.close(status_r)
        os.close(status_w)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    os.close(status_w)
    try:
        return _collect(proc, data, status_r, limits, started)
    finally:
        _kill_group(proc)
        proc.wait()
        os.close(status_r)
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(proc: subprocess.Popen, data: bytes, status_r: int, limits: SandboxLimits,
             started: float) -> SandboxResult:
    try:
        proc.stdin.write(data)  # the launcher reads all of it before anything else
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), status_r: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    deadline = started + limits.wall_time_s
    stopped, output = None, 0
    while selector.get_map():
        now = time.monotonic()
        if stopped is None and now >= deadline:
            stopped = "wall_time"
            _kill_group(proc)
            deadline = now + 5.0   # the namespace dies with its first process: EOF follows
        elif stopped is not None and now >= deadline:
            break                  # a stream still open 5 s after the kill: give up on it
        for key, _ in selector.select(timeout=max(0.0, deadline - now)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fd)
                continue
            if key.fd == status_r:
                streams[status_r] += chunk
                continue
            room = max(0, limits.max_output_bytes - output)
            streams[key.fd] += chunk[:room]
            output += len(chunk)
            if output > limits.max_output_bytes and stopped is None:
                stopped = "output_limit"
                _kill_group(proc)
                deadline = time.monotonic() + 5.0
    selector.close()
    wall = time.monotonic() - started
    records = [json.loads(line) for line in bytes(streams[status_r]).decode(errors="replace").splitlines()
               if line.strip().startswith("{")]
    stdout = bytes(streams[proc.stdout.fileno()]).decode("utf-8", "replace")
    stderr = bytes(streams[proc.stderr.fileno()]).decode("utf-8", "replace")
    errors = [r["error"] for r in records if "error" in r]
    final = next((r for r in records if "exit" in r or "signal" in r), None)
    if errors and stopped is None:
        raise SandboxUnavailable("; ".join(errors))
    if final is None and stopped is None:
        proc.wait()
        raise SandboxUnavailable(f"the sandbox launcher ended without a result (exit code {proc.returncode})"
                                 + (f": {stderr.strip()[-500:]}" if stderr.strip() else ""))
    final = final or {}
    exit_code, sig, cpu = final.get("exit"), final.get("signal"), final.get("cpu_s")
    if stopped:
        status = stopped
    elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu is not None and cpu >= limits.cpu_time_s - 0.05):
        status = "cpu_time"
    elif sig is not None:
        status = "killed"
    elif exit_code == 0:
        status = "ok"
    elif stderr.rstrip().splitlines()[-1:] and stderr.rstrip().splitlines()[-1].startswith("MemoryError"):
        status = "memory"
    else:
        status = "error"
    return SandboxResult(status=status, exit_code=exit_code, signal=sig, stdout=stdout, stderr=stderr,
                         wall_s=wall, cpu_s=cpu, limits=limits)
