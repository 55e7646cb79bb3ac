"""Datasets in verl's RL parquet schema: synthetic arithmetic and GSM8K conversion."""
import json
import re

import pyarrow.parquet as pq
import pytest

from stages.data.tools import (
    GSM8K_INSTRUCTION, convert_gsm8k, evaluate_expression, make_arith_dataset, write_rows,
)

QUESTION_RE = re.compile(r"^What is ([0-9 +\-*]+)\? Answer after ####\.$")


def _recompute(question: str) -> int:
    expression = QUESTION_RE.match(question).group(1)
    return eval(expression, {"__builtins__": {}})  # digits, spaces and + - * only


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_arith_rows_match_verl_schema_and_are_correct(difficulty):
    rows = make_arith_dataset(200, seed=7, difficulty=difficulty, split="test")
    assert len(rows) == 200
    for index, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == "stagerl/arith" and row["ability"] == "arithmetic"
        [message] = row["prompt"]
        assert message["role"] == "user"
        question = message["content"]
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(_recompute(question))}
        info = row["extra_info"]
        assert info["split"] == "test" and info["index"] == index and info["question"] == question
        assert info["answer"].endswith(f"#### {row['reward_model']['ground_truth']}")


def test_arith_difficulty_levels():
    easy = [QUESTION_RE.match(r["prompt"][0]["content"]).group(1).split()
            for r in make_arith_dataset(300, seed=0, difficulty=1)]
    assert all(op == "+" and len(a) == 1 and len(b) == 1 for a, op, b in easy)
    level2 = make_arith_dataset(300, seed=0, difficulty=2)
    assert all(int(r["reward_model"]["ground_truth"]) >= 0 for r in level2)
    level5 = make_arith_dataset(50, seed=0, difficulty=5)
    assert all(len(QUESTION_RE.match(r["prompt"][0]["content"]).group(1).split()) == 5 for r in level5)
    assert evaluate_expression("2 + 3 * 4 - 5") == 9
    with pytest.raises(ValueError, match="difficulty"):
        make_arith_dataset(3, difficulty=9)


def test_arith_is_deterministic_by_seed_and_split():
    assert make_arith_dataset(50, seed=1, difficulty=3) == make_arith_dataset(50, seed=1, difficulty=3)
    assert make_arith_dataset(50, seed=1, difficulty=3) != make_arith_dataset(50, seed=2, difficulty=3)
    train = [r["prompt"] for r in make_arith_dataset(50, seed=1, difficulty=3, split="train")]
    test = [r["prompt"] for r in make_arith_dataset(50, seed=1, difficulty=3, split="test")]
    assert train != test


def test_parquet_round_trip_keeps_nested_types(tmp_path):
    rows = make_arith_dataset(20, seed=0, difficulty=2)
    path = write_rows(rows, tmp_path / "sub" / "arith.parquet")
    table = pq.read_table(path)
    assert table.to_pylist() == rows
    assert str(table.schema.field("prompt").type) == "list<element: struct<role: string, content: string>>"
    assert str(table.schema.field("reward_model").type) == "struct<style: string, ground_truth: string>"


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


GSM8K_RECORDS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,000. What is it in dollars?", "answer": "It is 1,000.\n#### 1,000"},
    {"question": "What is 2 - 7?", "answer": "2 - 7 = -5\n#### -5"},
]


def test_convert_gsm8k_matches_verl_preprocessing(tmp_path):
    source = _write_jsonl(tmp_path / "train.jsonl", GSM8K_RECORDS)
    rows = pq.read_table(convert_gsm8k(source, tmp_path / "out.parquet", split="train")).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1000", "-5"]
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["prompt"] == [{"role": "user", "content": GSM8K_RECORDS[0]["question"] + " " + GSM8K_INSTRUCTION}]
    assert first["reward_model"]["style"] == "rule"
    assert first["extra_info"] == {"split": "train", "index": 0, "answer": GSM8K_RECORDS[0]["answer"],
                                   "question": GSM8K_RECORDS[0]["question"]}
    assert GSM8K_INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    # parquet input in the Hugging Face form gives the same rows
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(GSM8K_RECORDS), tmp_path / "hf.parquet")
    again = pq.read_table(convert_gsm8k(tmp_path / "hf.parquet", tmp_path / "out2.parquet")).to_pylist()
    assert again == rows


def test_convert_gsm8k_for_the_tool_agent_matches_verls_tool_agent_preprocessing(tmp_path):
    """`stagerl data gsm8k --agent tool_agent`: the rows of verl's examples/data_preprocess/
    gsm8k_tool_agent_loop.py (its system prompt and instruction, agent_name, the calc_gsm8k_reward
    tool's create_kwargs), which verl's multi-turn scripts train on."""
    from flows.cli import main

    source = _write_jsonl(tmp_path / "train.jsonl", GSM8K_RECORDS)
    assert main(["data", "gsm8k", "--agent", "tool_agent", "--input", str(source), "--out", str(tmp_path / "t.parquet")]) == 0
    rows = pq.read_table(tmp_path / "t.parquet").to_pylist()
    first = rows[1]
    assert first["agent_name"] == "tool_agent" and first["data_source"] == "openai/gsm8k"
    assert [m["role"] for m in first["prompt"]] == ["system", "user"]
    assert first["prompt"][0]["content"].startswith("You are a math expert.") and "`calc_gsm8k_reward`" in first["prompt"][0]["content"]
    assert first["prompt"][1]["content"] == ("A car costs $1,000. What is it in dollars? "
                                             "Let's think step by step and output the final answer after `####`.")
    assert first["extra_info"]["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1000"}}}
    assert first["extra_info"]["need_tools_kwargs"] is True and first["reward_model"]["ground_truth"] == "1000"
    assert first["extra_info"]["interaction_kwargs"] == {"query": GSM8K_RECORDS[1]["question"], "ground_truth": "1000"}


def test_convert_gsm8k_bad_row_names_it(tmp_path):
    bad = GSM8K_RECORDS[:1] + [{"question": "No answer marker", "answer": "The answer is 5."}]
    source = _write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(ValueError, match=r"row 1: no \"#### <number>\""):
        convert_gsm8k(source, tmp_path / "out.parquet")
    missing = _write_jsonl(tmp_path / "missing.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match="row 0: missing or non-text 'answer'"):
        convert_gsm8k(missing, tmp_path / "out.parquet")


def test_cli_data_commands(tmp_path, capsys):
    from flows.cli import main as cli_main

    out = tmp_path / "arith.parquet"
    assert cli_main(["data", "arith", "--out", str(out), "--n", "30", "--seed", "4",
                     "--difficulty", "2", "--split", "test"]) == 0
    assert pq.read_table(out).to_pylist() == make_arith_dataset(30, seed=4, difficulty=2, split="test")
    source = _write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_RECORDS)
    assert cli_main(["data", "gsm8k", "--input", str(source), "--out", str(tmp_path / "g.parquet"),
                     "--split", "test"]) == 0
    assert pq.read_table(tmp_path / "g.parquet").column("extra_info").to_pylist()[2]["split"] == "test"
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "none"}])
    assert cli_main(["data", "gsm8k", "--input", str(bad), "--out", str(tmp_path / "b.parquet")]) == 2
    assert "row 0" in capsys.readouterr().err
