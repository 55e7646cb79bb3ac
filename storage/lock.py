"""One writer per experiment: a lock object `{project}/{experiment}/_lock.json` in the store.

A second writer is refused with the holder's host, pid and time; a lock older than
`lock_stale_seconds` (since its last refresh) is taken over, unless its holder is a live process
on this host (a run whose refresh is late is never displaced, whatever lock_stale_seconds says);
`force=True` breaks it.
Object stores have no compare-and-swap here, so acquisition writes a unique token and reads it
back: of two racing writers at most one sees its own token."""
import datetime
import os
import socket
import time
import uuid

from storage.layout import RunLayout
from storage.store import Store


class LockedError(RuntimeError):
    """The experiment is held by another writer."""


class ExperimentLock:
    """Context manager: `with ExperimentLock(store, layout): ...`."""

    def __init__(self, store: Store, layout: RunLayout, *, force: bool = False, owner: str = ""):
        self.store, self.layout, self.force, self.owner = store, layout, force, owner
        self.key = layout.lock
        self.token = uuid.uuid4().hex
        self.held = False
        self._written = None  # time.monotonic() of this holder's last write of the lock

    def _record(self) -> dict:
        now = time.time()
        return {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                "owner": self.owner, "time": now, "time_iso": _iso(now)}

    def holder(self):
        """The current lock record, or None."""
        try:
            return self.store.read_json(self.key)
        except FileNotFoundError:
            return None
        except ValueError:
            return {"time": 0}  # unreadable: treat as stale

    def acquire(self) -> "ExperimentLock":
        current = self.holder()
        if current and current.get("token") != self.token and not self.force:
            age = time.time() - float(current.get("time", 0))
            if _live_local(current):
                raise LockedError(
                    f"experiment {self.layout.base} is locked by pid {current.get('pid')} on this host "
                    f"({current.get('host')}), which is running (last refresh {age:.0f}s ago): a live "
                    f"holder is never taken over. Wait for it to finish, or break the lock with "
                    f"--force-lock (lock object: {self.store.url(self.key)})")
            if age < self.store.lock_stale_seconds:
                raise LockedError(
                    f"experiment {self.layout.base} is locked by host {current.get('host')} "
                    f"pid {current.get('pid')} since {current.get('time_iso')} "
                    f"({age:.0f}s ago; stale after {self.store.lock_stale_seconds:.0f}s). "
                    f"Wait for it to finish, or break the lock with --force-lock "
                    f"(lock object: {self.store.url(self.key)})")
        self.store.write_json(self.key, self._record())
        again = self.holder()
        if not again or again.get("token") != self.token:
            raise LockedError(f"experiment {self.layout.base}: lost the lock race to host "
                              f"{(again or {}).get('host')} pid {(again or {}).get('pid')}")
        self.held = True
        self._written = time.monotonic()
        return self

    def refresh(self, min_interval_s: float = 0.0) -> None:
        """Renew the lock's time (long runs call this so the lock never looks stale), after
        checking that it is still this holder's. Within `min_interval_s` of this holder's last
        write it does nothing (a loop of short steps reads and writes the lock at most that often)."""
        if self._written is not None and time.monotonic() - self._written < min_interval_s:
            return
        current = self.holder()
        if not current or current.get("token") != self.token:
            raise LockedError(f"experiment {self.layout.base}: lock was taken over by host "
                              f"{(current or {}).get('host')} pid {(current or {}).get('pid')}")
        self.store.write_json(self.key, self._record())
        self._written = time.monotonic()

    def release(self) -> None:
        if self.held:
            current = self.holder()
            if current and current.get("token") == self.token:
                self.store.delete(self.key)
            self.held = False

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False


def _live_local(record: dict) -> bool:
    """The lock record's holder is a live process on this host (not this process: a record with
    our own pid is from an earlier run in a reused process)."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    return process_alive(pid)


def process_alive(pid: int) -> bool:
    """True while a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")
