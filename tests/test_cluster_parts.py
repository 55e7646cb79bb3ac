"""The pieces of the multi-host path that run without hosts (the hosts themselves: `make
cluster-test`, tests/cluster/): pdsh's failure lines, a remote rank's traceback classified from
the launcher's stderr, and the transfer of a remote machine's work files through the store."""
from pathlib import Path

import pytest

from stages.ranks.launch import PDSH_EXIT, relayed_errors
from stages.ranks.files import fetch_shipped
from stages.ranks.procs import RankStorageError, job_error
from storage.layout import RunLayout
from storage.store import Store

STORAGE_FAILURE = """trn1: stagerl rank 0 of 2 (stages.logprob) failed:
trn1: Traceback (most recent call last):
trn1:     raise EndpointConnectionError(endpoint_url=request.url, error=e)
trn1: botocore.exceptions.EndpointConnectionError: Could not connect to the endpoint URL: "http://ctl:9000/x"
trn1:
trn1: The above exception was the direct cause of the following exception:
trn1: storage.store.StoreError: read s3://runs/x failed: EndpointConnectionError
trn1: [2026-12-01 07:46:30,111] [INFO] [launch.py:335:sigkill_handler] Killing subprocess 123
pdsh@trn2: trn1: ssh exited with exit code 1
"""


def test_pdsh_exit_lines_name_the_host_and_code():
    assert PDSH_EXIT.search("pdsh@trn1: trn2: ssh exited with exit code 255").groups() == ("trn2", "255")
    assert PDSH_EXIT.search("trn2: ranks ready") is None


def test_a_remote_ranks_storage_error_stays_retryable(tmp_path):
    err = tmp_path / "stderr.txt"
    err.write_text(STORAGE_FAILURE)
    texts = relayed_errors(err)
    assert texts == ["storage.store.StoreError: read s3://runs/x failed: EndpointConnectionError"]
    assert isinstance(job_error("m", texts), RankStorageError)
    err.write_text(STORAGE_FAILURE.replace("storage.store.StoreError: read", "ValueError: bad row"))
    assert type(job_error("m", relayed_errors(err))) is RuntimeError  # bad input is never retried


class _Ctx:
    def __init__(self, root: Path):
        self.store, self.layout, self.step = Store.from_config({"root": str(root)}), RunLayout("p", "e"), 3


def test_files_shipped_from_another_machine_land_in_the_work_folder(tmp_path):
    ctx = _Ctx(tmp_path / "store")
    prefix = f"{ctx.layout.transfer(3, 'update')}/trn2"
    ctx.store.write_bytes(f"{prefix}/actor_state/zero_pp_rank_1_optim_states.pt", b"rank 1")
    ctx.store.write_bytes(f"{prefix}/actor_state/latest", b"step")
    work = tmp_path / "work"
    (work / "actor_state").mkdir(parents=True)
    (work / "actor_state" / "latest").write_bytes(b"step")  # written on both machines: must agree
    shipped = {"host": "trn2", "prefix": prefix,
               "files": ["actor_state/zero_pp_rank_1_optim_states.pt", "actor_state/latest"]}
    assert fetch_shipped(ctx, work, "update", [{"shipped": None}, {"shipped": shipped}]) == ["trn2"]
    assert (work / "actor_state" / "zero_pp_rank_1_optim_states.pt").read_bytes() == b"rank 1"
    assert not ctx.store.exists(prefix + "/actor_state/latest")  # the transfer folder is removed
    ctx.store.write_bytes(f"{prefix}/actor_state/latest", b"other")
    with pytest.raises(RuntimeError, match="written differently on trn2"):
        fetch_shipped(ctx, work, "update", [{"shipped": {**shipped, "files": ["actor_state/latest"]}}])
