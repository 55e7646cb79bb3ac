"""Storage tests, each run twice: on a local folder and on a real S3 endpoint (moto's server in a
subprocess on 127.0.0.1). Nothing is mocked."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _s3_server import MotoServer  # noqa: E402

from storage import artifacts, schemas  # noqa: E402
from storage.layout import InvalidName, RunLayout  # noqa: E402
from storage.lock import ExperimentLock, LockedError  # noqa: E402
from storage.store import Store  # noqa: E402
from storage.weights import load_weights, save_weights  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUCKET = "stagerl-test"
FAKE_KEY = "AKIAFAKEKEY7Q3Z9XW2M"
FAKE_SECRET = "fakeSecret+9vQx/Zr7TtPpLmNnBbVvCcXx"
FAKE_TOKEN = "hf_faketokenQWERTY123456"
FAKE_PASSWORD = "p4ssw0rd-FAKE-xyz"
SECRET_VALUES = (FAKE_KEY, FAKE_SECRET, FAKE_TOKEN, FAKE_PASSWORD)


@pytest.fixture(scope="session")
def s3_endpoint():
    with MotoServer() as srv:
        srv.make_bucket(BUCKET, FAKE_KEY, FAKE_SECRET)
        yield srv.endpoint_url


def test_every_store_call_raises_store_error_during_an_outage(s3_endpoint):
    """With the S3 endpoint unreachable (a proxy in front of it refusing connections), each Store
    call raises StoreError naming its key (what the retry policy retries), not a raw client error
    or a silent "missing"; a missing key is still FileNotFoundError / empty when reachable."""
    from _tcp_proxy import TcpProxy
    from storage.store import StoreError

    port = int(s3_endpoint.rsplit(":", 1)[1])
    with TcpProxy(port) as proxy:
        # storage.s3_retries=1: each call fails after one retry (the clients' default: ~6 s each)
        store = Store.from_config({"root": f"s3://{BUCKET}/outage", "endpoint_url": proxy.url,
                                   "key": FAKE_KEY, "secret": FAKE_SECRET, "s3_retries": 1})
        store.write_bytes("a/b.bin", b"x")
        assert store.list("a") == ["b.bin"] and store.list("nowhere") == [] and store.find("nowhere") == []
        with pytest.raises(FileNotFoundError, match="no object at s3://"):
            store.read_bytes("nowhere")
        proxy.cut(600)
        calls = {"exists": lambda: store.exists("a/unseen.bin"), "list": lambda: store.list("a"),
                 "find": lambda: store.find("a"), "move": lambda: store.move("a/b.bin", "a/c.bin"),
                 "delete": lambda: store.delete("a/b.bin"), "delete tree": lambda: store.delete("a", recursive=True),
                 "read": lambda: store.read_bytes("a/b.bin"), "write": lambda: store.write_bytes("a/d.bin", b"y"),
                 "size": lambda: store.size("a/unseen.bin")}
        for name, call in calls.items():
            with pytest.raises(StoreError, match=rf"s3://{BUCKET}/outage/a"):
                call()
            print(f"{name}: StoreError")


@pytest.fixture(params=["local", "s3"])
def storage_cfg(request, tmp_path):
    cache = tmp_path / "cache"
    if request.param == "local":
        return {"root": str(tmp_path / "store"), "key": FAKE_KEY, "secret": FAKE_SECRET,
                "cache_dir": str(cache)}
    endpoint = request.getfixturevalue("s3_endpoint")
    return {"root": f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}", "endpoint_url": endpoint,
            "key": FAKE_KEY, "secret": FAKE_SECRET, "cache_dir": str(cache)}


@pytest.fixture
def store(storage_cfg):
    return Store.from_config(storage_cfg)


@pytest.fixture
def layout():
    return RunLayout("proj", "exp-1")


def step_files(n_prompts=3, n=2, seed=0):
    """Small but schema-complete files for every stage of one step."""
    import random
    rng = random.Random(seed)
    rows = n_prompts * n
    lens = [rng.randint(1, 6) for _ in range(rows)]
    tok = lambda: [[rng.random() for _ in range(k)] for k in lens]  # noqa: E731
    rollout = schemas.make_table("rollout", {
        "uid": [f"u{i // n}" for i in range(rows)], "sample_index": [i % n for i in range(rows)],
        "prompt": ["what is 1+1?"] * rows, "prompt_ids": [[1, 2, 3]] * rows,
        "response": ["2"] * rows, "response_ids": [list(range(k)) for k in lens],
        "response_length": lens, "finish_reason": ["stop"] * rows,
        "data_source": ["gsm8k"] * rows, "ground_truth": ["2"] * rows,
        "extra_info": [json.dumps({"i": i}) for i in range(rows)]})
    logprob = schemas.make_table("logprob", {"old_log_probs": tok(), "ref_log_probs": tok(),
                                             "entropy": tok()})
    reward = schemas.make_table("reward", {"score": [1.0] * rows, "acc": [1.0] * rows,
                                           "format_ok": [True] * rows})
    advantage = schemas.make_table("advantage", {c: tok() for c in (
        "token_level_rewards", "advantages", "returns", "kl")})
    micro = schemas.make_table("microbatches", {
        "rank": [0, 1], "micro_batch": [0, 0], "rows": [[0, 1, 2], [3, 4, 5]],
        "real_tokens": [10, 12], "padded_tokens": [18, 18]})
    return {"rollout": {"rollout.parquet": rollout}, "logprob": {"logprob.parquet": logprob},
            "reward": {"reward.parquet": reward}, "advantage": {"advantage.parquet": advantage},
            "update": {"update/metrics.json": {"loss": 0.5, "grad_norm": 1.0},
                       "update/microbatches.parquet": micro}}


def write_step(store, layout, step, stages=("rollout", "logprob", "reward", "advantage", "update")):
    files = step_files(seed=step)
    prev = {}
    for stage in stages:
        fp = artifacts.fingerprint({"stage": stage, "step": step, "inputs": prev})
        artifacts.write_stage(store, layout, step, stage, files[stage], fingerprint=fp,
                              inputs=dict(prev), timings={"compute_s": 0.1})
        prev[stage] = fp
    return files


# ---- store basics ------------------------------------------------------------------------
def test_store_roundtrips(store):
    store.write_json("a/b.json", {"x": 1})
    assert store.read_json("a/b.json") == {"x": 1}
    store.write_bytes("a/c.bin", b"\x00\x01")
    assert store.read_bytes("a/c.bin") == b"\x00\x01"
    t = pa.table({"v": pa.array([1.5, 2.5], pa.float32())})
    store.write_parquet("a/d/t.parquet", t)
    assert store.read_parquet("a/d/t.parquet").equals(t)
    assert store.list("a") == ["b.json", "c.bin", "d"]
    assert store.list("missing") == []
    assert store.exists("a/b.json") and not store.exists("a/zz.json")
    assert store.copy_folder("a", "copy/a") == 3
    assert store.find("copy") == ["copy/a/b.json", "copy/a/c.bin", "copy/a/d/t.parquet"]
    store.delete("a/b.json")
    assert not store.exists("a/b.json")
    store.delete("copy", recursive=True)
    assert store.find("copy") == []
    with pytest.raises(FileNotFoundError, match="zz.json"):
        store.read_bytes("a/zz.json")
    import pyarrow.parquet as pq
    pq_meta = pq.read_metadata(pa.BufferReader(store.read_bytes("a/d/t.parquet")))
    assert pq_meta.row_group(0).column(0).compression == "ZSTD"


def test_layout_keys():
    lay = RunLayout("p", "e")
    assert lay.run_json == "p/e/run.json"
    assert lay.artifact(3, "rollout") == "p/e/steps/000003/rollout.parquet"
    assert lay.update_metrics(3) == "p/e/steps/000003/update/metrics.json"
    assert lay.update_microbatches(3) == "p/e/steps/000003/update/microbatches.parquet"
    assert lay.manifest(3, "reward") == "p/e/steps/000003/_manifests/reward.json"
    assert lay.weights(2) == "p/e/weights/step_000002"
    assert lay.train_state == "p/e/train_state"


@pytest.mark.parametrize("bad", ["", "  ", "..", "a..b", "a/b", "a\\b", "x\ny", "t\x00", "\x7f"])
def test_name_checks(bad):
    with pytest.raises(InvalidName, match="invalid project name"):
        RunLayout(bad, "ok")
    with pytest.raises(InvalidName, match="invalid experiment name"):
        RunLayout("ok", bad)


# ---- stage artifacts ---------------------------------------------------------------------
def test_stage_roundtrip_and_manifest(store, layout):
    files = write_step(store, layout, 0)
    for stage in ("rollout", "logprob", "reward", "advantage"):
        got = artifacts.read_table(store, layout, 0, stage)
        assert got.equals(files[stage][f"{stage}.parquet"])
    assert artifacts.read_file(store, layout, 0, "update", "update/metrics.json")["loss"] == 0.5
    assert artifacts.read_table(store, layout, 0, "update").num_rows == 2
    m = artifacts.read_manifest(store, layout, 0, "logprob")
    assert m["row_count"] == 6 and m["stage"] == "logprob" and m["step"] == 0
    assert set(m["inputs"]) == {"rollout"} and len(m["fingerprint"]) == 64
    entry = m["files"]["logprob.parquet"]
    assert entry["path"] == layout.artifact(0, "logprob")
    assert entry["size"] == store.size(entry["path"]) and len(entry["sha256"]) == 64
    assert "compute_s" in m["timings"] and "storage_write_s" in m["timings"]
    assert m["code_version"]["package"]
    assert artifacts.step_status(store, layout, 0) == dict.fromkeys(
        ("rollout", "logprob", "reward", "advantage", "update"), True)
    assert artifacts.is_complete(store, layout, 0, "logprob", m["fingerprint"])
    assert not artifacts.is_complete(store, layout, 0, "logprob", "other")
    assert not any(".tmp-" in k for k in store.find(""))
    assert artifacts.fingerprint({"b": 1, "a": [1, 2]}) == artifacts.fingerprint(
        {"a": [1, 2], "b": 1})


def test_artifact_without_manifest_is_incomplete(store, layout):
    write_step(store, layout, 0, ("rollout",))
    artifacts.upload_files(store, layout, 0, "logprob", step_files()["logprob"])
    assert store.exists(layout.artifact(0, "logprob"))
    assert artifacts.step_status(store, layout, 0)["logprob"] is False
    with pytest.raises(artifacts.IncompleteError, match="logprob"):
        artifacts.read_table(store, layout, 0, "logprob")


def test_tables_this_process_committed_are_read_back_without_decoding(store, layout):
    write_step(store, layout, 0, ("rollout", "logprob"))
    first = artifacts.read_table(store, layout, 0, "logprob")
    assert artifacts.read_table(store, layout, 0, "logprob") is first  # the table written, kept
    key = layout.artifact(0, "logprob")
    store.write_bytes(key, store.read_bytes(key))  # any write through a Store forgets it
    again = artifacts.read_table(store, layout, 0, "logprob")
    assert again is not first and again.equals(first)


def test_corruption_detected(store, layout):
    write_step(store, layout, 0, ("rollout", "logprob"))
    key = layout.artifact(0, "logprob")
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(key, bytes(data))
    with pytest.raises(artifacts.ChecksumError, match=r"checksum mismatch for .*logprob\.parquet"):
        artifacts.read_table(store, layout, 0, "logprob")
    artifacts.read_table(store, layout, 0, "rollout")  # the others stay readable


def test_schema_refusals(store, layout):
    good = step_files()["logprob"]["logprob.parquet"]
    with pytest.raises(schemas.SchemaError, match="missing column 'entropy'"):
        artifacts.write_table(store, layout, 0, "logprob", good.drop(["entropy"]), fingerprint="f")
    wrong = good.set_column(0, "old_log_probs", good.column("old_log_probs").cast(
        pa.list_(pa.float64())))
    with pytest.raises(schemas.SchemaError, match="'old_log_probs' has type list<.*double>"):
        artifacts.write_table(store, layout, 0, "logprob", wrong, fingerprint="f")
    short = good.set_column(2, "entropy", pa.array([[0.1]] * good.num_rows, pa.list_(pa.float32())))
    with pytest.raises(schemas.SchemaError, match="'entropy' has rows whose length"):
        artifacts.write_table(store, layout, 0, "logprob", short, fingerprint="f")
    assert not store.exists(layout.artifact(0, "logprob"))
    # optional columns accepted when typed right, refused otherwise
    vals = good.append_column("values", good.column("entropy"))
    artifacts.write_table(store, layout, 0, "logprob", vals, fingerprint="f")
    rew = step_files()["reward"]["reward.parquet"]
    rew = rew.append_column("error", pa.array([None] * rew.num_rows, pa.string()))
    artifacts.write_table(store, layout, 0, "reward", rew, fingerprint="f")
    with pytest.raises(schemas.SchemaError, match="'sample_index' has type int64"):
        schemas.validate("rollout", step_files()["rollout"]["rollout.parquet"].set_column(
            1, "sample_index", pa.array([0] * 6, pa.int64())))
    # a wrongly typed table already in the store is refused on read, naming the column
    entries = artifacts.upload_files(store, layout, 1, "reward", {"reward.parquet": b""})
    bad = pa.table({"score": pa.array([1], pa.int64()), "acc": pa.array([1.0], pa.float32())})
    data = Store.parquet_bytes(bad)
    store.write_bytes(entries["reward.parquet"]["path"], data)
    entries["reward.parquet"].update(size=len(data), sha256=artifacts.sha256_bytes(data))
    artifacts.write_manifest(store, layout, 1, "reward", entries, fingerprint="f")
    with pytest.raises(schemas.SchemaError, match="'score' has type int64"):
        artifacts.read_table(store, layout, 1, "reward")


# ---- weights -----------------------------------------------------------------------------
def make_hf_folder(path: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    path.mkdir(parents=True)
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (path / "tokenizer_config.json").write_text("{}")
    return path


def test_weights_save_load_and_cache(store, layout, tmp_path):
    src = make_hf_folder(tmp_path / "hf")
    m = save_weights(store, layout, 1, src)
    assert set(m["files"]) == {"model.safetensors", "config.json", "tokenizer.json",
                               "tokenizer_config.json"}
    assert store.exists(layout.weights(1) + "/model.safetensors")
    local = load_weights(store, layout, 1)
    for name in m["files"]:
        assert (local / name).read_bytes() == (src / name).read_bytes()
    # a cache hit does not fetch: it still works once the store's copy is gone
    store.delete(layout.weights(1) + "/model.safetensors")
    assert load_weights(store, layout, 1) == local
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_weights(store, layout, 1, cache_dir=tmp_path / "other-cache")
    with pytest.raises(artifacts.IncompleteError):
        load_weights(store, layout, 2)



def test_damaged_weights_cache_is_detected_and_downloaded_again(store, layout, tmp_path, capsys, monkeypatch):
    """A flipped byte (same size) or a truncated file in the cached folder is found on the next hit
    and the folder is fetched again; an untouched hit hashes nothing; an old-style seal (no stats)
    is verified once and sealed again."""
    from storage import weights

    src = make_hf_folder(tmp_path / "hf")
    save_weights(store, layout, 1, src)
    local = load_weights(store, layout, 1)
    good = (src / "model.safetensors").read_bytes()
    hashed = []
    real_sha = weights.file_sha256
    monkeypatch.setattr(weights, "file_sha256", lambda path: hashed.append(Path(path).name) or real_sha(path))
    assert load_weights(store, layout, 1) == local and hashed == []  # unchanged since sealed

    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0x01  # one flipped bit, same size
    (local / "model.safetensors").write_bytes(bytes(damaged))
    again = load_weights(store, layout, 1)
    assert "is damaged (model.safetensors does not match the manifest's sha256)" in capsys.readouterr().out
    assert (again / "model.safetensors").read_bytes() == good

    (again / "config.json").write_text("{}")  # another size
    again = load_weights(store, layout, 1)
    assert "config.json has 2 bytes" in capsys.readouterr().out
    assert (again / "config.json").read_bytes() == (src / "config.json").read_bytes()

    (again / ".complete").write_text(json.loads((again / ".complete").read_text())["checksum"])  # old seal
    hashed.clear()
    assert load_weights(store, layout, 1) == again and sorted(hashed) == sorted(
        ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"])
    hashed.clear()
    assert load_weights(store, layout, 1) == again and hashed == []  # sealed again with stats
    assert capsys.readouterr().out == ""


# ---- lock --------------------------------------------------------------------------------
def test_lock(storage_cfg, layout):
    store = Store.from_config(storage_cfg)
    first = ExperimentLock(store, layout).acquire()
    with pytest.raises(LockedError, match=r"locked by host .* pid %d since .* break the lock with --force-lock " % os.getpid()):
        ExperimentLock(store, layout).acquire()
    written = store.read_json(layout.lock)["time"]
    time.sleep(0.01)
    first.refresh(min_interval_s=3600)  # written this hour: neither read nor written again
    assert store.read_json(layout.lock)["time"] == written
    first.refresh()
    assert store.read_json(layout.lock)["time"] > written
    forced = ExperimentLock(store, layout, force=True).acquire()
    first.refresh(min_interval_s=3600)  # not looked at: the takeover is found by the next due refresh
    with pytest.raises(LockedError, match="taken over"):
        first.refresh()
    forced.release()
    assert not store.exists(layout.lock)
    with ExperimentLock(store, layout):
        with pytest.raises(LockedError, match="stale after 3600s"):  # a fresh lock is kept
            ExperimentLock(store, layout).acquire()
        record = store.read_json(layout.lock)
        store.write_json(layout.lock, {**record, "time": record["time"] - 10})  # refreshed 10 s ago
        with pytest.raises(LockedError, match=r"\(1\ds ago; stale after 60s\)"):  # 10 s + a slow moment
            ExperimentLock(Store.from_config({**storage_cfg, "lock_stale_seconds": 60}), layout).acquire()
        quick = Store.from_config({**storage_cfg, "lock_stale_seconds": 5})
        stale_taker = ExperimentLock(quick, layout).acquire()  # 10 s > 5 s: stale, taken over
        assert store.read_json(layout.lock)["token"] == stale_taker.token
        stale_taker.release()


def test_a_live_local_holder_is_never_displaced(storage_cfg, layout):
    """lock_stale_seconds=1 and a lock last refreshed an hour ago: held by a live process on this
    host it is refused (naming it), held by a dead one it is taken over."""
    import socket
    import time

    store = Store.from_config({**storage_cfg, "lock_stale_seconds": 1})
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"token": "other", "host": socket.gethostname(), "pid": live.pid, "time": time.time() - 3600}
        store.write_json(layout.lock, record)
        with pytest.raises(LockedError, match=rf"locked by pid {live.pid} on this host .* which is running"):
            ExperimentLock(store, layout).acquire()
    finally:
        live.kill()
        live.wait()
    taker = ExperimentLock(store, layout).acquire()  # the same record, its process now gone
    assert store.read_json(layout.lock)["token"] == taker.token
    taker.release()



def test_a_failing_lock_release_does_not_hide_the_runs_own_error(tmp_path):
    """flows.train.release_lock: while the run fails (its stage's error on its way), a lock that
    cannot be released (the store is down) is a warning, so the stage's error is reported last;
    on a run that did not fail it raises."""
    from flows.train import release_lock

    store = Store.from_config({"root": str(tmp_path / "store")})
    lock = ExperimentLock(store, RunLayout("p", "e")).acquire()
    record = Path(store.path(lock.key))
    record.unlink()
    record.mkdir()  # the lock record can no longer be read
    with pytest.raises(Exception):
        release_lock(lock, failing=False)
    warning = release_lock(lock, failing=True)  # logged as a warning, not raised
    assert warning.startswith("could not release the experiment lock (StoreError")

# ---- hygiene -----------------------------------------------------------------------------
def test_secrets_removed(store, layout, storage_cfg):
    config = {
        "storage": {**storage_cfg, "root": f"s3://{FAKE_KEY}:{FAKE_SECRET}@{BUCKET}/x"},
        "data": {"prompt_key": "prompt", "max_prompt_length": 512},
        "actor_rollout_ref": {"rollout": {"max_tokens": 32}},
        "trainer": {"project_name": "proj", "experiment_name": "exp-1",
                    "hf_token": FAKE_TOKEN, "tracker": {"password": FAKE_PASSWORD,
                                                        "url": f"https://u:{FAKE_PASSWORD}@h/x"}},
    }
    doc = artifacts.write_run_json(store, layout, config)
    raw = store.read_bytes(layout.run_json).decode()
    for v in SECRET_VALUES:
        assert v not in raw
    got = json.loads(raw)["config"]
    assert got["data"]["prompt_key"] == "prompt"
    assert got["actor_rollout_ref"]["rollout"]["max_tokens"] == 32
    assert got["storage"]["key"] == "***" and got["trainer"]["hf_token"] == "***"
    assert got["storage"]["root"] == f"s3://***@{BUCKET}/x"
    assert got["trainer"]["tracker"]["url"] == "https://***@h/x"
    assert doc["fingerprint"] == artifacts.fingerprint(got)
    m = artifacts.write_stage(store, layout, 0, "reward", step_files()["reward"],
                              fingerprint="f", extra={"note": f"used {FAKE_SECRET}",
                                                      "secret_key": "x"})
    raw = store.read_bytes(layout.manifest(0, "reward")).decode()
    assert FAKE_SECRET not in raw and m["extra"]["secret_key"] == "***"
    assert FAKE_SECRET not in repr(store) and FAKE_SECRET not in store.url("a")



def test_overrides_in_run_json_and_resume_keep_no_secret(store, layout, monkeypatch):
    """run.json's source overrides (what `stagerl resume` replays) hold no credential; resume drops
    the scrubbed ones and takes credentials from the environment; a reward error quoting an
    AWS_* value from the environment is scrubbed."""
    from flows.cli.train import resume_arguments
    from stages.scoring.reward_fns import describe_error
    from storage.secrets import is_scrubbed_override, scrub_override

    overrides = [f"storage.key={FAKE_KEY}", "storage.secret=short", f"+trainer.hf_token={FAKE_TOKEN}",
                 f"storage.root=s3://{FAKE_KEY}:{FAKE_SECRET}@{BUCKET}/x", "data.train_batch_size=8",
                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"]
    clean = [scrub_override(o) for o in overrides]
    assert clean == ["storage.key=***", "storage.secret=***", "+trainer.hf_token=***",
                     f"storage.root=s3://***@{BUCKET}/x", "data.train_batch_size=8",
                     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"]
    artifacts.write_run_json(store, layout, {"trainer": {}},
                             extra={"source": {"config": "tiny-cpu", "overrides": overrides}})
    raw = store.read_bytes(layout.run_json).decode()
    assert all(v not in raw for v in (FAKE_KEY, FAKE_SECRET, FAKE_TOKEN))  # also the unscrubbed list
    doc = {"source": {"config": "tiny-cpu", "overrides": clean}, "experiment": "e"}
    config, replay, name = resume_arguments(doc, None)
    assert replay == ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096"]
    assert not any(is_scrubbed_override(o) for o in replay)
    assert resume_arguments(doc, "s3://b/p")[1][-1] == "storage.root=s3://b/p"

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    try:
        raise RuntimeError(f"verifier refused key {FAKE_SECRET}")
    except RuntimeError as exc:
        message = describe_error(exc)
    assert FAKE_SECRET not in message and "verifier refused key ***" in message

def test_s3_root_with_embedded_credentials(s3_endpoint):
    store = Store.from_config({"root": f"s3://{FAKE_KEY}:{FAKE_SECRET}@{BUCKET}/embedded",
                               "endpoint_url": s3_endpoint})
    store.write_json("a.json", {"ok": True})
    assert store.read_json("a.json") == {"ok": True}
    assert store.url("a.json") == f"s3://{BUCKET}/embedded/a.json"


# ---- crash safety ------------------------------------------------------------------------
CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[2])
from storage import artifacts
from storage.layout import RunLayout
from storage.store import Store
from test_storage import step_files
store = Store.from_config(json.loads(sys.argv[1]))
layout = RunLayout("proj", "exp-1")
artifacts.upload_files(store, layout, 0, "logprob", step_files(seed=7)["logprob"])
print("READY", flush=True)
time.sleep(120)
"""


def test_sigkill_between_artifact_and_manifest(store, layout, storage_cfg):
    write_step(store, layout, 0, ("rollout", "logprob"))
    old = artifacts.read_table(store, layout, 0, "logprob")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(storage_cfg),
                              str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True,
                             env=env, cwd=REPO)
    try:
        assert child.stdout.readline().strip() == "READY"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    # the rewritten artifact is there, but no manifest commits it: the stage is incomplete
    assert store.exists(layout.artifact(0, "logprob"))
    assert store.read_parquet(layout.artifact(0, "logprob")) != old
    assert artifacts.step_status(store, layout, 0) == {
        "rollout": True, "logprob": False, "reward": False, "advantage": False, "update": False}
    with pytest.raises(artifacts.IncompleteError):
        artifacts.read_table(store, layout, 0, "logprob")
    for stage, done in artifacts.step_status(store, layout, 0).items():
        if done:
            artifacts.read_table(store, layout, 0, stage)


