"""torchtune-facing tokenizer: encode/decode round trips, manifest parameters, messages."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
from hlmtune.ecg_tokenizer.synth import write_synthetic_database
from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer, ecg_tokenizer
from hlmtune.ecg_tokenizer.vocab import TokenizerParams, quantizer_edges


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    q=st.sampled_from(["uniform", "mu-law"]),
    levels=st.integers(2, 1024),
    window=st.integers(128, 160),
    rr_bins=st.integers(0, 20),
    n=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_samples_round_trip_within_half_step(q, levels, window, rr_bins, n, seed):
    tk = ECGTokenizer(scheme="samples", quantization=q, levels=levels, window=window, rr_bins=rr_bins)
    rng = np.random.default_rng(seed)
    a = tk.params.amplitude_mv
    w = rng.uniform(-a, a, size=(n, window))
    labels = list(rng.choice(["N", "S", "V", "F", "Q", "<unlabeled>"], size=n))
    rr = rng.uniform(0.1, 2.5, size=n)
    rr[0] = math.nan
    ids = tk.encode({"labels": labels, "waveforms": w, "rr_s": rr})
    assert len(ids) == 2 + n * tk.tokens_per_beat and max(ids) < tk.vocab_size
    # a samples beat is signal only: no label token anywhere in the stream
    assert not any(tk.vocab.label_base <= i < tk.vocab.rr_base for i in ids)
    out = tk.decode(ids)
    assert out.labels == [] and out.waveforms.shape == (n, window)
    e = quantizer_edges(tk.params)
    lev = np.searchsorted(e[1:-1], w, side="right")
    assert np.all(np.abs(out.waveforms - w) <= (e[lev + 1] - e[lev]) / 2 + 1e-12)
    if rr_bins:
        assert out.rr_bins[0] == -1 and all(0 <= b < rr_bins for b in out.rr_bins[1:])
        width = (tk.params.rr_max_s - tk.params.rr_min_s) / rr_bins
        inside = (rr[1:] > tk.params.rr_min_s) & (rr[1:] < tk.params.rr_max_s)
        assert np.all(np.abs(np.array(out.rr_s[1:])[inside] - rr[1:][inside]) <= width / 2 + 1e-9)
    # text form round trip
    assert tk.encode(tk.ids_to_text(ids), add_bos=False, add_eos=False) == ids


@settings(derandomize=True, max_examples=40, deadline=None)
@given(labels=st.lists(st.sampled_from(["N", "S", "V", "F", "Q", "<unlabeled>"]), min_size=0, max_size=30),
       rr_bins=st.integers(0, 16))
def test_annotation_round_trip(labels, rr_bins):
    tk = ECGTokenizer(scheme="annotation", rr_bins=rr_bins)
    rr = [math.nan] + [0.8] * (len(labels) - 1) if labels else []
    ids = tk.encode({"labels": labels, "rr_s": rr})
    assert len(ids) == len(labels) + 2
    out = tk.decode(ids)
    assert out.labels == labels and out.waveforms is None
    if rr_bins and labels:
        assert out.rr_bins[0] == -1


def test_errors_and_text():
    tk = ECGTokenizer()
    with pytest.raises(KeyError, match="unknown ECG token 'q999'"):
        tk.encode("<sep> rr01 q999")
    with pytest.raises(ValueError, match="unknown label 'X'"):
        ECGTokenizer(scheme="annotation").encode_beats(["X"])
    with pytest.raises(ValueError, match=r"shape \(n_beats, 128\)"):
        tk.encode_beats(waveforms=np.zeros((1, 64)))
    with pytest.raises(ValueError, match="did you mean 'window'"):
        ECGTokenizer(windw=128)
    assert tk.special_tokens == {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<sep>": 3}
    assert tk.vocab_size == 4 + 6 + 17 + 256 + 16 + 4
    # a truncated last beat is dropped by decode; rhythm tokens and answers are reported
    ids = tk.encode({"waveforms": np.zeros((2, 128))}, add_eos=False)[:-5]
    out = tk.decode(ids + [tk.token_to_id("<beat?>"), tk.token_to_id("V"), tk.token_to_id("(AFIB")])
    assert out.labels == ["V"] and out.waveforms.shape == (1, 128) and out.rhythms == ["(AFIB"]


def test_tokenize_messages_and_call():
    from torchtune.data import Message

    tk = ecg_tokenizer(scheme="annotation", rr_bins=0, max_seq_len=64)
    msgs = [Message(role="user", content="N N V N", masked=True), Message(role="assistant", content="(AFIB")]
    tokens, mask = tk.tokenize_messages(msgs)
    assert tk.ids_to_text(tokens) == "<bos> N N V N (AFIB <eos>"
    assert mask == [True] * 5 + [False, False]
    sample = tk({"messages": [{"role": "user", "content": "N S"}, {"role": "assistant", "content": "(N"}]})
    assert sample["tokens"] == tk.encode("N S (N") and sample["mask"] == [True, True, True, False, False]
    long = [Message(role="user", content=" ".join(["N"] * 100))]
    tokens, mask = tk.tokenize_messages(long)
    assert len(tokens) == 64 and tokens[-1] == tk.eos_id and len(mask) == 64


def test_from_manifest(tmp_path):
    write_synthetic_database(tmp_path / "db", n_records=1, duration_s=20)
    p = TokenizerParams(levels=64, quantization="uniform", rr_bins=8)
    tokenize_directory(tmp_path / "db", tmp_path / "out", params=p, options=RecordOptions(), progress=False)
    tk = ecg_tokenizer(manifest_path=str(tmp_path / "out" / "manifest.json"), max_seq_len=512)
    assert tk.params == p and tk.max_seq_len == 512 and tk.manifest_dir == tmp_path / "out"
    assert ECGTokenizer(manifest_path=str(tmp_path / "out"), levels=64).params == p
    with pytest.raises(ValueError, match="levels=256 disagrees with the manifest"):
        ECGTokenizer(manifest_path=str(tmp_path / "out"), levels=256)
    tokens = np.load(tmp_path / "out" / "records" / "s000.tokens.npy")
    out = tk.decode(tokens)
    beats = np.load(tmp_path / "out" / "records" / "s000.beats.npy")
    assert out.labels == [] and out.waveforms.shape == (beats.size, 128) and len(out.rr_bins) == beats.size
    assert np.abs(out.waveforms).max() <= p.amplitude_mv
