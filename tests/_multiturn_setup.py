"""Multi-turn test assets: verl-format tool datasets, a calculator tool config, the tiny model
taught (by a short supervised fine-tune) to call the calculator in verl's hermes format, and a
scripted Engine whose turns are a function of the conversation so far.

The taught model makes the real hf engine emit real tool calls: for each prompt it memorises one
whole trajectory (an assistant turn with its calls, the tool turn the agent loop will append —
templated exactly as stages.engines.agent_loop does — and a final answer), with the loss on the
assistant tokens only. Greedy decoding then replays it token for token."""
from __future__ import annotations

import dataclasses
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq

from stages.engines import Engine, Generation, eos_token_ids, finish

CALC_CONFIG = "tools:\n  - class_name: calculator\n    config: {type: native}\n"


def call_text(name: str, arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def tool_row(question: str, truth: str, index: int, agent: str = "tool_agent") -> dict:
    """One row in verl's tool-agent schema (examples/data_preprocess/gsm8k_tool_agent_loop.py)."""
    return {"data_source": "stagerl/arith", "agent_name": agent,
            "prompt": [{"role": "system", "content": "Use the calculator tool, then answer after ####."},
                       {"role": "user", "content": question}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": index, "question": question, "need_tools_kwargs": True,
                           "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": truth}}}}}


