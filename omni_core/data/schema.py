"""The Arrow types of a verl RL row that every converter's schema shares.

    SCHEMA = rl_schema(("ability", pa.string()), ("reward_model", REWARD_MODEL),
                       ("extra_info", extra_info(("answer", pa.string()))))

Field order is the Parquet column order of the ingested shards: a converter's schema must keep its
own order (a different order is different bytes, though the dataset version id would not change).
"""

from __future__ import annotations

import pyarrow as pa

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])  # one chat message
MEDIA_LIST = pa.list_(pa.struct([("bytes", pa.binary())]))  # verl's `images` / `audios` / `videos`
REWARD_MODEL = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])

Field = tuple[str, pa.DataType]


def rl_schema(*fields: Field) -> pa.Schema:
    """A verl RL row: `data_source` and the chat `prompt`, then the dataset's `fields` in order."""
    return pa.schema([("data_source", pa.string()), ("prompt", pa.list_(MESSAGE)), *fields])


def extra_info(*fields: Field) -> pa.StructType:
    """The `extra_info` struct: the row's `split` and `index`, then the dataset's own `fields`."""
    return pa.struct([("split", pa.string()), ("index", pa.int64()), *fields])
