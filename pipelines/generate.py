"""The synthetic ads-log generator: flat CTR samples of any schema, labelled by a planted model.

The data is shaped like display-ads logs, so that compression and training see what they would
see in production:

* users have a heavy-tailed (lognormal) number of samples, about ``samples_per_user`` on average
  (57 in the XDL paper); their samples come as **pageviews** of several slots, and the pageviews
  of all users are interleaved in time order, never grouped by user;
* layer 0 is the user, the last layer the samples, middle layers are ad-like nodes: the first
  middle layer is drawn from a Zipf-popular pool (half of the time from the user's own favourites,
  so users see the same ads again), deeper layers are children of their parent (creatives under
  ads); every upper-layer feature is a deterministic function of its node's key (an ad's
  ``cate_id`` derives from its ``ad_id``), except that about 1% of users change one feature
  mid-stream and so become two user nodes;
* ``ids`` behaviour lists have a heavy-tailed length (mean about 10, some empty) and draw from the
  same Zipf pool as the matching single-id feature (``clicked_cats`` from ``cate_id``'s pool);
* the labels come from a planted logistic model over hidden per-id weights (plus a user x
  category interaction, the behaviour lists and the dense features); its bias is tuned so the
  click rate is close to ``ctr``; further labels are ESMM-like funnels (conversion = click AND
  Bernoulli(p_cvr)). The Bayes-optimal AUC of the true probabilities is written to ``_truth.json``;
* with ``sequential`` > 0 the click also depends on the ORDER of a user's behaviour sequence (an
  ``ids`` feature the schema declares ``sequence``): interest drift, the target ad's category
  matched against the user's recent behaviours more than the older ones (see
  :meth:`_Plan.sequence_term`). ``_truth.json`` then also holds the order-blind Bayes AUC: the
  best a model that sees the behaviours as a bag can reach. A sequence with a time column is
  stored shuffled, its time column giving the true order.

Every random value is a hash of (seed, what it is, which row/node it belongs to), a counter-based
RNG: any part of the stream can be built on its own, so chunking and sharding never change the
data, and the same seed gives the same rows.

Command line::

    python -m pipelines.generate --schema schemas/examples/taobao_like.yaml \\
        --samples 2000000 --out /tmp/raw --seed 7

Python::

    truth = generate(schema, 200_000, "/tmp/raw", seed=7)
    for table in generate_tables(schema, 200_000, seed=7):  # chunks of raw_arrow_schema()
        ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import schemas
from compression import cli, fs, outputs
from schemas import Feature, Schema, stable_hash
from schemas.hashing import GOLDEN, mix64

DEFAULT_SAMPLES_PER_USER = 57.0
DEFAULT_CTR = 0.04
DEFAULT_ROWS_PER_SHARD = 500_000
# Rows per yielded table; ~130k rows of taobao_like is ~60 MB in memory.
DEFAULT_CHUNK_ROWS = 1 << 17
TRUTH_FILE = "_truth.json"

# Conversions per click for the second and later (funnel) labels.
_FUNNEL_RATE = 0.1
# Standard deviation of the planted logit: with rare positives the Bayes AUC is about
# Phi(std / sqrt(2)), so 1.0 gives ~0.75, learnable but far from trivial.
_LOGIT_STD = 1.0
# Share of users who change one non-key feature half-way through their activity.
_CHANGE_RATE = 0.01
# Slots per pageview on average (ads shown on one page).
_SLOTS_PER_PAGEVIEW = 3.0
# Spread of log(samples per user): p99/p50 ~ exp(2.33 * 1.25) ~ 18.
_USER_ACTIVITY_SIGMA = 1.25
# Share of first-middle-layer draws that come from the user's favourites (repeat exposure).
_FAVOURITE_SHARE = 0.5
_FAVOURITES = 12
# Children per parent node at most (creatives per ad, ads per ad group).
_FANOUT = 16
# Behaviour lists: empty with this probability, else lognormal length (median e^2 ~ 7.4).
_LIST_EMPTY = 0.08
_LIST_LOG_MEAN, _LIST_LOG_SIGMA, _LIST_MAX = 2.0, 0.9, 400
# Interaction term: users fall into this many hidden taste groups.
_TASTE_GROUPS = 32
# Rows used to calibrate the planted model's bias and gain.
_PILOT_ROWS = 100_000
# The sequential signal: hidden category vectors of this dimension; the i-th most recent
# behaviour weighs _SEQUENCE_DECAY ** i (the last ~3 carry most of it); shuffles averaged for
# the order-blind Bayes AUC.
_SEQUENCE_DIM = 4
_SEQUENCE_DECAY = 0.5
_ORDER_BLIND_SHUFFLES = 16
# A time column's times: seconds from 2024-01-01 UTC, one behaviour an hour at most.
_EPOCH_2024_S = 1_704_067_200


# --- counter-based random numbers -----------------------------------------------------------

_GOLDEN = np.uint64(GOLDEN)
# 1 / std of the sum of four uniform integers in [0, 65535].
_IRWIN_HALL_SCALE = 1.0 / math.sqrt(4 * (65536.0 ** 2 - 1) / 12)


class _Random:
    """Hash-based random streams: ``uniform(name, a, b)`` is a pure function of its arguments
    and the seed, so any row or node can be drawn on its own, in any order."""

    def __init__(self, seed: int):
        self.seed = int(seed)
        self._salts: dict[str, np.uint64] = {}

    def salt(self, name: str) -> np.uint64:
        s = self._salts.get(name)
        if s is None:
            s = np.uint64(stable_hash(f"{self.seed}/{name}") & 0xFFFFFFFFFFFFFFFF)
            self._salts[name] = s
        return s

    def bits(self, name: str, a, b=None) -> np.ndarray:
        x = np.asarray(a).astype(np.uint64) ^ self.salt(name)
        x = mix64(x)
        if b is not None:
            x = mix64(x + np.asarray(b).astype(np.uint64) * _GOLDEN)
        return x

    def uniform(self, name: str, a, b=None) -> np.ndarray:
        """float64 in the open interval (0, 1)."""
        return ((self.bits(name, a, b) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53

    def normal(self, name: str, a, b=None) -> np.ndarray:
        """Approximately standard normal: the sum of the four 16-bit parts of one hash
        (Irwin-Hall), three times cheaper than Box-Muller; tails stop at 3.46 std."""
        h = self.bits(name, a, b)
        m = np.uint64(0xFFFF)
        total = ((h & m) + ((h >> np.uint64(16)) & m) + ((h >> np.uint64(32)) & m)
                 + (h >> np.uint64(48)))
        return (total.astype(np.float64) - 131070.0) * _IRWIN_HALL_SCALE


def _zipf_rank(u: np.ndarray, vocab: int, exponent: float) -> np.ndarray:
    """Inverse CDF of a continuous power law on [1, vocab + 1): rank 0 is the most popular."""
    if vocab <= 1:
        return np.zeros(u.shape, np.int64)
    if abs(exponent - 1.0) < 1e-9:
        x = np.exp(u * math.log(vocab + 1.0))
    else:
        e = 1.0 - exponent
        x = (1.0 + u * ((vocab + 1.0) ** e - 1.0)) ** (1.0 / e)
    return np.clip(x.astype(np.int64) - 1, 0, vocab - 1)


# --- what each feature is -------------------------------------------------------------------

# (name tokens, vocabulary): absolute sizes, or relative to the ad pool when given as a float.
# Checked in order; a token matches when it starts with the keyword ("cats" matches "cat").
_HOUR = ("hour",)
_WEEKDAY = ("weekday", "dow", "day")
_POSITION = ("position", "pos", "slot")
_CATEGORY = ("cate", "cat", "category")
_ITEM = ("item", "goods", "product", "sku", "ad")
_VOCAB_RULES: tuple[tuple[tuple[str, ...], float | int], ...] = (
    (_HOUR, 24),
    (_WEEKDAY, 7),
    (_POSITION, 10),
    (("pid", "scene", "placement", "page"), 8),
    (("age",), 7),
    (("gender", "sex"), 3),
    (("occupation", "job"), 2),
    (("city",), 5),
    (("level", "grade"), 4),
    (("segid", "segment"), 97),
    (("group",), 13),
    (("device", "os", "platform", "network"), 6),
    (_CATEGORY, 1 / 100),
    (("brand",), 1 / 3),
    (("campaign",), 1 / 2),
    (("customer", "advertiser", "seller", "shop", "merchant"), 1 / 4),
    (_ITEM, 1.0),
)
_LIST_PREFIXES = ("clicked", "click", "viewed", "view", "hist", "his", "behavior", "behaviour",
                  "bought", "cart", "fav", "recent", "seq")
_PRICE_WORDS = ("price", "amount", "cost", "value", "money", "gmv")
_CONTEXT_WORDS = ("pid", "scene", "placement", "page", "device", "os", "platform", "network")


def _tokens(name: str) -> list[str]:
    return [t for t in name.lower().split("_") if t]


def _rule_for(name: str):
    toks = _tokens(name)
    for words, size in _VOCAB_RULES:
        if any(t.startswith(w) for t in toks for w in words):
            return words, size
    return None, None


@dataclass
class _Pool:
    """A Zipf-popular set of ``vocab`` ids; rank r maps to a scattered, stable id value.

    Small vocabularies (gender, age level...) keep plain values ``base .. base + vocab - 1``.
    """

    name: str
    vocab: int
    exponent: float
    base: int = 1
    mult: int = 1
    offset: int = 1

    def __post_init__(self):
        # An affine map with a multiplier coprime to vocab is a bijection of [0, vocab): ids
        # look scattered (popular ids are not 1, 2, 3...) and never collide.
        m = max(1, int(self.vocab * 0.6180339887)) | 1
        while math.gcd(m, self.vocab) != 1:
            m += 2
        self.mult = m
        self.offset = 1 + (stable_hash(self.name) & 0xFFFF) * 10

    def values(self, rank: np.ndarray) -> np.ndarray:
        if self.vocab <= 100:
            return self.base + rank.astype(np.int64)
        return self.offset + (rank.astype(np.int64) * self.mult) % self.vocab


@dataclass
class _FeaturePlan:
    """How one feature's values are made (``role``) and how much it weighs in the logit."""

    feature: Feature
    layer: int
    role: str          # key | attribute (of the node's key) | time_hour | time_weekday
                       # | position (slot in the pageview) | page | context (per row) | list | dense
    pool: _Pool | None = None
    scale: float = 0.0  # prior std of its contribution to the click logit
    price_like: bool = False


