"""Parameters, vocabulary layout and quantizers (property tests, derandomized)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlmtune.ecg_tokenizer.vocab import (
    FastQuantizer,
    TokenizerParams,
    Vocabulary,
    dequantize,
    quantize,
    quantizer_edges,
    rr_bin,
    rr_edges,
)

QUANT = st.sampled_from(["uniform", "mu-law"])
LEVELS = st.integers(min_value=2, max_value=4096)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(q=QUANT, levels=LEVELS, amp=st.floats(0.5, 10.0), mu=st.floats(1.0, 1000.0),
       frac=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=64))
def test_round_trip_within_half_step(q, levels, amp, mu, frac):
    p = TokenizerParams(quantization=q, levels=levels, amplitude_mv=amp, mu=mu)
    e = quantizer_edges(p)
    assert e[0] == -amp and e[-1] == amp and np.all(np.diff(e) > 0)
    x = np.array(frac) * amp
    lev = quantize(x, e)
    assert lev.min() >= 0 and lev.max() <= levels - 1
    step = e[lev + 1] - e[lev]  # width of the bin each value falls in
    err = np.abs(dequantize(lev, e) - x)
    assert np.all(err <= step / 2 + 1e-12 * amp)


@settings(derandomize=True, max_examples=100, deadline=None)
@given(q=QUANT, levels=LEVELS, amp=st.floats(0.5, 10.0),
       x=st.lists(st.floats(-20.0, 20.0, allow_nan=False), min_size=1, max_size=200))
def test_fast_quantizer_equals_definition(q, levels, amp, x):
    e = quantizer_edges(TokenizerParams(quantization=q, levels=levels, amplitude_mv=amp))
    fq = FastQuantizer(e)
    xs = np.concatenate([np.array(x), e, np.nextafter(e, -np.inf), np.nextafter(e, np.inf)])
    assert np.array_equal(fq(xs), quantize(xs, e))


def test_out_of_range_clips_to_end_levels():
    e = quantizer_edges(TokenizerParams(quantization="uniform", levels=8, amplitude_mv=1.0))
    assert quantize(np.array([-5.0, -1.0, 0.999, 1.0, 7.0]), e).tolist() == [0, 0, 7, 7, 7]
    assert dequantize(np.array([0, 7]), e).tolist() == [-0.875, 0.875]


def test_rr_bins():
    p = TokenizerParams(rr_bins=4, rr_min_s=0.2, rr_max_s=1.0)
    e = rr_edges(p)
    assert rr_bin(np.array([0.1, 0.2, 0.45, 0.65, 0.99, 3.0, np.nan]), e).tolist() == [0, 0, 1, 2, 3, 3, 4]


@pytest.mark.parametrize("scheme", ["annotation", "samples"])
@pytest.mark.parametrize("rr", [0, 16])
def test_vocabulary_layout(scheme, rr):
    p = TokenizerParams(scheme=scheme, rr_bins=rr, levels=256)
    v = Vocabulary(p)
    assert v.names[:4] == ["<pad>", "<bos>", "<eos>", "<sep>"]
    n_cls = 6  # N S V F Q <unlabeled>
    if scheme == "annotation":
        assert v.rr_base - v.label_base == n_cls * (rr + 1 if rr else 1)
        assert v.sample_base == v.rhythm_base == v.rr_base
        if rr:
            assert v.names[v.label_base + 2 * (rr + 1) + 3] == "V|rr03"
    else:
        assert v.names[v.label_base:v.rr_base] == ["N", "S", "V", "F", "Q", "<unlabeled>"]
        assert v.sample_base - v.rr_base == (rr + 1 if rr else 0)
        assert v.names[v.sample_base] == "q000" and v.names[v.rhythm_base - 1] == "q255"
    assert v.names[v.rhythm_id("(AFIB")] == "(AFIB" and v.names[v.rhythm_id("(XYZ")] == "(OTHER"
    assert len(set(v.names)) == len(v) and v.dtype == np.uint16


def test_params_validation_and_typos():
    with pytest.raises(ValueError, match="window"):
        TokenizerParams(window=64)
    with pytest.raises(ValueError, match="window"):
        TokenizerParams(window=2048)
    with pytest.raises(ValueError, match="scheme"):
        TokenizerParams(scheme="sample")
    with pytest.raises(ValueError, match="did you mean 'levels'"):
        TokenizerParams.from_dict({"level": 8})
    p = TokenizerParams(levels=64)
    assert TokenizerParams.from_dict(p.to_dict()) == p and p.digest() == TokenizerParams(levels=64).digest()
    assert p.digest() != TokenizerParams().digest()
