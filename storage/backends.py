"""Store backends: where a `Store` (storage/store.py) keeps its objects, one class per kind of
storage, registered by URL scheme. The Store does keys, JSON/parquet, errors and secrets; a
backend does the few things that differ between a local folder and an object store.

    @register_backend("gs")              # e.g. gs:// through gcsfs; Store.from_config picks a
    class MyBackend(Backend):            # backend by the scheme of storage.root
        ...

Every backend wraps an fsspec filesystem (`self.fs`) for the calls they share (ls, find, cat,
put/get file) and implements the ones that differ: an atomic write, a folder delete, a rename.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from storage.registry import register_in


BACKENDS: dict[str, type] = {}  # URL scheme -> Backend subclass


def register_backend(*schemes: str):
    """Class decorator: the Backend for store roots with these URL schemes ("file": local paths)."""
    return register_in(BACKENDS, schemes, "store backend")


class Backend:
    """One kind of storage. `root` is the store root without scheme; `url(path)` adds it back."""

    scheme = ""  # prefix of a full URL ("s3://"; "" for local paths)

    def __init__(self, root: str, fs):
        self.root, self.fs = root, fs

    @classmethod
    def from_settings(cls, root: str, settings: dict) -> tuple["Backend", tuple]:
        """(backend, secret values it was given) for a store root and the `storage` settings."""
        raise NotImplementedError

    def url(self, path: str) -> str:
        return self.scheme + path

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write `data` at `path` so that a reader sees all of it or nothing."""
        raise NotImplementedError

    def delete_tree(self, path: str) -> None:
        """Remove everything under `path` (and `path` itself); nothing there is fine."""
        raise NotImplementedError

    def move(self, src: str, dst: str) -> None:
        raise NotImplementedError

    def copy(self, src: str, dst: str) -> None:
        self.fs.copy(src, dst)


@register_backend("file")
class LocalBackend(Backend):
    """A folder on this machine (or a shared file system)."""

    @classmethod
    def from_settings(cls, root: str, settings: dict):
        import fsspec

        return cls(str(Path(root).expanduser().resolve()), fsspec.filesystem("file", auto_mkdir=True)), ()

    def write_atomic(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # a rename is atomic on POSIX

    def delete_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        if os.path.isfile(path):
            os.remove(path)

    def move(self, src: str, dst: str) -> None:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)

    def copy(self, src: str, dst: str) -> None:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        self.fs.copy(src, dst)


@register_backend("s3", "s3a")
class S3Backend(Backend):
    """An S3 bucket/prefix (AWS, MinIO, moto) through s3fs. Credentials: the settings' key and
    secret, else those embedded in the root URL (s3://KEY:SECRET@bucket/p; accepted, not kept),
    else the AWS_* environment; endpoint and region likewise."""

    scheme = "s3://"

    @classmethod
    def from_settings(cls, root: str, settings: dict):
        import s3fs

        env = os.environ
        key = settings.get("key") or env.get("AWS_ACCESS_KEY_ID")
        secret = settings.get("secret") or env.get("AWS_SECRET_ACCESS_KEY")
        endpoint = (settings.get("endpoint_url") or env.get("AWS_ENDPOINT_URL_S3")
                    or env.get("AWS_ENDPOINT_URL"))
        region = settings.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        rest = root.split("://", 1)[1]
        if "@" in rest and ":" in rest.split("@", 1)[0]:  # the secret may contain '/'
            creds, rest = rest.split("@", 1)
            k, _, s = creds.partition(":")
            key, secret = key or k or None, secret or s or None
        client_kwargs = {"region_name": region} if region else None  # never defaulted: moto
        retries = settings.get("s3_retries")
        config_kwargs = {} if retries is None else {"retries": {"total_max_attempts": int(retries) + 1}}
        fs = s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=endpoint,
                               client_kwargs=client_kwargs, config_kwargs=config_kwargs,
                               use_listings_cache=False, skip_instance_cache=True)
        if retries is not None:
            fs.retries = int(retries) + 1  # s3fs's attempts of a call (its own backoff between them)
        return cls(rest.rstrip("/"), fs), (key, secret)

    def write_atomic(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)  # one PUT: an object appears whole or not at all

    def delete_tree(self, path: str) -> None:
        if self.fs.find(path):
            self.fs.rm(path, recursive=True)  # batched DeleteObjects

    def move(self, src: str, dst: str) -> None:
        self.fs.copy(src, dst)  # server-side copy, then delete
        self.fs.rm_file(src)


def backend_for(root: str, settings: dict) -> tuple[Backend, tuple]:
    """The registered backend for a store root ("s3://bucket/p", a local path) and its secrets."""
    scheme = root.split("://", 1)[0] if "://" in root else "file"
    if scheme not in BACKENDS:
        raise ValueError(f"storage.root {root!r}: no store backend for '{scheme}://' "
                         f"(registered: {', '.join(sorted(BACKENDS))}; see storage/backends.py)")
    return BACKENDS[scheme].from_settings(root, settings)
