"""The README from top to bottom, as a reader runs it: in a copy of this checkout (the files a clone
has), every command of its code blocks, in the order the README gives them, in one bash session,
one checkout and one store:

- `make demo` as a 3-step demo (`python -m flows.demo trainer.total_training_steps=3`, what `make
  demo` runs, shorter: it leaves the same experiment, tiny-cpu, behind); `make test` is this suite;
- the tour's inline steps 1-2 (`stagerl plan`, `stagerl train ... --experiment tour`), then each
  block: inspect, the killed run and its resume, the Prefect deployment (against a real Prefect
  server whose address replaces 127.0.0.1:4200, with the block's own background worker; its
  deployment run is run a second time, which the README says resumes it), forks and rescoring, the
  fork as a deployment run, the batch plan and the real-size model;
- blocks that show output (the demo's last line, the layout) and the elided `stagerl plan ...`
  transcript are not commands: the test names each block it leaves out, so a new one is noticed.

Each command must end with the exit code the README gives it (0; 137 for the run it kills; a
refusal where its comment says refused); then what the experiments left behind is read back."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _prefect_server import PrefectServer, prefect_env, stop

REPO = Path(__file__).resolve().parent.parent
DEMO = "python -m flows.demo trainer.total_training_steps=3"  # `make demo`, 3 steps instead of 40
COMMAND_WORDS = ("make ", "stagerl ", "STAGERL_FAULT=", "sha256sum ", "export ", "prefect ")
# blocks (and transcript lines) that are not commands to run, by their first characters
NOT_RUN = ("make test", "first 5 steps:", "stagerl plan ... trainer.n_gpus_per_node=8")  # and the layout
# exit codes other than 0, by the start of the command
EXIT_CODES = {"STAGERL_FAULT=update:before_manifest@3 stagerl train": 137,  # "the command exits 137"
              "stagerl fork tour tour-hot": 2,  # "refused (exit code 2)"
              "stagerl delete tour": 1}  # "refused while forks reference it"
DEPLOY_RUN = "prefect deployment run 'rl-train/tiny-cpu' --watch -p overrides="
# blocks that build on nothing the tour left but `make demo`'s model and data, run beside this test
# by tests/test_readme_parts.py (the longest test alone would take most of CI's 30 minutes): tour
# step 7 (the calculator task) and the real-size model
ELSEWHERE = {"tools": ("stagerl train --config tools-tiny-cpu", "stagerl inspect tools", "stagerl query --experiment tools ",
                       "stagerl show tools "),
             "real size": ("stagerl model qwen2.5-0.5b", "stagerl plan --config gsm8k-qwen2.5-0.5b")}


def readme_commands(text: str) -> tuple[list[str], list[str]]:
    """(the commands in README order, the starts of the blocks or lines left out). Commands are the
    lines of the fenced blocks (continuations joined; `$ ` transcripts: only their `$` lines), and
    the inline commands of tour steps 1 and 2, which the blocks after them build on."""
    found, skipped = [], []
    for title in ("**1. Plan.**", "**2. Train.**"):
        at = text.index(title)
        found.append((at, re.search(r"`(stagerl [^`]+)`", text[at:]).group(1)))
    for match in re.finditer(r"^```\n(.*?)^```", text, re.S | re.M):
        lines = match.group(1).replace("\\\n", " ").splitlines()
        lines = [" ".join(line.split()) if line.startswith("$ ") else line for line in lines if line.strip()]
        if any(line.startswith("$ ") for line in lines):
            lines = [line[2:] for line in lines if line.startswith("$ ")]
        for line in lines:
            if line.startswith(NOT_RUN) or not line.startswith(COMMAND_WORDS):
                skipped.append(line)
            else:
                found.append((match.start(), line))
    return [line for _, line in sorted(found, key=lambda f: f[0])], skipped


def checkout_copy(dest: Path) -> Path:
    """The files git tracks (as a clone would have them), plus untracked ones not ignored."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def session_script(commands: list[str], logs: Path) -> str:
    """One bash script running each command as written, its output to logs/N.log and its exit code
    and seconds to logs/N.rc (a command's own comment cannot swallow the closing brace)."""
    parts = []
    for i, command in enumerate(commands):
        parts.append(f"t0=$EPOCHREALTIME\n{{ {command}\n}} > {logs}/{i}.log 2>&1 < /dev/null\n"
                     f"echo \"$? $t0 $EPOCHREALTIME\" > {logs}/{i}.rc\n")
    return "".join(parts)


def flow_run_names(api_url: str) -> set:
    request = urllib.request.Request(f"{api_url}/flow_runs/filter", data=b'{"limit": 200}',
                                     headers={"Content-Type": "application/json"}, method="POST")
    return {r["name"] for r in json.loads(urllib.request.urlopen(request, timeout=30).read())}


