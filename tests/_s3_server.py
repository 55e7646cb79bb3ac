"""A real S3 endpoint for tests and benches: moto's server on 127.0.0.1 at a free port, in a
subprocess (the same API MinIO speaks; nothing is mocked in-process)."""
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """`with MotoServer() as srv: srv.endpoint_url` — started, then stopped by PID."""

    def __init__(self, port: int = None):
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout: float = 30.0) -> "MotoServer":
        exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable),
                                                          "moto_server")
        cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "moto.server"]
        env = dict(os.environ)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
            env.pop(name, None)
        self.proc = subprocess.Popen(cmd + ["-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1).read()
                return self
            except Exception:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint_url}")

    def make_bucket(self, name: str, key: str = "testing", secret: str = "testing") -> None:
        import s3fs
        fs = s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=self.endpoint_url,
                               skip_instance_cache=True)
        fs.mkdir(name)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
