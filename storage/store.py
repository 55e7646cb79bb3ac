"""`Store`: one small API over fsspec for a local folder or `s3://bucket/prefix`.

Every method takes a *key*: a posix path relative to the store root ("proj/exp/run.json").
`store.url(key)` gives the full URI (what flows pass between tasks)."""
import contextlib
import io
import json
import posixpath
import threading
from collections import OrderedDict
from pathlib import Path

from storage.secrets import scrub_text

DEFAULTS = {
    "root": "./runs",
    "endpoint_url": None,
    "key": None,
    "secret": None,
    "region": None,
    "lock_stale_seconds": 3600,
    "cache_dir": None,
    "s3_retries": None,
}


class StoreError(RuntimeError):
    """A storage operation failed (message names the key)."""


# Tables this process wrote last, by full object path: {path: (sha256 of the bytes written, table)}.
# A later stage of the same step in the same process (the training flow runs them one after
# another) gets the table back without reading and decoding the parquet, and only when its
# manifest lists exactly those bytes. Any write, move, copy or delete through a Store of this
# process forgets the path first; another process's writes are not seen (a reader in another
# process reads and verifies the object as always).
RECENT_TABLES_KEPT = 8
_recent_tables: "OrderedDict[str, tuple[str, object]]" = OrderedDict()
_recent_lock = threading.Lock()  # stage tasks of one step may run side by side (flows.step)


