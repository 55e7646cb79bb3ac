"""The pyarrow schema of every stage artifact: the one place that declares columns.

Per-token columns are list<float32> / list<int32> of the response length (no padding).
Each schema lists required and optional columns; extra columns are allowed (a stage may
add diagnostics), but a declared column must have its declared type."""
import pyarrow as pa

F32 = pa.float32()
I32 = pa.int32()
I64 = pa.int64()
STR = pa.string()
TOK_F32 = pa.list_(F32)
TOK_I32 = pa.list_(I32)
TOK_I8 = pa.list_(pa.int8())


class SchemaError(ValueError):
    """A table does not match its stage schema (the message names the column)."""


class StageSchema:
    """Required and optional columns of one artifact."""

    def __init__(self, name: str, required: list, optional: list = (), per_token=(), together=()):
        self.name = name
        self.required = pa.schema(required)
        self.optional = pa.schema(list(optional))
        self.per_token = tuple(per_token)
        self.together = tuple(tuple(group) for group in together)  # optional columns that come as a set

    @property
    def fields(self) -> dict:
        return {f.name: f.type for f in list(self.required) + list(self.optional)}

    def validate(self, table: pa.Table, where: str = "") -> pa.Table:
        """Return `table` if it matches; else raise SchemaError naming the column."""
        at = f" in {where}" if where else ""
        names = set(table.schema.names)
        for f in self.required:
            if f.name not in names:
                raise SchemaError(f"{self.name}: missing column {f.name!r} "
                                  f"(expected {f.type}){at}")
        for group in self.together:
            present = [c for c in group if c in names]
            if present and len(present) < len(group):
                missing = next(c for c in group if c not in names)
                raise SchemaError(f"{self.name}: missing column {missing!r} (it comes with "
                                  f"{', '.join(present)}){at}")
        for name, expected in self.fields.items():
            if name in names and not _same_type(table.schema.field(name).type, expected):
                raise SchemaError(f"{self.name}: column {name!r} has type "
                                  f"{table.schema.field(name).type}, expected {expected}{at}")
        self._check_lengths(table, at)
        return table

    def _check_lengths(self, table: pa.Table, at: str) -> None:
        """Per-token columns of a row share one length (= response_length when present)."""
        import pyarrow.compute as pc
        cols = [c for c in self.per_token if c in table.schema.names]
        ref_name = "response_length" if "response_length" in table.schema.names else None
        ref = table.column(ref_name) if ref_name else None
        for c in cols:
            lengths = pc.list_value_length(table.column(c))
            if ref is None:
                ref, ref_name = lengths, c
                continue
            if not pc.all(pc.equal(lengths.cast(I64), ref.cast(I64))).as_py():
                raise SchemaError(f"{self.name}: column {c!r} has rows whose length differs "
                                  f"from {ref_name!r}{at}")

    def table(self, columns: dict) -> pa.Table:
        """Build a table with the declared types from Python/numpy columns (unknown columns
        are inferred), then validate it."""
        arrays = {name: _as_array(values, self.fields.get(name)) for name, values in columns.items()}
        return self.validate(pa.table(arrays))


def _as_array(values, type_: pa.DataType | None) -> pa.Array:
    """A column from Python/numpy values, or an Arrow array as it is (cast to the declared type)."""
    if isinstance(values, pa.Array):
        return values if type_ is None or _same_type(values.type, type_) else values.cast(type_)
    return pa.array(values, type=type_)


def _same_type(actual: pa.DataType, expected: pa.DataType) -> bool:
    """Type equality ignoring list field names ('item' vs 'element' after a parquet trip)."""
    if pa.types.is_list(expected) or pa.types.is_large_list(expected):
        return (type(actual) is type(expected)
                and _same_type(actual.value_type, expected.value_type))
    return actual.equals(expected)


