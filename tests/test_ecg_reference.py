"""Golden token outputs of the reference tokenizer for a few real MIT-BIH records.

``tests/golden/ecg_tokens.json`` was generated once by the reference implementation
(``HLM_DATA=... python tests/test_ecg_reference.py``) and reviewed: beat and label counts
equal the annotation file's counts in each slice, tokens start ``<bos> <sep> N ...``.
The fast path must reproduce it too.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from hlmtune.ecg_tokenizer.core import tokenize_record
from hlmtune.ecg_tokenizer.labels import BEAT_SYMBOLS, label_classes, symbol_to_class
from hlmtune.ecg_tokenizer.records import load_record
from hlmtune.ecg_tokenizer.reference import tokenize_record_reference
from hlmtune.ecg_tokenizer.vocab import TokenizerParams

GOLDEN = Path(__file__).parent / "golden" / "ecg_tokens.json"
CASES = {
    "samples": TokenizerParams(),
    "annotation": TokenizerParams(scheme="annotation", rr_bins=16),
}
RECORDS = ["100", "119", "201", "232"]
SAMPTO = 360 * 60


def _entry(tok, p):
    classes = label_classes(p.label_mode)
    return {
        "n_tokens": int(tok.tokens.size),
        "n_beats": int(tok.beats.size),
        "n_dropped": len(tok.dropped),
        "label_counts": dict(sorted(Counter(classes[i] for i in tok.beats["label"]).items())),
        "head": tok.tokens[:48].tolist(),
        "tokens_sha256": hashlib.sha256(tok.tokens.astype("<u2").tobytes()).hexdigest(),
        "beats_sha256": hashlib.sha256(tok.beats.tobytes()).hexdigest(),
    }


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", RECORDS)
def test_reference_matches_golden(real_mitdb_dir, golden, name):
    rec = load_record(real_mitdb_dir, name, sampto=SAMPTO)
    for case, p in CASES.items():
        want = golden[case][name]
        ref = _entry(tokenize_record_reference(rec, p), p)
        assert ref == want
        assert _entry(tokenize_record(rec, p), p) == want


def test_golden_is_sane(real_mitdb_dir, golden):
    """Reviewed facts: golden label counts equal the annotation counts of each slice."""
    import wfdb

    s2c, classes = symbol_to_class("aami"), label_classes("aami")
    for name in RECORDS:
        ann = wfdb.rdann(str(real_mitdb_dir / name), "atr", sampto=SAMPTO)
        counts = Counter(classes[s2c[s]] for s in ann.symbol if s in BEAT_SYMBOLS)
        a = golden["annotation"][name]
        assert a["label_counts"] == dict(sorted(counts.items())) and a["n_dropped"] == 0
        s = golden["samples"][name]
        assert s["n_beats"] + s["n_dropped"] == sum(counts.values())
        assert s["head"][:2] == [1, 3]  # <bos> <sep>
        assert s["n_tokens"] == 2 + s["n_beats"] * (2 + 128)  # <sep> rr q*128: no label token



@pytest.mark.parametrize("name", ["119", "114"])
def test_second_lead_matches_the_reference(real_mitdb_dir, name):
    """``second_lead``: the fast path's (n_beats, window) second-lead tokens equal the per-beat,
    per-sample reference's; the stream and the beat table are those of a one-lead read; each row
    is the V1 (or V5) window of its beat: at the R peak the second lead's level is the one the
    reference quantizes from that lead's own samples, not the first lead's."""
    import numpy as np

    p = TokenizerParams(rr_bins=64)
    rec = load_record(real_mitdb_dir, name, sampto=360 * 20, second_lead=True)
    fast, ref = tokenize_record(rec, p), tokenize_record_reference(rec, p)
    assert fast.lead2.shape == (fast.beats.size, p.window) and fast.lead2.dtype == fast.tokens.dtype
    assert np.array_equal(fast.lead2, ref.lead2)
    one = tokenize_record(load_record(real_mitdb_dir, name, sampto=360 * 20), p)
    assert one.lead2 is None and np.array_equal(one.tokens, fast.tokens) and np.array_equal(one.beats, fast.beats)
    q = fast.tokens[fast.beats["token_start"][:, None] + 2 + np.arange(p.window)]  # (n_beats, W) first lead
    assert np.mean(q != fast.lead2) > 0.5  # another signal, not a copy of the first
    swapped = load_record(real_mitdb_dir, name, sampto=360 * 20, lead=rec.lead2, second_lead=True)
    assert swapped.lead2 == rec.lead and np.array_equal(tokenize_record(swapped, p).lead2, q)


if __name__ == "__main__":  # regenerate (review the diff before committing)
    root = Path(os.environ["HLM_DATA"]) / "mitdb"
    out = {}
    for case, p in CASES.items():
        out[case] = {}
        for name in RECORDS:
            out[case][name] = _entry(tokenize_record_reference(load_record(root, name, sampto=SAMPTO), p), p)
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(json.dumps({c: {n: (e["n_beats"], e["label_counts"]) for n, e in v.items()} for c, v in out.items()}))
    sys.exit(0)