# ---- `stagerl runs` ----------------------------------------------------------------------
def test_runs_command(store, storage_cfg, capsys, monkeypatch):
    import flows.cli
    monkeypatch.setattr(flows.cli, "COMMAND_MODULES", [
        m for m in flows.cli.COMMAND_MODULES if importlib.util.find_spec(m)])
    a, b = RunLayout("proj", "exp-a"), RunLayout("proj", "exp-b")
    artifacts.write_run_json(store, a, {"trainer": {"project_name": "proj"}})
    write_step(store, a, 0)
    write_step(store, a, 1, ("rollout", "logprob", "reward"))
    write_step(store, b, 0, ("rollout",))
    if storage_cfg["root"].startswith("s3://"):  # the command reads credentials from AWS_*
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
        monkeypatch.setenv("AWS_ENDPOINT_URL", storage_cfg["endpoint_url"])
    assert flows.cli.main(["runs", "--root", storage_cfg["root"]]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[1]: ln.split() for ln in out.splitlines() if ln.startswith("proj ")}
    assert lines["exp-a"][2:6] == ["1", "step", "1", "reward"]
    assert lines["exp-b"][2:6] == ["0", "step", "0", "rollout"]
    assert flows.cli.main(["runs", "--root", storage_cfg["root"], "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["experiment"]: r["last_step_done"] for r in rows} == {"exp-a": 0, "exp-b": None}


# ---- last: nothing written anywhere contains a secret ------------------------------------
def test_no_secret_in_any_object_of_a_run(s3_endpoint, tmp_path):
    """What the store layer writes for a run — run.json, a stage and its manifest, a weights
    folder, the lock — with credentials in the config, in the S3 root URL and in a manifest's
    extra: a grep of every object written, local and on S3, finds none of them."""
    import s3fs

    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.bin").write_bytes(b"weights")
    blobs = {}
    for cfg in ({"root": str(tmp_path / "store"), "key": FAKE_KEY, "secret": FAKE_SECRET},
                {"root": f"s3://{FAKE_KEY}:{FAKE_SECRET}@{BUCKET}/nosecret", "endpoint_url": s3_endpoint}):
        store, layout = Store.from_config(cfg), RunLayout("proj", "exp")
        artifacts.write_run_json(store, layout, {"storage": cfg, "trainer": {
            "hf_token": FAKE_TOKEN, "tracker": {"password": FAKE_PASSWORD}}})
        artifacts.write_stage(store, layout, 1, "reward", step_files()["reward"], fingerprint="f",
                              extra={"note": f"used {FAKE_SECRET}", "hf_token": FAKE_TOKEN})
        save_weights(store, layout, 1, tmp_path / "w", extra={"token": FAKE_TOKEN})
        with ExperimentLock(store, layout):
            for key in store.find(""):
                blobs[store.url(key)] = store.read_bytes(key)
    fs = s3fs.S3FileSystem(key=FAKE_KEY, secret=FAKE_SECRET, endpoint_url=s3_endpoint,
                           skip_instance_cache=True)  # and what S3 holds, read around the Store
    for key in fs.find(f"{BUCKET}/nosecret"):
        blobs[f"s3://{key}"] = fs.cat_file(key)
    assert sum(n.startswith("s3://") for n in blobs) == 6 and sum(not n.startswith("s3://") for n in blobs) == 6
    assert any(n.endswith("_lock.json") for n in blobs) and any(n.endswith("run.json") for n in blobs)
    leaks = [(name, v) for name, data in blobs.items() for v in SECRET_VALUES if v.encode() in data]
    assert not leaks, leaks


def test_fault_injection_wraps_the_store_not_the_commit_path(tmp_path, monkeypatch):
    """STAGERL_FAULT's before_manifest point: the store the flow opens through with_faults raises
    (or kills) just before a matching stage manifest is written; the commit code has no hook."""
    import inspect

    from storage.faults import ENV, FaultyStore, with_faults

    assert "faults" not in inspect.getsource(artifacts)  # no import of this module
    store = Store.from_config({"root": str(tmp_path)})
    monkeypatch.delenv(ENV, raising=False)
    assert with_faults(store) is store
    monkeypatch.setenv(ENV, "reward:before_manifest:value@3")
    faulty = with_faults(store)
    assert isinstance(faulty, FaultyStore) and faulty.url("x") == store.url("x")
    layout = RunLayout("p", "e")
    faulty.write_json(layout.manifest(2, "reward"), {"step": 2})  # another step
    faulty.write_json(layout.manifest(3, "rollout"), {"step": 3})  # another stage
    faulty.write_json(f"{layout.step_dir(3)}/reward.json", {"not": "a manifest"})
    with pytest.raises(ValueError, match=r"injected bad input at reward:before_manifest \(step 3\)"):
        faulty.write_json(layout.manifest(3, "reward"), {"step": 3})
    assert not store.exists(layout.manifest(3, "reward"))
    assert store.read_json(layout.manifest(2, "reward")) == {"step": 2}
