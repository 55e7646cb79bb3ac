"""Datasets in verl's RL parquet schema, built without a hub (verl: examples/data_preprocess/gsm8k.py).

Every row has: data_source (str), prompt (list of {role, content}), ability (str),
reward_model {style: "rule", ground_truth: str}, extra_info {split, index, question, answer}.

- make_arith_dataset: synthetic arithmetic questions ("What is 12 + 7? Answer after ####.").
- make_tool_arith_dataset: the calculator task (verl's tool-agent schema): products the tiny
  model is never taught to compute, each row with a demonstration (a calculator call, then the
  answer) for the multi-turn warm start.
- convert_gsm8k: GSM8K in its Hugging Face form (question, answer) -> the rows verl's
  examples/data_preprocess/gsm8k.py writes (agent="tool_agent": those of its
  gsm8k_tool_agent_loop.py, for the calc_gsm8k_reward tool of examples/tool_config).

Arithmetic difficulty levels (operands drawn uniformly, ends included):
  1  a + b,            a, b in 0..9              (single-digit addition)
  2  a + b | a - b,    a, b in 0..99, a >= b     (two-digit, never negative)
  3  a + b | a - b | a * b, a in 0..99, b in 0..9 for *, 0..99 otherwise; may be negative
  4  a + b | a - b | a * b, a, b in 0..999 (b in 0..99 for *); may be negative
  5  a op b op c with op in + - * (Python precedence), a, b, c in 0..99
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

ARITH_SOURCE = "stagerl/arith"
GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_SOLUTION_RE = re.compile(r"#### (\-?[0-9\.\,]+)")  # verl's extract_solution
DIFFICULTY_LEVELS = (1, 2, 3, 4, 5)
SPLITS = ("train", "test")


def _arrow_schema():
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(message)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([
            ("split", pa.string()),
            ("index", pa.int64()),
            ("answer", pa.string()),
            ("question", pa.string()),
        ])),
    ])


def write_rows(rows: list[dict], out_path) -> Path:
    """Write rows in verl's RL schema to a parquet file (parent folders created)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=_arrow_schema()), out)
    return out


def read_records(path) -> list[dict]:
    """Rows of a local .jsonl/.json (one object per line) or .parquet file, as dicts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"input file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}: line {line_no} is not valid JSON: {exc}") from None
        return rows
    raise ValueError(f"{path}: unsupported file type {path.suffix!r} (use .jsonl, .json or .parquet)")


# ---------------------------------------------------------------------------------------------
# arithmetic


def arith_expression(rng: random.Random, difficulty: int) -> str:
    """One expression at the given difficulty (module docstring), e.g. "12 + 7"."""
    if difficulty == 1:
        return f"{rng.randint(0, 9)} + {rng.randint(0, 9)}"
    if difficulty == 2:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-")
        if op == "-" and a < b:
            a, b = b, a
        return f"{a} {op} {b}"
    if difficulty in (3, 4):
        top = 99 if difficulty == 3 else 999
        op = rng.choice("+-*")
        b_top = (9 if difficulty == 3 else 99) if op == "*" else top
        return f"{rng.randint(0, top)} {op} {rng.randint(0, b_top)}"
    if difficulty == 5:
        a, b, c = (rng.randint(0, 99) for _ in range(3))
        return f"{a} {rng.choice('+-*')} {b} {rng.choice('+-*')} {c}"
    raise ValueError(f"difficulty must be one of {DIFFICULTY_LEVELS}, got {difficulty!r}")


def evaluate_expression(expression: str) -> int:
    """Integer value of an expression of non-negative integers and + - * (usual precedence)."""
    tokens = expression.split()
    if len(tokens) % 2 == 0 or not all(t.isdigit() for t in tokens[::2]):
        raise ValueError(f"not an arithmetic expression: {expression!r}")
    terms, signs, current = [], [], int(tokens[0])
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            current *= int(operand)
        elif op in "+-":
            terms.append(current)
            signs.append(op)
            current = int(operand)
        else:
            raise ValueError(f"unknown operator {op!r} in {expression!r}")
    terms.append(current)
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
        total = total + term if sign == "+" else total - term
    return total


def make_arith_dataset(n: int, seed: int = 0, difficulty: int = 1, split: str = "train") -> list[dict]:
    """n arithmetic rows in verl's RL schema; the same (n, seed, difficulty, split) gives the same
    rows, and train/test with one seed draw different streams."""
    if difficulty not in DIFFICULTY_LEVELS:
        raise ValueError(f"difficulty must be one of {DIFFICULTY_LEVELS}, got {difficulty!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{ARITH_SOURCE}:{seed}:{difficulty}:{split}")
    rows = []
    for index in range(n):
        expression = arith_expression(rng, difficulty)
        value = evaluate_expression(expression)
        question = f"What is {expression}? Answer after ####."
        rows.append({
            "data_source": ARITH_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(value)},
            "extra_info": {
                "split": split,
                "index": index,
                "question": question,
                "answer": f"{expression} = {value}\n#### {value}",
            },
        })
    return rows


ARITH_TOOL_SOURCE = "stagerl/arith-tool"  # scored on the last "#### <number>" (stages/scoring/scorers.py)
TOOL_SYSTEM_PROMPT = "Use the calculator tool, then answer after ####."


def hermes_call(name: str, arguments: dict, arguments_first: bool = False) -> str:
    """A tool call in the hermes format the agent loop parses (stages/tools/parser.py: any key
    order). arguments_first writes {"arguments": ..., "name": ...}: the expression then comes ~25
    tokens after the question instead of ~50, close enough for the tiny demo model to learn to
    read it in a short warm start (at ~50 it does not within 600 steps)."""
    body = {"arguments": arguments, "name": name} if arguments_first else {"name": name, "arguments": arguments}
    return "<tool_call>" + json.dumps(body) + "</tool_call>"


def make_tool_arith_dataset(n: int, seed: int = 0, split: str = "train", digits: int = 1,
                            op: str = "*") -> list[dict]:
    """n rows of the calculator task in verl's tool-agent schema (verl:
    examples/data_preprocess/gsm8k_tool_agent_loop.py): "What is a op b?" with a, b of `digits`
    digits (default: single-digit products, 1..9 * 1..9); a chat-list prompt with a system message,
    agent_name tool_agent, reward_model.ground_truth, extra_info.tools_kwargs.calculator.create_kwargs,
    and extra_info.demonstration: the assistant turns that solve it with the tool (a calculator
    call, then "#### <value>"), which the multi-turn warm start trains on
    (warmstart.demonstration_key). The same (n, seed, split, digits, op) gives the same rows.

    Why single digits: the demo's tiny model (2 layers) does not learn to copy a multi-digit
    number digit by digit into the call within a warm start (3-digit and 2-digit sums: the call's
    digits stayed at chance after 600 and 250 steps); two single digits it reads by content."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0 or digits < 1 or op not in ("+", "-", "*"):
        raise ValueError(f"n must be >= 0, digits >= 1 and op one of + - *, got n={n}, digits={digits}, op={op!r}")
    rng = random.Random(f"{ARITH_TOOL_SOURCE}:{seed}:{digits}:{op}:{split}")
    low, high = 10 ** (digits - 1), 10 ** digits - 1
    rows = []
    for index in range(n):
        expression = f"{rng.randint(low, high)} {op} {rng.randint(low, high)}"
        truth = str(evaluate_expression(expression))
        question = f"What is {expression}?"
        rows.append({
            "data_source": ARITH_TOOL_SOURCE,
            "agent_name": "tool_agent",
            "prompt": [{"role": "system", "content": TOOL_SYSTEM_PROMPT}, {"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "question": question, "need_tools_kwargs": True,
                           "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": truth}}},
                           "demonstration": [hermes_call("calculator", {"expression": expression}, arguments_first=True),
                                             f"#### {truth}"]},
        })
    return rows