@dataclass
class _Rows:
    """One materialised batch of rows: the Arrow columns plus the hidden ranks for the logit."""

    n: int
    columns: dict = field(default_factory=dict)       # feature name -> pa.Array
    ranks: dict = field(default_factory=dict)         # id feature -> int64 rank per row
    list_parts: dict = field(default_factory=dict)    # ids -> (node of row, values, offsets)
    dense: dict = field(default_factory=dict)         # dense feature -> float32[n, dim]
    list_times: dict = field(default_factory=dict)    # time column -> its values, stored order
    user: np.ndarray | None = None
    root_node: np.ndarray | None = None               # user * 2 + version
    row_id: np.ndarray | None = None
    taste_rank: np.ndarray | None = None              # item side of the interaction


class _Plan:
    """Everything fixed before the first row: users, pageviews in time order, feature roles,
    and the planted model's calibrated bias and gain per label."""

    def __init__(self, schema: Schema, samples: int, seed: int, samples_per_user: float,
                 ctr: float, sequential: float = 0.0):
        self.schema = schema
        self.samples = samples
        self.seed = seed
        self.ctr = ctr
        self.sequential = float(sequential)
        self.rand = _Random(seed)
        self.num_layers = len(schema.layers)
        flat = self.num_layers == 1
        self.samples_per_user = 1.0 if flat else float(samples_per_user)
        self.users = max(1, min(samples, int(round(samples / self.samples_per_user))))
        # The pool the ad-like nodes draw from: tens of thousands to millions, growing with N.
        self.ad_vocab = int(min(5_000_000, max(1000, samples // 8)))
        self._build_pageviews(flat)
        self._build_features()
        self.sequence_plan, self.query_plan = self._sequence_signal()
        self._calibrate()

    # -- users and pageviews --

    def _build_pageviews(self, flat: bool):
        rng = np.random.default_rng([self.seed, 0x5EED])
        n, u = self.samples, self.users
        if flat:
            counts = np.ones(u, np.int64)
        else:
            # Lognormal activity, apportioned so counts are >= 1 and sum exactly to N.
            w = rng.lognormal(0.0, _USER_ACTIVITY_SIGMA, u)
            share = w / w.sum() * (n - u)
            counts = 1 + np.floor(share).astype(np.int64)
            short = n - int(counts.sum())
            if short > 0:
                counts[np.argsort(-(share - np.floor(share)), kind="stable")[:short]] += 1
        slots = 1.0 if flat else _SLOTS_PER_PAGEVIEW
        pv_per_user = 1 + rng.binomial(counts - 1, 1.0 / slots)
        pv_user = np.repeat(np.arange(u, dtype=np.int32), pv_per_user)
        # Split each user's samples over its pageviews: 1 + an exponential share of the rest.
        extra = rng.exponential(1.0, len(pv_user))
        per_user_extra = np.bincount(pv_user, extra, minlength=u)
        # (The factor below 1 keeps float rounding from flooring to more than the total.)
        share = extra / per_user_extra[pv_user] * (counts - pv_per_user)[pv_user] * (1 - 1e-12)
        sizes = np.floor(share).astype(np.int64)
        frac = share - sizes
        missing = (counts - pv_per_user) - np.bincount(pv_user, sizes, minlength=u)
        # Largest remainders within each user get the missing units.
        order = np.lexsort((-frac, pv_user))
        first = np.concatenate([[0], np.cumsum(pv_per_user)[:-1]])
        rank_in_user = np.empty(len(order), np.int64)
        rank_in_user[order] = np.arange(len(order)) - first[pv_user[order]]
        sizes += 1 + (rank_in_user < missing[pv_user])
        # Time: each user is active around a centre, in a window of their own width; a window
        # never wraps, so "after the centre" is later in the stream.
        width = 0.05 + 0.9 * rng.random(u) ** 2
        centre = width / 2 + rng.random(u) * (1 - width)
        offset = rng.random(len(pv_user)) - 0.5
        pv_time = centre[pv_user] + width[pv_user] * offset
        order = np.argsort(pv_time, kind="stable")
        self.pv_user = pv_user[order]
        self.pv_size = sizes[order].astype(np.int32)
        self.pv_time = pv_time[order]
        self.pv_late = offset[order] >= 0.0
        self.pv_start = np.concatenate([[0], np.cumsum(self.pv_size, dtype=np.int64)])
        assert self.pv_start[-1] == n

    # -- features --

    def _vocab(self, name: str, default: int) -> int:
        _, size = _rule_for(name)
        if size is None:
            return default
        if isinstance(size, float):
            return max(10, int(self.ad_vocab * size))
        return size

    def _build_features(self):
        schema, L = self.schema, self.num_layers
        # Node pools: users; the ad-like pool; then children of the layer above (x _FANOUT).
        self.layer_pools: list[_Pool] = []
        for li, layer in enumerate(schema.layers):
            if li == 0 and L > 1:
                vocab, exponent = self.users, 0.8
            elif li <= 1:
                vocab, exponent = self.ad_vocab, 0.7
            else:
                vocab, exponent = self.layer_pools[li - 1].vocab * _FANOUT, 0.7
            self.layer_pools.append(_Pool(f"layer:{layer.name}", vocab, exponent))
        self.plans: list[_FeaturePlan] = []
        for li, layer in enumerate(schema.layers):
            leaf = li == L - 1
            for f in layer.features:
                plan = self._plan_feature(f, li, layer.key, leaf)
                self.plans.append(plan)
        for plan in self.plans:
            if plan.role == "list":
                plan.pool = self._list_pool(plan.feature.name)
        self.sequence_of_time = {}  # time column -> the first sequence it orders
        for f in schema.sequences:
            if f.sequence.time is not None:
                self.sequence_of_time.setdefault(f.sequence.time, f.name)
        # The one user feature that changes mid-stream for ~1% of users: prefer an age-like id.
        self.changed: _FeaturePlan | None = None
        if L > 1:
            # (not a list that shares its length with a time column)
            candidates = [p for p in self.plans if p.layer == 0 and p.role not in (
                "key", "list_time") and not (p.feature.sequence and p.feature.sequence.time)]
            def preference(p):
                return p.feature.kind != "id", not any(
                    t.startswith("age") for t in _tokens(p.feature.name))
            if candidates:
                self.changed = min(candidates, key=preference)
        # Interaction: hidden user taste x the first category-like id below the root.
        below = [p for p in self.plans if p.layer > 0 and p.feature.kind == "id" and p.pool]
        cat_like = [p for p in below if _rule_for(p.feature.name)[0] == _CATEGORY]
        self.taste_plan = (cat_like or below or [None])[0] if L > 1 else None

    def _plan_feature(self, f: Feature, li: int, key: tuple[str, ...], leaf: bool) -> _FeaturePlan:
        name = f.name
        toks = _tokens(name)
        if f.kind == "dense":
            return _FeaturePlan(f, li, "dense", scale=0.25,
                                price_like=any(t.startswith(w) for t in toks for w in _PRICE_WORDS))
        if f.kind == "ids":
            if name in self.schema.time_columns:
                return _FeaturePlan(f, li, "list_time")   # the times of a sequence's items
            return _FeaturePlan(f, li, "list", scale=0.6)
        pool = self.layer_pools[li]
        if key and name == key[0]:
            return _FeaturePlan(f, li, "key", pool, scale=0.5 if li == 0 else 0.4)
        if leaf:
            # Leaves are the impressions: time, slot and page are facts of the row, not the key.
            words, _ = _rule_for(name)
            if words == _HOUR:
                return _FeaturePlan(f, li, "time_hour", _Pool(name, 24, 0.0, base=0), scale=0.15)
            if words == _WEEKDAY:
                return _FeaturePlan(f, li, "time_weekday", _Pool(name, 7, 0.0, base=0),
                                    scale=0.1)
            if words == _POSITION:
                return _FeaturePlan(f, li, "position", _Pool(name, 10, 0.0), scale=0.3)
            if any(t.startswith(w) for t in toks for w in _CONTEXT_WORDS):
                return _FeaturePlan(f, li, "page", _Pool(name, self._vocab(name, 8), 1.1),
                                    scale=0.25)
            if not key:
                return _FeaturePlan(f, li, "context", _Pool(name, self._vocab(name, 100), 1.0),
                                    scale=0.25)
        default = 1000 if not leaf else 100
        vocab = max(2, self._vocab(name, default))
        exponent = 1.0 if vocab > 50 else 0.7
        return _FeaturePlan(f, li, "attribute", _Pool(name, vocab, exponent),
                            scale=0.3 if vocab > 50 else 0.2)

    def _list_pool(self, name: str) -> _Pool:
        """Behaviour lists draw from the pool of the single-id feature their name points to."""
        toks = _tokens(name)
        while toks and any(toks[0].startswith(p) for p in _LIST_PREFIXES):
            toks = toks[1:]
        stem = toks[0].rstrip("s") if toks else name
        # A single-id feature whose name starts with the stem: clicked_cats -> cate_id.
        for plan in self.plans:
            if plan.feature.kind == "id" and plan.pool is not None and plan.role in (
                    "key", "attribute") and _tokens(plan.feature.name)[0].startswith(stem[:4]):
                return plan.pool
        words, _ = _rule_for(stem)
        if words == _ITEM:
            # "items" with no item feature: the ad-like pool, as clicked items are ads.
            for p in self.plans:
                if p.role == "key" and p.layer > 0:
                    return p.pool
        return _Pool(name, max(10, self._vocab(stem, self.ad_vocab)), 1.0)

    def _sequence_signal(self):
        """The sequence and the target id of the sequential signal (None, None without one)."""
        if not self.sequential:
            return None, None
        schema = self.schema
        by_name = {p.feature.name: p for p in self.plans}
        sequences = [by_name[f.name] for f in schema.sequences
                     if schema.layer_index(f.name) == 0]
        if self.num_layers < 2 or not sequences:
            raise ValueError(
                "sequential: the schema declares no behaviour sequence on its first (user) "
                "layer; mark an ids feature of it `sequence: true` (e.g. clicked_cats) and give "
                "the schema a layer below with the id it draws from (e.g. cate_id)")
        for seq in sequences:
            queries = [p for p in self.plans if p.layer > 0 and p.feature.kind == "id"
                       and p.pool is seq.pool]
            if queries:
                return seq, queries[0]
        raise ValueError(
            f"sequential: no id feature below the user layer draws from the pool of the "
            f"sequence {sequences[0].feature.name!r}, so no ad can match its behaviours; name "
            "them alike (clicked_cats and cate_id)")

    # -- the planted model --

    def _calibrate(self):
        """Gain so the click logit has std ``_LOGIT_STD``; bias so the mean probability is the
        target rate, both on a pilot of random pageviews from the whole stream."""
        rng = np.random.default_rng([self.seed, 0xCA1])
        num_pv = len(self.pv_user)
        take = min(num_pv, max(1, int(_PILOT_ROWS / max(1.0, self.samples / num_pv))))
        pvs = np.sort(rng.choice(num_pv, take, replace=False))
        rows = self.rows(pvs)
        self.bias: list[float] = []
        self.gain: list[float] = []
        upstream = None
        for li, label in enumerate(self.schema.labels):
            raw = self.raw_logit(rows, li)
            std = float(raw.std())
            gain = _LOGIT_STD / std if std > 1e-12 else 0.0
            z = gain * raw
            target = self.ctr if li == 0 else _FUNNEL_RATE
            weight = upstream if upstream is not None else np.ones_like(z)
            lo, hi = -30.0, 30.0
            for _ in range(80):
                mid = (lo + hi) / 2
                rate = float(np.average(_sigmoid(mid + z), weights=weight))
                lo, hi = (mid, hi) if rate < target else (lo, mid)
            bias = (lo + hi) / 2
            self.bias.append(bias)
            self.gain.append(gain)
            p = _sigmoid(bias + z)
            upstream = p if upstream is None else upstream * p

    def raw_logit(self, rows: _Rows, label: int) -> np.ndarray:
        """The label's logit before gain and bias: a sum of hidden per-id weights and terms."""
        r = self.rand
        tag = f"w{label}"
        out = np.zeros(rows.n)
        for plan in self.plans:
            name = plan.feature.name
            if plan.role == "list":
                node, values, offsets = rows.list_parts[name]
                w = r.normal(f"{tag}:{name}", values)
                lengths = np.diff(offsets)
                seg = np.repeat(np.arange(len(lengths)), lengths)
                mean = np.bincount(seg, w, minlength=len(lengths)) / np.maximum(lengths, 1)
                out += plan.scale * mean[node]
            elif plan.role == "list_time":
                continue  # times order a sequence; the sequential term reads that order
            elif plan.role == "dense":
                x = rows.dense[name].astype(np.float64)
                if plan.price_like:
                    x = (np.log(np.maximum(x, 1e-3)) - 4.0) / 1.2
                direction = r.normal(f"{tag}:{name}", np.arange(x.shape[1]))
                out += plan.scale * (x @ direction) / math.sqrt(x.shape[1])
            else:
                out += plan.scale * r.normal(f"{tag}:{name}", rows.ranks[name])
        if rows.taste_rank is not None:
            group = r.bits("taste", rows.user) % np.uint64(_TASTE_GROUPS)
            out += 0.7 * r.normal(f"{tag}:taste", group, rows.taste_rank)
        if self.sequence_plan is not None and label == 0:
            out += self.sequential * self.sequence_term(rows)
        return out

    def sequence_term(self, rows: _Rows, shuffle: int | None = None) -> np.ndarray:
        """Interest drift: ``<v(target), sum_i decay^i v(b_i)> / sqrt(dim)`` per row, where
        ``b_0`` is the user's most recent behaviour, ``b_1`` the one before... and ``v`` a
        hidden normal vector per category rank (the target is the query id of the row's ad,
        from the same pool). Its std is about 1.15 on long lists, and a bag of the
        behaviours cannot tell which are recent. ``shuffle=k``: the same with the
        behaviours in the k-th random order (what a model blind to order could at best
        assume)."""
        r, name = self.rand, self.sequence_plan.feature.name
        node, values, offsets = rows.list_parts[name]
        lengths = np.diff(offsets)
        seg = np.repeat(np.arange(len(lengths)), lengths)
        start = np.repeat(offsets[:-1], lengths)
        rank = np.arange(len(values)) - start          # position in the list, oldest first
        if shuffle is not None:
            key = r.uniform(f"blind:{shuffle}", seg, rank)
            order = np.lexsort((key, seg))
            shuffled = np.empty_like(rank)
            shuffled[order] = rank
            rank = shuffled
        decay = _SEQUENCE_DECAY ** (lengths[seg] - 1 - rank)
        salt = f"seq:{self.query_plan.feature.name}"
        dims = np.arange(_SEQUENCE_DIM)
        vectors = r.normal(salt, values[:, None], dims[None, :])
        interest = np.stack([np.bincount(seg, decay * vectors[:, k], minlength=len(lengths))
                             for k in dims], axis=1)
        target = r.normal(salt, rows.ranks[self.query_plan.feature.name][:, None], dims[None, :])
        return (interest[node] * target).sum(axis=1) / math.sqrt(_SEQUENCE_DIM)

    def order_blind_probability(self, rows: _Rows) -> np.ndarray:
        """The first label's probability as a model that sees the sequence as a bag could know
        it at best: the true probability averaged over random orders of the behaviours (every
        order of a bag is equally likely: the items are drawn independently)."""
        base = self.raw_logit(rows, 0) - self.sequential * self.sequence_term(rows)
        total = np.zeros(rows.n)
        for k in range(_ORDER_BLIND_SHUFFLES):
            logit = base + self.sequential * self.sequence_term(rows, shuffle=k)
            total += _sigmoid(self.bias[0] + self.gain[0] * logit)
        return total / _ORDER_BLIND_SHUFFLES

    # -- rows --

    def chunks(self, chunk_rows: int) -> Iterator[np.ndarray]:
        """Consecutive pageview ranges of about ``chunk_rows`` rows each."""
        bounds = np.searchsorted(self.pv_start, np.arange(0, self.samples, chunk_rows), "left")
        bounds = np.unique(np.append(bounds, len(self.pv_user)))
        for a, b in zip(bounds[:-1], bounds[1:]):
            yield np.arange(a, b)

    def rows(self, pvs: np.ndarray) -> _Rows:
        """Materialise the rows of the given (sorted) pageviews."""
        r, L = self.rand, self.num_layers
        sizes = self.pv_size[pvs].astype(np.int64)
        n = int(sizes.sum())
        row_pv = np.repeat(pvs, sizes)
        slot = np.arange(n) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        row_id = self.pv_start[row_pv] + slot
        user = self.pv_user[row_pv].astype(np.int64)
        t = self.pv_time[row_pv]
        changed = (r.uniform("changed", user) < _CHANGE_RATE) if self.changed else np.zeros(n, bool)
        version = changed & self.pv_late[row_pv]
        rows = _Rows(n=n, user=user, row_id=row_id, root_node=user * 2 + version)

        # Node rank per layer: what identifies the node before its features are derived.
        node_rank: list[np.ndarray] = []
        for li in range(L):
            pool = self.layer_pools[li]
            if li == 0 and L > 1:
                rank = user
            elif li == 0 or li == 1:
                u_global = r.uniform(f"pick:{li}", row_id)
                rank = _zipf_rank(u_global, pool.vocab, pool.exponent)
                if L > 1:
                    fav = r.uniform(f"fav?:{li}", row_id) < _FAVOURITE_SHARE
                    which = (r.uniform(f"favslot:{li}", row_id) ** 2 * _FAVOURITES).astype(np.int64)
                    fav_rank = _zipf_rank(r.uniform(f"favs:{li}", user, which), pool.vocab,
                                          pool.exponent)
                    rank = np.where(fav, fav_rank, rank)
            else:
                parent = node_rank[li - 1]
                children = 1 + np.minimum(
                    (-np.log(r.uniform(f"kids:{li}", parent)) * 2.0).astype(np.int64), _FANOUT - 1)
                j = (r.uniform(f"child:{li}", row_id) * children).astype(np.int64)
                rank = parent * _FANOUT + j
            node_rank.append(rank)

        for plan in self.plans:
            f, li = plan.feature, plan.layer
            node = node_rank[li]
            name = f.name
            if plan.role == "dense":
                upper = li < L - 1
                by_key = upper or (plan.price_like and bool(self.schema.layers[li].key))
                a = node if by_key else row_id
                cols = np.arange(f.dim)
                if plan.price_like:
                    x = np.exp(4.0 + 1.2 * r.normal(f"dense:{name}", a[:, None], cols[None, :]))
                else:
                    x = r.normal(f"dense:{name}", a[:, None], cols[None, :])
                if plan is self.changed:
                    x[:, 0] += version
                x = x.astype(np.float32)
                rows.dense[name] = x
                rows.columns[name] = pa.ListArray.from_arrays(
                    pa.array(np.arange(0, n * f.dim + 1, f.dim, dtype=np.int32)),
                    pa.array(x.reshape(-1), pa.float32()))
                continue
            if plan.role == "list":
                self._list_column(rows, plan, node if li < L - 1 else row_id, li == 0 < L - 1)
                continue
            if plan.role == "list_time":
                continue  # made with the first sequence it orders, below
            pool = plan.pool
            if plan.role == "key":
                rank = node
            elif plan.role == "time_hour":
                rank = (t * 7 * 24).astype(np.int64) % 24
            elif plan.role == "time_weekday":
                rank = (t * 7).astype(np.int64) % 7
            elif plan.role == "position":
                rank = np.minimum(slot, pool.vocab - 1)
            elif plan.role == "page":
                rank = _zipf_rank(r.uniform(f"attr:{name}", row_pv), pool.vocab, pool.exponent)
            elif plan.role == "context":
                rank = _zipf_rank(r.uniform(f"attr:{name}", row_id), pool.vocab, pool.exponent)
            else:  # attribute of the node: a function of its key
                rank = _zipf_rank(r.uniform(f"attr:{name}", node), pool.vocab, pool.exponent)
            if plan is self.changed:
                rank = np.where(version, (rank + 1) % pool.vocab, rank)
            rows.ranks[name] = rank
            rows.columns[name] = _id_array(pool.values(rank), f.dtype)
            if plan is self.taste_plan:
                rows.taste_rank = rank
        for time_column, sequence in self.sequence_of_time.items():
            inverse, times, offsets = rows.list_times[sequence]
            nodes = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                             pa.array(times, pa.int64()))
            rows.columns[time_column] = nodes.take(pa.array(inverse.astype(np.int32)))
        return rows

    def _list_column(self, rows: _Rows, plan: _FeaturePlan, node: np.ndarray, is_root: bool):
        """Behaviour lists are built once per node and gathered to the rows with Arrow's take."""
        r, f, pool = self.rand, plan.feature, plan.pool
        key = rows.root_node if is_root else node
        uniq, inverse = np.unique(key, return_inverse=True)
        # The list is a function of the node (for users: without the version bit).
        ubase = (uniq // 2) if is_root else uniq
        # Sequences ordered by one time column share the lengths of the first of them (one
        # time per item).
        time_column = f.sequence.time if f.sequence is not None else None
        stream = self.sequence_of_time[time_column] if time_column else f.name
        empty = r.uniform(f"len0:{stream}", ubase) < _LIST_EMPTY
        length = np.ceil(np.exp(_LIST_LOG_MEAN + _LIST_LOG_SIGMA *
                                r.normal(f"len:{stream}", ubase))).astype(np.int64)
        length = np.where(empty, 0, np.minimum(length, _LIST_MAX))
        offsets = np.concatenate([[0], np.cumsum(length)])
        owner = np.repeat(ubase, length)
        position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], length)
        values = _zipf_rank(r.uniform(f"elem:{f.name}", owner, position), pool.vocab,
                            pool.exponent)
        if is_root and plan is self.changed:
            # The changed user's list gains one more recent id in their second node.
            late = (uniq % 2 == 1)
            if late.any():
                extra = _zipf_rank(r.uniform(f"late:{f.name}", ubase[late]), pool.vocab,
                                   pool.exponent)
                values, offsets = _append_one(values, offsets, late, extra)
        rows.list_parts[f.name] = (inverse, values, offsets)   # true order: oldest first
        if time_column is not None:
            # Stored in a shuffled order (the same for every sequence of this time column);
            # the times say the true one: an hour apart, from a start of the owner's own.
            stored = np.lexsort((r.uniform(f"store:{time_column}", owner, position),
                                 np.repeat(np.arange(len(length)), length)))
            start = r.bits(f"t0:{time_column}", ubase) % np.uint64(365 * 86400)
            times = (_EPOCH_2024_S + np.repeat(start.astype(np.int64), length)
                     + 3600 * position)
            values = values[stored]
            rows.list_times[f.name] = (inverse, times[stored], offsets)
        nodes = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                         _id_array(pool.values(values), f.dtype))
        rows.columns[f.name] = nodes.take(pa.array(inverse.astype(np.int32)))

    def table(self, rows: _Rows, labels: dict) -> pa.Table:
        schema = self.schema.raw_arrow_schema()
        arrays = [rows.columns[f.name] for f in self.schema.features]
        arrays += [pa.array(labels[name].astype(np.float32)) for name in self.schema.labels]
        arrays += [_carried_column(c, rows.row_id) for c in self.schema.carried]
        return pa.Table.from_arrays(arrays, schema=schema)

    def labels(self, rows: _Rows) -> tuple[dict, dict]:
        """Draw every label; returns (bool labels, true probability of each label).

        Later labels are a funnel: label k is label k-1 AND its own Bernoulli draw, so its true
        probability is the product of the stage probabilities (ESMM's CTCVR)."""
        labels, probs = {}, {}
        upstream_p, upstream_y = None, None
        for li, name in enumerate(self.schema.labels):
            p = _sigmoid(self.bias[li] + self.gain[li] * self.raw_logit(rows, li))
            y = self.rand.uniform(f"label:{li}", rows.row_id) < p
            if upstream_p is not None:
                p, y = p * upstream_p, y & upstream_y
            labels[name], probs[name] = y, p
            upstream_p, upstream_y = p, y
        return labels, probs