SCHEMAS = {
    "rollout": StageSchema(
        "rollout",
        required=[("uid", STR), ("sample_index", I32), ("prompt", STR), ("prompt_ids", TOK_I32),
                  ("response", STR), ("response_ids", TOK_I32), ("response_length", I32),
                  ("finish_reason", STR), ("data_source", STR), ("ground_truth", STR),
                  ("extra_info", STR)],
        # policy_version: the update whose weights sampled the row (0: the initial or warm-start weights)
        # multi-turn (actor_rollout_ref.rollout.multi_turn.enable): response_ids hold every turn after
        # the prompt; response_mask is 1 on the tokens the policy sampled and 0 on tool-response tokens
        # (verl's), num_turns verl's count (assistant + tool turns + 1)
        optional=[("rollout_log_probs", TOK_F32), ("policy_version", I32), ("response_mask", TOK_I8),
                  ("num_turns", I32)],
        per_token=("response_ids", "rollout_log_probs", "response_mask"),
        together=[("response_mask", "num_turns")],
    ),
    # rollout/turns.parquet (multi-turn): one row per assistant turn and per tool call, in order;
    # `row` is the trajectory's row in rollout.parquet; token_start/token_end its turn's span in
    # response_ids (a tool turn's calls share it; empty when the response length cut the turn off),
    # token_ids those tokens, mask the response_mask over them (1 assistant, 0 tool); response the
    # assistant's decoded text (special tokens kept) or the tool message's content
    "rollout_turns": StageSchema(
        "rollout_turns",
        required=[("step", I32), ("row", I32), ("uid", STR), ("sample_index", I32), ("turn", I32), ("role", STR),
                  ("call", I32), ("tool", STR), ("arguments", STR), ("response", STR), ("token_start", I32),
                  ("token_end", I32), ("mask", I32), ("latency_s", F32), ("error", STR), ("detail", STR),
                  ("reward", F32), ("finish_reason", STR), ("token_ids", TOK_I32)],
    ),
    "logprob": StageSchema(
        "logprob",
        # old/entropy: only with a separate old-log-prob pass (else the update's own forward
        # stores them in update/log_probs.parquet); ref: only with KL; values: PPO
        required=[],
        optional=[("old_log_probs", TOK_F32), ("entropy", TOK_F32), ("ref_log_probs", TOK_F32),
                  ("values", TOK_F32),
                  # Σ_v π_v² per response token (verl's sum_pi_squared; optimal_token_baseline)
                  ("sum_pi_squared", TOK_F32)],
        per_token=("old_log_probs", "ref_log_probs", "entropy", "values", "sum_pi_squared"),
        together=[("old_log_probs", "entropy")],
    ),
    # update/log_probs.parquet: the update's first forward (detached) when it replaced the
    # separate old-log-prob pass (plan rollout.old_log_prob_pass false); rollout row order.
    "update_log_probs": StageSchema(
        "update_log_probs",
        required=[("old_log_probs", TOK_F32), ("entropy", TOK_F32)],
        per_token=("old_log_probs", "entropy"),
    ),
    # rollout/candidates.parquet: every answer DAPO's dynamic sampling generated, kept or not
    # (stages/algos/dynamic_sampling.py); the kept ones are rollout.parquet's rows.
    "rollout_candidates": StageSchema(
        "rollout_candidates",
        required=[("gen_batch", I32), ("uid", pa.string()), ("sample_index", I32), ("data_source", pa.string()),
                  ("response_length", I32), ("metric", F32), ("group_std", F32), ("kept", pa.bool_()),
                  ("reason", pa.string())],
    ),
    # reward/baseline.parquet: the scores of rollout/baseline.parquet's greedy answers (estimators
    # that need a baseline: remax), one row per prompt, keyed by uid; the reward columns otherwise.
    "reward_baseline": StageSchema(
        "reward_baseline",
        required=[("uid", STR), ("score", F32), ("acc", F32)],
        optional=[("error", STR)],
    ),
    "reward": StageSchema(
        "reward",
        required=[("score", F32), ("acc", F32)],
        optional=[("error", STR)],  # reward extras: any further column
    ),
    "advantage": StageSchema(
        "advantage",
        required=[("token_level_rewards", TOK_F32), ("advantages", TOK_F32),
                  ("returns", TOK_F32), ("kl", TOK_F32)],
        per_token=("token_level_rewards", "advantages", "returns", "kl"),
    ),
    # update/microbatches.parquet: one row per (rank, micro-batch); `rows` are step row indices.
    "microbatches": StageSchema(
        "microbatches",
        required=[("rank", I32), ("micro_batch", I32), ("rows", TOK_I32),
                  ("real_tokens", I64), ("padded_tokens", I64)],
        optional=[("mini_batch", I32), ("epoch", I32), ("role", pa.string())],
    ),
}

# Which schema each stored table file uses (by file name in the step folder).
FILE_SCHEMAS = {
    "rollout.parquet": "rollout",
    "rollout/candidates.parquet": "rollout_candidates",
    "rollout/baseline.parquet": "rollout",  # greedy baseline answers, one per prompt (remax)
    "rollout/turns.parquet": "rollout_turns",  # multi-turn: every assistant turn and tool call
    "reward/baseline.parquet": "reward_baseline",
    "logprob.parquet": "logprob",
    "reward.parquet": "reward",
    "advantage.parquet": "advantage",
    "update/microbatches.parquet": "microbatches",
    "update/log_probs.parquet": "update_log_probs",
}


def schema(name: str) -> StageSchema:
    if name not in SCHEMAS:
        raise KeyError(f"no schema {name!r}; known: {', '.join(SCHEMAS)}")
    return SCHEMAS[name]


def validate(name: str, table: pa.Table, where: str = "") -> pa.Table:
    """Check `table` against schema `name` (raises SchemaError naming the column)."""
    return schema(name).validate(table, where)


def make_table(name: str, columns: dict) -> pa.Table:
    """Build a typed, validated table for schema `name` from plain columns."""
    return schema(name).table(columns)
