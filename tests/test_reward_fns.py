"""Custom reward functions (verl's custom_reward_function) scored in worker processes with timeouts."""
import os
import textwrap
import time

import pytest

from stages.scoring.reward_fns import (
    RewardFnSpec, RewardFunctionNotFound, RewardScoringError, load_reward_fn, normalise_result)
from stages.scoring.pool import ScorerPool, score_batch

REWARD_FILE = textwrap.dedent('''
    import os, time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if ground_truth == "boom":
            raise ValueError(f"cannot score row {extra_info['index']}")
        if ground_truth == "hang":
            time.sleep(60)
        if ground_truth == "die":
            os._exit(3)
        if ground_truth == "nan":
            return float("nan")
        return 1.0 if solution_str.strip() == ground_truth else 0.0

    def with_details(data_source, solution_str, ground_truth, extra_info, bonus=0.0):
        correct = solution_str == ground_truth
        return {"score": float(correct) + bonus, "acc": correct, "length": len(solution_str),
                "source": data_source}
''')


def make_row(index, solution, truth, source="custom/task"):
    return {"data_source": source, "solution_str": solution, "ground_truth": truth,
            "extra_info": {"index": index}}


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return str(path)


def test_raising_and_hanging_rows_score_zero_and_are_counted(reward_file):
    truths = ["7", "boom", "8", "hang", "9", "boom", "10"]
    solutions = ["7", "x", "0", "x", "9", "x", "10"]
    rows = [make_row(i, s, t) for i, (s, t) in enumerate(zip(solutions, truths))]
    started = time.monotonic()
    results, metrics = score_batch(rows, {"path": reward_file}, num_workers=2, timeout_s=1.5)
    elapsed = time.monotonic() - started

    assert [r["score"] for r in results] == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert [r["error"] is None for r in results] == [True, False, True, False, True, False, True]
    assert results[1]["error"].startswith("ValueError: cannot score row 1 (at my_reward.py:")
    assert "cannot score row 5" in results[5]["error"]
    assert results[3]["error"].startswith("timeout") and "1.5s" in results[3]["error"]
    assert all(r["acc"] is None and r["extras"] == {} for r in results)   # scalar results carry no acc
    assert metrics == {"reward/errors": 2.0, "reward/timeouts": 1.0, "reward/rows": 7.0}
    assert elapsed < 20, f"a hung scorer held the batch for {elapsed:.1f}s"


def test_dead_worker_and_bad_values_are_row_errors(reward_file):
    rows = [make_row(0, "1", "die"), make_row(1, "1", "nan"), make_row(2, "3", "3")]
    results, metrics = score_batch(rows, RewardFnSpec(path=reward_file), num_workers=1, timeout_s=5)
    assert "died" in results[0]["error"] and "exit code 3" in results[0]["error"]
    assert "non-finite" in results[1]["error"]
    assert results[2] == {"score": 1.0, "acc": None, "extras": {}, "error": None}
    assert metrics["reward/errors"] == 2.0 and metrics["reward/timeouts"] == 0.0


def test_strict_raises_naming_the_row(reward_file):
    rows = [make_row(0, "1", "1"), make_row(1, "1", "1"), make_row(2, "x", "boom")]
    with pytest.raises(RewardScoringError, match=r"row 2 .*ValueError: cannot score row 2"):
        score_batch(rows, {"path": reward_file}, num_workers=1, timeout_s=5, strict=True)


def test_strict_timeout_raises_naming_the_row(reward_file):
    rows = [make_row(0, "x", "hang")]
    with pytest.raises(RewardScoringError, match=r"row 0 .*timeout"):
        score_batch(rows, {"path": reward_file}, num_workers=1, timeout_s=1, strict=True)


def test_dict_result_keeps_extra_keys_and_reward_kwargs(reward_file):
    spec = {"path": reward_file, "name": "with_details", "reward_kwargs": {"bonus": 0.5}}
    rows = [make_row(0, "abc", "abc"), make_row(1, "ab", "abc")]
    results, metrics = score_batch(rows, spec, num_workers=2, timeout_s=5)
    assert results[0] == {"score": 1.5, "acc": True, "error": None,
                          "extras": {"length": 3, "source": "custom/task"}}
    assert results[1]["score"] == 0.5 and results[1]["acc"] is False
    assert results[1]["extras"] == {"length": 2, "source": "custom/task"}
    assert metrics["reward/errors"] == 0.0