def test_readme_runs_top_to_bottom_in_one_store(tmp_path):
    text = (REPO / "README.md").read_text()
    commands, skipped = readme_commands(text)
    left_out = [s for s in skipped if not re.match(r"[a-z]+/ ", s)]  # and the layout's lines
    assert len(left_out) == len(NOT_RUN) and all(s.startswith(n) for s, n in zip(left_out, NOT_RUN)), left_out
    assert commands[0].startswith("make demo") and commands[1:3] == [
        "stagerl plan --config tiny-cpu", "stagerl train --config tiny-cpu --experiment tour trainer.total_training_steps=5"]
    elsewhere = tuple(start for starts in ELSEWHERE.values() for start in starts)
    assert [c for c in commands if c.startswith(elsewhere)] == [
        next(c for c in commands if c.startswith(start)) for start in elsewhere]  # each once, in this order
    commands = [c for c in commands if not c.startswith(elsewhere)]
    deploy = commands.index(next(c for c in commands if c.startswith(DEPLOY_RUN)))
    # the demo, shortened; the deployment run again (the README: running it again resumes it)
    commands = [DEMO] + commands[1:deploy + 1] + [commands[deploy]] + commands[deploy + 1:]
    assert len(commands) > 25

    checkout = checkout_copy(tmp_path / "checkout")
    logs = tmp_path / "logs"
    logs.mkdir()
    with PrefectServer(tmp_path / "prefect-server") as server:
        script = session_script([c.replace("http://127.0.0.1:4200/api", server.api_url) for c in commands], logs)
        # the reader's shell: .venv/bin on the PATH, their own Prefect home, no Prefect server set
        env = prefect_env(tmp_path / "prefect-home", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                          PYTHONPATH=str(checkout))
        env.pop("PREFECT_API_URL", None)  # the deploy block exports it
        t0 = time.time()
        proc = subprocess.Popen(["bash", "-c", script], cwd=checkout, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=1700)
        finally:
            stop(proc)  # the session's own processes: the deploy block's background worker too
        seconds = time.time() - t0
        names = flow_run_names(server.api_url)

    results = []
    for i, command in enumerate(commands):
        rc = (logs / f"{i}.rc").read_text().split() if (logs / f"{i}.rc").exists() else ["-", "0", "0"]
        results.append((command, rc[0], float(rc[2]) - float(rc[1]), (logs / f"{i}.log").read_text(errors="replace")
                        if (logs / f"{i}.log").exists() else ""))
    table = "\n".join(f"{rc:>3} {s:7.1f}s  {c[:110]}" for c, rc, s, _ in results)
    print(f"README in order: {seconds:.0f} s\n{table}")
    for command, rc, _, out in results:
        want = next((code for start, code in EXIT_CODES.items() if command.startswith(start)), 0)
        assert rc == str(want), f"{command}\nexit {rc}, README says {want}:\n{out[-5000:]}\n\n{table}"
    out = {c: o for c, _, _, o in results[:deploy] + results[deploy + 2:]}  # the deployment runs: below
    runs = checkout / "runs" / "stagerl"

    assert "fewer than 10 steps: no learning verdict" in out[DEMO]
    demo = json.loads((runs / "tiny-cpu" / "run.json").read_text())
    assert demo["config"]["trainer"]["total_training_steps"] == 3 and demo["total_training_steps"] == 3
    assert (runs / "tiny-cpu" / "weights" / "step_000003" / "_manifest.json").exists()
    fault = next(c for c in commands if c.startswith("STAGERL_FAULT="))
    assert "SIGKILL at update:before_manifest (step 3)" in out[fault]
    sums = out[next(c for c in commands if c.startswith("sha256sum "))].split()
    assert len(sums) == 4 and sums[0] == sums[2], sums  # tour and tour-fault: one sha256
    # the deployment trains its own experiment (not the demo's), and its second run resumes it
    assert (runs / "tiny-cpu-deployed" / "weights" / "step_000002" / "_manifest.json").exists()
    for _, _, _, run in results[deploy:deploy + 2]:
        assert re.search(r"Flow run finished successfully|finished in state Completed", run), run[-3000:]
    assert {"tiny-cpu-deployed · steps 1-2", "tiny-cpu-deployed · steps 1-2 done"} <= names, sorted(names)
    assert not (runs / "tiny-cpu" / "steps" / "000004").exists() and demo["config"]["trainer"]["experiment_name"] == "tiny-cpu"
    hot = next(c for c in commands if c.startswith("stagerl fork tour tour-hot"))
    assert "would change rollout of step 5" in out[hot]
    assert "forks reference its objects" in out[next(c for c in commands if c.startswith("stagerl delete tour"))]
    for experiment, step in (("tour", 5), ("tour-fault", 5), ("tour-rloo", 8), ("tour-strict", 5),
                             ("tour-rloo-deployed", 5)):
        assert (runs / experiment / "weights" / f"step_{step:06d}" / "_manifest.json").exists(), experiment
