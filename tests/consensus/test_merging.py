"""Merge methods (consensus.merging) against float64 numpy references written from the papers.

Each reference below works on one leaf at a time, flattened, in float64, and is
written from the paper's formula (and mergekit's where it implements the
method), independently of the JAX code: no shared helpers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import consensus
from consensus.base import ByzantineToleranceError
from consensus.merging._select import kth_largest_magnitude
from consensus.registry import RULES

N = 8


def make_base(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            "kernel": rng.standard_normal((7, 5)).astype(np.float32),
            "bias": rng.standard_normal(5).astype(np.float32),
        },
        "scale": np.float32(rng.standard_normal()),
    }


def make_nodes(base, n=N, seed=1, spread=0.3):
    rng = np.random.default_rng(seed)
    common = jax.tree.map(lambda p: 0.2 * rng.standard_normal(np.shape(p)), base)
    return consensus.stack(
        [
            jax.tree.map(
                lambda p, c: (p + c + spread * rng.standard_normal(np.shape(p))).astype(np.float32),
                base,
                common,
            )
            for _ in range(n)
        ]
    )


def leaves64(t):
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(t)]


def per_leaf(reference, stacked, base, *args):
    """Apply a (X (n, s), b (s,)) -> (s,) float64 reference to every leaf."""
    outs = []
    for x, b in zip(leaves64(stacked), leaves64(base), strict=True):
        n = x.shape[0]
        outs.append(reference(x.reshape(n, -1), b.reshape(-1), *args).reshape(b.shape))
    return outs


def assert_tree_close(tree, expected, rtol=2e-5, atol=2e-5):
    for got, want in zip(leaves64(tree), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- float64 references


def ref_task_arithmetic(X, b, scale, w):
    return b + scale * sum(w[i] * (X[i] - b) for i in range(len(X)))


def ref_ties(X, b, density, election, scale, w):
    D = X - b
    n, s = D.shape
    k = max(1, int(density * s))
    trimmed = np.zeros_like(D)
    for i in range(n):
        mags = np.abs(D[i])
        t = np.sort(mags)[::-1][k - 1]  # the k-th largest magnitude
        trimmed[i] = np.where(mags >= t, D[i], 0.0)  # ties at t are all kept
    tau = trimmed * w[:, None]
    votes = tau.sum(0) if election == "sum" else np.sign(tau).sum(0)
    elected = np.where(votes >= 0, 1.0, -1.0)
    kept = np.sign(tau) == elected
    num = np.where(kept, tau, 0.0).sum(0)
    den = (kept * w[:, None]).sum(0)
    den[den == 0] = 1.0
    return b + scale * num / den


def ref_model_stock(X, b):
    D = X - b
    n = len(D)
    norms = np.linalg.norm(D, axis=1)
    if np.any(norms == 0):
        return b.copy()
    cos = [D[i] @ D[j] / (norms[i] * norms[j]) for i in range(n) for j in range(i + 1, n)]
    c = float(np.mean(cos))
    t = n * c / (1 + (n - 1) * c)
    return t * X.mean(0) + (1 - t) * b


def ref_slerp(X, b, t):
    # mergekit's slerp (merge_methods/slerp.py), on the raw parameters.
    v0, v1 = X[0], X[1]
    n0, n1 = np.linalg.norm(v0), np.linalg.norm(v1)
    u0 = v0 / n0 if n0 > 1e-8 else v0
    u1 = v1 / n1 if n1 > 1e-8 else v1
    dot = float(np.sum(u0 * u1))
    if abs(dot) > 0.9995:
        return (1 - t) * v0 + t * v1
    theta = np.arccos(dot)
    return np.sin((1 - t) * theta) / np.sin(theta) * v0 + np.sin(t * theta) / np.sin(theta) * v1


def ref_karcher(X, b, w, iters=500):
    # Riemannian gradient descent on the sphere in the full space (float64).
    norms = np.linalg.norm(X, axis=1)
    U = X / norms[:, None]
    w = w / w.sum()
    mu = (w[:, None] * U).sum(0)
    mu /= np.linalg.norm(mu)
    for _ in range(iters):
        c = np.clip(U @ mu, -1, 1)
        th = np.arccos(c)
        f = np.where(th > 1e-12, th / np.sin(np.maximum(th, 1e-300)), 1.0)
        T = (w * f)[:, None] * (U - c[:, None] * mu[None])
        T = T.sum(0)
        s = np.linalg.norm(T)
        if s < 1e-14:
            break
        mu = np.cos(s) * mu + np.sin(s) * T / s
        mu /= np.linalg.norm(mu)
    return mu * float((w * norms).sum())


def ref_fisher(X, b, F, w, eps):
    Fw = w[:, None] * (np.maximum(F, 0) + eps)
    return (Fw * X).sum(0) / Fw.sum(0)


# ----------------------------------------------------------------------------- agreement with the references


@pytest.mark.parametrize("n", [1, 3, N])
def test_task_arithmetic_matches_reference(n):
    base = make_base()
    stacked = make_nodes(base, n)
    w = np.linspace(0.5, 1.5, n)
    agg = consensus.task_arithmetic(0.4, weights=w)
    merged, state = agg.update(stacked, agg.init(base), base)
    assert_tree_close(merged, per_leaf(ref_task_arithmetic, stacked, base, 0.4, w))
    # A sum, not a mean: scale 1/n with unit weights is the mean of the nodes.
    mean, _ = consensus.task_arithmetic(1.0 / n).update(stacked, None, base)
    assert_tree_close(mean, [x.mean(0) for x in leaves64(stacked)])


def _ties_case_is_slow(n: int, density: float, election: str) -> bool:
    """The fast suite keeps n = N at the other settings and n = 1 (one node) at density 1."""
    return (density, election) == (0.1, "sum") or (n == 1 and density != 1.0)


@pytest.mark.parametrize(
    "n,density,election",
    [
        pytest.param(
            n,
            density,
            election,
            marks=[pytest.mark.slow] if _ties_case_is_slow(n, density, election) else [],
        )
        for election in ("sum", "count")
        for density in (0.1, 0.35, 1.0)
        for n in (1, N)
    ],
)
def test_ties_matches_reference(election, density, n):
    base = make_base()
    stacked = make_nodes(base, n, seed=n)
    w = np.linspace(0.5, 2.0, n)
    agg = consensus.ties(density, election, scale=0.8, weights=w)
    merged, _ = agg.update(stacked, agg.init(base), base)
    assert_tree_close(merged, per_leaf(ref_ties, stacked, base, density, election, 0.8, w))


def test_ties_keeps_every_entry_tied_at_the_threshold_and_never_zeros():
    # Repeated magnitudes: k = int(0.3 * 10) = 3, but 5 entries of node 0 tie at the 3rd value.
    base = {"w": np.zeros(10, np.float32)}
    d0 = np.array([3, -2, 2, 2, -2, 2, 1, 0, 0, 0], np.float32)
    d1 = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 0], np.float32)  # a zero task vector
    d2 = np.array([-1, 1, -1, 1, -1, 1, -1, 1, -1, 1], np.float32)  # all tied
    stacked = consensus.stack([{"w": d} for d in (d0, d1, d2)])
    merged, _ = consensus.ties(0.3).update(stacked, None, base)
    want = ref_ties(np.stack([d0, d1, d2]).astype(np.float64), np.zeros(10), 0.3, "sum", 1.0, np.ones(3))
    np.testing.assert_allclose(np.asarray(merged["w"]), want, atol=1e-6)
    # Node 0 keeps all five entries of magnitude >= 2; node 2 keeps every entry (all tie), node 1 nothing,
    # so at coordinate 6 (node 0: 1, trimmed; node 2: -1 kept) the result is node 2's -1.
    assert merged["w"][6] == -1.0
    # Coordinate 1: votes -2 + 1 = -1 elect "-": only node 0's -2 is kept, divided by one weight.
    assert merged["w"][1] == -2.0
    # Coordinates 7-9: node 0 is 0 (not kept, not counted), node 2's value stands alone.
    np.testing.assert_array_equal(np.asarray(merged["w"][7:]), d2[7:])


def test_ties_count_election_resists_one_large_delta():
    base = {"w": np.zeros(50, np.float32)}
    honest = [np.full(50, 1.0 + 0.1 * i, np.float32) for i in range(4)]
    attacker = np.full(50, -100.0, np.float32)
    stacked = consensus.stack([{"w": x} for x in [*honest, attacker]])
    by_sum, _ = consensus.ties(1.0, "sum").update(stacked, None, base)
    by_count, _ = consensus.ties(1.0, "count").update(stacked, None, base)
    np.testing.assert_allclose(np.asarray(by_sum["w"]), -100.0)  # one delta set every sign
    np.testing.assert_allclose(np.asarray(by_count["w"]), 1.15, rtol=1e-6)  # the honest majority wins


# 50_000 columns: a full chunk of the counting pass plus a partial one, several chunks of the
# extraction pass, the continuous rows found by the extraction pass, the tied rows (lanes over 3
# entries) by the fallback.
@pytest.mark.parametrize(
    "s",
    [
        1,
        3,
        pytest.param(100, marks=pytest.mark.slow),
        pytest.param(4099, marks=pytest.mark.slow),
        pytest.param(50_000, marks=pytest.mark.slow),
    ],
)
def test_kth_largest_magnitude_is_exact(s):
    rng = np.random.default_rng(s)
    x = rng.standard_normal((5, s)).astype(np.float32)
    x[1] = np.round(x[1])  # many ties
    x[2, : s // 2] = 0.0  # many zeros
    x[3] = 0.0  # a zero row
    x[4] *= 1e-30  # subnormal-ish magnitudes
    for k in sorted({1, max(1, s // 7), max(1, s // 2), s}):
        got = np.asarray(kth_largest_magnitude(jnp.asarray(x), k))
        want = -np.sort(-np.abs(x), axis=1)[:, k - 1]
        np.testing.assert_array_equal(got, want)


def test_pass_counts_go_past_255_per_lane_without_wrapping():
    """The counts accumulate in uint8 lanes and are widened every NARROW_CHUNKS chunks."""
    from consensus.merging import _select

    rng = np.random.default_rng(3)
    n, lanes = 3, 8
    s = lanes * (2 * _select.NARROW_CHUNKS + 90) + 5  # three groups of chunks and a partial chunk
    x = rng.standard_normal((n, s)).astype(np.float32)
    base = np.zeros(s, np.float32)
    valid = np.array([True, False, True])  # an invalid row reads as zeros
    bits = np.where(valid[:, None], np.abs(x), 0.0).astype(np.float32).view(np.int32)
    mid = np.median(bits, axis=1).astype(np.int32)
    probes = np.stack([np.zeros(n, np.int32), mid, np.full(n, _select.TOP, np.int32)], axis=1)
    args = (jnp.asarray(x), jnp.asarray(base), jnp.asarray(valid))
    got = np.asarray(
        jax.jit(_select._count_pass, static_argnames="lanes")(*args, jnp.asarray(probes), lanes=lanes)
    )
    np.testing.assert_array_equal(got, (bits[:, :, None] >= probes[:, None, :]).sum(axis=1))
    assert got[0, 0] == s  # every entry counted: s / lanes > 255 per lane
    c_lo, c_hi, _, _ = jax.jit(_select._extract_pass, static_argnames="lanes")(
        *args, jnp.asarray(probes[:, 0]), jnp.asarray(mid), lanes=lanes
    )
    np.testing.assert_array_equal(np.asarray(c_lo), np.full(n, s))
    np.testing.assert_array_equal(np.asarray(c_hi), (bits >= mid[:, None]).sum(axis=1))


def test_extraction_reads_back_up_to_three_entries_per_lane_from_packed_counters():
    """Counts and the offset sum share a word; offsets up to the widest window, across groups."""
    from consensus.merging import _select

    n, lanes = 2, 8
    s = lanes * (2 * _select.NARROW_CHUNKS + 90) + 5  # three groups of chunks and a partial chunk
    wlo = np.float32(1.0).view(np.int32)
    width = _select.WINDOW_MAX_WIDTH
    bits = np.full((n, s), wlo - 5000, np.int32)  # below the window
    bits[:, 7::97] = wlo + width + 3  # above it
    top = width - 1  # the largest offset a window holds
    planted = {  # (row, lane): offsets from wlo, in chunks of different groups
        (0, 0): [top, top, top - 1],
        (0, 1): [0],
        (0, 2): [top, 5],
        (0, 3): [17, 0, 0],
        (1, 4): [1, 2, 3, 4],  # over 3: row 1 does not fit
    }
    chunks = [3, 300, 560, 600]
    for (row, lane), offs in planted.items():
        for chunk, off in zip(chunks, offs, strict=False):  # chunks outnumber offsets
            bits[row, chunk * lanes + lane] = wlo + off
    x = bits.view(np.float32)
    args = (jnp.asarray(x), jnp.zeros(s, jnp.float32), jnp.ones(n, bool))
    lo, hi = jnp.full(n, wlo, jnp.int32), jnp.full(n, wlo + width, jnp.int32)
    c_lo, c_hi, entries, fits = jax.jit(_select._extract_pass, static_argnames="lanes")(
        *args, lo, hi, lanes=lanes
    )
    np.testing.assert_array_equal(np.asarray(c_lo), (bits >= wlo).sum(axis=1))
    np.testing.assert_array_equal(np.asarray(c_hi), (bits >= wlo + width).sum(axis=1))
    np.testing.assert_array_equal(np.asarray(fits), [True, False])
    got = np.sort(np.asarray(entries)[0][np.asarray(entries)[0] >= 0])
    want = np.sort([wlo + o for (row, _), offs in planted.items() if row == 0 for o in offs])
    np.testing.assert_array_equal(got, want)


def test_window_is_capped_to_what_the_extraction_packs():
    from consensus.merging import _select

    lo = jnp.zeros(3, jnp.int32)
    hi = jnp.asarray([10**9, 10**6, 100], jnp.int32)
    c_lo, c_hi, k = jnp.full(3, 10**6, jnp.int32), jnp.zeros(3, jnp.int32), jnp.int32(400_000)
    wlo, whi = _select._window(lo, hi, c_lo, c_hi, k, _select.WINDOW_SPREAD)
    width = np.asarray(whi - wlo)
    assert np.all(width >= 1) and np.all(width <= _select.WINDOW_MAX_WIDTH)
    assert width[0] == width.max() > _select.WINDOW_MAX_WIDTH - 4  # a wide bracket is cut, not shrunk
    # The cut window still holds the interpolated answer (60% of the way down the bracket).
    assert int(wlo[0]) < 0.6 * 10**9 < int(whi[0])


@pytest.mark.slow
def test_kth_largest_takes_two_passes_on_continuous_rows_and_stays_exact_on_ties():
    from consensus.merging._select import kth_largest_delta_bits

    rng = np.random.default_rng(0)
    s, k = 100_000, 20_000
    base = rng.standard_normal(s).astype(np.float32)
    x = base + 0.01 * rng.standard_normal((4, s)).astype(np.float32)
    x[3] = base + np.round(rng.standard_normal(s)).astype(np.float32)  # ties at the k-th value
    valid = jnp.ones((4,), bool)
    want = -np.sort(-np.abs(x.astype(np.float64) - base).astype(np.float32), axis=1)[:, k - 1]
    bits, passes = kth_largest_delta_bits(jnp.asarray(x[:3]), jnp.asarray(base), valid[:3], k)
    np.testing.assert_array_equal(np.asarray(bits).view(np.float32), want[:3])
    assert int(passes) == 2  # a counting pass and an extraction pass, no fallback
    bits, _ = kth_largest_delta_bits(jnp.asarray(x), jnp.asarray(base), valid, k)
    np.testing.assert_array_equal(np.asarray(bits).view(np.float32), want)
    t, _ = kth_largest_delta_bits(jnp.asarray(x), jnp.asarray(base), valid, k, mask_only=True)
    mags = np.abs(x - base)
    for i in range(4):  # {|d| >= T} is exactly {|d| >= the k-th largest}
        np.testing.assert_array_equal(
            mags[i] >= np.asarray(t)[i : i + 1].view(np.float32)[0], mags[i] >= want[i]
        )


@pytest.mark.slow
def test_kth_largest_reads_a_crowded_lane_back_once_more_and_stays_exact():
    # Four entries of one extraction lane (columns 8192 apart, off the sample's grid, so the
    # first pass and the window do not move) planted inside the window: the lane holds over 3
    # window entries, the window is read back into 8191 lanes (one more pass), exactly.
    from consensus.merging import _select as sel

    rng = np.random.default_rng(0)
    s, k, n = 80_000, 16_000, 2
    x = rng.standard_normal((n, s)).astype(np.float32)
    zero, valid, kk = jnp.zeros(s, jnp.float32), jnp.ones(n, bool), jnp.int32(k)
    cols = 101 + sel.EXTRACT_LANES * np.arange(4)
    assert s // sel.SAMPLE == 4 and np.all(cols % 4 == 1)
    for _ in range(5):
        xj = jnp.asarray(x)
        probes = jnp.clip(
            sel._sample_probes(xj, zero, valid, k, sel.FIRST_PROBES, sel.FIRST_SPREAD), 0, sel.TOP
        )
        lo, hi, c_lo, c_hi = sel._bracket(
            probes,
            sel._count_pass(xj, zero, valid, probes),
            jnp.zeros(n, jnp.int32),
            jnp.full(n, sel.TOP, jnp.int32),
            jnp.full(n, s, jnp.int32),
            jnp.zeros(n, jnp.int32),
            kk,
        )
        wlo, whi = (int(v[0]) for v in sel._window(lo, hi, c_lo, c_hi, kk, sel.WINDOW_SPREAD))
        planted = np.abs(x[0, cols]).view(np.int32)
        if np.all((planted >= wlo) & (planted < whi)):
            break
        x[0, cols] = np.linspace(wlo, whi - 1, 6)[1:5].astype(np.int32).view(np.float32)
    want = -np.sort(-np.abs(x), axis=1)[:, k - 1]
    bits, passes = sel.kth_largest_delta_bits(jnp.asarray(x), zero, valid, k)
    np.testing.assert_array_equal(np.asarray(bits).view(np.float32), want)
    assert int(passes) == 3  # count, extract, extract again: no narrowing passes


@pytest.mark.parametrize("n", [2, 5])
def test_model_stock_matches_reference(n):
    base = make_base()
    stacked = make_nodes(base, n, seed=7)
    agg = consensus.model_stock()
    merged, state = agg.update(stacked, agg.init(base), base)
    assert_tree_close(merged, per_leaf(ref_model_stock, stacked, base), rtol=1e-4, atol=1e-5)


def test_model_stock_zero_delta_keeps_the_base():
    base = make_base()
    stacked = make_nodes(base, 3)
    stacked["dense"]["bias"] = stacked["dense"]["bias"].at[1].set(base["dense"]["bias"])  # node 1: zero delta
    merged, state = consensus.model_stock().update(stacked, None, base)
    np.testing.assert_array_equal(np.asarray(merged["dense"]["bias"]), base["dense"]["bias"])
    assert float(state.t["dense"]["bias"]) == 0.0
    assert float(state.t["dense"]["kernel"]) != 0.0


def test_model_stock_streams_long_leaves_exactly():
    # 50_000 columns: several chunks of the one-read Gram-and-sum pass plus a partial one; a NaN
    # node (eager and under jit: the optimistic pass, then the finite one) and a masked node.
    rng = np.random.default_rng(11)
    base = {"w": rng.standard_normal(50_000).astype(np.float32)}
    x = base["w"] + 0.1 * rng.standard_normal((5, 50_000)).astype(np.float32) + 0.05
    stacked = {"w": x.copy()}
    stacked["w"][4, 123] = np.nan
    agg = consensus.model_stock()
    jitted = jax.jit(lambda s, p, m: agg.update(s, agg.init(p), p, mask=m)[0])
    for mask in (None, jnp.arange(5) != 2):
        keep = [0, 1, 3] if mask is not None else [0, 1, 2, 3]
        want = ref_model_stock(x[keep].astype(np.float64), base["w"].astype(np.float64))
        for got in (agg.update(stacked, agg.init(base), base, mask=mask)[0], jitted(stacked, base, mask)):
            np.testing.assert_allclose(np.asarray(got["w"], np.float64), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0])
def test_slerp_matches_mergekit_formula(t):
    base = make_base()
    stacked = make_nodes(base, 2, spread=1.0)
    merged, state = consensus.slerp(t).update(stacked, None, base)
    assert_tree_close(merged, per_leaf(ref_slerp, stacked, base, t), rtol=1e-4, atol=1e-5)


def test_slerp_is_linear_when_collinear_and_depends_on_order():
    base = {"w": np.zeros(6, np.float32)}
    v = np.arange(1, 7, dtype=np.float32)
    merged, _ = consensus.slerp(0.25).update(consensus.stack([{"w": v}, {"w": 3 * v}]), None, base)
    np.testing.assert_allclose(np.asarray(merged["w"]), 0.75 * v + 0.25 * 3 * v, rtol=1e-6)
    stacked = make_nodes(make_base(), 2, spread=1.0)
    a, _ = consensus.slerp(0.3).update(stacked, None)
    swapped = jax.tree.map(lambda x: x[::-1], stacked)
    b, _ = consensus.slerp(0.7).update(swapped, None)
    c, _ = consensus.slerp(0.3).update(swapped, None)
    assert_tree_close(b, leaves64(a), rtol=1e-5)  # swapping the nodes is slerp(1 - t)
    assert not np.allclose(leaves64(c)[0], leaves64(a)[0])  # not permutation invariant


def test_slerp_on_deltas_adds_the_base_back():
    base = make_base()
    stacked = make_nodes(base, 2, spread=1.0)
    merged, _ = consensus.slerp(0.4, on="deltas").update(stacked, None, base)
    want = [
        b + ref_slerp(x.reshape(2, -1) - b.reshape(-1), None, 0.4).reshape(b.shape)
        for x, b in zip(leaves64(stacked), leaves64(base), strict=True)
    ]
    assert_tree_close(merged, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [2, 5])
def test_karcher_mean_matches_reference(n):
    base = make_base()
    stacked = make_nodes(base, n, spread=1.0, seed=3)
    w = np.linspace(1.0, 2.0, n)
    merged, _ = consensus.karcher_mean(max_iter=200, tol=1e-7, weights=w).update(stacked, None, base)
    assert_tree_close(merged, per_leaf(ref_karcher, stacked, base, w), rtol=2e-4, atol=2e-4)


def test_karcher_of_two_equal_norm_nodes_is_the_slerp_midpoint():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(20), rng.standard_normal(20)
    b *= np.linalg.norm(a) / np.linalg.norm(b)
    stacked = consensus.stack([{"w": a.astype(np.float32)}, {"w": b.astype(np.float32)}])
    k, _ = consensus.karcher_mean(tol=1e-7).update(stacked, None)
    s, _ = consensus.slerp(0.5).update(stacked, None)
    np.testing.assert_allclose(np.asarray(k["w"]), np.asarray(s["w"]), rtol=1e-4, atol=1e-5)


def test_fisher_merge_matches_reference():
    base = make_base()
    stacked = make_nodes(base, 4)
    rng = np.random.default_rng(3)
    fisher = jax.tree.map(lambda x: jnp.asarray(rng.exponential(size=x.shape).astype(np.float32)), stacked)
    fisher["scale"] = fisher["scale"].at[:].set(0.0)  # no node's data touches it: plain mean
    w = np.array([1.0, 2.0, 0.5, 1.0])
    merged, _ = consensus.fisher_merge(weights=w).update(stacked, None, base, fisher=fisher)
    want = [
        ref_fisher(x.reshape(4, -1), None, f.reshape(4, -1), w, 1e-8).reshape(b.shape)
        for x, f, b in zip(leaves64(stacked), leaves64(fisher), leaves64(base), strict=True)
    ]
    assert_tree_close(merged, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(merged["scale"]), (w * leaves64(stacked)[2]).sum() / w.sum(), rtol=1e-5)


def test_regmean_solves_the_least_squares_merge():
    # Reference: minimize sum_i ||X_i W - X_i W_i||^2 by stacking the examples (float64 lstsq).
    base = make_base()
    stacked = make_nodes(base, 3)
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal((20 + 5 * i, 7)) for i in range(3)]
    grams = {"['dense']['kernel']": jnp.asarray(np.stack([x.T @ x for x in inputs]), jnp.float32)}
    merged, _ = consensus.regmean(ridge=0.0).update(stacked, None, base, grams=grams)
    kernels = leaves64(stacked)[1]  # dense/kernel (leaf order: bias, kernel, scale)
    A = np.concatenate(inputs)
    B = np.concatenate([x @ kernels[i] for i, x in enumerate(inputs)])
    want = np.linalg.lstsq(A, B, rcond=None)[0]
    np.testing.assert_allclose(np.asarray(merged["dense"]["kernel"]), want, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(np.asarray(merged["dense"]["bias"]), leaves64(stacked)[0].mean(0), rtol=1e-5)
    # alpha = 0 keeps only the diagonals: a per-input-row weighted mean.
    merged0, _ = consensus.regmean(off_diagonal_scale=0.0, ridge=0.0).update(stacked, None, base, grams=grams)
    diag = np.stack([np.diag(x.T @ x) for x in inputs])  # (3, 7)
    want0 = (diag[:, :, None] * kernels).sum(0) / diag.sum(0)[:, None]
    np.testing.assert_allclose(np.asarray(merged0["dense"]["kernel"]), want0, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- DARE


def test_dare_drops_and_rescales_reproducibly():
    base = {"w": np.zeros((200, 50), np.float32)}
    stacked = consensus.stack([{"w": np.full((200, 50), 1.0 + i, np.float32)} for i in range(3)])
    pre = consensus.dare(0.3)
    y, state = pre.update(stacked, pre.init(base), base, key=jax.random.key(0))
    y2, _ = pre.update(stacked, pre.init(base), base, key=jax.random.key(0))
    y3, _ = pre.update(stacked, pre.init(base), base, key=jax.random.key(1))
    v = np.asarray(y["w"])
    np.testing.assert_array_equal(v, np.asarray(y2["w"]))
    assert not np.array_equal(v, np.asarray(y3["w"]))
    for i in range(3):
        kept = v[i] != 0
        assert abs(kept.mean() - 0.3) < 0.02  # 10 000 Bernoulli(0.3) draws: 4.6 sigma
        np.testing.assert_allclose(v[i][kept], (1.0 + i) / 0.3, rtol=1e-6)
    assert not np.array_equal(v[0] != 0, v[1] != 0)  # independent masks per node
    # L1 rescale (mergekit's rescale_norm: l1) keeps each node's L1 norm.
    l1, _ = consensus.dare(0.3, rescale="l1").update(stacked, None, base, key=jax.random.key(0))
    np.testing.assert_allclose(np.abs(np.asarray(l1["w"])).sum(axis=(1, 2)), [1e4, 2e4, 3e4], rtol=1e-5)
    # The factory's key, folded with the round counter, when the call gives none.
    own = consensus.dare(0.3, key=jax.random.key(4))
    s0 = own.init(base)
    a, s1 = own.update(stacked, s0, base)
    b, _ = own.update(stacked, s1, base)
    assert not np.array_equal(np.asarray(a["w"]), np.asarray(b["w"]))


@pytest.mark.slow
def test_dare_ties_is_ties_of_the_dropped_nodes():
    base = make_base()
    stacked = make_nodes(base, 4)
    key = jax.random.key(3)
    dropped, _ = consensus.dare(0.5).update(stacked, None, base, key=key)
    agg = consensus.process(consensus.ties(0.5), pre=[consensus.dare(0.5)])
    merged, _ = agg.update(stacked, agg.init(base), base, key=key)
    assert_tree_close(merged, per_leaf(ref_ties, dropped, base, 0.5, "sum", 1.0, np.ones(4)))


@pytest.mark.slow
def test_dare_keeps_a_non_finite_node_non_finite_and_the_merge_excludes_it():
    # DARE makes no finiteness pass: a dropped entry is d * 0, NaN where d is not finite, so a
    # poisoned node stays poisoned and the rule after DARE excludes it; masked nodes come out NaN.
    base = make_base()
    stacked = make_nodes(base, 5)
    key = jax.random.key(5)
    poisoned = jax.tree.map(lambda x: x.at[(2,) + (0,) * (x.ndim - 1)].set(jnp.inf), stacked)
    pre = consensus.dare(0.5)
    clean, _ = pre.update(stacked, None, base, key=key)
    dropped, _ = pre.update(poisoned, None, base, key=key)
    for c, p in zip(leaves64(clean), leaves64(dropped), strict=True):
        assert not np.isfinite(p[2]).all()  # kept or dropped, the Inf entry stays non-finite
        np.testing.assert_array_equal(np.delete(p, 2, axis=0), np.delete(c, 2, axis=0))
    masked, _ = pre.update(stacked, None, base, key=key, mask=jnp.arange(5) != 1)
    for c, m in zip(leaves64(clean), leaves64(masked), strict=True):
        assert np.isnan(m[1]).all()
        np.testing.assert_array_equal(np.delete(m, 1, axis=0), np.delete(c, 1, axis=0))
    honest = jax.tree.map(lambda x: np.delete(np.asarray(x), 2, axis=0), clean)
    want = per_leaf(ref_ties, honest, base, 0.5, "sum", 1.0, np.ones(4))
    agg = consensus.process(consensus.ties(0.5), pre=[consensus.dare(0.5)])
    merged, state = agg.update(poisoned, agg.init(base), base, key=key)
    assert_tree_close(merged, want)
    assert not bool(consensus.get_info(state).valid[2])
    jitted = jax.jit(lambda s, p, k: agg.update(s, agg.init(p), p, key=k)[0])
    assert_tree_close(jitted(poisoned, base, key), want)


@pytest.mark.slow
def test_dare_linear_sums_the_dropped_task_vectors_without_writing_them():
    """process(task_arithmetic, pre=[dare]) reads DARE's rows lazily (the drop recomputed where
    each entry is read): equal to task arithmetic of DARE's written rows and to a float64
    reference of the paper's formula, with the mask of kernels.dropout's keyed bits; a poisoned
    and a masked node are excluded; the other rules still get the rows written out."""
    from kernels.dropout import keep_mask

    base = make_base()
    stacked = make_nodes(base, 5)
    key = jax.random.key(7)
    density, scale = 0.4, 0.7
    poisoned = jax.tree.map(lambda x: x.at[(3,) + (0,) * (x.ndim - 1)].set(jnp.nan), stacked)
    allowed = np.arange(5) != 1
    agg = consensus.process(consensus.task_arithmetic(scale), pre=[consensus.dare(density)])
    merged, state = agg.update(poisoned, agg.init(base), base, key=key, mask=jnp.asarray(allowed))
    assert list(np.asarray(consensus.get_info(state).valid)) == [True, False, True, False, True]
    # float64 reference: base + scale * sum over the valid nodes of keep * (x - base) / density
    valid = np.array([True, False, True, False, True])
    want = []
    for idx, (x, b) in enumerate(zip(leaves64(stacked), leaves64(base), strict=True)):
        keep = np.asarray(keep_mask(jax.random.fold_in(key, idx), x.shape, jnp.float32(density)))
        want.append(b + scale * np.sum((keep * (x - b[None]) / density)[valid], axis=0))
    for got, w in zip(leaves64(merged), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=2e-5)
    # The written rows, then task arithmetic: the same merge (sums in another order).
    rows, _ = consensus.dare(density).update(poisoned, None, base, key=key, mask=jnp.asarray(allowed))
    written, _ = consensus.task_arithmetic(scale).update(rows, None, base)
    assert_tree_close(merged, leaves64(written))
    jitted = jax.jit(lambda s, p, k, m: agg.update(s, agg.init(p), p, key=k, mask=m)[0])
    assert_tree_close(jitted(poisoned, base, key, jnp.asarray(allowed)), leaves64(written))
    # A rule that does not read lazy rows gets them written: the median of DARE's rows.
    med = consensus.process(consensus.median(), pre=[consensus.dare(density)])
    got, _ = med.update(stacked, med.init(base), base, key=key)
    rows, _ = consensus.dare(density).update(stacked, None, base, key=key)
    for g, r in zip(leaves64(got), leaves64(rows), strict=True):
        np.testing.assert_allclose(g, np.median(r, axis=0), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- properties


def factories():
    return {
        "task_arithmetic": lambda: consensus.task_arithmetic(0.3),
        "ties_sum": lambda: consensus.ties(0.3),
        "ties_count": lambda: consensus.ties(0.3, "count"),
        "model_stock": consensus.model_stock,
        "karcher_mean": lambda: consensus.karcher_mean(tol=1e-7),
        "fisher_merge": consensus.fisher_merge,
        "nnm+ties": lambda: consensus.process(consensus.ties(0.3), pre=[consensus.nnm(2)]),
    }


PROPERTY = sorted(factories())


def _marked_slow(names, slow):
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in names]


def run(name, stacked, base, *, mask=None, jit=False):
    agg = factories()[name]()
    extra = {"fisher": jax.tree.map(lambda x: jnp.abs(x) + 0.1, stacked)} if name == "fisher_merge" else {}
    if jit:
        fn = jax.jit(lambda s, st, p, m, e: agg.update(s, st, p, mask=m, **e))
        return fn(stacked, agg.init(base), base, mask, extra)[0]
    return agg.update(stacked, agg.init(base), base, mask=mask, **extra)[0]


@pytest.mark.parametrize(
    "name", _marked_slow(PROPERTY, {"karcher_mean", "model_stock", "nnm+ties", "ties_count", "ties_sum"})
)
def test_jit_equals_eager(name):
    base = make_base()
    stacked = make_nodes(base)
    mask = jnp.asarray([True] * 6 + [False, True])
    for m in (None, mask):
        assert_tree_close(
            run(name, stacked, base, mask=m, jit=True), leaves64(run(name, stacked, base, mask=m)), 1e-5, 1e-6
        )


SHARDED_SLOW = {"fisher_merge", "nnm+ties", "ties_count", "ties_sum", "karcher_mean", "model_stock"}


@pytest.mark.parametrize("name", _marked_slow(PROPERTY, SHARDED_SLOW))
def test_sharded_equals_unsharded(name):
    base = make_base()
    stacked = make_nodes(base)
    mesh = Mesh(np.array(jax.devices()[:8]), ("node",))
    sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("node"))), stacked)
    assert len(jax.tree_util.tree_leaves(sharded)[0].sharding.device_set) == 8
    assert_tree_close(run(name, sharded, base), leaves64(run(name, stacked, base)), 1e-5, 1e-6)


@pytest.mark.parametrize("name", _marked_slow(PROPERTY, {"nnm+ties"}))
def test_permutation_invariant(name):
    base = make_base()
    stacked = make_nodes(base)
    perm = np.random.default_rng(0).permutation(N)
    permuted = jax.tree.map(lambda x: x[perm], stacked)
    assert_tree_close(run(name, permuted, base), leaves64(run(name, stacked, base)), 1e-5, 1e-6)


@pytest.mark.parametrize("name", _marked_slow(PROPERTY, {"nnm+ties", "ties_count", "ties_sum"}))
def test_non_finite_and_masked_nodes_take_no_part(name):
    base = make_base()
    stacked = make_nodes(base)
    poisoned = jax.tree.map(lambda x: x.at[3].set(jnp.nan), stacked)
    mask = jnp.arange(N) != 3
    out = run(name, poisoned, base)
    want = run(name, stacked, base, mask=mask)
    assert all(np.isfinite(x).all() for x in leaves64(out))
    assert_tree_close(out, leaves64(want), 1e-6, 1e-6)
    assert_tree_close(run(name, poisoned, base, jit=True), leaves64(want), 1e-5, 1e-6)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_model_stock_excludes_a_node_non_finite_in_one_entry_of_one_leaf(bad):
    # Model Stock checks its per-leaf ratios, not the merged tree, for finiteness (a non-finite
    # node makes its leaf's t NaN); one bad entry in one leaf must still exclude the node.
    base = make_base()
    stacked = make_nodes(base)
    leaf = jax.tree_util.tree_leaves(stacked)[-1]
    poisoned_leaf = leaf.at[(5,) + (0,) * (leaf.ndim - 1)].set(bad)
    leaves, tdef = jax.tree_util.tree_flatten(stacked)
    poisoned = jax.tree_util.tree_unflatten(tdef, leaves[:-1] + [poisoned_leaf])
    want = run("model_stock", stacked, base, mask=jnp.arange(N) != 5)
    for jit in (False, True):
        out = run("model_stock", poisoned, base, jit=jit)
        assert all(np.isfinite(x).all() for x in leaves64(out))
        assert_tree_close(out, leaves64(want), 1e-5, 1e-6)


@pytest.mark.parametrize(
    "name",
    ["task_arithmetic", pytest.param("ties_sum", marks=pytest.mark.slow), "model_stock", "fisher_merge"],
)
def test_every_node_at_the_base_gives_the_base(name):
    base = make_base()
    stacked = consensus.broadcast(base, 4)
    assert_tree_close(run(name, stacked, base), leaves64(base), 0, 0)


# ----------------------------------------------------------------------------- preconditions and errors


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, float("nan")])
def test_density_outside_unit_interval_is_refused(density):
    with pytest.raises(ValueError, match="density must be in"):
        consensus.ties(density)
    with pytest.raises(ValueError, match="density must be in"):
        consensus.dare(density)


def test_missing_base_is_refused():
    stacked = make_nodes(make_base(), 3)
    for agg in (
        consensus.task_arithmetic(),
        consensus.ties(0.5),
        consensus.model_stock(),
        consensus.regmean(),
    ):
        with pytest.raises(ValueError, match="needs the base model"):
            agg.update(stacked, agg.init(None), None)
    with pytest.raises(ValueError, match="needs the base model"):
        consensus.dare(0.5).update(stacked, None, None, key=jax.random.key(0))
    with pytest.raises(ValueError, match="needs a random key"):
        consensus.dare(0.5).update(stacked, consensus.dare(0.5).init(None), make_base())


@pytest.mark.slow
def test_node_count_preconditions():
    base = make_base()
    with pytest.raises(ByzantineToleranceError, match="model_stock.*at least 2"):
        consensus.model_stock().update(make_nodes(base, 1), None, base)
    with pytest.raises(ByzantineToleranceError, match="slerp.*exactly 2"):
        consensus.slerp(0.5).update(make_nodes(base, 3), None, base)
    two_valid = jnp.asarray([True, False, True])
    merged, _ = consensus.slerp(0.5).update(make_nodes(base, 3), None, base, mask=two_valid)
    ref, _ = consensus.slerp(0.5).update(
        jax.tree.map(lambda x: x[jnp.array([0, 2])], make_nodes(base, 3)), None
    )
    assert_tree_close(merged, leaves64(ref), 1e-6, 1e-6)
    with pytest.raises(ValueError, match="needs the nodes' diagonal Fisher"):
        consensus.fisher_merge().update(make_nodes(base, 2), None, base)
    with pytest.raises(ValueError, match="unknown leaves"):
        consensus.regmean().update(make_nodes(base, 2), None, base, grams={"['nope']": jnp.zeros((2, 3, 3))})
    with pytest.raises(ValueError, match="election"):
        consensus.ties(0.5, election="max")


def test_registered_as_merge_methods_with_their_preconditions():
    for name in (
        "task_arithmetic",
        "ties",
        "model_stock",
        "slerp",
        "karcher_mean",
        "fisher_merge",
        "regmean",
    ):
        spec = RULES[name]
        assert spec.kind == "merge" and spec.sensitivity
    assert RULES["ties"].needs == {"params"}
    assert RULES["dare"].kind == "pre" and RULES["dare"].needs == {"params", "key"}
    assert RULES["model_stock"].requirement(1, 0) == "at least 2 valid nodes"
    assert RULES["slerp"].requirement(3, 0) == "exactly 2 valid nodes"
    assert RULES["slerp"].requirement(2, 0) is None
    agg = consensus.registry.make("ties", density=0.4)
    assert agg.name == "ties"