def _append_one(values, offsets, which, extra):
    """Append ``extra[k]`` to the k-th list selected by ``which`` (vectorised)."""
    lengths = np.diff(offsets)
    new_lengths = lengths + which
    new_offsets = np.concatenate([[0], np.cumsum(new_lengths)])
    out = np.empty(new_offsets[-1], values.dtype)
    # Old elements keep their order; the appended one goes at the end of its list.
    shift = np.repeat(new_offsets[:-1] - offsets[:-1], lengths)
    out[np.arange(len(values)) + shift] = values
    out[new_offsets[1:][which] - 1] = extra
    return out, new_offsets


def _id_array(values: np.ndarray, dtype: str) -> pa.Array:
    if dtype == "int64":
        return pa.array(values, pa.int64())
    # String ids look like placement ids, e.g. "430548_1007"; the first part alone is already
    # one-to-one with the id, so distinct ids stay distinct strings.
    head = pa.array(430000 + values * 61, pa.int64())
    tail = pa.array(1000 + (values * 7919) % 9000, pa.int64())
    return pc.binary_join_element_wise(pc.cast(head, pa.string()), pc.cast(tail, pa.string()),
                                       "_")


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def auc(scores, labels) -> float:
    """Area under the ROC curve by the rank-sum formula; tied scores get their average rank.

    Returns NaN when the labels hold only one class.
    """
    scores = np.asarray(scores, np.float64).ravel()
    labels = np.asarray(labels).ravel().astype(bool)
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    # Average rank (1-based) of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    avg = (starts + ends + 1) / 2.0
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


