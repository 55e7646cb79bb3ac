"""verl's tool agent loop over stagerl's rollout engines: multi-turn trajectories, token in, token out.

verl: verl/experimental/agent_loop/tool_agent_loop.py (ToolAgentLoop, agent_name `tool_agent`) and
single_turn_agent_loop.py (`single_turn_agent`), volcengine/verl b178a3c. Per trajectory, exactly
as there:

- the prompt's token ids are generated from; each assistant turn's sampled ids are appended as
  they are (response_mask 1, the engine's log-probs kept) and are never re-templated;
- after an assistant turn the trajectory ends when the response holds response_length tokens or
  more, when it made max_assistant_turns assistant turns, when max_user_turns tool turns were
  appended, or when the turn's text (decoded with special tokens, as verl's parser) has no tool
  call (the hermes format, stages/tools/parser.py);
- otherwise its first max_parallel_calls calls run (in parallel, each with the ToolSet's per-call
  deadline; a malformed call, an unknown tool, a timeout or an exception answers
  "Error when executing tool: ..." and is counted, never raised); a response longer than
  max_tool_response_length characters is cut on tool_response_truncate_side (errors are not, as
  verl); the tool messages are templated with the chat template (add_generation_prompt=True) and
  the template's system-prompt prefix removed (verl's initialize_system_prompt); if the response
  plus those ids would reach response_length, the trajectory ends before them (it never ends on a
  tool turn); else they are appended with response_mask 0 (log-probs 0.0) and the next assistant
  turn generates;
- single_turn_agent rows generate once.

One deviation in how a turn is sampled, not in what: verl asks the server for up to
prompt_length + response_length - len(ids) new tokens and cuts the response at response_length at
the end; here each turn asks for the response budget left (response_length - tokens so far), so
nothing past the cut is sampled. The tokens kept are distributed alike.

Determinism and overlap. Trajectories are cut into fixed groups of consecutive rows
(`group_rows`: the hf engine's generation batch); a group's next assistant turn is one engine call
over its rows still running, each row seeded from (seed, row, round). So which rows share a call, and every seed, is a function of the
data, never of timing: the same seed gives the same trajectories, with tools fast or slow. While
a group's tools run the engine generates the next turn of any other group whose tools have
returned; a group waits only for its own rows' tools. With one group (a batch smaller than
hf_generate_batch_size × n) generation and tools alternate.

Streamed (an engine with Engine.stream: vLLM or hf, one replica, resident; a batch with tool_agent
rows and a tool config; a batch of single-turn rows is one call, as the plain rollout): the whole
batch is one continuous batch. A row whose turn ends leaves it, its tools run while the other rows go on
generating for multi_turn.tool_overlap_steps engine steps, and its next turn then joins the running
batch, so no row waits for a round's slowest. The engine waits at that step for tools still running
(with 0 steps, at once): which rows share an engine step is a function of the tokens, never of
timing. The seeds are the rounds' (seed, row, turn), and both engines sample a row from its own
seed (vLLM's per-request seeds; hf's stages.engines.hf.sample_rows), so a row samples the same
tokens either way (up to float sums that depend on the batch).

    loop = AgentLoop(generate, tokenizer, tools, LoopSettings.from_rollout(rollout, response_length), sampling)
    trajectories = loop.run(prompt_ids, agents, tools_kwargs, keys, seed=..., group_rows=...)
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from typing import Callable, Sequence

from stages.engines import Generation, Sampling, derive_seed

SINGLE_TURN, TOOL_AGENT = "single_turn_agent", "tool_agent"
AGENT_LOOPS = (SINGLE_TURN, TOOL_AGENT)  # verl's agent_name values this loop runs
TRUNCATE_SIDES = ("left", "middle", "right")
MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """verl's multi_turn keys (actor_rollout_ref.rollout.multi_turn) and the response length."""
    response_length: int
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    format: str = "hermes"
    tool_overlap_steps: int = 0  # streamed: engine steps the other rows generate while a turn's tools run

    @classmethod
    def from_rollout(cls, rollout: dict, response_length: int) -> "LoopSettings":
        mt = dict(rollout.get("multi_turn") or {})
        side = mt.get("tool_response_truncate_side", "middle")
        if side not in TRUNCATE_SIDES:
            raise ValueError(f"{MULTI_TURN}.tool_response_truncate_side={side!r}: one of {TRUNCATE_SIDES}")
        return cls(response_length=int(response_length), max_assistant_turns=mt.get("max_assistant_turns"),
                   max_user_turns=mt.get("max_user_turns"), max_parallel_calls=int(mt.get("max_parallel_calls", 1)),
                   max_tool_response_length=int(mt.get("max_tool_response_length", 256)),
                   tool_response_truncate_side=side, format=str(mt.get("format", "hermes")),
                   tool_overlap_steps=int(mt.get("tool_overlap_steps") or 0))


