"""The README's "Deploy with Prefect" block, run as written: in a copy of this checkout where
`make demo` has built the tiny model and data, against a real Prefect server (the block's
127.0.0.1:4200 replaced by the test server's address), with its background worker. Every
command must exit 0 and the watched flow run must complete, leaving step 2's weights."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from _prefect_server import PrefectServer, stop

REPO = Path(__file__).resolve().parent.parent


def readme_block(title: str) -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index(title):]
    return re.search(r"```\n(.*?)```", section, re.S).group(1)


def checkout_copy(dest: Path) -> Path:
    """The files git tracks (as a clone would have them), plus untracked ones not ignored."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def test_readme_deploy_block_runs_as_written(tmp_path):
    block = readme_block("**5. Deploy with Prefect.**")
    assert "prefect deploy --name tiny-cpu" in block and "--watch" in block
    checkout = checkout_copy(tmp_path / "checkout")
    subprocess.run([sys.executable, "-c", "from configs.loader import load_config; from flows.demo import "
                    "prepare; prepare(load_config('tiny-cpu'))"], cwd=checkout, check=True,
                   env={**os.environ, "PYTHONPATH": str(checkout)})  # what `make demo` built first
    with PrefectServer(tmp_path / "prefect-home") as server:
        script = block.replace("http://127.0.0.1:4200/api", server.api_url)
        env = server.env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                         PYTHONPATH=str(checkout))
        env.pop("PREFECT_API_URL", None)  # the block exports it
        log = tmp_path / "block.log"  # a file: the background worker keeps a pipe open after bash ends
        with log.open("w") as sink:
            proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=checkout, env=env, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=900)
            finally:
                stop(proc)  # the block's own session: its background worker too
        out = log.read_text()
    assert proc.returncode == 0, out[-5000:]
    assert "Created work pool 'cpu'" in out and "Deployment 'rl-train/tiny-cpu' successfully created" in out
    assert re.search(r"Flow run finished successfully|finished in state Completed", out), out[-3000:]
    weights = checkout / "runs" / "stagerl" / "tiny-cpu" / "weights" / "step_000002" / "_manifest.json"
    assert weights.exists(), sorted(p.name for p in (checkout / "runs").rglob("*"))[:50]