# --- public API -----------------------------------------------------------------------------

_EPOCH_2024_US = 1_704_067_200_000_000


def _carried_column(carried, row_id: np.ndarray) -> pa.Array:
    """A carried column (not trained, so it plays no part in the labels): the sample's row id
    (int64, float64, its decimal text for strings) or, for timestamps, one second per row from
    2024-01-01 UTC."""
    row_id = row_id.astype(np.int64)
    if carried.dtype == "timestamp":
        return pa.array(_EPOCH_2024_US + row_id * 1_000_000, pa.int64()).cast(
            carried.raw_arrow_type())
    if carried.dtype == "string":
        return pa.array(row_id).cast(pa.string())
    return pa.array(row_id).cast(carried.raw_arrow_type())


def _check(schema, samples, seed, samples_per_user, ctr, chunk_rows, sequential=0.0):
    if not isinstance(schema, Schema):
        raise TypeError(f"schema: expected a schemas.Schema, got {type(schema).__name__}; "
                        "load one with schemas.load(path)")
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples <= 0:
        raise ValueError(f"samples: expected a positive integer, got {samples!r}")
    if not (samples_per_user >= 1.0):
        raise ValueError(f"samples_per_user: expected a mean of at least 1, "
                         f"got {samples_per_user!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    if not (0.0 < ctr < 1.0):
        raise ValueError(f"ctr: expected a click rate strictly between 0 and 1, got {ctr!r}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows: expected a positive integer, got {chunk_rows!r}")
    if isinstance(sequential, bool) or not isinstance(sequential, (int, float)) or not (
            0.0 <= sequential < math.inf):
        raise ValueError(f"sequential: expected the strength of the sequential signal, a "
                         f"number >= 0 (0: none), got {sequential!r}")


def _stream(schema, samples, seed, samples_per_user, ctr, chunk_rows, sequential=0.0):
    _check(schema, samples, seed, samples_per_user, ctr, chunk_rows, sequential)
    plan = _Plan(schema, int(samples), int(seed), float(samples_per_user), float(ctr),
                 sequential)
    for pvs in plan.chunks(chunk_rows):
        rows = plan.rows(pvs)
        labels, probs = plan.labels(rows)
        yield plan, rows, plan.table(rows, labels), labels, probs


def generate_tables(schema: Schema, samples: int, seed: int = 0, *,
                    samples_per_user: float = DEFAULT_SAMPLES_PER_USER, ctr: float = DEFAULT_CTR,
                    chunk_rows: int = DEFAULT_CHUNK_ROWS,
                    with_probabilities: bool = False,
                    with_hidden: bool = False, sequential: float = 0.0) -> Iterator[pa.Table]:
    """Yield the ``samples`` rows in time order as tables of about ``chunk_rows`` rows.

    Columns are exactly ``schema.raw_arrow_schema()``; with ``with_probabilities`` each table
    also ends with a float64 column ``p_<label>`` per label: the planted model's true
    probability of that label (what the Bayes AUC is computed from). With ``with_hidden`` it
    also ends with an int64 column ``h_taste_cross``: the planted interaction's hidden token,
    ``taste group * 2^32 + the category's rank`` (what a model given the generator's hidden
    features would know; null when the schema has no interaction). Memory holds one chunk
    plus a per-pageview plan of about 7 bytes per sample. ``sequential``: the strength of the
    sequential signal (0: none; the module's docstring); with it and ``with_probabilities``,
    also ``p_<label>_order_blind`` for the first label (:meth:`_Plan.order_blind_probability`).
    """
    for plan, rows, table, _, probs in _stream(schema, samples, seed, samples_per_user, ctr,
                                               chunk_rows, sequential):
        if with_probabilities:
            for name in schema.labels:
                table = table.append_column(f"p_{name}", pa.array(probs[name], pa.float64()))
            if plan.sequence_plan is not None:
                table = table.append_column(
                    f"p_{schema.labels[0]}_order_blind",
                    pa.array(plan.order_blind_probability(rows), pa.float64()))
        if with_hidden:
            cross = None
            if rows.taste_rank is not None:
                group = plan.rand.bits("taste", rows.user) % np.uint64(_TASTE_GROUPS)
                cross = (group.astype(np.int64) << 32) + rows.taste_rank.astype(np.int64)
            table = table.append_column("h_taste_cross", pa.array(
                cross if cross is not None else [None] * table.num_rows, pa.int64()))
        yield table


def taste_oracles(schema: Schema, samples: int, seed: int = 0, *, train_rows: int,
                  samples_per_user: float = DEFAULT_SAMPLES_PER_USER,
                  ctr: float = DEFAULT_CTR,
                  chunk_rows: int = DEFAULT_CHUNK_ROWS) -> dict | None:
    """What the planted interaction is worth to a model of the OBSERVED data: click
    probabilities of rows ``train_rows:`` of :func:`generate_tables` (same arguments, so the
    same rows; time order) by the planted model itself, knowing every hidden per-id weight
    but not the users' taste groups:

    - ``history``: each user's group inferred from that user's rows before ``train_rows``
      (their labels; a uniform prior over the groups, Bayes' rule with the planted
      likelihood), the prediction averaged over the posterior. No model trained on those rows
      can know more about a user's taste, so ``AUC(history) - AUC(prior)`` bounds what
      learning the interaction can add to any model;
    - ``prior``: the group unknown (the prediction averaged over the groups): the planted main
      effects alone.

    Returns ``{"history": float64[m], "prior": float64[m]}`` for the first label, or None when
    the schema has no interaction (one layer, or no id below the root). Memory: ~8 bytes per
    row and taste group."""
    _check(schema, samples, seed, samples_per_user, ctr, chunk_rows)
    if not 0 < train_rows < samples:
        raise ValueError(f"train_rows: expected 0 < train_rows < samples ({samples}), "
                         f"got {train_rows!r}")
    users, logits, labels = [], [], []
    plan = None
    for plan, rows, _, drawn, _ in _stream(schema, samples, seed, samples_per_user, ctr,
                                           chunk_rows):
        if rows.taste_rank is None:
            return None
        r, label = plan.rand, schema.labels[0]
        actual = r.bits("taste", rows.user) % np.uint64(_TASTE_GROUPS)
        base = plan.bias[0] + plan.gain[0] * (
            plan.raw_logit(rows, 0) - 0.7 * r.normal("w0:taste", actual, rows.taste_rank))
        groups = [r.normal("w0:taste", np.full(rows.n, g, np.uint64), rows.taste_rank)
                  for g in range(_TASTE_GROUPS)]
        logits.append(base[:, None] + plan.gain[0] * 0.7 * np.stack(groups, axis=1))
        users.append(np.asarray(rows.user, np.int64))
        labels.append(drawn[label].astype(np.float64))
    user, logit, y = (np.concatenate(users), np.concatenate(logits), np.concatenate(labels))
    # log-likelihood of every user's train rows under each group, summed per user
    log_p, log_q = -np.logaddexp(0.0, -logit[:train_rows]), -np.logaddexp(0.0, logit[:train_rows])
    ids, which = np.unique(user, return_inverse=True)
    evidence = np.zeros((len(ids), _TASTE_GROUPS))
    np.add.at(evidence, which[:train_rows],
              y[:train_rows, None] * log_p + (1.0 - y[:train_rows, None]) * log_q)
    posterior = np.exp(evidence - evidence.max(axis=1, keepdims=True))
    posterior /= posterior.sum(axis=1, keepdims=True)
    p = _sigmoid(logit[train_rows:])
    return {"history": (posterior[which[train_rows:]] * p).sum(axis=1), "prior": p.mean(axis=1)}


def generate(schema: Schema, samples: int, out_dir: str | os.PathLike, seed: int = 0, *,
             shards: int | None = None, samples_per_user: float = DEFAULT_SAMPLES_PER_USER,
             ctr: float = DEFAULT_CTR, chunk_rows: int = DEFAULT_CHUNK_ROWS,
             progress: bool = False, sequential: float = 0.0) -> dict:
    """Write ``out_dir/part-00000.parquet``... (zstd) and ``out_dir/_truth.json``; return the truth.

    ``shards`` defaults to one file per ~500k rows. Files are written under a temporary name and
    renamed, and ``part-*.parquet`` files left from an earlier, larger run are removed, so the
    directory always holds one complete data set. Same arguments, same rows.

    ``out_dir`` may be an object-store URI (``s3://...``, through :mod:`compression.fs`): each
    file is then one object that appears complete when it is closed, written in place (the
    command writes into the hidden generation of a :class:`compression.fs.StagedObjectOutput`,
    published by its manifest at the end).

    ``sequential`` > 0 plants the sequential signal (the module's docstring); the truth then
    has ``sequential``: its strength, sequence and target feature, and
    ``order_blind_bayes_auc``, the best AUC of a model that sees the sequence as a bag.
    """
    _check(schema, samples, seed, samples_per_user, ctr, chunk_rows, sequential)
    samples = int(samples)
    if shards is None:
        shards = max(1, math.ceil(samples / DEFAULT_ROWS_PER_SHARD))
    if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)) or shards < 1:
        raise ValueError(f"shards: expected a positive integer, got {shards!r}")
    if shards > samples:
        raise ValueError(f"shards: {shards} shards for {samples} samples would leave empty "
                         f"files; use at most {samples}")
    out_dir = os.fspath(out_dir)
    if fs.is_local(out_dir):
        _prepare_dir(out_dir)

    names = [f"part-{i:05d}.parquet" for i in range(shards)]
    shard_writer = _ShardWriter(out_dir, names, math.ceil(samples / shards),
                                schema.raw_arrow_schema())
    probs_all = {name: np.empty(samples, np.float32) for name in schema.labels}
    labels_all = {name: np.empty(samples, bool) for name in schema.labels}
    root_counts = None
    blind = None   # the order-blind probability of the first label, with a sequential signal
    written = 0
    # Parquet encoding (zstd) releases the GIL: one writer thread overlaps it with generating
    # the next chunk. Waiting for the previous write first keeps at most two chunks in memory.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate-writer")
    pending = None
    bar = _NoBar()
    try:
        # made inside the try, so that an interrupt closes it (ends its line) whenever it comes
        bar = _progress_bar(samples, progress)
        for plan, rows, table, labels, probs in _stream(schema, samples, seed, samples_per_user,
                                                         ctr, chunk_rows, sequential):
            if root_counts is None:
                root_counts = np.zeros(plan.users * 2, np.int64)
            root_counts += np.bincount(rows.root_node, minlength=plan.users * 2)
            for name in schema.labels:
                probs_all[name][written:written + rows.n] = probs[name]
                labels_all[name][written:written + rows.n] = labels[name]
            if plan.sequence_plan is not None:
                if blind is None:
                    blind = np.empty(samples, np.float32)
                blind[written:written + rows.n] = plan.order_blind_probability(rows)
            if pending is not None:
                pending.result()
            pending = pool.submit(shard_writer.write, table)
            written += rows.n
            bar.update(rows.n)
        if pending is not None:
            pending.result()
        shard_writer.close()
    finally:
        pool.shutdown(wait=True)
        bar.close()
        shard_writer.abort()
    assert written == samples and shard_writer.done == len(names), (written, shard_writer.done)
    if fs.is_local(out_dir):
        _remove_stale(out_dir, set(names))

    truth = _truth(plan, root_counts, labels_all, probs_all, out_dir, names, seed)
    if blind is not None:
        first = schema.labels[0]
        truth["sequential"] = {
            "strength": plan.sequential, "sequence": plan.sequence_plan.feature.name,
            "target": plan.query_plan.feature.name, "decay": _SEQUENCE_DECAY,
            "order_blind_bayes_auc": _json_float(auc(blind, labels_all[first]))}
    fs.write_text(fs.join(out_dir, TRUTH_FILE), json.dumps(truth, indent=2) + "\n")
    return truth