def test_builtin_scorers_without_a_path():
    rows = [make_row(0, "#### 72", "72", "openai/gsm8k"), make_row(1, "#### 72.", "72", "openai/gsm8k"),
            make_row(2, "so = 19", "19", "stagerl/arith"), make_row(3, "#### 1", "1", "no/such")]
    results, metrics = score_batch(rows, None, num_workers=2, timeout_s=5)
    assert [(r["score"], r["acc"]) for r in results[:3]] == [(1.0, True), (0.0, False), (1.0, True)]
    assert results[3]["score"] == 0.0
    assert "UnknownDataSourceError" in results[3]["error"] and "'no/such'" in results[3]["error"]
    assert metrics["reward/errors"] == 1.0


def test_builtin_scorers_run_in_this_process():
    """Without a custom_reward_function.path the rule scorers run in the calling process (no worker
    round trip): a scorer registered here, after any worker could have been started, scores."""
    from stages.scoring.scorers import SCORERS, register_scorer

    register_scorer("test/in_process")(lambda solution_str, ground_truth, extra_info=None: {"score": float(os.getpid())})
    try:
        results, metrics = score_batch([make_row(0, "x", "x", "test/in_process")], None, num_workers=2, timeout_s=5)
    finally:
        SCORERS.pop("test/in_process")
    assert results[0]["score"] == float(os.getpid()) and metrics == {
        "reward/errors": 0.0, "reward/timeouts": 0.0, "reward/rows": 1.0}
    with pytest.raises(RewardScoringError, match=r"row 1 \(data_source='no/such'\)"):
        score_batch([make_row(0, "#### 1", "1", "openai/gsm8k"), make_row(1, "1", "1", "no/such")], None,
                    num_workers=2, timeout_s=5, strict=True)


