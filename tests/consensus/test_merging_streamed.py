"""The chunked methods (consensus.merging.streamed) equal the whole-tensor formulas they stream.

Tensors of 37 x 23 entries read in chunks of 100 entries (whole rows where the method works by
rows): several chunks, a partial last one, chunks that cut rows for the flat statistics. The
element-wise steps are the formula's own, so what can differ is float32 rounding of the
whole-tensor sums (accumulated chunk by chunk in float64 here): a few ulps at most; the counts
(RAM+) and Arcee Fusion's per-row importance are exact, so those results are the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from consensus.merging import generalized, spherical, streamed

SHAPE = (37, 23)
CHUNK = 100


def _reader(a):
    flat = a.reshape(-1)
    return lambda s, e: flat[s:e]


@pytest.fixture(params=[np.float32, np.float16])
def data(request):
    dtype = request.param
    rng = np.random.default_rng(3)
    base = rng.normal(size=SHAPE)
    xs = [base + 0.3 * rng.normal(size=SHAPE) for _ in range(4)]
    xs[1][0, :7] = base[0, :7]  # unchanged entries (RAM's counts, SCE's zero variance)
    return dtype, base.astype(dtype), [x.astype(dtype) for x in xs]


def _close(got, want, ulps):
    """Within ``ulps`` rounding steps of the tensor's scale (cancellation makes a per-entry ulp
    meaningless near zero), and most entries the same bits."""
    want = want.reshape(-1)
    assert got.dtype == want.dtype
    step = np.finfo(want.dtype).eps * float(np.max(np.abs(want.astype(np.float64))))
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert err.max() <= ulps * step, (err.max() / step, np.mean(got == want))
    assert ulps or np.array_equal(got, want)


def test_slerp(data):
    dtype, base, xs = data
    for t in (0.0, 0.3, 1.0):
        out = np.empty(base.size, dtype)
        streamed.slerp(t, _reader(base), _reader(xs[0]), base.size, out, chunk=CHUNK)
        _close(out, spherical.slerp(t, base, xs[0]), 2)
    out = np.empty(base.size, dtype)  # colinear: linear interpolation
    streamed.slerp(0.3, _reader(base), _reader(base * dtype(2)), base.size, out, chunk=CHUNK)
    _close(out, spherical.slerp(0.3, base, base * dtype(2)), 0)


@pytest.mark.parametrize(("row_wise", "flatten"), [(False, True), (False, False), (True, False)])
def test_nuslerp(data, row_wise, flatten):
    dtype, base, xs = data
    kw = {"row_wise": row_wise, "flatten": flatten}
    out = np.empty(base.size, dtype)
    streamed.nuslerp(0.4, _reader(xs[0]), _reader(xs[1]), SHAPE, out, chunk=CHUNK, **kw)
    _close(out, spherical.nuslerp(0.4, xs[0], xs[1], **kw), 2)
    # with a base, as mergekit_exec runs it: base + nuslerp of the task vectors
    streamed.nuslerp(0.4, _reader(xs[0]), _reader(xs[1]), SHAPE, out, base=_reader(base), chunk=CHUNK, **kw)
    _close(out, base + spherical.nuslerp(0.4, xs[0] - base, xs[1] - base, **kw), 2)
    one = np.empty(7, dtype)  # a 1-D tensor: one vector whatever the axes
    streamed.nuslerp(0.4, _reader(xs[0][0, :7]), _reader(xs[1][1, :7]), (7,), one, chunk=3, **kw)
    _close(one, spherical.nuslerp(0.4, xs[0][0, :7], xs[1][1, :7], **kw), 2)


def test_multislerp(data):
    dtype, base, xs = data
    w = [0.5, 1.0, 0.25, 0.7]
    for b in (base, None):
        out = np.empty(base.size, dtype)
        streamed.multislerp(
            [_reader(x) for x in xs], w, base.size, out, base=None if b is None else _reader(b), chunk=CHUNK
        )
        _close(out, spherical.multislerp(xs, w, b), 4)
    out = np.empty(base.size, dtype)  # one model: itself
    streamed.multislerp([_reader(xs[2])], [1.0], base.size, out, base=_reader(base), chunk=CHUNK)
    np.testing.assert_array_equal(out, xs[2].reshape(-1))
    if dtype == np.float16:
        return  # eps = 1e-8 rounds to 0 in float16: antipodes give NaN there, in the formula as here
    # antipodal tensors with equal weights: two models interpolate linearly, more are an error
    anti = [_reader(xs[0]), _reader(-xs[0])]
    streamed.multislerp(anti, [1, 1], base.size, out, chunk=CHUNK)
    _close(out, spherical.multislerp([xs[0], -xs[0]], [1, 1]), 0)
    with pytest.raises(ValueError, match="weighted sum"):
        spherical.multislerp([xs[0], -xs[0]] * 2, [1] * 4)
    with pytest.raises(ValueError, match="weighted sum"):
        streamed.multislerp(anti * 2, [1] * 4, base.size, out, chunk=CHUNK)


@pytest.mark.parametrize("topk", [1.0, 0.5, 0.1, 0.0])
def test_sce(data, topk):
    dtype, base, xs = data
    out = np.empty(base.size, dtype)
    streamed.sce(_reader(base), [_reader(x) for x in xs], base.size, out, select_topk=topk, chunk=CHUNK)
    _close(out, generalized.sce(base, xs, topk), 2)


def test_arcee_fusion_same_bits(data, monkeypatch):
    dtype, base, xs = data
    out = np.empty(base.size, dtype)
    streamed.arcee_fusion(_reader(base), _reader(xs[0]), SHAPE, out, chunk=CHUNK)
    np.testing.assert_array_equal(out, spherical.arcee_fusion(base, xs[0]).reshape(-1))
    # over the sample size the quantiles come from the same draws of the same generator
    monkeypatch.setattr(spherical, "QUANTILE_SAMPLE", 300)
    streamed.arcee_fusion(_reader(base), _reader(xs[0]), SHAPE, out, np.random.default_rng(5), chunk=CHUNK)
    want = spherical.arcee_fusion(base, xs[0], np.random.default_rng(5))
    np.testing.assert_array_equal(out, want.reshape(-1))
    with pytest.raises(ValueError, match="generator"):
        streamed.arcee_fusion(_reader(base), _reader(xs[0]), SHAPE, out, chunk=CHUNK)


def test_ramplus_boost_same_bits(data):
    dtype, base, xs = data
    eps = 0.2
    boost = streamed.ramplus_boost(_reader(base), [_reader(x) for x in xs], base.size, eps, chunk=CHUNK)
    out = np.concatenate(
        [
            generalized.ram(base.reshape(-1)[s:e], [x.reshape(-1)[s:e] for x in xs], eps, True, boost=boost)
            for s, e in streamed._spans(base.size, CHUNK)
        ]
    )
    np.testing.assert_array_equal(out, generalized.ram(base, xs, eps, plus=True).reshape(-1))
