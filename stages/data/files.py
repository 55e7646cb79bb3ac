"""Reading prompt parquet files in verl's RL schema: the rows of several files concatenated, a
locator that names each row as "FILE row K", and the checks that refuse a row naming it (text
that is not UTF-8, a prompt that cannot be templated, a missing ground truth)."""
from __future__ import annotations


def read_parquet_rows(files: list[str]) -> list[dict]:
    return read_parquet_records(files)[0]


class RowLocator:
    """Names a row of the concatenated files as "FILE row K" (K counted from 0 in that file)."""

    def __init__(self):
        self.spans: list[tuple[int, str]] = []  # (first row number, file)

    def add(self, start: int, path: str) -> None:
        self.spans.append((start, path))

    def __call__(self, number: int) -> str:
        start, path = max((s for s in self.spans if s[0] <= number), default=(0, "?"))
        return f"{path} row {number - start}"


def _undecodable(table, path: str, exc: UnicodeDecodeError) -> ValueError:
    """The first cell of `table` that is not valid UTF-8, as an error naming file, row, column."""
    for name in table.column_names:
        column = table.column(name)
        for i in range(len(column)):
            try:
                column[i].as_py()
            except UnicodeDecodeError as cell:
                return ValueError(f"{path} row {i}: column {name!r} is not valid UTF-8 "
                                  f"({cell.reason} at byte {cell.start}): re-encode the file's text as UTF-8")
    return ValueError(f"{path}: text that is not valid UTF-8 ({exc})")


def read_parquet_records(files: list[str]) -> tuple[list[dict], RowLocator]:
    """The rows of the parquet files, concatenated, and a RowLocator naming each one's file."""
    import os

    import pyarrow.parquet as pq

    rows, where = [], RowLocator()
    for path in files:
        local = os.path.expanduser(path)
        if not os.path.exists(local):
            raise FileNotFoundError(f"data file not found: {path}")
        table = pq.read_table(local)
        try:
            records = table.to_pylist()
        except UnicodeDecodeError as exc:
            raise _undecodable(table, path, exc) from None
        where.add(len(rows), path)
        rows.extend(records)
    return rows, where


def prompt_problem(messages) -> str | None:
    """Why a prompt (a list of chat messages) cannot be templated, or None."""
    if not messages:
        return "empty prompt"
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {j} is {type(message).__name__}, not a {{role, content}} record"
        content = message.get("content")
        if isinstance(content, (bytes, bytearray)):
            return f"message {j}'s content is bytes, not text: store it as a UTF-8 string column"
        if not isinstance(content, str) or not content:
            return f"empty prompt: message {j} has no text content ({content!r})"
    return None


def refuse_records(records: list[dict], where: RowLocator, prompt_key: str, reward_fn_key: str,
                   files) -> None:
    """Raise naming "FILE row K" and the column for the first record a run cannot use: no prompt
    column (data.prompt_key; KeyError), a prompt that cannot be templated (prompt_problem), no
    data.reward_fn_key column (KeyError) or one that is not text."""
    if records and prompt_key not in records[0]:
        raise KeyError(f"prompt column {prompt_key!r} (data.prompt_key) not in {list(files)}; "
                       f"columns: {sorted(records[0])}")
    for number, record in enumerate(records):
        messages = record.get(prompt_key)
        problem = prompt_problem(messages)
        if problem:
            raise ValueError(f"{where(number)}: {problem} (column {prompt_key!r}): {messages!r:.200}")
        if reward_fn_key not in record:
            raise KeyError(f"{where(number)}: no {reward_fn_key!r} column (data.reward_fn_key)")
        if not isinstance(record[reward_fn_key], str):
            raise ValueError(f"{where(number)}: column {reward_fn_key!r} (data.reward_fn_key) "
                             f"is {type(record[reward_fn_key]).__name__}, not text: "
                             f"{record[reward_fn_key]!r:.100}")


def ground_truth_problem(missing: list[str], total: int, split: str) -> str:
    """What to say of `missing` ("FILE row K" of rows without reward_model.ground_truth)."""
    shown = "; ".join(missing[:5]) + (f"; and {len(missing) - 5} more" if len(missing) > 5 else "")
    return f"{len(missing)} of {total} {split} prompts have no reward_model.ground_truth: {shown}"


GROUND_TRUTH_REFUSED = ("The built-in scorers compare answers with it: fix those rows, "
                        "or give custom_reward_function.path")


def rows_without_ground_truth(files, rows) -> list[str]:
    """"FILE row K" of each prepared row whose reward_model.ground_truth is null or missing."""
    import os

    import pyarrow.parquet as pq

    locate, start = RowLocator(), 0
    for path in files:
        locate.add(start, path)
        start += pq.ParquetFile(os.path.expanduser(path)).metadata.num_rows
    if hasattr(rows, "field_values"):  # rows read from a cache file (stages.data.arrow.ArrowRows)
        numbers, truths = rows.field_values("row"), rows.field_values("ground_truth")
    else:
        numbers, truths = [r.row for r in rows], [r.ground_truth for r in rows]
    return [locate(n) for n, truth in zip(numbers, truths) if truth is None]