class Store:
    """A store root behind the same calls, whatever keeps the objects (storage/backends.py: a
    local folder, an S3 prefix, or a backend registered there). Every failure of the storage
    itself is raised as StoreError naming the key (the retry policy retries exactly those); a
    missing object read is FileNotFoundError."""

    def __init__(self, backend, *, lock_stale_seconds: float = 3600, cache_dir=None,
                 secret_values=(), settings=None):
        self.backend = backend
        self.fs = backend.fs
        self.root = backend.root
        self.lock_stale_seconds = float(lock_stale_seconds)
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "stagerl").expanduser()
        self.secret_values = tuple(v for v in secret_values if v)
        self._settings = dict(settings or {})

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, storage_cfg: dict | None = None) -> "Store":
        """Build from the config's `storage` section (root, credentials, endpoint, ...); the
        backend is chosen by the root's scheme and falls back to the AWS_* environment."""
        from storage.backends import backend_for

        cfg = dict(DEFAULTS)
        cfg.update({k: v for k, v in (storage_cfg or {}).items() if v is not None or k == "root"})
        root = str(cfg["root"] or DEFAULTS["root"])
        backend, secrets = backend_for(root, cfg)
        return cls(backend, lock_stale_seconds=cfg["lock_stale_seconds"], cache_dir=cfg["cache_dir"],
                   settings=cfg, secret_values=(cfg["key"], cfg["secret"], *secrets))

    def __repr__(self) -> str:
        return f"Store({self.url('')!r})"

    # ---- paths --------------------------------------------------------------------------
    def path(self, key: str) -> str:
        """The filesystem path (no scheme) of `key`."""
        key = str(key).strip("/")
        return posixpath.join(self.root, key) if key else self.root

    def url(self, key: str) -> str:
        """The full URI of `key` (credential-free)."""
        return scrub_text(self.backend.url(self.path(key)))

    def _rel(self, full: str) -> str:
        full = full.split("://", 1)[-1]
        return posixpath.relpath(full, self.root) if full != self.root else ""

    def _err(self, what: str, key: str, exc: Exception) -> StoreError:
        msg = scrub_text(f"{what} {self.url(key)} failed: {type(exc).__name__}: {exc}",
                         self.secret_values)
        return StoreError(msg)

    @contextlib.contextmanager
    def _errors(self, what: str, key: str, missing=None):
        """Raise a storage failure as StoreError; FileNotFoundError becomes `missing()` when
        given (a value to return through the caller), else a FileNotFoundError naming the key."""
        try:
            yield
        except StoreError:
            raise
        except (FileNotFoundError, NotADirectoryError) as exc:
            if missing is not None:
                raise _Missing() from exc
            raise FileNotFoundError(f"no object at {self.url(key)}") from None
        except Exception as exc:
            raise self._err(what, key, exc) from exc

    # ---- tables written by this process -------------------------------------------------
    def remember_table(self, key: str, sha256: str, table) -> None:
        path = self.path(key)
        with _recent_lock:
            _recent_tables[path] = (sha256, table)
            _recent_tables.move_to_end(path)
            while len(_recent_tables) > RECENT_TABLES_KEPT:
                _recent_tables.popitem(last=False)

    def recent_table(self, key: str, sha256: str):
        """The table this process wrote at `key` if its bytes had this sha256, else None. A hit
        keeps it as recently used: a step's rollout, read by each of its later stages, is still
        here for its update while the next step's stages write theirs (trainer.staleness >= 1)."""
        path = self.path(key)
        with _recent_lock:
            entry = _recent_tables.get(path)
            if entry is not None:
                _recent_tables.move_to_end(path)
        return entry[1] if entry is not None and entry[0] == sha256 else None

    def _forget(self, key: str, recursive: bool = False) -> None:
        path = self.path(key)
        with _recent_lock:
            _recent_tables.pop(path, None)
            if recursive:
                prefix = path.rstrip("/") + "/"
                for p in [p for p in _recent_tables if p.startswith(prefix)]:
                    del _recent_tables[p]

    # ---- bytes --------------------------------------------------------------------------
    def write_bytes(self, key: str, data: bytes) -> int:
        """Write `data` at `key` atomically (local: temp file + rename; S3: one PUT)."""
        self._forget(key)
        with self._errors("write", key):
            self.backend.write_atomic(self.path(key), data)
        return len(data)

    def read_bytes(self, key: str) -> bytes:
        with self._errors("read", key):
            return self.fs.cat_file(self.path(key))

    def open_read(self, key: str):
        """A binary file object of `key` (for reading large objects in chunks)."""
        with self._errors("open", key):
            return self.fs.open(self.path(key), "rb")

    # ---- JSON / parquet -----------------------------------------------------------------
    def write_json(self, key: str, obj) -> int:
        data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode()
        return self.write_bytes(key, data)

    def read_json(self, key: str):
        return json.loads(self.read_bytes(key))

    @staticmethod
    def parquet_bytes(table) -> bytes:
        """Serialise a pyarrow table as zstd parquet."""
        import pyarrow.parquet as pq
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        return buf.getvalue()

    @staticmethod
    def parquet_table(data: bytes):
        import pyarrow.parquet as pq
        return pq.read_table(io.BytesIO(data))

    def write_parquet(self, key: str, table) -> int:
        return self.write_bytes(key, self.parquet_bytes(table))

    def read_parquet(self, key: str):
        return self.parquet_table(self.read_bytes(key))

    # ---- listing and housekeeping -------------------------------------------------------
    def exists(self, key: str) -> bool:
        with self._errors("check", key):
            return bool(self.fs.exists(self.path(key)))

    def list(self, key: str = "") -> list:
        """Sorted names of the immediate children of `key` (empty if it does not exist)."""
        base = self.path(key)
        try:
            with self._errors("list", key, missing=True):
                entries = self.fs.ls(base, detail=False)
        except _Missing:
            return []
        names = {posixpath.basename(e.rstrip("/")) for e in entries
                 if e.rstrip("/").split("://", 1)[-1] != base}
        return sorted(n for n in names if n)

    def find(self, key: str = "") -> list:
        """Every file under `key`, as keys relative to the store root."""
        try:
            with self._errors("list", key, missing=True):
                found = self.fs.find(self.path(key))
        except _Missing:
            return []
        return sorted(self._rel(p) for p in found)

    def size(self, key: str) -> int:
        with self._errors("size of", key):
            return int(self.fs.size(self.path(key)))

    def delete(self, key: str, recursive: bool = False) -> None:
        """Remove `key` (a folder too with recursive=True); missing keys are fine."""
        self._forget(key, recursive)
        path = self.path(key)
        try:
            with self._errors("delete", key, missing=True):
                if recursive:
                    self.backend.delete_tree(path)
                elif self.fs.exists(path):
                    self.fs.rm_file(path)
        except _Missing:
            pass

    def move(self, src: str, dst: str) -> None:
        """Rename a file (local: atomic rename; S3: server-side copy then delete)."""
        self._forget(src)
        self._forget(dst)
        with self._errors(f"move to {self.url(dst)} from", src):
            self.backend.move(self.path(src), self.path(dst))

    def copy(self, src: str, dst: str) -> None:
        """Copy one object (S3: a server-side copy)."""
        self._forget(dst)
        with self._errors(f"copy to {self.url(dst)} from", src):
            self.backend.copy(self.path(src), self.path(dst))

    def copy_folder(self, src: str, dst: str) -> int:
        """Copy every file under `src` to the same relative path under `dst`; returns count."""
        files = self.find(src)
        self._forget(dst, recursive=True)
        for f in files:
            rel = posixpath.relpath(f, src.strip("/"))
            with self._errors(f"copy to {self.url(dst)} from", f):
                self.backend.copy(self.path(f), self.path(posixpath.join(dst, rel)))
        return len(files)

    # ---- local files --------------------------------------------------------------------
    def put_file(self, local_path, key: str) -> None:
        self._forget(key)
        with self._errors("upload to", key):
            self.fs.put_file(str(local_path), self.path(key))

    def get_file(self, key: str, local_path) -> None:
        with self._errors("download of", key):
            self.fs.get_file(self.path(key), str(local_path))


class _Missing(Exception):
    """Internal: the key does not exist (list/find/delete treat that as empty)."""
