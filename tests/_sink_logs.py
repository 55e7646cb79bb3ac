"""Read back what the tensorboard and wandb sinks wrote, with the packages' own readers: TensorBoard's
EventAccumulator, and wandb's record protobuf over the LevelDB-style log of an offline run's
run-<id>.wandb file (7-byte file header; 32 KiB blocks of records: crc32, length, type, data)."""
import json
import time
from pathlib import Path


def tensorboard_scalars(folder) -> dict:
    """{tag: {step: value}} of every event file under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for events in sorted(Path(folder).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def _log_records(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", "not a wandb run file"
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is zero padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero fill up to the block's end
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            out.append(pending)
            pending = b""
    return out


def wandb_run(folder) -> dict:
    """{"history": {step: {key: value}}, "config": {...}, "project", "name"} of the offline run(s)
    under `folder` (a run's own folder or a wandb/ folder holding one)."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(folder).rglob("run-*.wandb"))
    assert len(files) == 1, files
    out = {"history": {}, "config": {}, "project": None, "name": None, "file": files[0]}
    deadline = time.time() + 30  # wandb's service process writes the file; finish() can return
    while True:                  # before its last records are on disk (seen under load)
        data = files[0].read_bytes()
        try:
            records = [pb.Record.FromString(r) for r in _log_records(data)]
        except Exception:  # a record still being written
            records = []
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.time() > deadline:
            break
        time.sleep(0.2)
    assert "run" in kinds and "exit" in kinds, f"{files[0]} holds {kinds}"
    for record, kind in zip(records, kinds):
        if kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            out["history"][row.pop("_step")] = row
        elif kind == "run":
            out["project"], out["name"] = record.run.project, record.run.display_name
            for item in record.run.config.update:
                out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
