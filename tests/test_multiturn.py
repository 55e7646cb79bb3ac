"""Multi-turn tool-calling rollouts (issue 36): verl's tool agent loop, token in, token out.

A port of verl's tool-agent test assertions (tests/experimental/agent_loop/test_basic_agent_loop.py:
no tool-response token under the response mask, the turn limits, max_parallel_calls, a tool error
is a response), each on the AgentLoop driven by a scripted Engine (stages.engines' interface; its
turns are a function of the conversation) with the real calculator in the real ToolSet workers,
and end to end through the rollout stage with the real hf engine and the tiny model taught to call
the calculator (tests/_multiturn_setup.py), then logprob, reward, advantage and update on those
rows: the stored mask is honoured everywhere."""
import json
from pathlib import Path

import pytest

from _multiturn_setup import (ScriptedEngine, ScriptedStream, scripted_generate, teach_tool_calls, tool_row, trajectories,
                              write_calc_config, write_tool_dataset)
from _rollout_setup import make_assets, make_ctx, rollout_bytes
from configs.loader import load_config
from configs.schema import ConfigError
from configs.suggest import make_plan
from stages import rollout
from stages.engines import EngineSpec, Sampling
from stages.engines.agent_loop import AgentLoop, LoopSettings, _template_ids
from stages.tools.toolset import ToolSet, truncate_response
from storage.artifacts import read_file, read_table

MT = "actor_rollout_ref.rollout.multi_turn"


# ---------------------------------------------------------------------------------------------
# The loop, driven by a scripted engine

@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("mt-assets"))


@pytest.fixture(scope="module")
def calc_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mt-tools")
    path = folder / "tools.yaml"
    path.write_text("tools:\n  - class_name: calculator\n    config: {type: native}\n"
                    "  - class_name: _tool_fixtures.SleepTool\n    config: {type: native}\n")
    return str(path)


@pytest.fixture(scope="module")
def toolset(calc_config):
    with ToolSet.from_config(calc_config, num_workers=2, timeout_s=20.0, instance_per="call") as tools:
        tools.start(wait=True)
        yield tools


@pytest.fixture(scope="module")
def scripted(assets):
    from stages.model.models import load_tokenizer

    engine = ScriptedEngine()
    engine.start(EngineSpec(engine="scripted", model_dir=str(assets[0]), rollout=()))
    return engine, load_tokenizer(assets[0])


def run_loop(scripted, toolset, questions, response_length=400, agents=None, calls=None, group_rows=8, **settings):
    engine, tokenizer = scripted
    prompts = [_template_ids(tokenizer, [{"role": "user", "content": q}], True, {}) for q in questions]
    loop = AgentLoop(scripted_generate(engine, calls), tokenizer, toolset,
                     LoopSettings(response_length=response_length, **settings), Sampling(do_sample=False))
    trajs = loop.run(prompts, agents or ["tool_agent"] * len(prompts), [{}] * len(prompts),
                     [f"q{i}-{id(loop)}" for i in range(len(prompts))], seed=3, group_rows=group_rows)
    return loop, trajs


def spans(traj):
    """[(turn, role, start, end, token ids)] of the distinct turns, in order."""
    seen = {}
    for rec in traj.turns:
        seen.setdefault(rec.turn, (rec.turn, rec.role, rec.start, rec.end, rec.token_ids))
    return [seen[t] for t in sorted(seen)]


def check_trajectory(traj, tokenizer):
    """verl's assertions on one trajectory: mask 1 exactly on assistant tokens, 0 exactly on tool
    tokens; the turns concatenated are the response; it ends on an assistant turn."""
    assert len(traj.response_ids) == len(traj.response_mask)
    joined = []
    for turn, role, start, end, ids in spans(traj):
        assert start == len(joined) and traj.response_ids[start:end] == ids
        assert traj.response_mask[start:end] == [1 if role == "assistant" else 0] * len(ids)
        if role == "tool" and ids:   # the tool message, templated: never under the mask
            assert tokenizer.decode(ids).startswith("<|im_start|>tool\n")
        elif role == "tool":   # a tool turn the response length cut off: the last, empty
            assert (turn, start, end) == (spans(traj)[-1][0], len(traj.response_ids), len(traj.response_ids))
        joined += ids
    assert joined == traj.response_ids
    assert traj.turns[-1].role == "assistant" or traj.turns[-1].end == traj.turns[-1].start  # never ends on a tool turn
    assert traj.response_mask[-1] == 1
    tool_text = "".join(tokenizer.decode([t]) for t, m in zip(traj.response_ids, traj.response_mask) if not m)
    assert "<tool_call>" not in tool_text