class _ShardWriter:
    """Cuts the row stream into ``names`` files of ``rows_per_shard`` rows; each local file is
    written under a temporary name and renamed when complete (an object on a store appears,
    complete, when its stream is closed: no temporary name there)."""

    def __init__(self, out_dir: str, names: list[str], rows_per_shard: int, schema: pa.Schema):
        self.out_dir, self.names, self.rows_per_shard, self.schema = (
            out_dir, names, rows_per_shard, schema)
        self.local = fs.is_local(out_dir)
        self.suffix = f".tmp-{os.getpid()}" if self.local else ""
        self.done = 0          # files completed
        self._writer = None
        self._sink = None      # the object's stream on a store
        self._rows = 0         # rows in the open file

    def _path(self, name: str) -> str:
        return fs.join(self.out_dir, name)

    def _open(self, path: str) -> pq.ParquetWriter:
        if self.local:
            return pq.ParquetWriter(path, self.schema, compression="zstd")
        self._sink = fs.open_output(path)
        return pq.ParquetWriter(self._sink, self.schema, compression="zstd")

    def _close(self) -> None:
        self._writer.close()
        self._writer = None
        if self._sink is not None:
            with fs.translate_errors(self._path(self.names[self.done]), "write it"):
                self._sink.close()
            self._sink = None

    def write(self, table: pa.Table):
        start = 0
        while start < table.num_rows:
            if self._writer is None:
                self._writer = self._open(self._path(self.names[self.done] + self.suffix))
            take = min(table.num_rows - start, self.rows_per_shard - self._rows)
            self._writer.write_table(table.slice(start, take))
            start += take
            self._rows += take
            if self._rows == self.rows_per_shard:
                self._finish()

    def close(self):
        if self._writer is not None:
            self._finish()

    def _finish(self):
        self._close()
        name = self.names[self.done]
        if self.local:
            os.replace(self._path(name + self.suffix), self._path(name))
        self.done, self._rows = self.done + 1, 0

    def abort(self):
        """After a failure: drop the half-written file (complete ones stay)."""
        if self._writer is not None:
            self._close()
            fs.delete_tree(self._path(self.names[self.done] + self.suffix))


