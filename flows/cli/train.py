"""`stagerl train [--config NAME] [key=value ...]` and `stagerl resume EXPERIMENT [--root URL]`:
both run the `rl-train` Prefect flow (the same one the rl-train/* deployments run).

Without PREFECT_API_URL the flow runs against a local `prefect server start` child (SQLite in a
scratch PREFECT_HOME: the store's .cache/prefect for a local store, else ./.cache/prefect;
analytics off) that stops when the command ends and also when it is killed (flows.prefect_server:
PR_SET_PDEATHSIG), so training works offline and leaves no server behind."""
import contextlib
import importlib
import os
from pathlib import Path

from flows.cli.args import add_config, add_experiment, add_force_lock, add_overrides, add_root


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train (or continue) an experiment as a Prefect flow")
    add_config(p, "base")
    p.add_argument("--experiment", default=None, help="trainer.experiment_name (run folder name)")
    add_force_lock(p)
    add_overrides(p)
    p.set_defaults(func=run_train)

    r = subparsers.add_parser("resume", help="continue an experiment at its first incomplete stage")
    add_experiment(r)
    add_root(r)
    add_force_lock(r)
    r.add_argument("--no-verify", action="store_true",
                   help="continue without first checking the stored files against their checksums")
    r.set_defaults(func=run_resume)


def prefect_env(storage_root: str | None) -> None:
    """Offline defaults when no Prefect server is configured (set before prefect is imported).
    Alone (bench/step.py) Prefect then starts its own temporary server for the flow; `stagerl
    train` starts one that dies with it instead (local_prefect_server)."""
    if os.environ.get("PREFECT_API_URL"):
        return
    root = storage_root or "./runs"
    base = Path(os.path.expanduser(root)) if "://" not in root else Path(".")
    home = Path(os.environ.setdefault("PREFECT_HOME", str((base / ".cache" / "prefect").resolve())))
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


@contextlib.contextmanager
def local_prefect_server(next_step: str = "stagerl resume EXPERIMENT"):
    """Without PREFECT_API_URL: a `prefect server start` child in PREFECT_HOME (see prefect_env)
    that dies with this process, as PREFECT_API_URL while the block runs. Its URL is set before
    prefect is imported (Prefect reads its settings at import), and the flow modules (torch,
    transformers) are imported while the server starts. Should the server die during the block,
    the run is stopped within seconds with a message naming it and `next_step`
    (LocalServer.watch)."""
    if os.environ.get("PREFECT_API_URL"):
        yield None
        return
    from flows.prefect_server import local_server

    timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
    with local_server(os.environ["PREFECT_HOME"]) as server:
        os.environ["PREFECT_API_URL"] = server.api_url
        try:
            importlib.import_module("flows.train")
            from prefect.settings import PREFECT_API_URL, temporary_settings

            server.wait_healthy(timeout)
            print(f"Prefect: local server {server.api_url} up in {server.started_s:.1f}s "
                  f"(home {os.environ['PREFECT_HOME']}; set PREFECT_API_URL to use another)",
                  flush=True)
            server.watch(next_step)
            with temporary_settings({PREFECT_API_URL: server.api_url}):  # if prefect was imported
                try:
                    yield server
                finally:
                    if server.died is None:  # else nothing can take what they hold
                        drain_prefect_senders()
                    server.unwatch()
        finally:
            os.environ.pop("PREFECT_API_URL", None)