@dataclasses.dataclass
class TurnRecord:
    """One assistant turn, or one tool call of a tool turn (the calls of a tool turn share its
    token span). `start`/`end`: the span in the trajectory's response ids; a tool turn that the
    response length cut off ran but was not appended (an empty span at the end)."""
    turn: int
    role: str                 # "assistant" | "tool"
    start: int
    end: int
    token_ids: list
    text: str                 # assistant: its ids decoded (special tokens kept); tool: the message content
    call: int | None = None   # the call's index in its turn (tool rows)
    tool: str | None = None
    arguments: str | None = None
    latency_s: float | None = None
    error: str | None = None
    detail: str = ""
    reward: float | None = None
    finish_reason: str | None = None  # assistant turns: stop | length

    @property
    def mask(self) -> int:
        return 1 if self.role == "assistant" else 0


@dataclasses.dataclass
class Trajectory:
    prompt_ids: list
    agent_name: str
    response_ids: list = dataclasses.field(default_factory=list)
    response_mask: list = dataclasses.field(default_factory=list)
    log_probs: list | None = None
    turns: list = dataclasses.field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_rewards: list = dataclasses.field(default_factory=list)
    finish_reason: str = "stop"
    done: bool = False

    @property
    def num_turns(self) -> int:
        """verl's num_turns: user + assistant turns + 1 (the prompt)."""
        return self.user_turns + self.assistant_turns + 1


def system_prompt_ids(tokenizer, template_kwargs: dict) -> list:
    """verl's initialize_system_prompt: the ids a chat template puts before the first message (a
    default system prompt), which a templated tool message must not repeat."""
    one = _template_ids(tokenizer, [{"role": "user", "content": ""}], False, template_kwargs)
    two = _template_ids(tokenizer, [{"role": "user", "content": ""}] * 2, False, template_kwargs)
    return one[:-(len(two) - len(one))] if len(two) > len(one) else []


def _template_ids(tokenizer, messages, add_generation_prompt: bool, template_kwargs: dict) -> list:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tool_turn_ids(tokenizer, texts: Sequence[str], system_prompt: list, template_kwargs: dict) -> list:
    """The ids the loop appends for one tool turn (response_mask 0): the tool messages `texts`
    templated with add_generation_prompt=True, the template's system-prompt prefix removed."""
    return _template_ids(tokenizer, [{"role": "tool", "content": t} for t in texts], True,
                         template_kwargs)[len(system_prompt):]


def tool_text(result, settings: "LoopSettings") -> str:
    """A tool call's message content as the loop appends it: a response cut to
    max_tool_response_length on tool_response_truncate_side (errors are not cut, as verl)."""
    from stages.tools.toolset import truncate_response

    text = result.text
    if result.ok:
        text = truncate_response(text, settings.max_tool_response_length, settings.tool_response_truncate_side)
    return text or ""


