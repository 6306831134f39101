"""A generated Taobao ad stream: the reference's 20 columns, clicks and buys from a hidden
model whose probabilities are known (so each task's Bayes-optimal AUC is too).

Every sample is a pure function of ``(seed, index)`` (``topologies/streamgen.py``).

- A **user** (popularity rank over ``num_users``, power law) has fixed attributes derived
  from a hash of the user: ``cms_segid``, ``cms_group_id``, ``final_gender_code``,
  ``age_level``, ``pvalue_level``, ``shopping_level``, ``occupation``,
  ``new_user_class_level``, and 0-5 interest categories and brands
  (``tag_category_list``, ``tag_brand_list``).
- An **ad** (rank over ``num_ads``) has a category, brand, campaign, customer and price.
- ``pid`` is one of two placements.
- **click** ~ Bernoulli(sigmoid(lc)) with ``lc`` = bias + user and ad effects (weights
  concentrated on frequent users and ads, as in ``synthetic_ctr``) + a category effect +
  placement + a bonus when the ad's category / brand is among the user's interests −
  a price effect.
- **buy** (only after a click) ~ Bernoulli(sigmoid(lb)) with ``lb`` = bias + ad quality +
  shopping level + interest in the brand − price, the price penalty softened for users
  of a higher ``pvalue_level``. So ``P(buy) = P(click) * P(buy | click)`` and buy ⊂ click.

The two tasks share the interest features and differ in how price and the ad matter,
which is what a multi-task model with shared and task-specific experts is for.

**Distribution shift** (``shift_at`` >= 0; ``stream-persia run --concept-shift-at K``, env
``STREAM_PERSIA_CONCEPT_SHIFT_AT``, read by :func:`shift_at_from_env`): from sample
``shift_at`` on, the popularity ranks drawn for users and ads are rotated by
``shift_fraction`` of their populations, so other users and ads (with their categories,
brands, prices and interests) make up the stream: yesterday's rare users and ads are
today's frequent ones. What a user or an ad does is unchanged (the hidden model is a
function of the user and the ad), so only the mix of the samples changes (a covariate
shift), not the concept. The new frequent users and ads were rare, so their weights are
small and their embeddings untrained: the Bayes-optimal AUC changes too, and
:meth:`TaobaoStream.bayes_auc` gives it on either side (each side is stationary). The
eval split lies after any shift.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE.parent), str(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from schema import COLUMNS, MULTI_ID, SINGLE_ID, RawChunk  # noqa: E402
from streamgen import (  # noqa: E402
    bayes_auc,
    hashed,
    key,
    normal,
    unit,
    zipf_probability,
    zipf_rank,
)

__all__ = ["TaobaoStream", "EVAL_OFFSET", "csv_lines", "shift_at_from_env"]

EVAL_OFFSET = 1 << 48
MAX_TAGS = 5

# Quantities hashed under their own key: key(seed, quantity, column).
(_USER, _AD, _PID, _CLICK, _BUY, _UATTR, _UTAG_N, _UTAG_CAT, _UTAG_BRAND, _AATTR,
 _W_USER, _W_AD, _W_AD2, _W_CATE) = range(1, 15)


@dataclass(frozen=True)
class TaobaoStream:
    """The stream's definition; :meth:`samples` generates any range of it.

    Args:
        seed: selects the stream and its hidden model.
        num_users, num_ads, num_categories, num_brands: population sizes.
        zipf_s: power-law exponent of user and ad popularity.
        popularity_floor: users/ads drawn much less often than this carry little weight.
        click_bias, buy_bias: intercepts (click rate ~0.2, buy rate ~0.05 by default).
        shift_at: first sample of the distribution shift (-1: none; module docstring).
        shift_fraction: how far the shift rotates the popularity ranks, as a fraction of
            the users and of the ads (0.5: the frequent half becomes the rare half).
    """

    seed: int = 0
    num_users: int = 50_000
    num_ads: int = 50_000
    num_categories: int = 2_000
    num_brands: int = 5_000
    zipf_s: float = 1.1
    popularity_floor: float = 1e-3
    click_bias: float = -1.8
    buy_bias: float = -1.2
    shift_at: int = -1
    shift_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.shift_fraction < 1.0:
            raise ValueError(f"shift_fraction must be in (0, 1), got {self.shift_fraction}")

    def _k(self, quantity: int, column: int = 0) -> np.uint64:
        return key(self.seed, quantity, column)

    def _attr(self, ids: np.ndarray, quantity: int, column: int, n: int, low: int = 0
              ) -> np.ndarray:
        return low + (hashed(ids, self._k(quantity, column)) % np.uint64(n)).astype(np.int64)

    def _shrunk_normal(self, rank: np.ndarray, quantity: int, vocab: int) -> np.ndarray:
        z = normal(hashed(rank, self._k(quantity, 0)), hashed(rank, self._k(quantity, 1)))
        pr = zipf_probability(rank, self.zipf_s, vocab)
        return z * np.sqrt(pr / (pr + self.popularity_floor))

    # ------------------------------------------------------------------ entities
    def users(self, u: np.ndarray) -> dict[str, np.ndarray]:
        """Attributes and interests of users ``u`` (fixed per user)."""
        attrs = {"cms_segid": self._attr(u, _UATTR, 0, 97),
                 "cms_group_id": self._attr(u, _UATTR, 1, 13),
                 "final_gender_code": self._attr(u, _UATTR, 2, 2, 1),
                 "age_level": self._attr(u, _UATTR, 3, 7),
                 "pvalue_level": self._attr(u, _UATTR, 4, 3, 1),
                 "shopping_level": self._attr(u, _UATTR, 5, 3, 1),
                 "occupation": self._attr(u, _UATTR, 6, 2),
                 "new_user_class_level": self._attr(u, _UATTR, 7, 4, 1)}
        n_tags = self._attr(u, _UTAG_N, 0, MAX_TAGS + 1)
        attrs["tag_mask"] = np.arange(MAX_TAGS)[None, :] < n_tags[:, None]
        cats = np.empty((len(u), MAX_TAGS), np.int64)
        brands = np.empty((len(u), MAX_TAGS), np.int64)
        for k in range(MAX_TAGS):
            cats[:, k] = zipf_rank(unit(hashed(u, self._k(_UTAG_CAT, k))), 1.2,
                                   self.num_categories)
            brands[:, k] = zipf_rank(unit(hashed(u, self._k(_UTAG_BRAND, k))), 1.2,
                                     self.num_brands)
        attrs["tag_categories"], attrs["tag_brands"] = cats, brands
        return attrs

    def ads(self, a: np.ndarray) -> dict[str, np.ndarray]:
        """Attributes of ads ``a`` (fixed per ad)."""
        campaign = (a // 4) * 7919 + self._attr(a, _AATTR, 0, 3)
        return {"cate_id": zipf_rank(unit(hashed(a, self._k(_AATTR, 1))), 1.2,
                                     self.num_categories),
                "brand": zipf_rank(unit(hashed(a, self._k(_AATTR, 2))), 1.2, self.num_brands),
                "campaign_id": campaign, "customer": campaign // 3,
                "price": np.floor(50 * unit(hashed(a, self._k(_AATTR, 3))) ** 2).astype(
                    np.int64)}

    # ------------------------------------------------------------------ sampling
    def samples(self, start: int, n: int) -> RawChunk:
        """Samples ``start .. start + n - 1`` (the same whatever the chunking)."""
        if start < 0 or n < 0:
            raise ValueError(f"start and n must be >= 0, got {start}, {n}")
        return self.samples_at(np.arange(start, start + n, dtype=np.int64))

    def eval_samples(self, n: int, start: int = 0) -> RawChunk:
        """The held-out split: never overlaps any training range."""
        return self.samples(EVAL_OFFSET + start, n)

    def bayes_auc(self, start: int, n: int, chunks: int = 10
                  ) -> dict[str, tuple[float, float]]:
        """``{task: (auc, stderr)}``: each task's Bayes-optimal AUC around ``start``, from
        the true probabilities of samples ``start .. start + n - 1``
        (``streamgen.bayes_auc``: no label noise; ``stderr`` from ``chunks`` parts)."""
        parts = [self.samples(lo, min(65_536, start + n - lo))
                 for lo in range(start, start + n, 65_536)]
        return {"click": bayes_auc(np.concatenate([c.p_click for c in parts]), chunks),
                "buy": bayes_auc(np.concatenate([c.p_buy for c in parts]), chunks)}

    def samples_at(self, index: np.ndarray) -> RawChunk:
        index = np.asarray(index, dtype=np.int64)
        u = zipf_rank(unit(hashed(index, self._k(_USER))), self.zipf_s, self.num_users)
        a = zipf_rank(unit(hashed(index, self._k(_AD))), self.zipf_s, self.num_ads)
        if self.shift_at >= 0:
            after = index >= self.shift_at
            u = np.where(after, (u + int(self.shift_fraction * self.num_users))
                         % self.num_users, u)
            a = np.where(after, (a + int(self.shift_fraction * self.num_ads)) % self.num_ads, a)
        pid = (unit(hashed(index, self._k(_PID))) < 0.4).astype(np.int64)
        user, ad = self.users(u), self.ads(a)
        mask = user["tag_mask"]
        cate_match = ((user["tag_categories"] == ad["cate_id"][:, None]) & mask).any(1)
        brand_match = ((user["tag_brands"] == ad["brand"][:, None]) & mask).any(1)
        price = ad["price"]
        z_cate = normal(hashed(ad["cate_id"], self._k(_W_CATE, 0)),
                        hashed(ad["cate_id"], self._k(_W_CATE, 1)))

        lc = (self.click_bias + 0.6 * self._shrunk_normal(u, _W_USER, self.num_users)
              + 0.7 * self._shrunk_normal(a, _W_AD, self.num_ads) + 0.3 * z_cate
              + 0.3 * pid + 1.4 * cate_match + 0.9 * brand_match - 0.015 * price)
        price_pain = 0.06 * (1.0 - 0.35 * (user["pvalue_level"] - 1))
        lb = (self.buy_bias + 0.7 * self._shrunk_normal(a, _W_AD2, self.num_ads)
              + 0.5 * (user["shopping_level"] - 2) + 1.2 * brand_match - price_pain * price)
        p_click = 1.0 / (1.0 + np.exp(-lc))
        p_buy_given_click = 1.0 / (1.0 + np.exp(-lb))
        clk = unit(hashed(index, self._k(_CLICK))) < p_click
        buy = clk & (unit(hashed(index, self._k(_BUY))) < p_buy_given_click)

        single = {"pid": pid, "adgroup_id": a, "cate_id": ad["cate_id"],
                  "campaign_id": ad["campaign_id"], "customer": ad["customer"],
                  "brand": ad["brand"], "user_id": u}
        single.update({c: user[c] for c in SINGLE_ID if c in user})
        offsets = np.zeros(len(index) + 1, np.int64)
        np.cumsum(mask.sum(1), out=offsets[1:])
        multi = {"tag_category_list": (user["tag_categories"][mask], offsets),
                 "tag_brand_list": (user["tag_brands"][mask], offsets.copy())}
        return RawChunk(clk=clk.astype(np.float32), buy=buy.astype(np.float32),
                        single=single, multi=multi, price=price, p_click=p_click,
                        p_buy=p_click * p_buy_given_click)


def shift_at_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The distribution shift's sample from ``STREAM_PERSIA_CONCEPT_SHIFT_AT`` (-1 or
    unset: none), which ``stream-persia run --concept-shift-at`` sets for every role."""
    env = os.environ if environ is None else environ
    raw = env.get("STREAM_PERSIA_CONCEPT_SHIFT_AT", "").strip() or "-1"
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"STREAM_PERSIA_CONCEPT_SHIFT_AT={raw!r}: expected an integer "
                         "sample index (-1: no shift)") from None
    if value < -1:
        raise SystemExit(f"STREAM_PERSIA_CONCEPT_SHIFT_AT={raw!r}: must be >= -1")
    return value


def csv_lines(chunk: RawChunk) -> list[str]:
    """The rows of ``chunk`` in the reference's CSV format (20 columns, no header)."""
    cols: dict[str, list[str]] = {
        "clk": chunk.clk.astype(np.int64).astype(str).tolist(),
        "buy": chunk.buy.astype(np.int64).astype(str).tolist(),
        "price": chunk.price.astype(str).tolist()}
    for c in SINGLE_ID:
        cols[c] = chunk.single[c].astype(str).tolist()
    for c in MULTI_ID:
        values, offsets = chunk.multi[c]
        cols[c] = ["|".join(map(str, values[offsets[i]:offsets[i + 1]]))
                   for i in range(len(chunk))]
    return [",".join(cols[c][i] for c in COLUMNS) for i in range(len(chunk))]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write generated rows as a Taobao CSV")
    ap.add_argument("out", help="output file")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--start", type=int, default=0, help="first sample index")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    stream = TaobaoStream(seed=args.seed)
    with open(args.out, "w") as f:
        for lo in range(0, args.rows, 65_536):
            chunk = stream.samples(args.start + lo, min(65_536, args.rows - lo))
            f.write("\n".join(csv_lines(chunk)) + "\n")


if __name__ == "__main__":
    main()
