"""The run layout in the store (docs/architecture.md). The only module that spells out keys.

    {project}/{experiment}/run.json
    {project}/{experiment}/steps/{step:06d}/{stage}.parquet
    {project}/{experiment}/steps/{step:06d}/update/metrics.json
    {project}/{experiment}/steps/{step:06d}/update/microbatches.parquet
    {project}/{experiment}/steps/{step:06d}/_manifests/{stage}.json
    {project}/{experiment}/weights/step_{k:06d}/
    {project}/{experiment}/train_state/
    {project}/{experiment}/plots/{name}.png
    {project}/{experiment}/forks/{fork}.json          the forks that reference this run's objects
"""
import re

STAGES = ("rollout", "logprob", "reward", "advantage", "update")
# Stages that run once before step 1, recorded under step 0 (the optional supervised warm start).
SETUP_STAGES = ("warmstart",)
# Files each stage writes, relative to its step folder.
STAGE_FILES = {
    "rollout": ("rollout.parquet",),
    "logprob": ("logprob.parquet",),
    "reward": ("reward.parquet",),
    "advantage": ("advantage.parquet",),
    "update": ("update/metrics.json", "update/microbatches.parquet"),
    "warmstart": ("warmstart/metrics.json",),
}
# The rollout's optional file of a multi-turn step: one row per assistant turn and per tool call.
TURNS_FILE = "rollout/turns.parquet"
LOCK_NAME = "_lock.json"
MAX_NAME = 128  # characters of a project or experiment name (file systems allow 255 per name)
WEIGHTS_MANIFEST = "_manifest.json"
_STEP_RE = re.compile(r"^\d{6,}$")
_WEIGHTS_RE = re.compile(r"^step_(\d{6,})$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class InvalidName(ValueError):
    """An invalid project or experiment name."""


def check_name(name, what: str = "name") -> str:
    """Validate a project/experiment name: non-empty, no '..', no slash, no control chars."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidName(f"invalid {what} {name!r}: must be a non-empty string")
    if _CONTROL.search(name):
        raise InvalidName(f"invalid {what} {name!r}: contains control characters")
    if "/" in name or "\\" in name:
        raise InvalidName(f"invalid {what} {name!r}: must not contain a slash")
    if ".." in name:
        raise InvalidName(f"invalid {what} {name!r}: must not contain '..'")
    if name.strip() != name or name == ".":
        raise InvalidName(f"invalid {what} {name!r}: no leading/trailing spaces, not '.'")
    if len(name) > MAX_NAME:
        raise InvalidName(f"invalid {what} {name[:40]!r}... ({len(name)} characters): at most {MAX_NAME} "
                          f"(a folder name in the store)")
    return name


def check_stage(stage: str) -> str:
    if stage not in STAGES + SETUP_STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES + SETUP_STAGES)}")
    return stage


def check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"invalid step {step!r}: must be an integer >= 0")
    return step


class RunLayout:
    """Keys (relative to the store root) of one experiment's run."""

    def __init__(self, project: str, experiment: str):
        self.project = check_name(project, "project name")
        self.experiment = check_name(experiment, "experiment name")
        self.base = f"{project}/{experiment}"

    @classmethod
    def from_config(cls, config: dict) -> "RunLayout":
        trainer = config.get("trainer", {})
        return cls(trainer.get("project_name"), trainer.get("experiment_name"))

    @staticmethod
    def find(store, name: str) -> tuple[str, str]:
        """(project, experiment) of EXPERIMENT or PROJECT/EXPERIMENT that has a run.json in
        `store`; LookupError naming the name otherwise (none, an invalid name, or several)."""
        if "/" in name:
            project, experiment = name.split("/", 1)
            candidates = [(project, experiment)]
        else:
            candidates = [(p, name) for p in store.list("")]
        try:
            found = [c for c in candidates if store.exists(RunLayout(*c).run_json)]
        except ValueError as exc:  # InvalidName: '..', '/', empty parts
            raise LookupError(f"experiment {name!r}: {exc}") from None
        if not found:
            raise LookupError(f"no experiment {name!r} with a run.json under {store.url('')}")
        if len(found) > 1:
            raise LookupError(f"experiment {name!r} exists in several projects "
                              f"({', '.join(p for p, _ in found)}): give PROJECT/EXPERIMENT")
        return found[0]

    def __repr__(self) -> str:
        return f"RunLayout({self.base!r})"

    @property
    def run_json(self) -> str:
        return f"{self.base}/run.json"

    @property
    def lock(self) -> str:
        return f"{self.base}/{LOCK_NAME}"

    @property
    def steps_dir(self) -> str:
        return f"{self.base}/steps"

    def step_dir(self, step: int) -> str:
        return f"{self.steps_dir}/{check_step(step):06d}"

    def stage_file(self, step: int, name: str) -> str:
        """Key of a file `name` (e.g. 'update/metrics.json') in the step folder."""
        return f"{self.step_dir(step)}/{name}"

    def artifact(self, step: int, stage: str) -> str:
        """Key of a stage's main artifact (update: its microbatches table)."""
        files = STAGE_FILES[check_stage(stage)]
        return self.stage_file(step, files[-1] if stage == "update" else files[0])

    def update_metrics(self, step: int) -> str:
        return self.stage_file(step, "update/metrics.json")

    def update_microbatches(self, step: int) -> str:
        return self.stage_file(step, "update/microbatches.parquet")

    def manifests_dir(self, step: int) -> str:
        return f"{self.step_dir(step)}/_manifests"

    def manifest(self, step: int, stage: str) -> str:
        return f"{self.manifests_dir(step)}/{check_stage(stage)}.json"

    @property
    def weights_dir(self) -> str:
        return f"{self.base}/weights"

    def weights(self, k: int) -> str:
        return f"{self.weights_dir}/step_{check_step(k):06d}"

    def critic_weights(self, k: int) -> str:
        """The critic after step k (an HF token-classification folder), what step k+1's values use."""
        return f"{self.weights_dir}/critic_step_{check_step(k):06d}"

    def plot(self, name: str) -> str:
        return f"{self.base}/plots/{name}"

    @property
    def train_state(self) -> str:
        return f"{self.base}/train_state"

    def heartbeat(self, step: int, stage: str) -> str:
        """The heartbeat a stage's flow run on another machine writes (flows/stage_watch.py)."""
        return f"{self.base}/_live/{check_step(step):06d}/{check_stage(stage)}.json"

    def transfer(self, step: int, stage: str) -> str:
        """Where ranks on other machines leave files for the machine that launched them (no shared
        file system: stages/ranks/files.py); removed once that machine has fetched them."""
        return f"{self.base}/_transfer/{check_step(step):06d}/{check_stage(stage)}"

    @property
    def forks_dir(self) -> str:
        return f"{self.base}/forks"

    def fork_record(self, experiment: str) -> str:
        """The record of fork `experiment` (same project) that references this run's objects."""
        return f"{self.forks_dir}/{check_name(experiment, 'experiment name')}.json"


def owner_base(key: str) -> str:
    """'{project}/{experiment}' of a key in the store: the run whose folder holds the object."""
    parts = str(key).strip("/").split("/")
    if len(parts) < 2:
        raise ValueError(f"{key!r} is not a key of (or inside) a run folder")
    return f"{parts[0]}/{parts[1]}"


def parse_step(name: str):
    """'000012' -> 12; anything else -> None."""
    return int(name) if _STEP_RE.match(name) else None


def parse_weights_step(name: str):
    """'step_000012' -> 12; anything else -> None."""
    m = _WEIGHTS_RE.match(name)
    return int(m.group(1)) if m else None


def temp_key(key: str, token: str) -> str:
    """A temporary sibling of `key`; never listed in a manifest, never read."""
    return f"{key}.tmp-{token}"

