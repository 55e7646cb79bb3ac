"""`Store`: one small API over fsspec for a local folder or `s3://bucket/prefix`.

Every method takes a *key*: a posix path relative to the store root ("proj/exp/run.json").
`store.url(key)` gives the full URI (what flows pass between tasks)."""
import io
import json
import os
import posixpath
import uuid
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
}


class StoreError(RuntimeError):
    """A storage operation failed (message names the key)."""


class Store:
    """A local folder or an S3 prefix, behind the same calls."""

    def __init__(self, root: str, fs, *, lock_stale_seconds: float = 3600, cache_dir=None,
                 secret_values=(), settings=None):
        self.fs = fs
        self.is_s3 = str(root).startswith(("s3://", "s3a://"))
        if self.is_s3:
            self.root = str(root).split("://", 1)[1].rstrip("/")
            self.scheme = "s3://"
        else:
            self.root = str(Path(root).expanduser().resolve())
            self.scheme = ""
        self.lock_stale_seconds = float(lock_stale_seconds)
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "stagerl").expanduser()
        self.secret_values = tuple(v for v in secret_values if v)
        self._settings = dict(settings or {})

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, storage_cfg: dict | None = None) -> "Store":
        """Build from the config's `storage` section; S3 credentials fall back to AWS_* env."""
        cfg = dict(DEFAULTS)
        cfg.update({k: v for k, v in (storage_cfg or {}).items() if v is not None or k == "root"})
        root = str(cfg["root"] or DEFAULTS["root"])
        common = dict(lock_stale_seconds=cfg["lock_stale_seconds"], cache_dir=cfg["cache_dir"],
                      settings=cfg)
        if not root.startswith(("s3://", "s3a://")):
            import fsspec
            return cls(root, fsspec.filesystem("file", auto_mkdir=True),
                       secret_values=(cfg["key"], cfg["secret"]), **common)
        import s3fs
        env = os.environ
        key = cfg["key"] or env.get("AWS_ACCESS_KEY_ID")
        secret = cfg["secret"] or env.get("AWS_SECRET_ACCESS_KEY")
        endpoint = cfg["endpoint_url"] or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        region = cfg["region"] or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        # Credentials embedded in the root URL (s3://AK:SK@bucket/prefix) are accepted, not kept.
        scheme, rest = root.split("://", 1)
        if "@" in rest and ":" in rest.split("@", 1)[0]:  # the secret may contain '/'
            creds, rest = rest.split("@", 1)
            k, _, s = creds.partition(":")
            key, secret = key or k or None, secret or s or None
            root = f"{scheme}://{rest}"
        client_kwargs = {}
        if region:  # never defaulted: region_name=us-east-1 breaks bucket creation on moto
            client_kwargs["region_name"] = region
        fs = s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=endpoint,
                               client_kwargs=client_kwargs or None, use_listings_cache=False,
                               skip_instance_cache=True)
        return cls(root, fs, secret_values=(key, secret), **common)

    def with_cache_dir(self, cache_dir) -> "Store":
        """The same store with another local cache folder."""
        other = Store.__new__(Store)
        other.__dict__.update(self.__dict__)
        other.cache_dir = Path(cache_dir)
        return other

    def __repr__(self) -> str:
        return f"Store({self.url('')!r})"

    # ---- paths --------------------------------------------------------------------------
    def path(self, key: str) -> str:
        """The filesystem path (no scheme) of `key`."""
        key = str(key).strip("/")
        return posixpath.join(self.root, key) if key else self.root

    def url(self, key: str) -> str:
        """The full URI of `key` (credential-free)."""
        return scrub_text(self.scheme + self.path(key))

    def _rel(self, full: str) -> str:
        full = full.split("://", 1)[-1] if self.is_s3 else full
        return posixpath.relpath(full, self.root) if full != self.root else ""

    def _err(self, what: str, key: str, exc: Exception) -> StoreError:
        msg = scrub_text(f"{what} {self.url(key)} failed: {type(exc).__name__}: {exc}",
                         self.secret_values)
        return StoreError(msg)

    # ---- bytes --------------------------------------------------------------------------
    def write_bytes(self, key: str, data: bytes) -> int:
        """Write `data` at `key` atomically (local: temp file + rename; S3: one PUT)."""
        path = self.path(key)
        try:
            if self.is_s3:
                self.fs.pipe_file(path, data)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
        except Exception as exc:
            raise self._err("write", key, exc) from exc
        return len(data)

    def read_bytes(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(key))
        except FileNotFoundError:
            raise FileNotFoundError(f"no object at {self.url(key)}") from None
        except Exception as exc:
            raise self._err("read", key, exc) from exc

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
        return bool(self.fs.exists(self.path(key)))

    def list(self, key: str = "") -> list:
        """Sorted names of the immediate children of `key` (empty if it does not exist)."""
        try:
            entries = self.fs.ls(self.path(key), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = self.path(key)
        names = {posixpath.basename(e.rstrip("/")) for e in entries
                 if e.rstrip("/").split("://", 1)[-1] != base}
        return sorted(n for n in names if n)

    def find(self, key: str = "") -> list:
        """Every file under `key`, as keys relative to the store root."""
        try:
            found = self.fs.find(self.path(key))
        except FileNotFoundError:
            return []
        return sorted(self._rel(p) for p in found)

    def size(self, key: str) -> int:
        return int(self.fs.size(self.path(key)))

    def delete(self, key: str, recursive: bool = False) -> None:
        """Remove `key` (a folder too with recursive=True); missing keys are fine."""
        path = self.path(key)
        try:
            if recursive and not self.is_s3:
                import shutil
                shutil.rmtree(path, ignore_errors=True)
                if os.path.isfile(path):
                    os.remove(path)
            elif recursive:
                if self.fs.find(path):
                    self.fs.rm(path, recursive=True)  # batched DeleteObjects
            elif self.fs.exists(path):
                self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def move(self, src: str, dst: str) -> None:
        """Rename a file (local: atomic rename; S3: server-side copy then delete)."""
        if self.is_s3:
            self.fs.copy(self.path(src), self.path(dst))
            self.fs.rm_file(self.path(src))
        else:
            os.makedirs(os.path.dirname(self.path(dst)), exist_ok=True)
            os.replace(self.path(src), self.path(dst))

    def copy_folder(self, src: str, dst: str) -> int:
        """Copy every file under `src` to the same relative path under `dst`; returns count."""
        files = self.find(src)
        for f in files:
            rel = posixpath.relpath(f, src.strip("/"))
            target = self.path(posixpath.join(dst, rel))
            if not self.is_s3:
                os.makedirs(os.path.dirname(target), exist_ok=True)
            self.fs.copy(self.path(f), target)
        return len(files)

    # ---- local files --------------------------------------------------------------------
    def put_file(self, local_path, key: str) -> None:
        try:
            self.fs.put_file(str(local_path), self.path(key))
        except Exception as exc:
            raise self._err("upload to", key, exc) from exc

    def get_file(self, key: str, local_path) -> None:
        try:
            self.fs.get_file(self.path(key), str(local_path))
        except FileNotFoundError:
            raise FileNotFoundError(f"no object at {self.url(key)}") from None
        except Exception as exc:
            raise self._err("download of", key, exc) from exc