def _truth(plan: _Plan, root_counts, labels_all, probs_all, out_dir, names, seed) -> dict:
    counts = root_counts[root_counts > 0] if plan.num_layers > 1 else np.ones(plan.samples,
                                                                              np.int64)
    present_users = int((root_counts.reshape(-1, 2).sum(1) > 0).sum())
    two_nodes = int(((root_counts.reshape(-1, 2) > 0).sum(1) == 2).sum())
    first = plan.schema.labels[0]
    truth = {
        "schema": plan.schema.name,
        "seed": int(seed),
        "samples": plan.samples,
        "users": int(len(counts)),
        "user_keys": present_users if plan.num_layers > 1 else plan.samples,
        "users_with_feature_change": two_nodes,
        "changed_feature": plan.changed.feature.name if plan.changed else None,
        "samples_per_user_mean": float(counts.mean()),
        "samples_per_user_p50": float(np.percentile(counts, 50)),
        "samples_per_user_p99": float(np.percentile(counts, 99)),
        "samples_per_user_max": int(counts.max()),
        "pageviews": int(len(plan.pv_user)),
        "ctr": float(labels_all[first].mean()),
        "bayes_auc": _json_float(auc(probs_all[first], labels_all[first])),
        "labels": {},
        "planted": {"target_ctr": plan.ctr, "funnel_rate": _FUNNEL_RATE,
                    "logit_std": _LOGIT_STD, "samples_per_user": plan.samples_per_user},
        "vocab": {p.feature.name: p.pool.vocab for p in plan.plans if p.pool is not None},
        "files": names,
        "bytes": int(sum(fs.size(fs.join(out_dir, n)) for n in names)),
    }
    for li, name in enumerate(plan.schema.labels):
        stats = {"rate": float(labels_all[name].mean()),
                 "bayes_auc": _json_float(auc(probs_all[name], labels_all[name])),
                 "mean_probability": float(probs_all[name].mean(dtype=np.float64)),
                 "bias": plan.bias[li], "gain": plan.gain[li]}
        truth["labels"][name] = stats
        if li > 0:
            truth[f"{name}_rate"] = stats["rate"]
            truth[f"{name}_bayes_auc"] = stats["bayes_auc"]
    return truth