def test_tool_tokens_are_never_under_the_mask_and_turns_concatenate(scripted, toolset):
    _, tokenizer = scripted
    loop, trajs = run_loop(scripted, toolset, ["call 1 2", "call 2 1", "plain"], max_parallel_calls=2)
    for traj in trajs:
        check_trajectory(traj, tokenizer)
    first, second, plain = trajs
    assert [r.role for r in first.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert (first.assistant_turns, first.user_turns, first.num_turns) == (3, 2, 6)
    assert [r.text for r in first.turns if r.role == "tool"] == ["0", "1"]    # 0 + 0, then 1 + 0
    assert [r.text for r in second.turns if r.role == "tool"] == ["0", "1"]   # 0 + 0 and 0 + 1 in one turn
    assert tokenizer.decode(second.turns[1].token_ids) == "<|im_start|>tool\n0<|im_end|>\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>assistant\n"
    assert first.turns[-1].text == "#### done<|im_end|>" and first.finish_reason == "stop"
    assert (plain.assistant_turns, plain.user_turns, plain.response_mask) == (1, 0, [1] * len(plain.response_ids))
    assert loop.stats["tool_calls"] == 4 and first.tool_rewards == [0.0, 0.0]


def test_single_turn_agent_rows_never_call(scripted, toolset):
    _, trajs = run_loop(scripted, toolset, ["call 1 2"], agents=["single_turn_agent"])
    assert trajs[0].assistant_turns == 1 and [r.role for r in trajs[0].turns] == ["assistant"]
    assert "<tool_call>" in trajs[0].turns[0].text   # the call is text, not run


def test_turn_limits(scripted, toolset):
    _, tokenizer = scripted
    # verl: the checks follow each assistant turn: assistant turns, then tool turns already appended
    _, (a,) = run_loop(scripted, toolset, ["forever"], max_assistant_turns=3)
    _, (u,) = run_loop(scripted, toolset, ["forever"], max_user_turns=2)
    _, (one,) = run_loop(scripted, toolset, ["forever"], max_assistant_turns=1)
    assert (a.assistant_turns, a.user_turns) == (3, 2)
    assert (u.assistant_turns, u.user_turns) == (3, 2)
    assert (one.assistant_turns, one.user_turns, [r.role for r in one.turns]) == (1, 0, ["assistant"])
    # no limit: the response length ends it, on an assistant turn, never past response_length
    _, (free,) = run_loop(scripted, toolset, ["forever"], response_length=300)
    for traj in (a, u, one, free):
        check_trajectory(traj, tokenizer)
    assert len(free.response_ids) <= 300 and free.finish_reason == "length" and free.user_turns >= 2


def test_a_tool_turn_that_would_fill_the_response_ends_the_trajectory_before_it(scripted, toolset):
    _, tokenizer = scripted
    _, (full,) = run_loop(scripted, toolset, ["call 1 1"])
    first_turn, tool_turn = full.turns[0].end, full.turns[1].end - full.turns[1].start
    # verl: len(mask) + len(tool ids) >= response_length ends it (the tool turn is not appended)
    _, (cut,) = run_loop(scripted, toolset, ["call 1 1"], response_length=first_turn + tool_turn)
    check_trajectory(cut, tokenizer)
    assert cut.response_ids == full.response_ids[:first_turn] and cut.response_mask == [1] * first_turn
    assert (cut.assistant_turns, cut.user_turns, cut.finish_reason) == (1, 0, "length")
    assert [(r.role, r.start, r.end, r.text) for r in cut.turns[1:]] == [("tool", first_turn, first_turn, "0")]
    _, (fits,) = run_loop(scripted, toolset, ["call 1 1"], response_length=first_turn + tool_turn + 1)
    assert fits.user_turns == 1 and fits.response_ids[:first_turn + tool_turn] == full.response_ids[:first_turn + tool_turn]
    assert len(fits.response_ids) == first_turn + tool_turn + 1 and fits.finish_reason == "length"


def test_max_parallel_calls(scripted, toolset):
    _, tokenizer = scripted
    for limit in (1, 2, 5):
        _, (traj,) = run_loop(scripted, toolset, ["call 3 1"], max_parallel_calls=limit)
        check_trajectory(traj, tokenizer)
        tool = [r for r in traj.turns if r.role == "tool"]
        ran = min(limit, 3)
        assert [r.call for r in tool] == list(range(ran)) and [r.text for r in tool] == [str(k) for k in range(ran)]
        assert tokenizer.decode(tool[0].token_ids).count("<|im_start|>tool\n") == ran


def test_a_tool_error_is_a_response_not_a_crash(scripted, toolset):
    _, tokenizer = scripted
    toolset.metrics(reset=True)
    loop, (traj,) = run_loop(scripted, toolset, ["bad"])
    check_trajectory(traj, tokenizer)
    tool = [r for r in traj.turns if r.role == "tool"]
    assert [r.error for r in tool] == ["bad_json", "unknown_tool", "exception"]
    assert all(r.text.startswith("Error when executing tool: ") for r in tool)
    assert "division by zero" in tool[2].text
    assert traj.turns[-1].text == "#### gave up<|im_end|>" and traj.tool_rewards == [0.0, 0.0, 0.0]
    metrics = toolset.metrics()
    assert (metrics["tools/errors/bad_json"], metrics["tools/errors/unknown_tool"], metrics["tools/errors/exception"]) == (1, 1, 1)


@pytest.mark.parametrize("side", ["left", "middle", "right"])
def test_long_tool_responses_are_cut_as_verl(scripted, toolset, side):
    _, (traj,) = run_loop(scripted, toolset, ["long"], max_tool_response_length=40, tool_response_truncate_side=side)
    full = str(7 ** 473)
    assert traj.turns[1].text == truncate_response(full, 40, side) != full


def test_groups_do_not_wait_for_each_other_and_seeds_do_not_depend_on_timing(scripted, toolset):
    """Two groups: the first's tool sleeps, the second's answers at once. The engine generates
    the second group's next turn (and finishes it) while the first waits; the trajectories are the
    same as when both tools are fast."""
    slow = ['<tool_call>{"name": "sleep", "arguments": {"seconds": 1.5}}</tool_call>', "#### slept"]
    engine, tokenizer = scripted

    class Sleepy(ScriptedEngine):
        def turn_text(self, conversation):
            if "sleep" in conversation.split("<|im_start|>user\n")[1][:20]:
                return slow[min(conversation.count("<|im_start|>tool"), 1)]
            return super().turn_text(conversation)

    sleepy = Sleepy()
    sleepy.__dict__.update(engine.__dict__)
    order = []

    def generate(rows, sampling, call_seed, row_seeds):
        order.append(tokenizer.decode(rows[0]).split("<|im_start|>user\n")[1].split("<|im_end|>")[0])
        return sleepy.generate(rows, row_seeds, sampling, 0, call_seed, {})

    questions = ["sleep", "plain", "call 1 2", "call 1 2"]
    prompts = [_template_ids(tokenizer, [{"role": "user", "content": q}], True, {}) for q in questions]
    loop = AgentLoop(generate, tokenizer, toolset, LoopSettings(response_length=400), Sampling(do_sample=False))
    trajs = loop.run(prompts, ["tool_agent"] * 4, [{}] * 4, [f"g{i}" for i in range(4)], seed=3, group_rows=2)
    assert order == ["sleep", "call 1 2", "call 1 2", "call 1 2", "sleep"]   # group 1 ran all its turns meanwhile
    assert loop.stats["engine_calls"] == 5 and loop.stats["tool_wait_s"] > 0.5
    assert trajs[0].turns[-1].text == "#### slept<|im_end|>" and trajs[2].user_turns == 2


def test_a_streamed_batch_never_waits_for_its_slowest_row(scripted, toolset):
    """Engine.stream (vLLM's continuous batching): a row whose turn ends runs its tools and its next
    turn joins the running batch at once. One row writes a long answer in one turn; the others
    make two or three short calling turns and are done before it. The engine's steps are the most
    tokens any one row sampled (rounds would pay each round's slowest row); the trajectories equal
    the rounds' (same seeds, the same turns)."""
    engine, tokenizer = scripted
    long_answer = "#### " + " ".join(str(k) for k in range(60))

    class Slow(ScriptedEngine):
        def turn_text(self, conversation):
            if conversation.split("<|im_start|>user\n")[1].startswith("slow"):
                return long_answer
            return super().turn_text(conversation)

    slow = Slow()
    slow.__dict__.update(engine.__dict__)
    questions = ["slow", "call 1 2", "call 2 2", "plain"]
    prompts = [_template_ids(tokenizer, [{"role": "user", "content": q}], True, {}) for q in questions]

    def run(stream):
        loop = AgentLoop(lambda rows, sampling, call_seed, row_seeds: slow.generate(rows, row_seeds, sampling, 0, call_seed, {}),
                         tokenizer, toolset, LoopSettings(response_length=400, max_parallel_calls=2),
                         Sampling(do_sample=False), stream=stream)
        return loop, loop.run(prompts, ["tool_agent"] * 4, [{}] * 4, [f"s{i}-{stream is None}" for i in range(4)],
                              seed=3, group_rows=4)

    stream = ScriptedStream(slow)
    loop, trajs = run(stream)
    _, rounds = run(None)
    for a, b in zip(trajs, rounds):
        check_trajectory(a, tokenizer)
        assert (a.response_ids, a.response_mask, [t.text for t in a.turns]) == \
            (b.response_ids, b.response_mask, [t.text for t in b.turns])
    sampled = [sum(a.response_mask) for a in trajs]
    assert trajs[0].turns[-1].text == long_answer + "<|im_end|>" and [t.assistant_turns for t in trajs] == [1, 3, 2, 1]
    assert sampled[0] > max(sampled[1:])                     # the slow row sampled the most
    assert stream.steps == sampled[0]                           # and the batch took no step more
    ended = [rows for _, rows, _ in stream.log]
    assert ended[-1] == [0] and all(0 not in rows for rows in ended[:-1])   # the others ended before it
    assert all(set(added) <= {1, 2} for added, _, _ in stream.log[1:])   # only the calling rows came back
    assert loop.stats["streamed"] and loop.stats["engine_calls"] == len(stream.log) and loop.stats["rounds"] == 3
    assert loop.stats["engine_steps"] == stream.steps


def test_a_streamed_batch_generates_while_a_tool_runs_and_the_schedule_ignores_how_long(scripted, toolset):
    """multi_turn.tool_overlap_steps = 6: while one row's tool sleeps, the other rows go on
    generating for 6 engine steps, then the engine waits for it there. The sleeping row's next turn
    joins at the same engine step whether its tool takes 0.01 s or 0.8 s: the calls, the rows each
    added and ended, the steps and the trajectories are the same; only the time waited differs."""
    engine, tokenizer = scripted

    class Sleeper(ScriptedEngine):
        seconds = "0.01"

        def turn_text(self, conversation):
            question = conversation.split("<|im_start|>user\n")[1]
            if question.startswith("nap"):
                return ('<tool_call>{"name": "sleep", "arguments": {"seconds": ' + self.seconds + '}}</tool_call>'
                        if "<|im_start|>tool" not in conversation else "#### rested")
            if question.startswith("slow"):
                return "#### " + " ".join(str(k) for k in range(40))
            return super().turn_text(conversation)

    sleeper = Sleeper()
    sleeper.__dict__.update(engine.__dict__)
    questions = ["nap", "call 1 2", "slow", "call 2 2"]
    prompts = [_template_ids(tokenizer, [{"role": "user", "content": q}], True, {}) for q in questions]

    def run(seconds):
        sleeper.seconds = seconds
        stream = ScriptedStream(sleeper)
        loop = AgentLoop(None, tokenizer, toolset, LoopSettings(response_length=400, max_parallel_calls=2, tool_overlap_steps=6),
                         Sampling(do_sample=False), stream=stream)
        trajs = loop.run(prompts, ["tool_agent"] * 4, [{}] * 4, [f"n{i}-{seconds}" for i in range(4)], seed=3, group_rows=4)
        return stream, loop, trajs

    fast, fast_loop, fast_trajs = run("0.01")
    slow, slow_loop, slow_trajs = run("0.81")
    assert [(added, ended) for added, ended, _ in fast.log] == [(added, ended) for added, ended, _ in slow.log]
    assert [s for _, _, s in fast.log] == [s for _, _, s in slow.log] and fast.steps == slow.steps
    for a, b in zip(fast_trajs, slow_trajs):
        check_trajectory(b, tokenizer)
        assert len(a.response_ids) == len(b.response_ids) and [t.role for t in a.turns] == [t.role for t in b.turns]
    assert slow_trajs[0].turns[-1].text == "#### rested<|im_end|>" and slow_trajs[0].turns[1].text == "slept 0.81"
    nap_ended = next(i for i, (_, ended, _) in enumerate(slow.log) if 0 in ended)
    nap_back = next(i for i, (added, _, _) in enumerate(slow.log) if i > nap_ended and 0 in added)
    assert slow.log[nap_back - 1][2] == slow.log[nap_ended][2] + 6   # it rejoined 6 steps after its turn ended
    assert slow_loop.stats["tool_wait_s"] > 0.4 > fast_loop.stats["tool_wait_s"]
    assert slow_loop.stats["engine_steps"] == slow.steps


# ---------------------------------------------------------------------------------------------
# End to end: the rollout stage with the real hf engine and a model that calls the calculator

@pytest.fixture(scope="module")
def taught(tmp_path_factory, assets):
    """(model taught to call the calculator, verl-format train file, tool config)."""
    from stages.data.dataset import RLDataset
    from stages.model.models import load_tokenizer

    folder = tmp_path_factory.mktemp("mt-taught")
    config = write_calc_config(folder / "calc.yaml")
    train = write_tool_dataset(folder / "train.parquet", [tool_row(q, t, i) for i, (q, t, _) in enumerate(trajectories())])
    ctx = make_ctx(folder / "probe", (assets[0], train, assets[2]), stage_overrides(config))
    rows = RLDataset(dict(ctx.get("data")), load_tokenizer(assets[0])).rows
    with ToolSet.from_config(config, num_workers=1, instance_per="call") as tools:
        loss = teach_tool_calls(assets[0], folder / "taught", {r.extra_info["question"]: r.prompt_ids for r in rows},
                                tools, steps=100)
    assert loss < 0.05
    return folder / "taught", train, config


def stage_overrides(config, *more):
    return [f"{MT}.enable=true", f"{MT}.tool_config_path={config}", f"{MT}.max_parallel_calls=2",
            "data.max_prompt_length=64", "data.max_response_length=320", "actor_rollout_ref.rollout.do_sample=false",
            "data.shuffle=false", "actor_rollout_ref.rollout.calculate_log_probs=true", *more]


def test_rollout_stage_with_the_hf_engine_calls_the_calculator(tmp_path, taught, assets):
    model, train, config = taught
    ctx = make_ctx(tmp_path / "a", (model, train, assets[2]), stage_overrides(config))
    manifest = rollout.run(ctx)
    cols = read_table(ctx.store, ctx.layout, 1, "rollout").to_pydict()
    turns = read_file(ctx.store, ctx.layout, 1, "rollout", "rollout/turns.parquet").to_pydict()
    truths = [t for _, t, _ in trajectories()]
    assert [r.endswith(f"#### {truths[i // 2]}") for i, r in enumerate(cols["response"])] == [True] * 8
    assert cols["response"][0] == ('<tool_call>{"name": "calculator", "arguments": {"expression": "123 + 456"}}'
                                   '</tool_call>tool\n579\nassistant\n#### 579')   # verl: decoded without special tokens
    assert cols["num_turns"] == [4, 4, 4, 4, 4, 4, 6, 6] and cols["finish_reason"] == ["stop"] * 8
    for row in range(8):
        ids, mask, lps = cols["response_ids"][row], cols["response_mask"][row], cols["rollout_log_probs"][row]
        mine = [k for k, r in enumerate(turns["row"]) if r == row]
        assert {turns["uid"][k] for k in mine} == {cols["uid"][row]}
        joined, seen = [], set()
        for k in mine:
            if turns["turn"][k] in seen:   # the calls of one tool turn share its span
                continue
            seen.add(turns["turn"][k])
            start, end = turns["token_start"][k], turns["token_end"][k]
            assert start == len(joined) and ids[start:end] == turns["token_ids"][k]
            assert mask[start:end] == [turns["mask"][k]] * (end - start)
            assert turns["mask"][k] == (turns["role"][k] == "assistant")
            joined += turns["token_ids"][k]
        assert cols["prompt_ids"][row] + joined == cols["prompt_ids"][row] + ids   # the trajectory is its turns
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m) and all(lp <= 0 for lp, m in zip(lps, mask) if m)
        extra = json.loads(cols["extra_info"][row])
        assert extra["num_turns"] == cols["num_turns"][row] and extra["tools_kwargs"]["calculator"]["create_kwargs"]["ground_truth"] == truths[row // 2]
    tool_rows = [k for k, role in enumerate(turns["role"]) if role == "tool"]
    assert [turns["response"][k] for k in tool_rows[:2]] == ["579", "579"]
    assert sorted({(turns["tool"][k], turns["error"][k]) for k in tool_rows}, key=str) == sorted(
        {("calculator", None), (None, "bad_json"), ("abacus", "unknown_tool")}, key=str)
    assert all(turns["latency_s"][k] >= 0 for k in tool_rows)
    summary = manifest["extra"]["multi_turn"]
    assert (summary["tool_calls"], summary["tool_errors/bad_json"], summary["tool_errors/unknown_tool"]) == (12, 2, 2)
    assert summary["calls_by_tool"] == {"calculator": 8, "?": 2, "abacus": 2} and summary["num_turns_mean"] == 4.5
    assert summary["llm_tokens"] + summary["tool_tokens"] == sum(cols["response_length"])
    # one continuous batch (HFEngine.stream): a call ends one turn or more, never a round's worth
    assert summary["streamed"] and summary["rounds"] == 3 and summary["engine_calls"] <= 8 * 3
    # the same seed gives the same bytes; the same turns (but their measured latencies); in a run
    # the engine stays in this process and frees its turn caches when the batch is over
    from stages.session import RunSession

    again = make_ctx(tmp_path / "b", (model, train, assets[2]), stage_overrides(config))
    with RunSession() as session:
        again.session = session
        rollout.run(again)
        engines = session.engines()
        assert engines.local is not None and not engines.workers and engines.local[1].batch is None
    assert rollout_bytes(again) == rollout_bytes(ctx)
    turns_again = read_file(again.store, again.layout, 1, "rollout", "rollout/turns.parquet").to_pydict()
    assert {k: v for k, v in turns_again.items() if k != "latency_s"} == {k: v for k, v in turns.items() if k != "latency_s"}


def test_logprob_advantage_and_update_honour_the_mask_and_the_readers_show_the_turns(tmp_path, taught, assets, capsys):
    from flows.cli import main
    from stages import advantage, logprob, reward, update
    from storage.artifacts import write_run_json

    model, train, config = taught
    ctx = make_ctx(tmp_path, (model, train, assets[2]), stage_overrides(
        config, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=true",
        f"storage.cache_dir={tmp_path / 'cache'}"))
    assert not ctx.plan["rollout"]["old_log_prob_pass"] and ctx.plan["ref"] is not None
    for stage in (rollout, logprob, reward, advantage, update):
        stage.run(ctx)
    cols = read_table(ctx.store, ctx.layout, 1, "rollout").to_pydict()
    masks = cols["response_mask"]
    assert sum(m.count(0) for m in masks) > 100    # tool tokens are there
    ref = read_table(ctx.store, ctx.layout, 1, "logprob").column("ref_log_probs").to_pylist()
    adv = read_table(ctx.store, ctx.layout, 1, "advantage").to_pydict()
    forward = read_file(ctx.store, ctx.layout, 1, "update", "update/log_probs.parquet").to_pydict()
    scores = read_table(ctx.store, ctx.layout, 1, "reward").column("score").to_pylist()
    assert scores == [1.0] * 8   # every trajectory ends "#### <truth>"
    for row, mask in enumerate(masks):
        for name, values in (("ref", ref[row]), ("advantages", adv["advantages"][row]), ("returns", adv["returns"][row]),
                             ("kl", adv["kl"][row]), ("old", forward["old_log_probs"][row]),
                             ("entropy", forward["entropy"][row])):
            assert [v for v, m in zip(values, mask) if not m] == [0.0] * mask.count(0), (name, row)
        assert all(v <= 0 for v, m in zip(ref[row], mask) if m)
    # the update's token means are over the sampled tokens only: its entropy is the stored
    # entropies' sum over the mask's ones
    metrics = read_file(ctx.store, ctx.layout, 1, "update", "update/metrics.json")
    tokens = sum(sum(m) for m in masks)
    expected = sum(sum(e) for e in forward["entropy"]) / tokens
    assert metrics["actor/entropy"] == pytest.approx(expected, rel=1e-4)
    assert expected != pytest.approx(sum(sum(e) for e in forward["entropy"]) / sum(cols["response_length"]), rel=1e-2)

    # the readers: query sees `turns`, inspect counts the calls and errors, show renders the turns
    write_run_json(ctx.store, ctx.layout, dict(ctx.cfg))
    root = ["--root", str(tmp_path)]
    capsys.readouterr()   # what the stages printed

    def cli(*argv):
        code = main(list(argv))
        out = capsys.readouterr()
        assert code == 0, out.err
        return out.out

    rows = json.loads(cli("query", "select tool, error, count(*) as n, avg(latency_s) >= 0 as timed from turns "
                                   "where role = 'tool' group by all order by tool, error", "--experiment", "t",
                          *root, "--json"))
    assert [(r["tool"], r["error"], r["n"], r["timed"]) for r in rows] == [
        ("abacus", "unknown_tool", 2, True), ("calculator", None, 8, True), (None, "bad_json", 2, True)]
    by_tool = json.loads(cli("query", "select tool, count(*) as n, avg(latency) = avg(latency_s) as same from turns "
                                      "group by tool order by tool", "--experiment", "t", *root, "--json"))
    assert [(r["tool"], r["n"], r["same"]) for r in by_tool] == [("abacus", 2, True), ("calculator", 8, True), (None, 20, True)]
    joined = json.loads(cli("query", "select r.score, count(*) as turns from turns t join reward r using (step, row) "
                                     "group by r.score", "--experiment", "t", *root, "--json"))
    assert joined == [{"score": 1.0, "turns": 18 + 12}]   # 18 assistant turns and 12 tool calls, all of rows scoring 1
    summary = json.loads(cli("inspect", "t", *root, "--step", "1", "--json"))
    multi = summary["stages"]["rollout"]["multi_turn"]
    assert (multi["tool_calls"], multi["calls_by_tool"], multi["errors"]) == (
        12, {"calculator": 8, "?": 2, "abacus": 2}, {"bad_json": 2, "unknown_tool": 2})
    assert multi["error_rate"] == {"bad_json": 2 / 12, "unknown_tool": 2 / 12} and multi["num_turns"]["mean"] == 4.5
    assert multi["assistant_turns"] == {"mean": 18 / 8, "min": 2.0, "max": 3.0}
    text = cli("inspect", "t", *root, "--step", "1")
    assert "tool errors:     bad_json=2  unknown_tool=2" in text and "tool calls:      12 (1.5/sample)" in text
    overview = cli("inspect", "t", *root)
    assert "turns/mean" in overview and "tool_error_rate" in overview
    shown = cli("show", "t", *root, "--step", "1", "--uid", cols["uid"][6], "--sample", "1")
    assert "turns (5):" in shown
    assert '[1] tool call 0: ?({"name": "calculator", "arguments": ) error bad_json' in shown
    assert "[3] tool call 0: abacus({\"expression\": \"9 + 10\"}) error unknown_tool" in shown
    assert "[4] assistant (tokens" in shown and "#### 19<|im_end|>" in shown
    tokens = json.loads(cli("show", "t", *root, "--step", "1", "--uid", cols["uid"][0], "--json", "--ids"))["tokens"]
    assert [t["mask"] for t in tokens] == masks[0]
    # export (verl's rollout dump) carries verl's num_turns and each trajectory's turns; the step report a tool table
    exported = [json.loads(line) for line in cli("export", "t", *root, "--out", "-").splitlines()]
    assert [e["num_turns"] for e in exported] == cols["num_turns"] and sum(len(e["turns"]) for e in exported) == 30
    assert [(t["role"], t["tool"], t["error"]) for t in exported[6]["turns"][:2]] == [
        ("assistant", None, None), ("tool", None, "bad_json")]
    from flows.step_report import tool_turn_lines

    report = tool_turn_lines(ctx)
    assert "2.25 assistant turns and 1.50 tool calls per trajectory" in report[1]
    assert [line.split(" | ")[:3] for line in report[-3:]] == [["| ?", "2", "2"], ["| abacus", "2", "2"],
                                                               ["| calculator", "8", "0"]]


def test_single_turn_rows_through_the_loop_equal_the_single_turn_rollout(tmp_path, assets):
    """Greedy, the loop's single_turn_agent rows sample what the plain rollout samples (the loop
    only adds the mask, the turns and verl's extra_info keys)."""
    greedy = ["actor_rollout_ref.rollout.do_sample=false"]
    plain = make_ctx(tmp_path / "plain", assets, greedy)
    loop = make_ctx(tmp_path / "loop", assets, [*greedy, f"{MT}.enable=true"])
    rollout.run(plain)
    manifest = rollout.run(loop)
    a, b = (read_table(x.store, x.layout, 1, "rollout").to_pydict() for x in (plain, loop))
    assert a["response_ids"] == b["response_ids"] and a["response"] == b["response"]
    assert b["response_mask"] == [[1] * n for n in b["response_length"]] and b["num_turns"] == [2] * 8
    assert "response_mask" not in a and manifest["extra"]["multi_turn"]["tool_calls"] == 0


# ---------------------------------------------------------------------------------------------
# Config: verl's keys, and what stagerl cannot honour refused by name

def refused(overrides) -> str:
    with pytest.raises(ConfigError) as info:
        cfg = load_config("tiny-cpu", overrides)
        make_plan(cfg)
    return str(info.value)


def test_multi_turn_keys_and_refusals(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n    config: {type: native}\n")
    on = [f"{MT}.enable=true", f"{MT}.tool_config_path={tools}"]
    cfg = load_config("tiny-cpu", [*on, f"{MT}.max_assistant_turns=4", f"{MT}.tool_response_truncate_side=left"])
    make_plan(cfg)
    assert cfg["data"]["tool_config_path"] == str(tools)   # verl's interpolation
    mt = cfg["actor_rollout_ref"]["rollout"]["multi_turn"]
    assert (mt["max_parallel_calls"], mt["max_tool_response_length"], mt["format"], mt["max_user_turns"]) == (1, 256, "hermes", None)
    assert "multi_turn.format: 'llama3_json' is not one of ['hermes', 'qwen']" in refused([*on, f"{MT}.format=llama3_json"])
    assert "interaction_config_path='x.yaml': stagerl does not implement" in refused([*on, f"{MT}.interaction_config_path=x.yaml"])
    assert "use_inference_chat_template=True: stagerl does not implement" in refused([*on, f"{MT}.use_inference_chat_template=true"])
    assert "agent_loop_config_path" in refused([*on, "actor_rollout_ref.rollout.agent.agent_loop_config_path=a.yaml"])
    assert "'react_agent' is not one of" in refused([*on, "actor_rollout_ref.rollout.agent.default_agent_loop=react_agent"])
    assert "tool_response_truncate_side: 'top'" in refused([*on, f"{MT}.tool_response_truncate_side=top"])
    assert "max_parallel_calls=0: must be >= 1" in refused([*on, f"{MT}.max_parallel_calls=0"])
    assert f"{MT}.tool_config_path={tmp_path}/nope.yaml: no such file" in refused([f"{MT}.enable=true", f"{MT}.tool_config_path={tmp_path}/nope.yaml"])
    assert "data.tool_config_path=None differs" in refused([*on, "data.tool_config_path=null"])
    assert "dynamic sampling of multi-turn" in refused([*on, "algorithm.filter_groups.enable=true",
                                                        "algorithm.filter_groups.metric=acc"])
    assert "algorithm.adv_estimator=remax" in refused([*on, "algorithm.adv_estimator=remax"])


# verl's examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml and the keys of its
# run_qwen2.5-3b_gsm8k_multiturn.sh (model, data and tool config paths local)
VERL_MT_CONFIG = """hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
      format: qwen
"""
VERL_MT_KEYS = (
    "algorithm.adv_estimator=grpo data.train_batch_size=256 data.max_prompt_length=1024 data.max_response_length=1024 "
    "data.filter_overlong_prompts=True data.truncation=error data.return_raw_chat=True actor_rollout_ref.actor.optim.lr=1e-6 "
    "actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256 "
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True "
    "actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl "
    "actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True "
    "actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False "
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.rollout.tensor_model_parallel_size=2 "
    "actor_rollout_ref.rollout.name=sglang_async actor_rollout_ref.rollout.gpu_memory_utilization=0.5 "
    "actor_rollout_ref.rollout.n=16 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 "
    "actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False trainer.critic_warmup=0 "
    "trainer.logger=['console','wandb'] trainer.project_name=gsm8k_async_rl "
    "trainer.experiment_name=qwen2.5-3b_function_rm-gsm8k-async-sgl-multi-w-tool-verify-n16 trainer.n_gpus_per_node=8 "
    "trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=20 trainer.total_epochs=15").split()


def test_verls_multi_turn_command_line_loads_and_what_cannot_be_honoured_is_refused_by_name(tmp_path, capsys):
    """verl's own multi-turn command line with only the entry point changed (`stagerl plan` for
    `python3 -m verl.trainer.main_ppo`, Hydra's --config-path/--config-name kept): its config file
    composes as Hydra does (defaults [ppo_trainer, _self_] = base, then the file; its `format:
    qwen`, SGLang's name for the hermes <tool_call> JSON, is read as hermes); the SGLang engine
    and a micro-batch that does not divide the mini-batch (verl asserts it too) are refused by
    name, in that order, and with those two changed it plans."""
    from flows.cli import main

    (tmp_path / "gsm8k_multiturn_grpo.yaml").write_text(VERL_MT_CONFIG)
    tools = tmp_path / "gsm8k_tool_config.yaml"
    tools.write_text((Path(__file__).resolve().parents[1] / "examples/tool_config/gsm8k_tool_config.yaml").read_text())
    line = ["plan", f"--config-path={tmp_path}", "--config-name=gsm8k_multiturn_grpo", *VERL_MT_KEYS,
            f"actor_rollout_ref.model.path={tmp_path}/Qwen2.5-3B-Instruct", f"data.train_files={tmp_path}/train.parquet",
            f"data.val_files={tmp_path}/test.parquet", f"{MT}.tool_config_path={tools}"]
    fixes = [("actor_rollout_ref.rollout.name: 'sglang_async' is not one of ['hf', 'vllm']", "actor_rollout_ref.rollout.name=vllm"),
             ("ppo_mini_batch_size 512 should be divisible by ppo_micro_batch_size_per_gpu 40",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32")]
    for message, fix in fixes:
        assert main(line) == 2
        assert message in capsys.readouterr().err
        line.append(fix)
    assert main(line + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["rows_per_step"] == 256 * 16 and plan["n_gpus"] == 8
    cfg = load_config(str(tmp_path / "gsm8k_multiturn_grpo.yaml"), line[3:])
    mt = cfg["actor_rollout_ref"]["rollout"]["multi_turn"]
    assert (mt["enable"], mt["max_assistant_turns"], mt["tool_config_path"], mt["format"]) == (True, 5, str(tools), "qwen")
    assert any("hydra" in w for w in cfg.warnings)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", f"--config-path={tmp_path}", "--config-name=nope"])
    assert exit_info.value.code == 2 and "no config file" in capsys.readouterr().err


# verl's examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.sh, its keys verbatim
# (TRAIN_BATCH_SIZE=32, MICRO_BATCH_SIZE=8 substituted; `use_kl_loss=${use_kl_loss}` with the shell
# variable unset, as the script leaves it); model, data and tool config paths are added local
VERL_MT_VLLM_KEYS = (
    "actor_rollout_ref.rollout.name=vllm algorithm.adv_estimator=grpo data.train_batch_size=32 "
    "data.max_prompt_length=1024 data.max_response_length=1024 data.filter_overlong_prompts=True "
    "data.truncation=error data.return_raw_chat=True actor_rollout_ref.actor.optim.lr=1e-6 "
    "actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 "
    "actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 "
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0 "
    "actor_rollout_ref.actor.use_kl_loss= actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 "
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.n=8 "
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.9 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 "
    "algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.project_name=gsm8k_async_rl "
    "trainer.experiment_name=qwen2.5-3b_function_rm-gsm8k-sgl-multi-w-tool-verify-n16 trainer.n_gpus_per_node=16 "
    "trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=20 trainer.logger=[\"console\"] trainer.total_epochs=15 "
    "actor_rollout_ref.rollout.trace.token2text=False actor_rollout_ref.rollout.mode=async "
    "actor_rollout_ref.rollout.multi_turn.enable=true actor_rollout_ref.rollout.enforce_eager=True "
    "actor_rollout_ref.actor.use_torch_compile=False actor_rollout_ref.rollout.free_cache_engine=True").split()


def test_verls_vllm_multi_turn_command_line_plans_and_this_machine_is_named(tmp_path, capsys):
    """verl's vLLM multi-turn script with only the entry point changed plans as verl derives it (its
    unset `${use_kl_loss}` read as false, as verl's configs read the empty string; its trace key
    accepted). `stagerl train` then names what this machine lacks, before anything starts: a CUDA
    device (trainer.device=cuda is verl's default), then a model context for 1024 + 1024 tokens."""
    from flows.cli import main
    from stages.data.tools import convert_gsm8k
    import torch

    (tmp_path / "gsm8k_multiturn_grpo.yaml").write_text(VERL_MT_CONFIG)
    tools = tmp_path / "gsm8k_tool_config.yaml"
    tools.write_text((Path(__file__).resolve().parents[1] / "examples/tool_config/gsm8k_tool_config.yaml").read_text())
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}) + "\n")
    for split in ("train", "test"):
        convert_gsm8k(tmp_path / "gsm8k.jsonl", tmp_path / f"{split}.parquet", split, agent="tool_agent")
    line = [f"--config-path={tmp_path}", "--config-name=gsm8k_multiturn_grpo", *VERL_MT_VLLM_KEYS,
            f"actor_rollout_ref.model.path={make_assets(tmp_path)[0]}", f"data.train_files={tmp_path}/train.parquet",
            f"data.val_files={tmp_path}/test.parquet", f"{MT}.tool_config_path={tools}"]
    capsys.readouterr()  # what building the tiny model printed
    assert main(["plan", *line, "--json"]) == 0
    out = capsys.readouterr()
    plan = json.loads(out.out)
    assert (plan["rows_per_step"], plan["n_gpus"]) == (32 * 8, 16)
    cfg = load_config(str(tmp_path / "gsm8k_multiturn_grpo.yaml"), line[2:])
    assert "actor_rollout_ref.actor.use_kl_loss= (an empty value) is read as false, as verl reads it" in cfg.warnings
    assert cfg["actor_rollout_ref"]["actor"]["use_kl_loss"] is False
    assert cfg["actor_rollout_ref"]["rollout"]["trace"]["token2text"] is False
    if not torch.cuda.is_available():
        assert main(["train", *line]) == 2
        assert "trainer.device=cuda (verl's default), but this machine has no CUDA device" in "".join(capsys.readouterr())
    assert main(["train", *line, "trainer.device=cpu"]) == 2   # the tiny model's 1024 positions
    assert ("data.max_prompt_length 1024 + data.max_response_length 1024 = 2048 tokens is longer than the "
            "model's context: max_position_embeddings 1024") in "".join(capsys.readouterr())
    # with a model of 4096 positions and trainer.device=cpu: 16 ranks and 8 replicas × TP 2 engine
    # processes on one host (an OOM kill on this 24 GiB machine) are refused for the host's memory
    from configs.memory import DoesNotFit, check_host_fits, estimate_memory
    from stages.model.tiny import save_tiny_model

    long = save_tiny_model(tmp_path / "long", max_position_embeddings=4096)
    cfg = load_config(str(tmp_path / "gsm8k_multiturn_grpo.yaml"), [*line[2:], f"actor_rollout_ref.model.path={long}",
                                                                     "trainer.device=cpu"])
    plan = make_plan(cfg)
    estimate = estimate_memory(cfg, plan)
    with pytest.raises(DoesNotFit, match=r"share this host's 23.5 GiB: 8 replica\(s\) × TP 2 engine processes"):
        check_host_fits(cfg, plan, estimate, host_gib=23.5)
    check_host_fits(cfg, plan, estimate, host_gib=64.0)
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.trace.backend='mlflow': stagerl does not implement"):
        load_config(str(tmp_path / "gsm8k_multiturn_grpo.yaml"), [*line[2:], "actor_rollout_ref.rollout.trace.backend=mlflow"])


def test_vllm_in_a_run_session_gives_the_hf_trajectories(tmp_path, taught, assets):
    """The resident vLLM engine of a run (and the run's tool workers, RunSession.tools) runs the
    same loop, streamed (Engine.stream): greedy, its trajectories and turns equal the hf engine's."""
    from stages.session import RunSession

    model, train, config = taught
    hf = make_ctx(tmp_path / "hf", (model, train, assets[2]), stage_overrides(config))
    rollout.run(hf)
    with RunSession() as session:
        vllm = make_ctx(tmp_path / "vllm", (model, train, assets[2]), stage_overrides(
            config, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true"))
        vllm.session = session
        manifest = rollout.run(vllm)
        tools = session.tools(config, None, 30.0)
        assert session.tools(config, None, 30.0) is tools and tools.instance_per == "call"
        assert len(session.engines().pids()) == 1   # vLLM in its worker process, kept for the run
    a, b = (read_table(x.store, x.layout, 1, "rollout").to_pydict() for x in (hf, vllm))
    for key in ("response_ids", "response_mask", "num_turns", "response", "extra_info", "finish_reason"):
        assert a[key] == b[key], key
    ta, tb = (read_file(x.store, x.layout, 1, "rollout", "rollout/turns.parquet").to_pydict() for x in (hf, vllm))
    assert {k: v for k, v in ta.items() if k != "latency_s"} == {k: v for k, v in tb.items() if k != "latency_s"}
    mt = manifest["extra"]["multi_turn"]   # one continuous batch (Engine.stream): a call ends one turn or more
    assert manifest["extra"]["engine"] == "vllm" and mt["streamed"] and mt["rounds"] <= mt["engine_calls"]
    assert mt["engine_calls"] <= sum(role == "assistant" for role in tb["role"])