def demonstrations(tokenizer, prompt_ids: Sequence, turns: Sequence, tools, settings: "LoopSettings", eos: int,
                   tools_kwargs: Sequence | None = None, template_kwargs: dict | None = None,
                   keys: Sequence[str] | None = None, tool_timeout_s: float | None = None) -> list:
    """(ids, labels) of whole trajectories built as the loop would build them had the policy
    sampled the given assistant turns (`turns[i]`: row i's assistant texts, in order): each turn is
    tokenised and ends with `eos` (labels: the ids); after a turn with calls (parsed as the loop
    parses them, its first max_parallel_calls) the real tools (`tools`, a ToolSet) answer them and
    their tool turn is appended exactly as the loop appends it, with labels -100. The prompt's
    labels are -100. A supervised warm start on these teaches the tool-call format
    (stages/model/warmstart.py). A trajectory whose response would reach settings.response_length
    is refused (the loop would cut it)."""
    from stages.tools.parser import get_parser

    parse = get_parser(settings.format)
    template_kwargs = dict(template_kwargs or {})
    system = system_prompt_ids(tokenizer, template_kwargs)
    keys = list(keys) if keys is not None else [f"demo{i}" for i in range(len(turns))]
    kwargs = list(tools_kwargs) if tools_kwargs is not None else [{}] * len(turns)
    # every call of every row is submitted at once (a demonstration's texts do not depend on the
    # responses), then the trajectories are assembled in order
    encoded, futures, created = [], {}, []
    try:
        for i, texts in enumerate(turns):
            rows = []
            for t, text in enumerate(texts):
                ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [eos]
                _, calls = parse(tokenizer.decode(ids, skip_special_tokens=False))
                calls = calls[:settings.max_parallel_calls] if t < len(texts) - 1 else []
                if calls and tools is None:
                    raise ValueError(f"demonstration {i}: turn {t} calls a tool but there is no tool config")
                if calls and keys[i] not in created:
                    tools.create(keys[i], kwargs[i] or {})
                    created.append(keys[i])
                futures[(i, t)] = [tools.submit(keys[i], call, tool_timeout_s) for call in calls]
                rows.append(ids)
            encoded.append(rows)
        out = []
        for i, rows in enumerate(encoded):
            ids, labels = list(prompt_ids[i]), [-100] * len(prompt_ids[i])
            for t, turn_ids in enumerate(rows):
                ids += turn_ids
                labels += turn_ids
                results = [f.result() for f in futures[(i, t)]]
                if results:
                    tool_ids = tool_turn_ids(tokenizer, [tool_text(r, settings) for r in results], system,
                                             template_kwargs)
                    ids += tool_ids
                    labels += [-100] * len(tool_ids)
            if len(ids) - len(prompt_ids[i]) >= settings.response_length:
                raise ValueError(f"demonstration {i}: {len(ids) - len(prompt_ids[i])} response tokens, not below "
                                 f"the response length {settings.response_length} (the loop would cut it)")
            out.append((ids, labels))
        return out
    finally:
        for key in created:
            tools.release(key)


def correct_tool_use(turns: dict, ground_truths: Sequence[str]) -> float:
    """The correct-tool-use rate of a batch: the share of trajectories (rows) with a tool call that
    answered, without error, the row's ground truth (its text, stripped). `turns`: the turns
    table's columns (rollout/turns.parquet: row, role, error, response). For a tool that computes
    the answer (the calculator task) it is the share of samples that asked the right question;
    0.0 for tools whose responses are never the answer itself."""
    rows = {row for row, role, error, text in zip(turns["row"], turns["role"], turns["error"], turns["response"])
            if role == "tool" and error is None and row < len(ground_truths)
            and (text or "").strip() == str(ground_truths[row]).strip()}
    return len(rows) / len(ground_truths) if ground_truths else 0.0


# generate(rows of token ids, sampling, call seed, row seeds) -> one Generation per row
GenerateFn = Callable[[list, Sampling, int, list], "list[Generation]"]
# Engine.stream through the run's engines: (add [(row, ids, seed, max new tokens)], sampling, first,
# max engine steps or None) -> ([(row, Generation)] of the turns that ended, engine steps taken)
StreamFn = Callable[[list, Sampling, bool, "int | None"], tuple]