def _json_float(x: float):
    return None if math.isnan(x) else x


def _prepare_dir(out_dir: str):
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out {out_dir}: exists and is not a directory")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out_dir}: cannot create the directory: {e.strerror}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out_dir}: directory is not writable")


def _remove_stale(out_dir: str, keep: set):
    for name in os.listdir(out_dir):
        if name.startswith("part-") and name.endswith(".parquet") and name not in keep:
            os.remove(os.path.join(out_dir, name))


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="rows", unit_scale=True, file=sys.stderr, desc="generate")


# --- command line ---------------------------------------------------------------------------

PROG = "python -m pipelines.generate"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=textwrap.fill(
            "Write realistic synthetic ads logs (flat samples of a schema) as Parquet "
            "shards, labelled by a planted logistic model, plus _truth.json with the "
            "data's statistics and its Bayes-optimal AUC."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=cli.epilog(f"{PROG} --schema schemas/examples/taobao_like.yaml --samples 2000000 "
                          "--out /tmp/raw --seed 7"))
    p.add_argument("--schema", required=True,
                   help="schema YAML file, e.g. schemas/examples/taobao_like.yaml")
    p.add_argument("--samples", required=True, type=int,
                   help="number of samples (rows) to write")
    p.add_argument("--out", required=True,
                   help="output directory (part-*.parquet and _truth.json), local or on an "
                        "object store (s3://bucket/raw); a non-empty one is refused unless "
                        "--overwrite; written through a temporary directory renamed into place "
                        "at the end (on an object store: under a hidden prefix, published by "
                        "OUT/_MANIFEST.json written last)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed; the same seed and options give the same rows (default 0)")
    p.add_argument("--shards", type=int, default=None,
                   help="number of Parquet files (default: one per ~500k rows)")
    p.add_argument("--samples-per-user", type=float, default=DEFAULT_SAMPLES_PER_USER,
                   help="mean samples per user; per-user counts are heavy-tailed around it "
                        "(default 57, the XDL paper's Taobao figure)")
    p.add_argument("--ctr", type=float, default=DEFAULT_CTR,
                   help="target click rate; the planted model's bias is tuned so the realised "
                        "rate is close (default 0.04)")
    p.add_argument("--sequential", type=float, default=0.0, metavar="STRENGTH",
                   help="plant a sequential signal of this strength (e.g. 1.5): the click "
                        "also depends on the order of the user's behaviour sequence (an ids "
                        "feature the schema declares `sequence`); _truth.json gains the "
                        "order-blind Bayes AUC (default 0: none)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar on stderr (shown by default from 200k samples)")
    cli.add_overwrite_flag(p)
    cli.add_debug_flag(p)
    return p