def write_tool_dataset(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_calc_config(path) -> str:
    path.write_text(CALC_CONFIG)
    return str(path)


# Each prompt's scripted trajectory: its assistant turns; the tool turns between them are what
# the real ToolSet answers to the turn's calls (computed, so they match the loop's exactly).
def trajectories() -> list[tuple[str, str, list[str]]]:
    """(question, ground truth, assistant turns)."""
    return [
        ("What is 123 + 456?", "579", [call_text("calculator", {"expression": "123 + 456"}), "#### 579"]),
        ("What is 812 - 97?", "715", [call_text("calculator", {"expression": "812 - 97"}), "#### 715"]),
        # two calls in one turn (both run when max_parallel_calls >= 2)
        ("What is 25 * 4 + 7?", "107",
         [call_text("calculator", {"expression": "25 * 4"}) + call_text("calculator", {"expression": "100 + 7"}),
          "#### 107"]),
        # a call whose JSON cannot be read, then an unknown tool: errors become responses
        ("What is 9 + 10?", "19",
         ['<tool_call>{"name": "calculator", "arguments": </tool_call>', call_text("abacus", {"expression": "9 + 10"}),
          "#### 19"]),
    ]


def sft_examples(tokenizer, prompt_ids: dict, eos: int, tools) -> list[tuple[list[int], list[int]]]:
    """(ids, labels with -100 off the assistant tokens) of every scripted trajectory; `prompt_ids`
    maps each question to its templated prompt ids (as the dataset tokenised it); `tools` a ToolSet
    that answers the calls as the agent loop's will (stages.engines.agent_loop.demonstrations, what
    the multi-turn warm start trains on)."""
    from stages.engines.agent_loop import LoopSettings, demonstrations

    scripts = trajectories()
    return demonstrations(tokenizer, [prompt_ids[q] for q, _, _ in scripts], [turns for _, _, turns in scripts],
                          tools, LoopSettings(response_length=10 ** 6, max_parallel_calls=8), eos,
                          keys=[f"sft{n}" for n in range(len(scripts))])


def teach_tool_calls(model_dir, out_dir, prompt_ids: dict, tools, steps: int = 300, lr: float = 3e-3):
    """Fine-tune the tiny model at `model_dir` on the scripted trajectories (tool turns answered by
    the ToolSet `tools`); save it to `out_dir`; returns the last loss."""
    import shutil

    import torch

    from stages.model.models import load_policy, load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(model_dir)
    model = load_policy(model_dir)
    model.train()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    examples = sft_examples(tokenizer, prompt_ids, eos, tools)
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (seq, lab) in enumerate(examples):
        ids[i, :len(seq)], labels[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(seq), torch.tensor(lab), 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    shutil.copy(f"{model_dir}/generation_config.json", f"{out_dir}/generation_config.json")
    return float(loss.detach())


class ScriptedEngine(Engine):
    """A rollout engine whose assistant turn is a function of the conversation so far (registered
    as "scripted" in stages.engines.ENGINES by the tests that use it). The user message picks a
    script: "call N" emits N calculator calls per turn and answers after `turns` tool turns;
    "forever" calls the calculator every turn; "bad" emits an unreadable call, a call of an
    unknown tool and one that raises, in turn; "long" asks for a 400-digit number; "plain" answers
    at once. Each turn stops with <|im_end|> and honours max_new_tokens."""

    def start(self, spec):
        from stages.model.models import load_tokenizer

        self.tokenizer = load_tokenizer(spec.model_dir)
        self.eos = eos_token_ids(spec.model_dir)
        self.im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return {"engine_start_s": 0.0}

    def load_weights(self, model_dir):
        return {"load_weights_s": 0.0}

    def turn_text(self, conversation: str) -> str:
        question = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", conversation, re.S).group(1)
        done = conversation.count("<|im_start|>tool")
        if question.startswith("call"):
            calls, turns = (int(x) for x in question.split()[1:3])
            if done >= turns:
                return "#### done"
            return "".join(call_text("calculator", {"expression": f"{done} + {k}"}) for k in range(calls))
        if question == "forever":
            return f"thinking {done} " + call_text("calculator", {"expression": f"{done} * 2"})
        if question == "bad":
            return ['<tool_call>{"name": </tool_call>', call_text("abacus", {"expression": "1"}),
                    call_text("calculator", {"expression": "1 / 0"}), "#### gave up"][min(done, 3)]
        if question == "long":
            return "#### ok" if done else call_text("calculator", {"expression": "7 ** 473"})
        return "#### plain"

    def generate(self, prompt_ids, seeds, sampling, replica, step_seed, rollout):
        out = []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            tokens = self.tokenizer(self.turn_text(text), add_special_tokens=False)["input_ids"] + [self.im_end]
            out.append(finish(tokens, self.eos, sampling.max_new_tokens))
        return out


def scripted_generate(engine: ScriptedEngine, calls: list | None = None):
    """An AgentLoop generate function over a started ScriptedEngine (records each call's rows)."""
    def generate(rows, sampling, call_seed, row_seeds):
        if calls is not None:
            calls.append({"rows": len(rows), "max_new_tokens": sampling.max_new_tokens, "seed": call_seed})
        return engine.generate(rows, row_seeds, sampling, 0, call_seed, {})
    return generate


class ScriptedStream:
    """Engine.stream over a ScriptedEngine, for AgentLoop(stream=...): a request's turn is the
    scripted engine's, sampled one token per engine step, all running requests in each step (a
    continuous batch); a call runs steps until one request or more has ended, or for max_steps.
    `log` records each call's (rows added, rows ended, steps so far); `steps` counts the steps."""

    def __init__(self, engine: ScriptedEngine):
        self.engine, self.running, self.log, self.steps = engine, {}, [], 0

    def __call__(self, add, sampling, first, max_steps=None):
        for row, ids, seed, max_new in add:
            gen = self.engine.generate([ids], [seed], dataclasses.replace(sampling, max_new_tokens=max_new), 0, 0, {})[0]
            self.running[row] = [len(gen.response_ids), gen]
        ended, steps = [], 0
        while self.running and not ended and (max_steps is None or steps < max_steps):
            self.steps += 1
            steps += 1
            for row, entry in self.running.items():
                entry[0] -= 1
                if entry[0] <= 0:
                    ended.append(row)
        done = [(row, self.running.pop(row)[1]) for row in sorted(ended)]
        self.log.append(([a[0] for a in add], [row for row, _ in done], self.steps))
        return done, steps


__all__ = ["Generation", "ScriptedEngine", "ScriptedStream", "teach_tool_calls", "tool_row", "trajectories", "write_calc_config",
           "write_tool_dataset", "scripted_generate"]
