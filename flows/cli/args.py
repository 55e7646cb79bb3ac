"""The arguments several `stagerl` commands share, each added by one function so that its name,
default and help read the same in every command: --config and the dotted overrides, --root, the
EXPERIMENT positional, --force-lock, --json, and the run arguments of the read-side commands."""

OVERRIDES_HELP = "dotted overrides as in verl/Hydra: a.b=c, +a.b=c (add), ++a.b=c, ~a.b (delete)"
RUN_HELP = "trainer.experiment_name of the run"


def add_config(parser, default: str | None = None) -> None:
    """--config NAME. Commands that read a run default to tiny-cpu (its storage.* and
    trainer.project_name); the others to None/base, verl's defaults."""
    if default == "tiny-cpu":
        help_text = ("config name in configs/ or a YAML path (default: tiny-cpu): its storage.* and "
                     "trainer.project_name locate the run")
    else:
        help_text = ("config name in configs/ or a YAML path (default: base = verl's defaults, so a verl "
                     "command line means what it means in verl; the CPU demo is tiny-cpu)")
    parser.add_argument("--config", default=default, help=help_text)
    parser.add_argument("--config-path", default=None,
                        help="Hydra's, as verl's command lines give it: the folder of --config-name")
    parser.add_argument("--config-name", default=None,
                        help="Hydra's: a verl config file (NAME.yaml in --config-path) merged on base; its "
                             "`defaults: [ppo_trainer, _self_]` are verl's defaults, i.e. base")


def hydra_config(args) -> str | None:
    """verl's `--config-path DIR --config-name NAME` (Hydra) as `--config DIR/NAME.yaml`; an error
    message when the pair does not name a file."""
    name = getattr(args, "config_name", None)
    if name is None:
        return None if getattr(args, "config_path", None) is None else "--config-path needs --config-name (Hydra's pair)"
    from pathlib import Path

    path = Path(args.config_path or ".") / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if not path.is_file():
        return f"--config-path {args.config_path} --config-name {name}: no config file {path}"
    args.config = str(path)
    return None


def add_overrides(parser, note: str = "", trailing: bool = False) -> None:
    """The KEY=VALUE positionals. `trailing`: overrides may also follow an option
    (`stagerl fork SRC NEW --at 3:advantage key=value`, see flows.cli.main)."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=note + OVERRIDES_HELP)
    if trailing:
        parser.set_defaults(trailing_overrides=True)


def add_config_args(parser) -> None:
    """--config NAME and trailing dotted overrides: a command that loads a config."""
    add_config(parser)
    add_overrides(parser)


def add_experiment(parser, dest: str = "experiment", label: str = "") -> None:
    """The run in the store a command acts on (EXP, found in any project, or PROJECT/EXP)."""
    parser.add_argument(dest, help=f"{label}EXPERIMENT or PROJECT/EXPERIMENT in the store")


def add_root(parser, from_config: bool = False) -> None:
    """--root URL; its default is $STAGERL_ROOT, else ./runs or (`from_config`) the config's."""
    if from_config:
        default = ("$STAGERL_ROOT, else the config's storage.root); S3 credentials and endpoint come "
                   "from the config's storage.* or AWS_* variables")
    else:
        default = "$STAGERL_ROOT, else ./runs); S3 credentials come from the AWS_* environment variables"
    parser.add_argument("--root", default=None,
                        help=f"store root: a local path or s3://bucket/prefix (default: {default}")


def add_force_lock(parser) -> None:
    parser.add_argument("--force-lock", action="store_true",
                        help="break the experiment lock held by another writer")


def add_json(parser, what: str = "") -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what + ' as ' if what else ''}JSON")


def add_run_arguments(parser, experiment: bool = True) -> None:
    """The run a read-side command opens (flows.read.inspect_lib.open_view): EXPERIMENT,
    --project, --root and the --config giving the store's settings."""
    if experiment:
        parser.add_argument("experiment", help=RUN_HELP)
    parser.add_argument("--project", default=None, help="trainer.project_name (default: the config's)")
    add_root(parser, from_config=True)
    add_config(parser, "tiny-cpu")