def run(argv=None) -> dict:
    """Parse the command line, generate, print a one-line summary; returns the truth dict.
    A bad schema or option raises ``ValueError`` (:func:`main` makes it one line, exit 2)."""
    args = _parser().parse_args(argv)
    schema = schemas.load(args.schema)
    started = time.perf_counter()
    # the output policy of every command: a failed or interrupted run leaves no --out
    with outputs.StagedOutput(args.out, args.overwrite, "--out", [args.schema]) as staged:
        truth = generate(schema, args.samples, staged.tmp, args.seed, shards=args.shards,
                         samples_per_user=args.samples_per_user, ctr=args.ctr,
                         sequential=args.sequential, progress=not args.no_progress and args.samples >= 200_000)
        staged.commit()
    seconds = time.perf_counter() - started
    print(f"{truth['samples']:,} samples of {truth['schema']} in {len(truth['files'])} files "
          f"({truth['bytes'] / 1e6:.1f} MB) in {seconds:.1f} s "
          f"({truth['samples'] / seconds / 1e6:.2f}M rows/s): {truth['users']:,} users, "
          f"{truth['samples_per_user_mean']:.1f} samples/user "
          f"(p50 {truth['samples_per_user_p50']:.0f}, p99 {truth['samples_per_user_p99']:.0f}), "
          f"ctr {truth['ctr']:.4f}, bayes_auc {truth['bayes_auc']:.4f}")
    print(fs.join(args.out, TRUTH_FILE))
    return truth


def main(argv=None) -> int:
    """The command: one line for an error (exit 2 for bad input, 1 for a failure while
    writing), 130/143 when interrupted; ``--debug`` adds the traceback."""
    return cli.run_command(PROG, _main, argv)


def _main(argv) -> int:
    run(argv)
    return cli.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