def test_empty_batch_and_bad_arguments(reward_file):
    assert score_batch([], {"path": reward_file}, num_workers=2, timeout_s=1) == (
        [], {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/rows": 0.0})
    with pytest.raises(ValueError, match="num_workers"):
        score_batch([make_row(0, "1", "1")], None, num_workers=-1, timeout_s=1)


def test_num_workers_0_scores_a_custom_function_in_this_process(tmp_path):
    """reward.num_workers=0: the user's function runs in the calling process (verl's reward manager,
    TRL's reward_funcs), its errors still the rows' errors; the file is imported once per content: an edit is used at the
    next call."""
    path = tmp_path / "pid_reward.py"
    path.write_text("import os\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    if ground_truth == 'boom':\n        raise ValueError('no')\n    return float(os.getpid())\n")
    rows = [make_row(0, "a", "a"), make_row(1, "b", "boom")]
    results, metrics = score_batch(rows, {"path": str(path)}, num_workers=0, timeout_s=1)
    assert results[0]["score"] == float(os.getpid()) and "ValueError: no" in results[1]["error"]
    assert metrics == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/rows": 2.0}
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 7.0\n")
    assert score_batch(rows[:1], {"path": str(path)}, num_workers=0, timeout_s=1)[0][0]["score"] == 7.0
    two, _ = score_batch(rows[:1], {"path": str(str(tmp_path / "pid_reward.py"))}, num_workers=1, timeout_s=5)
    assert two[0]["score"] == 7.0  # the same function in a worker process
    path.write_text("SEEN = []\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    SEEN.append(1)\n    return float(len(SEEN))\n")
    firsts = [score_batch(rows, {"path": str(path)}, num_workers=0, timeout_s=1)[0] for _ in range(2)]
    assert [r["score"] for batch in firsts for r in batch] == [1.0, 2.0, 3.0, 4.0]  # imported once per content


def test_user_file_with_dataclass_result(tmp_path):
    path = tmp_path / "dc_reward.py"
    path.write_text(textwrap.dedent('''
        from __future__ import annotations
        from dataclasses import dataclass

        @dataclass
        class Verdict:
            score: float

        def compute_score(data_source, solution_str, ground_truth, extra_info):
            return {"score": Verdict(1.0).score, "verdict": Verdict(0.5)}
    '''))
    results, metrics = score_batch([make_row(0, "a", "a")], {"path": str(path)}, num_workers=1, timeout_s=5)
    assert results[0]["score"] == 1.0 and results[0]["error"] is None
    assert results[0]["extras"]["verdict"].score == 0.5


def test_missing_function_or_file_is_a_clear_error(reward_file, tmp_path):
    with pytest.raises(RewardFunctionNotFound) as info:
        load_reward_fn({"path": reward_file, "name": "score_it"})
    assert "'score_it'" in str(info.value) and reward_file in str(info.value)
    assert "compute_score" in str(info.value)   # lists what the file does define
    missing = str(tmp_path / "nope.py")
    with pytest.raises(RewardFunctionNotFound, match="nope.py"):
        score_batch([make_row(0, "1", "1")], {"path": missing}, num_workers=1, timeout_s=1)


def test_load_reward_fn_defaults_and_in_process_call(reward_file):
    assert load_reward_fn({"path": reward_file})("s", "4", "4", {"index": 0}) == 1.0
    details = load_reward_fn({"path": reward_file, "name": "with_details", "reward_kwargs": {"bonus": 1}})
    assert details("s", "a", "a", None)["score"] == 2.0
    assert load_reward_fn(None)("openai/gsm8k", "#### 5", "5") == {"score": 1.0, "acc": True}


@pytest.mark.parametrize("value, expected_error", [
    ({"acc": True}, "without 'score'"), ("high", "expected a number"), (None, "expected a number"),
    (float("inf"), "non-finite"), (float("nan"), "non-finite"),
])
def test_normalise_result_rejects_unusable_values(value, expected_error):
    outcome = normalise_result(value)
    assert outcome["score"] == 0.0 and expected_error in outcome["error"]


def test_normalise_result_accepts_numbers_and_bools():
    assert normalise_result(1) == {"score": 1.0, "acc": None, "extras": {}, "error": None}
    assert normalise_result(True)["score"] == 1.0
    assert normalise_result({"score": 0.25, "acc": 0})["acc"] is False


# ---- ScorerPool: workers resident across calls ----------------------------------------------
def alive(pid):
    """Whether a process with this pid exists (a reaped child does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_pool_keeps_its_workers_and_row_order_across_calls(reward_file):
    spec = {"path": reward_file, "name": "with_details"}
    with ScorerPool(spec, num_workers=2, timeout_s=5) as pool:
        assert pool.worker_pids == []   # started by the first call that has rows
        solutions = ["a" * (i % 7) for i in range(50)]
        first, metrics = pool.score([make_row(i, s, "aaa") for i, s in enumerate(solutions)])
        pids = pool.worker_pids
        assert len(pids) == 2 and all(alive(p) for p in pids)
        assert [r["extras"]["length"] for r in first] == [i % 7 for i in range(50)]
        assert [r["score"] for r in first] == [1.0 if i % 7 == 3 else 0.0 for i in range(50)]
        assert metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/rows": 50.0}
        second, _ = score_batch([make_row(0, "aaa", "aaa"), make_row(1, "b", "aaa")], spec,
                                num_workers=2, timeout_s=5, pool=pool)
        assert [(r["score"], r["extras"]["length"]) for r in second] == [(1.0, 3), (0.0, 1)]
        assert pool.worker_pids == pids


def test_pool_replaces_hung_and_dead_workers_and_scores_the_next_batch(reward_file):
    # one worker, chunks of half the queue: rows 0-3 (row 1 kills the worker, rows 2-3 go back
    # to the queue), then rows 2-4 (row 3 hangs, row 4 goes back), then 4-5, 6, 7
    pool = ScorerPool({"path": reward_file}, num_workers=1, timeout_s=1.5)
    try:
        rows = [make_row(0, "1", "1"), make_row(1, "x", "die"), make_row(2, "2", "2"),
                make_row(3, "x", "hang"), make_row(4, "4", "4"), make_row(5, "x", "5"),
                make_row(6, "6", "6"), make_row(7, "7", "7")]
        results, metrics = pool.score(rows)
        assert [r["score"] for r in results] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
        assert "died while scoring" in results[1]["error"] and "exit code 3" in results[1]["error"]
        assert results[3]["error"].startswith("timeout: scoring took longer than 1.5s")
        assert [r["error"] is None for r in results] == [True, False, True, False, True, True, True, True]
        assert metrics == {"reward/errors": 1.0, "reward/timeouts": 1.0, "reward/rows": 8.0}
        [pid] = pool.worker_pids
        assert alive(pid)
        results, metrics = pool.score([make_row(0, "9", "9"), make_row(1, "x", "boom"), make_row(2, "3", "4")])
        assert [r["score"] for r in results] == [1.0, 0.0, 0.0]
        assert results[1]["error"].startswith("ValueError: cannot score row 1")
        assert metrics == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/rows": 3.0}
        assert pool.worker_pids == [pid]   # a raising function does not cost the worker
    finally:
        pool.close()
    assert not alive(pid)


def test_pool_restarts_workers_when_the_reward_file_changes(reward_file):
    rows = [make_row(0, "7", "7"), make_row(1, "6", "7")]
    with ScorerPool({"path": reward_file}, num_workers=2, timeout_s=5) as pool:
        assert [r["score"] for r in pool.score(rows)[0]] == [1.0, 0.0]
        pids = pool.worker_pids
        stat = os.stat(reward_file)
        os.utime(reward_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, same code
        assert [r["score"] for r in pool.score(rows)[0]] == [1.0, 0.0]
        assert pool.worker_pids == pids
        with open(reward_file, "w") as f:   # same size, new scores
            f.write(REWARD_FILE.replace("return 1.0 if", "return 5.0 if").replace("else 0.0", "else 0.5"))
        assert [r["score"] for r in pool.score(rows)[0]] == [5.0, 0.5]
        assert set(pool.worker_pids).isdisjoint(pids) and not any(alive(p) for p in pids)
        with open(reward_file, "w") as f:
            f.write("def compute_score(:\n")
        with pytest.raises(RewardFunctionNotFound, match="failed to import"):
            pool.score(rows)
        os.remove(reward_file)
        with pytest.raises(RewardFunctionNotFound, match="does not exist"):
            pool.score(rows)
        with open(reward_file, "w") as f:
            f.write(REWARD_FILE)
        assert [r["score"] for r in pool.score(rows)[0]] == [1.0, 0.0]


def test_pool_strict_raises_naming_the_row_and_keeps_working(reward_file):
    with ScorerPool({"path": reward_file}, num_workers=1, timeout_s=5) as pool:
        rows = [make_row(0, "1", "1"), make_row(1, "x", "boom")] + [make_row(i, "1", "1") for i in range(2, 8)]
        with pytest.raises(RewardScoringError, match=r"row 1 .*ValueError: cannot score row 1"):
            pool.score(rows, strict=True)
        results, metrics = pool.score([make_row(0, "2", "2"), make_row(1, "3", "2")], strict=True)
        assert [r["score"] for r in results] == [1.0, 0.0] and metrics["reward/errors"] == 0.0


def test_pool_close_leaves_no_process_and_refuses_work(reward_file):
    pool = ScorerPool({"path": reward_file}, num_workers=3, timeout_s=5)
    pool.start()
    pids = pool.worker_pids
    assert len(pids) == 3 and all(alive(p) for p in pids)
    assert pool.score([make_row(0, "1", "1")])[0][0]["score"] == 1.0
    pool.close()
    pool.close()
    assert pool.worker_pids == [] and not any(alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score([make_row(0, "1", "1")])


def test_score_batch_refuses_a_pool_made_for_other_settings(reward_file):
    with ScorerPool({"path": reward_file}, num_workers=2, timeout_s=5) as pool:
        with pytest.raises(ValueError, match=r"reward.num_workers 3 \(pool: 2\)"):
            score_batch([make_row(0, "1", "1")], {"path": reward_file}, num_workers=3, timeout_s=5, pool=pool)
        with pytest.raises(ValueError, match=r"custom_reward_function .*with_details"):
            score_batch([make_row(0, "1", "1")], {"path": reward_file, "name": "with_details"},
                        num_workers=2, timeout_s=5, pool=pool)
        with pytest.raises(ValueError, match=r"reward.timeout_s 1 \(pool: 5.0\)"):
            score_batch([make_row(0, "1", "1")], {"path": reward_file}, num_workers=2, timeout_s=1, pool=pool)
        assert pool.worker_pids == []


def test_reward_file_digest_is_read_again_only_when_the_file_changed(tmp_path, monkeypatch):
    """reward_file_sha256 keeps a file's digest by its stat (the reward stage asks three times a
    step), reads it again once the file changes, and never keeps one of a file changed less than
    RACY_S before it was read (an edit within the same clock tick keeps mtime and may keep size)."""
    import hashlib

    from stages.scoring import reward_fns

    path = tmp_path / "r.py"
    path.write_text("A = 1\n")
    reads = []
    real_open = open

    def counting_open(file, *a, **k):
        if str(file) == str(path):
            reads.append(file)
        return real_open(file, *a, **k)
    monkeypatch.setattr(reward_fns, "open", counting_open, raising=False)
    digest = hashlib.sha256(b"A = 1\n").hexdigest()
    assert reward_fns.reward_file_sha256(str(path)) == digest
    assert reward_fns.reward_file_sha256(str(path)) == digest and len(reads) == 2  # fresh: not kept
    old = time.time() - 60
    os.utime(path, (old, old))  # written a minute ago (ctime moves now: kept from the next read on)
    monkeypatch.setattr(reward_fns, "RACY_S", -120.0)
    assert reward_fns.reward_file_sha256(str(path)) == digest and len(reads) == 3
    assert reward_fns.reward_file_sha256(str(path)) == digest and len(reads) == 3  # kept: not read
    path.write_text("A = 2\n")  # same size, same second: ctime and mtime in ns still move
    assert reward_fns.reward_file_sha256(str(path)) == hashlib.sha256(b"A = 2\n").hexdigest()
    assert len(reads) == 4 and reward_fns.reward_file_sha256(str(tmp_path / "none.py")) is None
