"""savable_loader.index.permutation: the keyed bijection of the drop-in order and its quality.

The quality tests compare the Feistel order with ``numpy``'s ``Generator.permutation``
on ``n = 10**5`` with statistics a poor shuffle fails: the distribution of how far a
position moves, the correlation between the indices at neighbouring (and more distant)
positions, the joint distribution of the indices at position pairs, fixed points and
neighbours that stay neighbours. A two-round network, which is a visibly poor shuffle,
fails them (the test can fail).
"""

from __future__ import annotations

import numpy as np
import pytest

from savable_loader.index.permutation import EpochOrder, FeistelPermutation
from savable_loader.rng import derive_seed

pytestmark = pytest.mark.timeout(120)

N = 10**5


def everything(perm: FeistelPermutation) -> list[int]:
    return perm(np.arange(perm.n, dtype=np.uint64)).tolist()


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 31, 33, 100, 1000, 4097, 65537])
def test_a_bijection_of_range_n_for_every_size(n):
    for key in (0, 1, 2**63 + 5):
        out = everything(FeistelPermutation(n, key))
        assert sorted(out) == list(range(n))


def test_deterministic_per_key_and_different_across_keys():
    a = everything(FeistelPermutation(1000, 42))
    assert everything(FeistelPermutation(1000, 42)) == a
    assert everything(FeistelPermutation(1000, 43)) != a
    assert a != list(range(1000))


def test_one_position_and_many_agree():
    perm = FeistelPermutation(12345, 9)
    whole = everything(perm)
    picks = [0, 1, 77, 12344, 6000]
    assert [perm.index(p) for p in picks] == [whole[p] for p in picks]
    assert perm.indices(picks) == [whole[p] for p in picks]
    assert perm(np.asarray(picks[::-1], dtype=np.uint64)).tolist() == [whole[p] for p in picks[::-1]]


def test_huge_domains_in_constant_memory():
    for n in (10**10, 10**12, 2**62 - 1):
        perm = FeistelPermutation(n, 3)
        positions = np.array([0, 1, n // 2, n - 2, n - 1], dtype=np.uint64)
        out = perm(positions)
        assert ((out >= 0) & (out < n)).all()
        assert len(set(out.tolist())) == 5
    with pytest.raises(ValueError, match="below 2"):
        FeistelPermutation(2**62, 0)


def test_epoch_order_and_padding():
    new = EpochOrder(50, seed=3, epoch=2, shuffle=True)
    assert new(np.arange(50)).tolist() == everything(FeistelPermutation(50, derive_seed(3, "order", 2)))
    # padding positions wrap around: position p holds the sample of p % n
    assert new(np.array([50, 51, 149])).tolist() == new(np.array([0, 1, 49])).tolist()
    same = EpochOrder(50, seed=3, epoch=2, shuffle=False)
    assert same(np.arange(60)).tolist() == [p % 50 for p in range(60)]
    assert EpochOrder(0, seed=0, epoch=0, shuffle=True)(np.arange(0)).tolist() == []


def test_golden_epoch_orders():
    """The order every state records as "feistel-1": a change of the network, its rounds
    or its key changes every drop-in stream (and every saved state would resume into other
    data)."""
    small = EpochOrder(20, seed=3, epoch=2, shuffle=True)
    assert small(np.arange(20)).tolist() == [12, 19, 15, 4, 10, 17, 18, 13, 5, 8, 11, 9, 1, 14, 7, 0, 2, 6, 3, 16]
    huge = EpochOrder(10**10, seed=7, epoch=0, shuffle=True)
    positions = np.array([0, 1, 2, 5 * 10**9, 10**10 - 1])
    assert huge(positions).tolist() == [2721464530, 362795570, 2524221030, 2695073817, 5183800066]


# -- quality -------------------------------------------------------------------------


def _stats(perm: np.ndarray) -> dict[str, float]:
    n = len(perm)
    p = np.arange(n)
    out: dict[str, float] = {}
    # displacement |perm[p] - p| / n: for a uniform permutation its density is 2(1 - x);
    # the Kolmogorov-Smirnov distance to that law, scaled by sqrt(n)
    d = np.sort(np.abs(perm - p) / n)
    law = 2 * d - d * d
    ecdf = np.arange(1, n + 1) / n
    out["displacement_ks"] = float(np.max(np.abs(ecdf - law)) * np.sqrt(n))
    out["displacement_mean"] = float(d.mean())  # 1/3 for a uniform permutation
    out["rank_correlation"] = abs(float(np.corrcoef(perm, p)[0, 1]))
    for lag in (1, 2, 3, 64, 256, 512, 1024, 4096, n // 2):
        out[f"lag{lag}_correlation"] = abs(float(np.corrcoef(perm[:-lag], perm[lag:])[0, 1]))
        # pair statistic: the indices at positions (p, p + lag), binned 16 x 16, against
        # the uniform joint law (chi-square with 225 degrees of freedom)
        a = perm[:-lag] * 16 // n
        b = perm[lag:] * 16 // n
        counts = np.bincount(a * 16 + b, minlength=256)
        expected = len(a) / 256
        out[f"lag{lag}_pairs_chi2"] = float(((counts - expected) ** 2 / expected).sum())
    out["fixed_points"] = float(np.count_nonzero(perm == p))  # Poisson(1)
    out["neighbours_kept"] = float(np.count_nonzero(np.abs(np.diff(perm)) == 1))  # about 2
    return out


def _limits() -> dict[str, float]:
    # 1/sqrt(n) is the standard deviation of a correlation of independent sequences;
    # chi-square with 225 degrees of freedom: mean 225, standard deviation 21.2
    limits = {"displacement_ks": 2.0, "rank_correlation": 5 / np.sqrt(N), "fixed_points": 8, "neighbours_kept": 10}
    for lag in (1, 2, 3, 64, 256, 512, 1024, 4096, N // 2):
        limits[f"lag{lag}_correlation"] = 5 / np.sqrt(N)
        limits[f"lag{lag}_pairs_chi2"] = 225 + 6 * 21.2
    return limits


def test_shuffle_quality_matches_numpy_permutation():
    limits = _limits()
    feistel = [_stats(FeistelPermutation(N, derive_seed(s, "order", 0))(np.arange(N))) for s in range(4)]
    numpy = [_stats(np.random.default_rng(s).permutation(N)) for s in range(4)]
    for name, limit in limits.items():
        ours = [s[name] for s in feistel]
        theirs = [s[name] for s in numpy]
        # both within the limits a uniform permutation meets with a wide margin ...
        assert max(theirs) < limit, f"{name}: numpy's own permutation at {theirs}: the limit {limit} is wrong"
        assert max(ours) < limit, f"{name}: Feistel {ours}, numpy {theirs}, limit {limit}"
    # ... and the mean displacement as close to 1/3 as numpy's
    ours = [abs(s["displacement_mean"] - 1 / 3) for s in feistel]
    theirs = [abs(s["displacement_mean"] - 1 / 3) for s in numpy]
    assert max(ours) < 0.01 and max(theirs) < 0.01, (ours, theirs)


def test_the_quality_statistics_catch_a_poor_shuffle():
    limits = _limits()
    for rounds in (1, 2):
        stats = _stats(FeistelPermutation(N, 5, rounds=rounds)(np.arange(N)))
        failed = [name for name, limit in limits.items() if stats[name] >= limit]
        assert failed, f"{rounds} round(s) passed every statistic: {stats}"