class AgentLoop:
    """Runs trajectories of a batch; `tools` a stages.tools.toolset.ToolSet (None: no tools, every
    turn ends the trajectory), `template_kwargs` the chat template keywords (data.apply_chat_template_kwargs
    and a custom chat_template)."""

    def __init__(self, generate: GenerateFn, tokenizer, tools, settings: LoopSettings, sampling: Sampling,
                 template_kwargs: dict | None = None, tool_timeout_s: float | None = None,
                 stream: StreamFn | None = None):
        from stages.tools.parser import get_parser

        self.generate = generate
        self.stream = stream
        self.tokenizer = tokenizer
        self.tools = tools
        self.settings = settings
        self.sampling = sampling
        self.parse = get_parser(settings.format)
        self.template_kwargs = dict(template_kwargs or {})
        self.system_prompt = system_prompt_ids(tokenizer, self.template_kwargs)
        self.tool_timeout_s = tool_timeout_s
        self.stats = {"engine_calls": 0, "generate_s": 0.0, "tool_wait_s": 0.0, "tool_calls": 0,
                      "tool_s": 0.0, "rounds": 0, "tool_turns_cut": 0, "streamed": False}

    # ---- the batch --------------------------------------------------------------------------
    def run(self, prompt_ids: Sequence, agents: Sequence[str], tools_kwargs: Sequence, keys: Sequence[str],
            seed: int, group_rows: int) -> list[Trajectory]:
        """One Trajectory per row. `agents`: each row's agent loop (AGENT_LOOPS); `tools_kwargs`:
        each row's verl extra_info.tools_kwargs; `keys`: a unique name per row (its tool instances)."""
        if group_rows < 1:
            raise ValueError(f"group_rows must be >= 1, got {group_rows}")
        for agent in set(agents):
            if agent not in AGENT_LOOPS:
                raise ValueError(f"agent_name {agent!r} is not an agent loop stagerl runs ({', '.join(AGENT_LOOPS)})")
        trajs = [Trajectory(list(p), a, log_probs=[] if self.sampling.log_probs else None)
                 for p, a in zip(prompt_ids, agents)]
        groups = [list(range(start, min(start + group_rows, len(trajs)))) for start in range(0, len(trajs), group_rows)]
        rounds = [0] * len(groups)
        ready = deque(range(len(groups)))
        returned: queue.Queue = queue.Queue()   # groups whose tool calls have all answered
        waiting: dict[int, dict] = {}            # group -> {row: [futures]}
        created: set = set()
        t_run = time.perf_counter()
        if self.stream is not None and self.tools is not None and TOOL_AGENT in agents:
            self.stats["streamed"] = True
            try:
                self._run_streamed(trajs, tools_kwargs, keys, seed, created)
            finally:
                for row in created:
                    self.tools.release(keys[row])
            self.stats["wall_s"] = time.perf_counter() - t_run
            return trajs

        def tools_returned(group: int) -> None:
            self._take_tools(trajs, waiting.pop(group))
            if any(not trajs[i].done for i in groups[group]):
                rounds[group] += 1
                ready.append(group)

        try:
            while ready or waiting:
                if not ready:   # nothing to generate: wait for the first group whose tools return
                    t_wait = time.perf_counter()
                    tools_returned(returned.get())
                    self.stats["tool_wait_s"] += time.perf_counter() - t_wait
                    continue
                while not returned.empty():
                    tools_returned(returned.get_nowait())
                group = ready.popleft()
                rows = [i for i in groups[group] if not trajs[i].done]
                calls = self._assistant_turn(trajs, rows, seed, group, rounds[group]) if rows else {}
                if not calls:   # every row of the group is done
                    continue
                futures = self._submit_tools(calls, keys, tools_kwargs, created)
                waiting[group] = {"calls": calls, "futures": futures}
                _when_all([f for fs in futures.values() for f in fs], lambda g=group: returned.put(g))
        finally:
            for row in created:
                self.tools.release(keys[row])
        self.stats["wall_s"] = time.perf_counter() - t_run
        return trajs

    # ---- one assistant turn of a group --------------------------------------------------------
    def _assistant_turn(self, trajs, rows: list, seed: int, group: int, round_: int) -> dict:
        """Generate the next assistant turn of `rows`; returns {row: calls to run} for the rows that
        go on to a tool turn (the others are done)."""
        s = self.settings
        budgets = [s.response_length - len(trajs[i].response_mask) for i in rows]
        sampling = dataclasses.replace(self.sampling, n=1, max_new_tokens=max(budgets))
        ids = [trajs[i].prompt_ids + trajs[i].response_ids for i in rows]
        t0 = time.perf_counter()
        gens = self.generate(ids, sampling, derive_seed(seed, "group", group, round_),
                             [derive_seed(seed, "row", i, round_) for i in rows])
        self.stats["generate_s"] += time.perf_counter() - t0
        self.stats["engine_calls"] += 1
        self.stats["rounds"] = max(self.stats["rounds"], round_ + 1)
        out = {}
        for i, gen, budget in zip(rows, gens, budgets):
            calls = self._end_turn(trajs[i], gen, budget)
            if calls:
                out[i] = calls
        return out

    def _end_turn(self, traj: Trajectory, gen: Generation, budget: int) -> list | None:
        """Append a sampled assistant turn to `traj`; returns the calls to run when it goes on to
        a tool turn (None: the trajectory is done)."""
        s = self.settings
        tokens, finish, lps = list(gen.response_ids), gen.finish_reason, gen.log_probs
        if len(tokens) > budget:   # the response budget this row had left
            tokens, finish = tokens[:budget], "length"
            lps = None if lps is None else lps[:budget]
        start = len(traj.response_ids)
        traj.response_ids += tokens
        traj.response_mask += [1] * len(tokens)
        if traj.log_probs is not None:
            traj.log_probs += list(lps or [])[:len(tokens)] + [0.0] * (len(tokens) - len(lps or []))
        traj.assistant_turns += 1
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        traj.turns.append(TurnRecord(turn=len(_distinct_turns(traj.turns)), role="assistant", start=start,
                                     end=len(traj.response_ids), token_ids=tokens, text=text,
                                     finish_reason=finish))
        traj.finish_reason = finish
        if len(traj.response_mask) >= s.response_length:
            traj.finish_reason = "length"
            traj.done = True
        elif traj.agent_name != TOOL_AGENT or self.tools is None \
                or (s.max_assistant_turns and traj.assistant_turns >= s.max_assistant_turns) \
                or (s.max_user_turns and traj.user_turns >= s.max_user_turns):
            traj.done = True
        else:
            _, calls = self.parse(text)
            if calls:
                return calls[:s.max_parallel_calls]
            traj.done = True
        return None

    # ---- the whole batch in one engine stream (Engine.stream) -----------------------------------
    def _run_streamed(self, trajs, tools_kwargs, keys, seed: int, created: set) -> None:
        """Every row's turns through one continuous batch: a row whose turn ends leaves the
        engine's batch, its tools run while the other rows go on generating for
        settings.tool_overlap_steps engine steps, and its next turn joins the batch after them
        (the engine waits there for tools still running; at once when it has nothing else to
        run). Every decision counts engine steps and ended turns, never seconds, so which rows
        share an engine step is a function of the tokens. Each turn samples with the seed (seed,
        row, turn): the rounds' seeds."""
        s = self.settings
        sampling = dataclasses.replace(self.sampling, n=1)

        def request(i: int) -> tuple:
            traj = trajs[i]
            return (i, traj.prompt_ids + traj.response_ids, derive_seed(seed, "row", i, traj.assistant_turns),
                    s.response_length - len(traj.response_mask))

        add, running = [request(i) for i in range(len(trajs))], len(trajs)
        in_engine, step, first = 0, 0, True
        pending: deque = deque()  # (engine step its next turns join at, calls, futures), in order
        while running:
            in_engine += len(add)
            if not in_engine:
                raise RuntimeError(f"the engine's stream has nothing to run with {running} trajectories unfinished")
            limit = pending[0][0] - step if pending else None
            t0 = time.perf_counter()
            ended, steps = self.stream(add, sampling, first, limit)
            self.stats["generate_s"] += time.perf_counter() - t0
            self.stats["engine_calls"] += 1
            first, add, step, in_engine = False, [], step + steps, in_engine - len(ended)
            calls = {}
            for i, gen in ended:
                traj = trajs[i]
                row_calls = self._end_turn(traj, gen, s.response_length - len(traj.response_mask))
                self.stats["rounds"] = max(self.stats["rounds"], traj.assistant_turns)
                if row_calls:
                    calls[i] = row_calls
                else:
                    running -= 1
            if calls:
                pending.append((step + s.tool_overlap_steps, calls,
                                 self._submit_tools(calls, keys, tools_kwargs, created)))
            while pending and (pending[0][0] <= step or not in_engine):
                _, calls, futures = pending.popleft()
                t_wait = time.perf_counter()
                for fs in futures.values():
                    for f in fs:
                        f.result()
                self.stats["tool_wait_s"] += time.perf_counter() - t_wait
                self._take_tools(trajs, {"calls": calls, "futures": futures})
                for row in calls:
                    if trajs[row].done:
                        running -= 1
                    else:
                        add.append(request(row))
        self.stats["engine_steps"] = step

    def _submit_tools(self, calls: dict, keys, tools_kwargs, created: set) -> dict:
        """Start the tool calls of {row: calls} (a row's tool instances are created at its first
        call); returns {row: [futures]}."""
        for row in calls:
            if row not in created:
                self.tools.create(keys[row], tools_kwargs[row] or {})
                created.add(row)
        return {row: [self.tools.submit(keys[row], call, self.tool_timeout_s) for call in row_calls]
                for row, row_calls in calls.items()}

    # ---- the tool turn of a group -------------------------------------------------------------
    def _take_tools(self, trajs, pending: dict) -> None:
        """Append the answered tool turns of a group (or end the rows they would overflow)."""
        s = self.settings
        for row, futures in pending["futures"].items():
            traj = trajs[row]
            results = [f.result() for f in futures]
            texts = []
            for result in results:
                texts.append(tool_text(result, s))
                if result.error is not None:
                    traj.tool_rewards.append(0.0)
                elif result.reward is not None:
                    traj.tool_rewards.append(float(result.reward))
                self.stats["tool_calls"] += 1
                self.stats["tool_s"] += float(result.latency_s or 0.0)
            ids = tool_turn_ids(self.tokenizer, texts, self.system_prompt, self.template_kwargs)
            start = len(traj.response_ids)
            appended = len(traj.response_mask) + len(ids) < s.response_length
            if appended:
                traj.response_ids += ids
                traj.response_mask += [0] * len(ids)
                if traj.log_probs is not None:
                    traj.log_probs += [0.0] * len(ids)
                traj.user_turns += 1
            else:   # verl: the trajectory ends on its last assistant turn
                traj.done = True
                traj.finish_reason = "length"
                self.stats["tool_turns_cut"] += 1
            turn = len(_distinct_turns(traj.turns))
            for call_index, (call, result, text) in enumerate(zip(pending["calls"][row], results, texts)):
                traj.turns.append(TurnRecord(
                    turn=turn, role="tool", start=start, end=len(traj.response_ids),
                    token_ids=list(ids) if appended else [], text=text, call=call_index, tool=result.tool or call.name,
                    arguments=call.arguments, latency_s=float(result.latency_s or 0.0), error=result.error,
                    detail=result.detail or "", reward=result.reward))


def _distinct_turns(records) -> set:
    return {r.turn for r in records}


def _when_all(futures, callback) -> None:
    """callback() once every future is done (at once when there are none)."""
    left = [len(futures)]
    lock = threading.Lock()
    if not futures:
        callback()
        return

    def one(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            callback()

    for future in futures:
        future.add_done_callback(one)
