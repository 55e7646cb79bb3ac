"""Prepared prompt rows as an Arrow table (stages.data.cache's disk format): the schema,
encoding (JSON text for the free-form fields, refused when a value would not read back equal) and
ArrowRows, which decodes a row into a PromptRow only when a batch first uses it."""
from __future__ import annotations

import json
import operator
from collections.abc import Sequence

from stages.data.dataset import PromptRow

JSON_FIELDS = ("messages", "ground_truth", "extra_info")


def row_schema():
    import pyarrow as pa

    return pa.schema([("index", pa.int64()), ("row", pa.int64()), ("prompt_ids", pa.list_(pa.int32())),
                      ("data_source", pa.string()), ("truncated", pa.bool_())]
                     + [(name, pa.string()) for name in JSON_FIELDS] + [("agent_name", pa.string())])


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _json_column(rows, name: str) -> tuple[list[str] | None, str | None]:
    """(one JSON text per row, None), or (None, why not) when a value would not read back equal.
    The round trip is checked for the whole column at once (one parse, one deep comparison)."""
    values = [getattr(row, name) for row in rows]
    try:
        texts = [_ENCODER.encode(value) for value in values]
        if json.loads("[" + ",".join(texts) + "]") == values:
            return texts, None
    except (TypeError, ValueError):
        pass
    for row, value in zip(rows, values):  # name the first row that does not round-trip
        try:
            text = _ENCODER.encode(value)
        except (TypeError, ValueError) as err:
            return None, f"row {row.row}: {name} is not JSON ({err})"
        if json.loads(text) != value:
            return None, f"row {row.row}: {name} does not read back equal from JSON ({value!r})"
    return None, f"{name} does not read back equal from JSON"


def encode_rows(rows) -> "tuple[object | None, str | None]":
    """(Arrow table, None), or (None, why not) when a field would not read back equal."""
    import pyarrow as pa

    texts = {}
    for name in JSON_FIELDS:
        texts[name], why_not = _json_column(rows, name)
        if why_not:
            return None, why_not
    columns = {"index": [r.index for r in rows], "row": [r.row for r in rows],
               "prompt_ids": [r.prompt_ids for r in rows], "data_source": [r.data_source for r in rows],
               "truncated": [r.truncated for r in rows], **texts, "agent_name": [r.agent_name for r in rows]}
    return pa.table(columns, schema=row_schema()), None


class ArrowRows(Sequence):
    """Prepared rows read from a cache file, each decoded into a PromptRow the first time a batch
    uses it (then kept), so a step decodes its batch, not the dataset. Read-only; equal to a list
    of the same PromptRows."""

    def __init__(self, table, source: str = ""):
        self._table = table
        self._source = source
        self._decoded: dict[int, PromptRow] = {}

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, item):
        if isinstance(item, slice):
            return self.take(range(len(self))[item])
        return self.take([item])[0]

    def __iter__(self):
        for start in range(0, len(self), 4096):
            yield from self._decode_range(start, min(start + 4096, len(self)))

    def __eq__(self, other):
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"ArrowRows({len(self)} rows from {self._source or 'memory'})"

    def field_values(self, name: str) -> list:
        """One PromptRow field of every row, without decoding (or keeping) the rows."""
        column = self._table.column(name).to_pylist()
        return [json.loads(v) for v in column] if name in JSON_FIELDS else column

    def take(self, indices) -> list[PromptRow]:
        """The rows at `indices` (a batch); the ones not decoded yet are gathered in one go."""
        n, wanted = len(self), []
        for i in indices:
            i = operator.index(i)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"row {i} out of range for {n} prepared rows")
            wanted.append(i)
        missing = [i for i in dict.fromkeys(wanted) if i not in self._decoded]
        if missing:
            import pyarrow as pa

            self._decode(missing, self._table.take(pa.array(missing, pa.int64())))
        return [self._decoded[i] for i in wanted]

    def _decode_range(self, start: int, stop: int) -> list[PromptRow]:
        self._decode(range(start, stop), self._table.slice(start, stop - start))
        return [self._decoded[i] for i in range(start, stop)]

    def _decode(self, indices, part) -> None:
        """PromptRows for the rows of `part` (the table's rows `indices`), kept once decoded."""
        names = part.column_names
        for i, values in zip(indices, zip(*(part.column(name).to_pylist() for name in names))):
            if i not in self._decoded:
                fields = dict(zip(names, values))
                for name in JSON_FIELDS:
                    fields[name] = json.loads(fields[name])
                self._decoded[i] = PromptRow(**fields)