def drain_prefect_senders(timeout: float = 10.0) -> None:
    """Send the logs and events Prefect still holds before the server stops (else its senders
    retry against a closed port for a minute at exit)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for sender in (APILogWorker, EventsWorker):
        try:
            sender.drain_all(timeout=timeout)
        except Exception as exc:  # never hide the run's own outcome
            print(f"warning: could not flush Prefect {sender.__name__}: {exc}")


def _run_flow(config: str, overrides: list, experiment, force_lock: bool, fork: dict | None = None) -> int:
    """The rl-train flow on a local Prefect server (see local_prefect_server); with `fork`, the
    experiment is first made a fork (flows.fork: `overrides` are then the fork's own)."""
    import gc

    gc.disable()  # the start-up (torch, transformers, Prefect, DeepSpeed) without automatic
    #               collections: flows.train.freeze_heap turns them on after the first step
    from configs.loader import load_config
    from configs.schema import ConfigError
    from stages.ranks.zygote import prestart
    from storage.layout import InvalidName, RunLayout

    spawner = None
    try:
        try:  # refuse a bad config or plan (or fork) before any Prefect start-up
            whole = (config, overrides)
            if fork:  # flows.fork imports no Prefect at load: PREFECT_HOME is not set yet
                from flows.fork import fork_arguments

                whole = fork_arguments(config, overrides, fork)
            cfg = load_config(whole[0], list(whole[1]) + (
                [f"trainer.experiment_name={experiment}"] if experiment else []))
            RunLayout.from_config(cfg)  # the project and experiment names (InvalidName)
            spawner = prestart(cfg)  # the run's fork server imports torch while the rest starts:
            # before this process imports torch itself (the plan's modules below do, ~1.5 s)
            from configs.local_paths import check_local_paths
            from configs.memory import check_fits, check_host_fits, estimate_memory
            from configs.plan import check_trainable
            from configs.suggest import make_plan

            plan = make_plan(cfg)
            check_trainable(cfg)
            check_local_paths(cfg)
            estimate = estimate_memory(cfg, plan)
            check_fits(cfg, estimate)  # with a known device size
            check_host_fits(cfg, plan, estimate)  # the CPU: engines and ranks in this host's memory
            check_rows(cfg)  # every row usable: refused here, before anything is written or started
            if fork:
                from flows.fork import check_fork, preexisting_fork
                from storage.store import Store

                prefect_env(cfg["storage"]["root"])  # check_fork reads the stage modules (flows.step: Prefect)
                store = Store.from_config(cfg["storage"])
                if not preexisting_fork(store, cfg, fork):
                    check_fork(store, cfg, plan, fork)
            else:  # a rerun: a changed config refused, a total at or below the steps done has nothing to run
                from flows.rerun import RunConfigChanged, check_rerun
                from storage.store import Store

                try:
                    nothing = check_rerun(Store.from_config(cfg["storage"]), RunLayout.from_config(cfg), cfg)
                except RunConfigChanged:
                    raise
                except Exception:  # noqa: BLE001 - e.g. the store not reachable yet: the flow checks again
                    nothing = None
                if nothing:
                    print(nothing)
                    return 0
        except (ConfigError, LookupError, InvalidName) as exc:
            print(f"error: {exc}")
            return 2
        return _train_on_server(cfg, config, overrides, experiment, force_lock, fork)
    finally:  # the fork server prestart offered the flow (closed by then) or nobody took
        if spawner is not None:
            spawner.close()


def check_rows(cfg: dict) -> None:
    """A train or validation row the run could not use (stages.data.dataset.check_dataset_rows)
    as a ConfigError naming its file, row and column: exit 2 before the run writes or starts
    anything (the flow would refuse it too, at load, after the Prefect server started)."""
    from configs.schema import ConfigError
    from stages.data.dataset import check_dataset_rows

    try:
        check_dataset_rows(cfg)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise ConfigError(exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)) from None


def _train_on_server(cfg: dict, config: str, overrides: list, experiment, force_lock: bool, fork) -> int:
    prefect_env(cfg["storage"]["root"])
    from storage.secrets import held_secret_overrides, split_secret_overrides

    overrides, secret = split_secret_overrides(overrides)  # credentials stay out of Prefect's database:
    with local_prefect_server(resume_command(cfg)) as server, \
            held_secret_overrides(secret) as token:  # the flow gets a token that stands for them
        from flows.train import train

        try:
            state = train(config=config, overrides=list(overrides), experiment_name=experiment,
                          force_lock=force_lock, return_state=True, **({"fork": fork} if fork else {}),
                          **({"secret_overrides": token} if token else {}))
        except KeyboardInterrupt:
            if server is None or server.died is None:
                raise
            return 1  # the watch printed why, and what to run next
        except Exception as exc:  # Prefect's own API calls (creating or ending the flow run)
            note = prefect_api_error(exc, server, resume_command(cfg))
            if note is None:
                raise
            print(note)
            return 1
        if server is not None and server.died is not None:
            return 1
        if not state.is_completed():
            try:
                state.result()
            except Exception as exc:
                next_step = resume_command(cfg)
                print(prefect_api_error(exc, server, next_step) or failure_message(exc, next_step))
            return 1
        return 0


def failure_message(exc: BaseException, next_step: str) -> str:
    """What a failed run prints last: its error, then (its own last line) the commit that failed,
    if one did, and the command that continues the run once the cause is fixed."""
    from stages.session import DeferredCommitError

    text = f"error: training failed: {type(exc).__name__}: {exc}"
    if isinstance(exc, DeferredCommitError):
        return (f"{text}\nerror: the {exc.stage} of step {exc.step} trained, but its commit to the store "
                f"failed ({exc.cause}); once the store takes writes again, `{next_step}` runs it again")
    return f"{text}\nto continue once the cause is fixed: `{next_step}`"


LOW_DISK_BYTES = 64 << 20  # below this, a Prefect server error is put down to a full disk


def prefect_api_error(exc: BaseException, server, next_step: str) -> str | None:
    """The message for a failure of the Prefect API itself (prefect_server_error: it answered
    5xx; prefect_api_gone: it stopped answering), or None for other errors."""
    return prefect_server_error(exc, server, next_step) or prefect_api_gone(exc, server, next_step)


