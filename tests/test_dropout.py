"""The dropout hash: the rate it keeps, and no correlation between neighbours or between seeds.

Every backend draws its keep decisions from ``_dropout.keep_mask`` (the Triton kernels from a copy
that the Triton tests hold to the same outputs), so these properties hold for all of them.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from ejkfn.attention import AttentionSpec
from ejkfn.attention._dropout import MIN_RATE, keep_mask, keep_scale, keep_tile, threshold

HEADS, SEQ = 2, 256


def _keep(seed: int, p: float) -> np.ndarray:
    """The keep decisions of batch 0 as ``[HEADS, SEQ, SEQ]`` floats (1.0 kept)."""
    h = jnp.arange(HEADS)[:, None, None]
    i = jnp.arange(SEQ)[None, :, None]
    j = jnp.arange(SEQ)[None, None, :]
    kept = keep_mask(jnp.uint32(seed), jnp.uint32(0), h, i, j, HEADS, SEQ, p)
    return np.asarray(kept, np.float64)


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keeps_one_minus_p(p: float) -> None:
    # 131072 decisions: the rate's standard deviation is at most 0.0014.
    assert abs(_keep(7, p).mean() - (1.0 - p)) < 0.008


@pytest.mark.parametrize("p", [0.1, 0.3, 2**-16])
def test_kept_weights_are_scaled_by_the_rate_the_hash_keeps(p: float) -> None:
    kept = 1.0 - (threshold(p) >> 16) / 2**16  # at p = 0.1: 1 - 6553 / 65536, not exactly 0.9
    assert keep_scale(p) * kept == pytest.approx(1.0, rel=1e-15)
    assert keep_scale(0.5) == 2.0


@pytest.mark.parametrize("p", [1e-6, 2**-17, MIN_RATE * 0.999])
def test_a_rate_too_fine_to_drop_anything_is_refused(p: float) -> None:
    with pytest.raises(ValueError, match=rf"dropout_prob={p!r} is below 2\^-16"):
        AttentionSpec(scale=1.0, dropout_prob=p)
    AttentionSpec(scale=1.0, dropout_prob=MIN_RATE)  # the finest rate it resolves


def test_threshold_rounds_p_down_to_sixteen_bits_and_saturates() -> None:
    assert threshold(0.0) == threshold(2**-17) == 0  # keeps everything
    assert threshold(0.5) == 2**31
    assert threshold(0.1) == 6553 << 16
    assert threshold(1.0) == 0xFFFF << 16


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_neighbours_are_uncorrelated(seed: int) -> None:
    # A correlation estimated from about 65k pairs has a standard deviation near 0.004.
    kept = _keep(seed, 0.5)
    assert abs(_correlation(kept[:, :, 1:], kept[:, :, :-1])) < 0.03  # columns
    assert abs(_correlation(kept[:, :, 0::2], kept[:, :, 1::2])) < 0.03  # the halves of one hash
    assert abs(_correlation(kept[:, 1:, :], kept[:, :-1, :])) < 0.03  # rows
    assert abs(_correlation(kept[1], kept[0])) < 0.03  # heads


@pytest.mark.parametrize(("first", "second"), [(0, 1), (1, 2), (41, 42), (0, 2**31)])
def test_seeds_are_uncorrelated(first: int, second: int) -> None:
    # Training steps often pass consecutive seeds: the same position must not repeat its decision.
    assert abs(_correlation(_keep(first, 0.5), _keep(second, 0.5))) < 0.03


@pytest.mark.parametrize("col0", [0, 64, 1030])
def test_a_tile_hashed_in_pairs_keeps_what_each_score_keeps(col0: int) -> None:
    rows = jnp.arange(40, 72)
    args = (jnp.uint32(99), jnp.uint32(1), jnp.uint32(1))
    tile = keep_tile(*args, rows, jnp.int32(col0), 64, HEADS, SEQ, 0.3)
    cols = col0 + jnp.arange(64)
    each = keep_mask(*args, rows[:, None], cols[None, :], HEADS, SEQ, 0.3)
    np.testing.assert_array_equal(np.asarray(tile), np.asarray(each))