def write_tool_rows(rows: list[dict], out_path) -> Path:
    """Write tool-agent rows (their schema inferred) to a parquet file (parent folders created)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def write_arith_dataset(out_path, n: int = 1000, seed: int = 0, difficulty: int = 1,
                        split: str = "train") -> Path:
    return write_rows(make_arith_dataset(n, seed, difficulty, split), out_path)


# ---------------------------------------------------------------------------------------------
# GSM8K


def gsm8k_ground_truth(answer: str, row: int | None = None) -> str:
    """The number after "#### " with commas removed (verl's extract_solution)."""
    match = GSM8K_SOLUTION_RE.search(answer or "")
    if match is None:
        where = f"row {row}" if row is not None else "answer"
        snippet = (answer or "")[-80:].replace("\n", "\\n")
        raise ValueError(f'GSM8K {where}: no "#### <number>" in the answer (ends with: {snippet!r})')
    return match.group(1).replace(",", "")


# verl's examples/data_preprocess/gsm8k_tool_agent_loop.py: its instruction and system prompt
GSM8K_TOOL_INSTRUCTION = "Let's think step by step and output the final answer after `####`."
GSM8K_TOOL_SYSTEM = ("You are a math expert. You are given a question and you need to solve it step by step. "
                     "Reasoning step by step before any tool call. "
                     "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
                     "before generate final answer at least once and refine your answer if necessary. "
                     "Put your final answer in the format of `#### <answer>`.")


def gsm8k_rows(records: list[dict], split: str = "train", agent: str | None = None) -> list[dict]:
    """GSM8K records ({question, answer}) -> verl's preprocessed rows (verl: examples/data_preprocess/
    gsm8k.py; agent="tool_agent": gsm8k_tool_agent_loop.py's rows, which call calc_gsm8k_reward)."""
    if agent not in (None, "tool_agent"):
        raise ValueError(f"GSM8K agent {agent!r}: only tool_agent (or none) has a verl preprocessing")
    rows = []
    for index, record in enumerate(records):
        for key in ("question", "answer"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"GSM8K row {index}: missing or non-text {key!r} column")
        question, answer = record["question"], record["answer"]
        truth = gsm8k_ground_truth(answer, index)
        row = {
            "data_source": GSM8K_SOURCE,
            "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
        }
        if agent == "tool_agent":
            row["agent_name"] = agent
            row["prompt"] = [{"role": "system", "content": GSM8K_TOOL_SYSTEM},
                             {"role": "user", "content": question + " " + GSM8K_TOOL_INSTRUCTION}]
            row["extra_info"].update({
                "need_tools_kwargs": True,
                "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
                "interaction_kwargs": {"query": question, "ground_truth": truth}})
        rows.append(row)
    return rows


def convert_gsm8k(input_path, out_path, split: str = "train", agent: str | None = None) -> Path:
    """Convert a local GSM8K file (jsonl or parquet with question/answer) to verl's RL parquet."""
    rows = gsm8k_rows(read_records(input_path), split, agent)
    return write_rows(rows, out_path) if agent is None else write_tool_rows(rows, out_path)