def api_url(server) -> str:
    """The Prefect API the run talks to: the local server `stagerl train` started, or PREFECT_API_URL."""
    return server.api_url if server is not None else os.environ.get("PREFECT_API_URL", "?")


def prefect_server_error(exc: BaseException, server, next_step: str) -> str | None:
    """The message for an HTTP 5xx answer of the Prefect server, or None for other errors.
    SQLite on a full disk makes the server answer "500 Internal Server Error" (and its log may
    not be writable either), so the free space of PREFECT_HOME is looked at and named."""
    import shutil

    status = getattr(getattr(exc, "response", None), "status_code", None)
    if not isinstance(status, int) or status < 500:
        return None
    url = api_url(server)
    home = os.environ.get("PREFECT_HOME")
    free = shutil.disk_usage(home).free if server is not None and home and os.path.isdir(home) else None
    if free is not None and free < LOW_DISK_BYTES:
        return (f"error: the local Prefect server ({url}) cannot write its database: the disk of "
                f"PREFECT_HOME {home} is full ({free / 1e6:.1f} MB free; \"No space left on "
                f"device\"), so it answered HTTP {status}. The run's data in the store is intact: "
                f"free space there (or set PREFECT_HOME to a folder with room), then `{next_step}`")
    log = f" (its log: {server.log})" if server is not None else ""
    return (f"error: the Prefect server {url}{log} answered HTTP {status}: {exc}. The run's data in "
            f"the store is intact: once the server is healthy, `{next_step}`")


def prefect_api_gone(exc: BaseException, server, next_step: str) -> str | None:
    """The message for a Prefect API that stopped answering (no connection, a timeout: the
    client's retries spent), or None for other errors. The steps go on without it (a stage
    needs only the store; the step reports wait: flows.step_report), so what fails is Prefect's
    record of the flow run's end."""
    import httpx

    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, httpx.TransportError):
            return (f"error: the Prefect API {api_url(server)} stopped answering "
                    f"({type(exc).__name__}: {exc}), so Prefect could not record how the flow run "
                    f"ended. The run's data in the store is intact (a stage is complete when its "
                    f"manifest is): once the API answers again, `{next_step}` continues after the "
                    f"last complete stage")
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def resume_command(cfg: dict) -> str:
    """The command that continues this run (credentials in the store URL left out)."""
    import shlex

    from storage.secrets import scrub_text

    trainer = cfg["trainer"]
    name = f"{trainer['project_name']}/{trainer['experiment_name']}"
    return f"stagerl resume {shlex.quote(name)} --root {shlex.quote(scrub_text(str(cfg['storage']['root'])))}"


def run_train(args) -> int:
    return _run_flow(args.config, args.overrides, args.experiment, args.force_lock)


def resume_arguments(doc: dict, root: str | None) -> tuple[str, list, str]:
    """(config, overrides, experiment_name) that recreate the run's config from its run.json."""
    from storage.secrets import is_scrubbed_override

    source = doc.get("source") or {}
    stored = source.get("overrides") or []
    overrides = [o for o in stored if not o.startswith("storage.root=") and not is_scrubbed_override(o)]
    if root:
        overrides.append(f"storage.root={root}")
    else:
        overrides += [o for o in stored if o.startswith("storage.root=") and not is_scrubbed_override(o)]
    return source.get("config") or "tiny-cpu", overrides, doc.get("experiment")


def run_resume(args) -> int:
    from flows.read.inspect_lib import find_experiment_or_say
    from storage.artifacts import read_run_json
    from storage.layout import RunLayout

    found = find_experiment_or_say(args)
    if found is None:
        return 2
    store, root, project, experiment = found
    doc = read_run_json(store, RunLayout(project, experiment))
    if not args.no_verify:  # a damaged file of a complete stage would otherwise go unnoticed
        from flows.cli.verify import check_run

        if not check_run(store, project, experiment, root):
            print("error: not resuming a run with damaged files (--no-verify to resume anyway)")
            return 1
    from storage.secrets import is_scrubbed_override, scrub_override

    config, overrides, experiment = resume_arguments(doc, args.root)
    dropped = [o.split("=", 1)[0] for o in (doc.get("source") or {}).get("overrides") or []
               if is_scrubbed_override(o)]
    if dropped:
        print(f"note: {', '.join(dropped)} held credentials, which run.json does not keep: they come "
              f"from the environment now (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) "
              f"or from --root")
    shown = [scrub_override(o, store.secret_values) for o in overrides]
    print(f"resuming {project}/{experiment}: config {config}, overrides {shown}")
    return _run_flow(config, overrides, experiment, args.force_lock)
