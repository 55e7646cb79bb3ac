"""Run on a cluster host (it reaches S3 and the Prefect API): wait for something, print it as JSON.

    python tests/cluster/probe.py object ROOT KEY TIMEOUT_S [NOT_RUN]   # until the store has KEY (a
                                                                       # heartbeat of another flow run than NOT_RUN)
    python tests/cluster/probe.py flow-run ID TIMEOUT_S            # until the flow run is final
    python tests/cluster/probe.py worker NAME TIMEOUT_S            # until the worker's heartbeat is newer than now

Exit code 0 when it came, 1 on timeout."""
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def wait_object(root: str, key: str, timeout: float, not_run: str | None = None) -> int:
    from storage.store import Store

    store, deadline = Store.from_config({"root": root}), time.time() + timeout
    while time.time() < deadline:
        try:
            doc = store.read_json(key)
            if not_run is None or doc.get("flow_run_id") != not_run:
                print(json.dumps(doc))
                return 0
        except Exception:  # noqa: BLE001 - not there yet (or the store is down): keep waiting
            pass
        time.sleep(0.2)
    return 1


def wait_flow_run(run_id: str, timeout: float) -> int:
    from prefect import get_client

    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while time.time() < deadline:
            run = client.read_flow_run(run_id)
            if run.state is not None and run.state.is_final():
                print(json.dumps({"state": run.state.name, "type": str(run.state.type.value),
                                  "message": run.state.message or "", "at": time.time()}))
                return 0
            time.sleep(0.5)
    return 1


def wait_worker(name: str, timeout: float) -> int:
    from prefect import get_client

    since, deadline = datetime.now(timezone.utc), time.time() + timeout
    with get_client(sync_client=True) as client:
        while time.time() < deadline:
            for pool in ("cpu", "inference", "training"):
                for w in client.read_workers_for_work_pool(pool):
                    if w.name == name and w.last_heartbeat_time and w.last_heartbeat_time > since:
                        print(json.dumps({"worker": name, "pool": pool}))
                        return 0
            time.sleep(0.5)
    return 1


def main() -> int:
    kind, args = sys.argv[1], sys.argv[2:]
    if kind == "object":
        return wait_object(args[0], args[1], float(args[2]), args[3] if len(args) > 3 else None)
    if kind == "flow-run":
        return wait_flow_run(args[0], float(args[1]))
    if kind == "worker":
        return wait_worker(args[0], float(args[1]))
    raise SystemExit(f"unknown probe {kind!r}")


if __name__ == "__main__":
    sys.exit(main())
