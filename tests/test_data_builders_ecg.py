"""The Heart Language Model's datasets (``hlmtune.data_builders.ecg``).

The central property: no label reaches a model input. A beat-classification prompt holds
signal-derived tokens only (RR bins, waveform levels) and the answer comes after the target
beat's own tokens; earlier beats carry no label; AF targets come from rhythm annotations that
are never tokens of the input. Checked on real MIT-BIH records when ``HLM_DATA`` is set, on
synthetic records otherwise. (Training runs of the model: ``test_hlm_recipes.py``.)
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hlm_fixtures import make_shards

HLMTUNE = str(Path(sys.executable).with_name("hlmtune"))


def _evaluation_set(tk, **keys):
    """The test set `hlmtune eval` builds (``beat_test_dataset``) for a run with these dataset keys."""
    from hlmtune.data_builders.ecg import beat_test_dataset

    keys.pop("evaluation", None)
    split, records = keys.pop("split", "DS2"), keys.pop("records", None)
    builder = keys.pop("builder", "ecg_beat_classification_dataset")
    return beat_test_dataset(tk, builder, keys, split=split, records=records)


@pytest.fixture(scope="module")
def ecg_shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ecg")
    for cmd in (
        [HLMTUNE, "synth-ecg", "--out", str(root / "records"), "--n-records", "4", "--duration", "600"],
        [HLMTUNE, "tokenize", "--records", str(root / "records"), "--scheme", "annotation", "--out",
         str(root / "shards"), "--no-progress"],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "shards"


def test_builder_is_exported_and_reads_shards(ecg_shards):
    from hlmtune.data_builders import ecg_tokens_dataset
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer

    tok = ECGTokenizer(manifest_path=str(ecg_shards / "manifest.json"), max_seq_len=64)
    ds = ecg_tokens_dataset(tok, shards_dir=str(ecg_shards), max_seq_len=64)
    assert len(ds) > 0
    item = ds[0]
    assert len(item["tokens"]) == len(item["labels"]) <= 64
    assert max(item["tokens"]) < tok.vocab_size


@pytest.fixture(scope="module")
def hlm(tmp_path_factory):
    info = make_shards(tmp_path_factory.mktemp("hlm"))
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer

    info["tk"] = ECGTokenizer(manifest_path=str(info["shards"]), max_seq_len=1024)
    return info


def _stem(record):
    from hlmtune.ecg_tokenizer.shards import stem

    return stem(record)


def _beats(info, record):
    from hlmtune.ecg_tokenizer.shards import stem

    return np.load(Path(info["shards"]) / "records" / f"{stem(record)}.beats.npy")


def test_classification_prompts_hold_no_label_and_answer_last(hlm):
    """Every prompt token is a signal token; the one trained position is the true class, after the beat."""
    from hlmtune.data_builders import ecg_beat_classification_dataset

    tk = hlm["tk"]
    v = tk.vocab
    ds = ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), balance=None, context_beats=8)
    is_label = lambda t: v.label_base <= t < v.rr_base  # noqa: E731
    tables = {r: _beats(hlm, r) for r in hlm["train"]}
    starts = {r: {int(s): j for j, s in enumerate(t["token_start"])} for r, t in tables.items()}
    checked = 0
    for k in range(0, len(ds), max(1, len(ds) // 400)):
        item = ds[k]
        toks, labels = item["tokens"], item["labels"]
        answer_pos = [i for i, lab in enumerate(labels) if lab != -100]
        assert len(answer_pos) == 1 and answer_pos[0] == len(toks) - 2
        prompt = toks[: answer_pos[0]]
        assert not any(is_label(t) for t in prompt), tk.ids_to_text(prompt)
        assert prompt[-1] == v.ids["<beat?>"] and is_label(toks[answer_pos[0]])
        # the answer is the annotated class of the beat whose waveform ends the prompt
        rec, j = hlm["train"][int(ds.rec[ds.index[k]])], int(ds.beat[ds.index[k]])
        assert ds.record_of(k) == rec  # the record whose tables the prompt is checked against below
        t = tables[rec]
        assert toks[answer_pos[0]] - v.label_base == t["label"][j]
        beat = prompt[-(2 + 130) : -2]  # <sep> rr q*128, then rr(next) <beat?>
        assert beat[0] == tk.sep_id and int(t["token_start"][j]) in starts[rec]
        # context: the RR bins of up to 8 earlier beats, nothing else
        ctx = prompt[1 : -(2 + 130)]
        assert ctx == [v.rr_base + int(b) for b in t["rr_bin"][max(0, j - 8) : j]]
        checked += 1
    assert checked > 100


def test_normalized_rr_tokens_match_a_slow_reference(hlm):
    """rrn(i) = RR token of 0.8 s * rr(i) / median of the last N RRs (this one included), by hand."""
    import statistics

    from hlmtune.data_builders.ecg import normalized_rr_tokens

    v = hlm["tk"].vocab
    p = hlm["tk"].params
    width = (p.rr_max_s - p.rr_min_s) / p.rr_bins
    for record in hlm["train"][:3]:
        table = _beats(hlm, record)
        got = normalized_rr_tokens(table, v, 16)
        for i in range(len(table)):
            known = [int(x) for x in table["rr"][max(0, i - 15) : i + 1] if x > 0]
            if table["rr"][i] <= 0 or not known:
                assert got[i] == v.rr_base + p.rr_bins  # unknown
                continue
            seconds = 0.8 * int(table["rr"][i]) / statistics.median(known)
            want = min(p.rr_bins - 1, max(0, int((seconds - p.rr_min_s) // width)))
            assert got[i] - v.rr_base == want, (record, i)


@pytest.mark.parametrize("reference", ["median", "gated", "gated_regular"])
def test_normalized_rr_prompt_replaces_every_interval_and_keeps_the_waveform(hlm, reference):
    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.data_builders.ecg import normalized_rr_tokens

    tk, v = hlm["tk"], hlm["tk"].vocab
    plain = ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), balance=None, context_beats=4)
    norm = ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), balance=None, context_beats=4,
                                           normalized_rr=64, rr_reference=reference)
    unknown = v.rr_base + tk.params.rr_bins
    changed = 0
    for k in range(0, len(plain), max(1, len(plain) // 50)):
        a, b = plain.prompt(k), norm.prompt(k)
        i, j = int(norm.rec[norm.index[k]]), int(norm.beat[norm.index[k]])
        rn = normalized_rr_tokens(_beats(hlm, hlm["train"][i]), v, 64, reference).tolist()
        c = len(a) - 1 - (2 + 128 + 2)  # context beats before <sep>
        want = ([a[0]] + rn[j - c : j] + [a[1 + c], rn[j]] + a[3 + c : 3 + c + 128]
                + [rn[j + 1] if j + 1 < len(rn) else unknown, a[-1]])
        assert b == want
        changed += a != b
    assert changed > 10


def test_normalized_amplitude_puts_each_records_median_r_peak_at_1_mv(hlm):
    """After the map, the median |R| of every record is 1 mV within the quantizer's step there."""
    from hlmtune.data_builders.ecg import amplitude_lut
    from hlmtune.ecg_tokenizer.shards import stem
    from hlmtune.ecg_tokenizer.vocab import quantizer_edges

    tk, v = hlm["tk"], hlm["tk"].vocab
    p = tk.params
    edges = quantizer_edges(p)
    mid = lambda level: (edges[level] + edges[level + 1]) / 2  # noqa: E731  bin midpoint (mV)
    for record in hlm["train"][:3]:
        table = _beats(hlm, record)
        tokens = np.load(Path(hlm["shards"]) / "records" / f"{stem(record)}.tokens.npy")
        lut = amplitude_lut(table, tokens, v)
        assert all(lut[t] == t for t in range(v.sample_base))  # specials, labels, RR untouched
        r_levels = [int(tokens[int(s) + 2 + p.window // 3]) for s in table["token_start"]]
        before = float(np.median([abs(mid(t - v.sample_base)) for t in r_levels]))
        after = float(np.median([abs(mid(int(lut[t]) - v.sample_base)) for t in r_levels]))
        step = edges[np.searchsorted(edges, 1.0)] - edges[np.searchsorted(edges, 1.0) - 1]
        if 0.25 <= 1.0 / before <= 4.0:
            assert abs(after - 1.0) <= step, (record, before, after)
        levels = [int(lut[v.sample_base + q]) - v.sample_base for q in range(p.levels)]
        assert levels == sorted(levels)  # monotone: the waveform's shape is kept


def test_cropped_beat_keeps_the_samples_around_the_r_peak(hlm):
    from hlmtune.data_builders import ecg_beat_classification_dataset

    tk = hlm["tk"]
    full = ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), balance=None, context_beats=3)
    crop = ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), balance=None, context_beats=3,
                                           beat_samples=80)
    r_at = tk.params.window // 3  # 42: the R peak in the tokenizer's window; kept at 80 // 3 = 26
    for k in range(0, len(full), max(1, len(full) // 30)):
        a, b = full.prompt(k), crop.prompt(k)
        c = len(a) - 1 - (2 + 128 + 2)
        wave = a[3 + c : 3 + c + 128]
        assert b == a[: 3 + c] + wave[r_at - 26 : r_at - 26 + 80] + a[-2:]


def test_augmentation_changes_only_the_waveform_and_never_evaluation(hlm):
    from hlmtune.data_builders import ecg_beat_classification_dataset

    tk, v = hlm["tk"], hlm["tk"].vocab
    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=4, beat_samples=96)
    plain = ecg_beat_classification_dataset(tk, **kw)
    aug = ecg_beat_classification_dataset(tk, augment=True, **kw)
    differ = 0
    for k in range(0, len(plain), max(1, len(plain) // 60)):
        a, b = plain.prompt(k), aug.prompt(k)
        assert len(a) == len(b) and aug.prompt(k) == b  # same length; seeded per example
        wave = slice(len(a) - 2 - 96, len(a) - 2)
        assert a[: wave.start] == b[: wave.start] and a[wave.stop :] == b[wave.stop :]
        assert all(v.sample_base <= t < v.rhythm_base for t in b[wave])
        differ += a != b
    assert differ > 0.8 * len(range(0, len(plain), max(1, len(plain) // 60)))
    ev_kw = dict(shards_dir=None, split="DS2", records=None, split_file=str(hlm["split_file"]), context_beats=4,
                 classes=None, balance=None, num_examples=None, seed=0, random_test_fraction=0.2, evaluation=True,
                 beat_samples=96)
    e1, e2 = _evaluation_set(tk, augment=True, **ev_kw), _evaluation_set(tk, augment=False, **ev_kw)
    assert all(e1.prompt(k) == e2.prompt(k) for k in range(0, len(e1), 7))


def _template_reference(hlm, record, j, beats, crop):
    """Patient template of beat j, by hand: median of earlier beats' bin midpoints, re-binned."""
    import bisect
    import statistics

    from hlmtune.ecg_tokenizer.shards import stem
    from hlmtune.ecg_tokenizer.vocab import quantizer_edges

    tk = hlm["tk"]
    v, w = tk.vocab, tk.params.window
    edges = [float(e) for e in quantizer_edges(tk.params)]
    table = _beats(hlm, record)
    tokens = np.load(Path(hlm["shards"]) / "records" / f"{stem(record)}.tokens.npy")
    start = (j // 64) * 64  # one template per 64 beats
    window = range(start - beats, start) if start >= beats else range(0, min(len(table), beats))
    out = []
    for q in range(crop[0], crop[0] + crop[1]):
        mv = [(edges[lv] + edges[lv + 1]) / 2 for lv in
              (int(tokens[int(table["token_start"][b]) + 2 + q]) - v.sample_base for b in window)]
        level = min(len(edges) - 2, max(0, bisect.bisect_right(edges, statistics.median(mv)) - 1))
        out.append(v.sample_base + level)
    return out


def test_template_prompt_opens_with_the_patients_median_beat(hlm):
    """template_beats: [bos] template(96) + the plain prompt; template = median of earlier beats, by hand."""
    from hlmtune.data_builders import ecg_beat_classification_dataset

    tk = hlm["tk"]
    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=4, beat_samples=96)
    plain = ecg_beat_classification_dataset(tk, **kw)
    tmpl = ecg_beat_classification_dataset(tk, template_beats=100, **kw)
    offset = tk.params.window // 3 - 96 // 3  # the crop keeps the R peak at a third
    blocks = set()
    for k in range(0, len(plain), max(1, len(plain) // 40)):
        a, b = plain.prompt(k), tmpl.prompt(k)
        i, j = int(tmpl.rec[tmpl.index[k]]), int(tmpl.beat[tmpl.index[k]])
        want = _template_reference(hlm, hlm["train"][i], j, 100, (offset, 96))
        assert b == [a[0]] + want + a[1:], (k, j)
        blocks.add(j // 64)
    assert {0, 1, 2} <= blocks  # warm-up blocks and causal ones


def test_template_swap_shows_n_and_s_beats_as_the_template_and_never_in_evaluation(hlm):
    from hlmtune.data_builders import ecg_beat_classification_dataset

    tk = hlm["tk"]
    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=4, beat_samples=96, template_beats=100)
    plain = ecg_beat_classification_dataset(tk, **kw)
    swapped = ecg_beat_classification_dataset(tk, template_swap=1.0, **kw)
    seen = set()
    for k in range(0, len(plain), max(1, len(plain) // 80)):
        a, b = plain.prompt(k), swapped.prompt(k)
        tmpl, wave = a[1:97], slice(len(a) - 2 - 96, len(a) - 2)
        cls = plain.label_of(k)
        seen.add(cls)
        assert b[: wave.start] == a[: wave.start] and b[wave.stop :] == a[wave.stop :]
        assert b[wave] == (tmpl if cls in ("N", "S") else a[wave]), (k, cls)
    assert {"N", "V"} <= seen
    half = ecg_beat_classification_dataset(tk, template_swap=0.5, **kw)
    ns = [k for k in range(len(plain)) if plain.label_of(k) in ("N", "S")][:200]
    share = np.mean([half.prompt(k) != plain.prompt(k) for k in ns])
    assert 0.35 < share < 0.65
    ev = dict(shards_dir=None, split="DS2", records=None, split_file=str(hlm["split_file"]), context_beats=4,
              classes=None, balance=None, num_examples=None, seed=0, random_test_fraction=0.2, evaluation=True,
              beat_samples=96, template_beats=100)
    e1, e2 = _evaluation_set(tk, template_swap=1.0, **ev), _evaluation_set(tk, **ev)
    assert all(e1.prompt(k) == e2.prompt(k) for k in range(0, len(e1), 7))
    with pytest.raises(ValueError, match="template_swap"):
        ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), template_swap=0.5)


def test_previous_swap_shows_the_previous_beats_samples_and_never_in_evaluation(hlm):
    """N/S examples read the previous beat's samples (their own RR tokens kept); V/F and eval untouched."""
    from hlmtune.data_builders import ecg_beat_classification_dataset

    tk = hlm["tk"]
    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=4, beat_samples=96)
    plain = ecg_beat_classification_dataset(tk, **kw)
    swapped = ecg_beat_classification_dataset(tk, previous_swap=1.0, **kw)
    # a by-hand reference: the shard tokens of beat j-1, cropped like the target beat
    tables = {r: _beats(hlm, r) for r in hlm["train"]}
    tokens = {r: np.load(Path(hlm["shards"]) / "records" / f"{_stem(r)}.tokens.npy") for r in hlm["train"]}
    off = swapped.offset
    seen = set()
    for k in range(0, len(plain), max(1, len(plain) // 80)):
        a, b = plain.prompt(k), swapped.prompt(k)
        e = int(plain.index[k])
        rec, j = hlm["train"][int(plain.rec[e])], int(plain.beat[e])
        cls = plain.label_of(k)
        wave = slice(len(a) - 2 - 96, len(a) - 2)
        assert b[: wave.start] == a[: wave.start] and b[wave.stop :] == a[wave.stop :]  # RR tokens kept
        if cls in ("N", "S") and j > 0:
            s0 = int(tables[rec]["token_start"][j - 1]) + 2 + off
            assert b[wave] == tokens[rec][s0 : s0 + 96].tolist(), (k, j)
            seen.add(cls)
        else:
            assert b[wave] == a[wave], (k, cls)
    assert "N" in seen
    ev = dict(shards_dir=None, split="DS2", records=None, split_file=str(hlm["split_file"]), context_beats=4,
              classes=None, balance=None, num_examples=None, seed=0, random_test_fraction=0.2, evaluation=True,
              beat_samples=96)
    e1, e2 = _evaluation_set(tk, previous_swap=1.0, **ev), _evaluation_set(tk, **ev)
    assert all(e1.prompt(k) == e2.prompt(k) for k in range(0, len(e1), 7))
    with pytest.raises(ValueError, match="previous_swap"):
        ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), previous_swap=1.5)


def test_next_rr_false_drops_only_the_following_interval(hlm):
    """Without ``next_rr`` the prompt is the default prompt less rr(i+1), the token before <beat?>."""
    from hlmtune.data_builders import ecg_beat_classification_dataset

    tk = hlm["tk"]
    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=4, beat_samples=96)
    full = ecg_beat_classification_dataset(tk, **kw)
    short = ecg_beat_classification_dataset(tk, next_rr=False, **kw)
    query = tk.vocab.ids["<beat?>"]
    for k in range(0, len(full), max(1, len(full) // 60)):
        a, b = full.prompt(k), short.prompt(k)
        e = int(full.index[k])
        rr = full.rr_tokens[int(full.rec[e])]
        j = int(full.beat[e])
        assert a[-1] == b[-1] == query and b == a[:-2] + [query]
        assert a[-2] == (int(rr[j + 1]) if j + 1 < rr.size else full.unknown_rr)


def test_template_delta_shows_the_beat_minus_the_template_by_hand(hlm):
    """template_delta: the waveform is (beat - template) in mV, re-binned by hand; all else unchanged.
    show_template False: the same prompt without the template."""
    import bisect

    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.vocab import quantizer_edges

    tk = hlm["tk"]
    v = tk.vocab
    edges = [float(e) for e in quantizer_edges(tk.params)]
    mid = lambda t: (edges[t - v.sample_base] + edges[t - v.sample_base + 1]) / 2  # noqa: E731
    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=4, beat_samples=96, template_beats=100)
    plain = ecg_beat_classification_dataset(tk, **kw)
    delta = ecg_beat_classification_dataset(tk, template_delta=True, **kw)
    hidden = ecg_beat_classification_dataset(tk, template_delta=True, show_template=False, **kw)
    small, large = [], []
    for k in range(0, len(plain), max(1, len(plain) // 60)):
        a, b = plain.prompt(k), delta.prompt(k)
        assert hidden.prompt(k) == [b[0]] + b[97:], k  # the same prompt less the template after <bos>
        wave = slice(len(a) - 2 - 96, len(a) - 2)
        assert b[: wave.start] == a[: wave.start] and b[wave.stop :] == a[wave.stop :]
        want = [v.sample_base + min(len(edges) - 2, max(0, bisect.bisect_right(edges, mid(x) - mid(t)) - 1))
                for x, t in zip(a[wave], a[1:97])]  # a[1:97]: the template that opens the prompt
        assert b[wave] == want, k
        assert not any(v.label_base <= t < v.rr_base for t in b), k  # still no label token in the input
        (small if plain.label_of(k) == "N" else large).append(np.mean([abs(mid(t)) for t in b[wave]]))
    assert small and np.median(small) < 0.1  # a normal beat is near its patient's template
    with pytest.raises(ValueError, match="template_delta"):
        ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), template_delta=True)
    with pytest.raises(ValueError, match="show_template"):
        ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), show_template=False)


def test_second_lead_follows_the_beat_by_hand(hlm):
    """second_lead: 32 samples of the second lead's window (R at 0.4 of them) follow the first lead's
    samples of the target beat, read from the shard file by hand; with template_delta they are the
    beat minus the second lead's own template, a median of the same earlier beats computed here;
    everything else in the prompt is unchanged. Training variations move both leads alike."""
    import bisect

    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.vocab import quantizer_edges

    tk = hlm["tk"]
    v, pre = tk.vocab, tk.params.pre
    edges = [float(e) for e in quantizer_edges(tk.params)]
    mid = lambda t: (edges[t - v.sample_base] + edges[t - v.sample_base + 1]) / 2  # noqa: E731
    level = lambda mv: v.sample_base + min(len(edges) - 2, max(0, bisect.bisect_right(edges, mv) - 1))  # noqa: E731
    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=4, beat_samples=96)
    plain = ecg_beat_classification_dataset(tk, **kw)
    raw = ecg_beat_classification_dataset(tk, second_lead=32, **kw)
    tkw = dict(kw, template_beats=100, template_delta=True)
    delta = ecg_beat_classification_dataset(tk, **tkw)
    both = ecg_beat_classification_dataset(tk, second_lead=32, **tkw)
    lead2 = {r: np.load(Path(hlm["shards"]) / "records" / f"{_stem(r)}.lead2.npy") for r in hlm["train"]}
    lo = pre - 13  # round(0.4 * 32) samples before R
    for k in range(0, len(plain), max(1, len(plain) // 40)):
        rec, j = hlm["train"][int(raw.rec[raw.index[k]])], int(raw.beat[raw.index[k]])
        a, b = plain.prompt(k), raw.prompt(k)
        cut = len(a) - 2  # after the first lead's samples: rr(i+1) <beat?>
        assert b[:cut] + b[cut + 32 :] == a and b[cut : cut + 32] == lead2[rec][j, lo : lo + 32].tolist(), k
        c, d = delta.prompt(k), both.prompt(k)
        assert d[:cut + 96] + d[cut + 96 + 32 :] == c, k  # (the template opens the prompt: 96 tokens later)
        s = (j // 64) * 64  # the template block's first beat; its median reads the 100 beats before it
        rows = lead2[rec][s - 100 : s] if s >= 100 else lead2[rec][:100]
        tmpl = [level(m) for m in np.median(np.vectorize(mid)(rows[:, lo : lo + 32]), axis=0)]  # (32,) tokens
        want = [level(mid(x) - mid(t)) for x, t in zip(lead2[rec][j, lo : lo + 32].tolist(), tmpl)]
        assert d[cut + 96 : cut + 96 + 32] == want, k
        assert not any(v.label_base <= t < v.rr_base for t in d), k
    from hlmtune.data_builders.ecg import lead_amplitude_lut

    scaled = ecg_beat_classification_dataset(tk, second_lead=32, normalize_amplitude=True, **kw)
    luts = {r: lead_amplitude_lut(lead2[r], v) for r in hlm["train"]}
    for k in range(0, len(scaled), max(1, len(scaled) // 20)):  # the second lead at its own scale
        rec, j = hlm["train"][int(scaled.rec[scaled.index[k]])], int(scaled.beat[scaled.index[k]])
        assert scaled.prompt(k)[-2 - 32 : -2] == luts[rec][lead2[rec][j, lo : lo + 32]].tolist(), k
    aug = ecg_beat_classification_dataset(tk, second_lead=32, augment=True, template_swap=1.0, **tkw)
    zero = level(0.0)
    for k in range(0, len(aug), max(1, len(aug) // 40)):
        p = aug.prompt(k)
        if aug.label_of(k) in ("N", "S"):  # the template in place of the beat, in both leads: delta zero
            assert p[-2 - 32 : -2] == [zero] * 32 and p[-2 - 32 - 96 : -2 - 32] == [zero] * 96, k
    with pytest.raises(ValueError, match="second_lead must be 0"):
        ecg_beat_classification_dataset(tk, second_lead=4, **kw)


def test_second_lead_is_shifted_with_the_first_in_training(hlm, monkeypatch):
    """augment's crop shift (+-2 samples) moves the second lead's samples by the same amount as the
    first lead's (the random gain made the identity here, so the shift can be read off the tokens)."""
    from hlmtune.data_builders import ecg as builders

    tk = hlm["tk"]
    monkeypatch.setattr(builders, "gain_lut", lambda vocab, edges, gain: np.arange(len(vocab), dtype=np.int64))
    ds = builders.ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), balance=None, context_beats=4,
                                                  beat_samples=96, second_lead=32, augment=True)
    pre = tk.params.pre
    lo1, lo2 = pre - 32, pre - 13  # the unshifted crops: R at a third of 96, at 0.4 of 32
    shifts = set()
    for k in range(0, len(ds), max(1, len(ds) // 60)):
        rec, j = hlm["train"][int(ds.rec[ds.index[k]])], int(ds.beat[ds.index[k]])
        tokens = np.load(Path(hlm["shards"]) / "records" / f"{_stem(rec)}.tokens.npy", mmap_mode="r")
        lead2 = np.load(Path(hlm["shards"]) / "records" / f"{_stem(rec)}.lead2.npy", mmap_mode="r")
        window = tokens[int(_beats(hlm, rec)["token_start"][j]) + 2 :][: tk.params.window].tolist()
        p = ds.prompt(k)
        first, second = p[-2 - 32 - 96 : -2 - 32], p[-2 - 32 : -2]
        found = [d for d in range(-2, 3) if window[lo1 + d : lo1 + d + 96] == first]
        assert found, k
        assert any(second == lead2[j, lo2 + d : lo2 + d + 32].tolist() for d in found), (k, found)
        shifts.update(found if len(found) == 1 else [])
    assert len(shifts) >= 3  # the shift did vary


def test_second_lead_needs_shards_with_it(hlm, tmp_path):
    """Shards tokenized without --second-lead: the builder names the records and the command."""
    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams

    recs = hlm["train"][:2] + hlm["test"][:1]
    opts = RecordOptions(sampto=360 * 60) if hlm["real"] else RecordOptions()
    tokenize_directory(hlm["db"], tmp_path / "one", params=TokenizerParams(), options=opts, records=recs,
                       workers=1, progress=False)
    tk = ECGTokenizer(manifest_path=str(tmp_path / "one"), max_seq_len=1024)
    (tmp_path / "s.json").write_text(json.dumps({"DS1": recs[:2], "DS2": recs[2:]}))
    with pytest.raises(ValueError, match=r"hold none for 2 record\(s\) .*hlmtune tokenize --second-lead"):
        ecg_beat_classification_dataset(tk, split_file=str(tmp_path / "s.json"), second_lead=32)
    ecg_beat_classification_dataset(tk, split_file=str(tmp_path / "s.json"))  # fine without it


def test_second_lead_amplitude_puts_each_records_median_qrs_peak_at_1_mv(hlm):
    """lead_amplitude_lut: after it, the median over beats of the largest |mV| within 50 ms of R is ~1 mV."""
    from hlmtune.data_builders.ecg import lead_amplitude_lut
    from hlmtune.ecg_tokenizer.vocab import dequantize, quantizer_edges

    tk = hlm["tk"]
    v, pre, edges = tk.vocab, tk.params.pre, quantizer_edges(tk.params)
    for r in hlm["train"][:3]:
        w = np.load(Path(hlm["shards"]) / "records" / f"{_stem(r)}.lead2.npy").astype(np.int64)
        peak = lambda x: float(np.median(np.abs(dequantize(x[:, pre - 6 : pre + 7] - v.sample_base, edges)).max(1)))  # noqa: E731
        before = peak(w)
        after = peak(lead_amplitude_lut(w, v)[w])
        want = before * float(np.clip(1.0 / before, 0.25, 4.0))  # 1 mV unless the factor is clipped
        assert abs(after - want) < 0.08 * want, (r, before, after)


def test_premature_synth_makes_n_beats_early_labels_them_s_and_never_in_evaluation(hlm):
    """A share p of the drawn N examples: same waveform, rr(i) at 0.55-0.85 of the context's median
    cycle, a longer following interval, answer S. Other examples and evaluation are untouched."""
    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.vocab import rr_edges

    tk = hlm["tk"]
    v = tk.vocab
    e = [float(x) for x in rr_edges(tk.params)]
    width = e[1] - e[0]
    sec = lambda t: (e[t - v.rr_base] + e[t - v.rr_base + 1]) / 2  # noqa: E731
    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=8, beat_samples=96)
    plain = ecg_beat_classification_dataset(tk, **kw)
    synth = ecg_beat_classification_dataset(tk, premature_synth=0.3, **kw)
    s_id = v.label_base + v.classes.index("S")
    changed = n_total = 0
    for k in range(len(plain)):
        a, b = plain.prompt(k), synth.prompt(k)
        if plain.label_of(k) != "N":
            assert b == a and synth.label_of(k) == plain.label_of(k)
            continue
        n_total += 1
        if b == a and synth.label_of(k) == "N":
            continue
        changed += 1
        assert not any(v.label_base <= t < v.rr_base for t in b), k  # the new label S is only the answer
        item = synth[k]
        assert synth.label_of(k) == "S" and item["tokens"][len(b)] == s_id and item["labels"][len(b)] == s_id
        wave = slice(len(a) - 2 - 96, len(a) - 2)
        assert b[wave] == a[wave] and b[: wave.start - 1] == a[: wave.start - 1] and b[-1] == a[-1]
        ctx = [t for t in a[1 : wave.start - 2] + [a[wave.start - 1]] if v.rr_base <= t < v.rr_base + tk.params.rr_bins]
        cycle = float(np.median([sec(t) for t in ctx]))
        before, after = sec(b[wave.start - 1]), sec(b[-2])
        lo, hi = min(0.55 * cycle, e[-1]), min(0.85 * cycle, e[-1])
        assert lo - width <= before <= hi + width, (k, before, cycle)  # clipped to the RR grid's ends
        assert after >= before
    assert n_total > 50 and 0.2 < changed / n_total < 0.4
    ev = dict(shards_dir=None, split="DS2", records=None, split_file=str(hlm["split_file"]), context_beats=8,
              classes=None, balance=None, num_examples=None, seed=0, random_test_fraction=0.2, evaluation=True)
    e1, e2 = _evaluation_set(tk, premature_synth=1.0, **ev), _evaluation_set(tk, **ev)
    assert all(e1[k] == e2[k] for k in range(0, len(e1), 5))
    with pytest.raises(ValueError, match="premature_synth"):
        ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), classes=["N", "V"], premature_synth=0.2)


def test_rr_ratios_are_bin_midpoints_over_the_standard_cycle_and_nan_off_the_rr_bins(hlm):
    """``rr_ratios`` (vectorised, what ``early_n_weight`` reads) and ``rr_ratio`` (one token, the timing
    table's) against the bin midpoints written out by hand; the unknown-interval token and any token
    outside the RR bins are NaN."""
    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.vocab import rr_edges

    tk = hlm["tk"]
    v, p = tk.vocab, tk.params
    e = [float(x) for x in rr_edges(p)]
    ds = ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), balance=None, context_beats=2,
                                         normalized_rr=32)
    tokens = np.arange(v.rr_base - 2, v.rr_base + p.rr_bins + 3)
    want = [(e[t - v.rr_base] + e[t - v.rr_base + 1]) / 2 / 0.8 if 0 <= t - v.rr_base < p.rr_bins else math.nan
            for t in tokens]
    got = ds.rr_ratios(tokens)
    assert got.shape == tokens.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, equal_nan=True)
    assert math.isnan(ds.rr_ratio(ds.unknown_rr)) and math.isnan(got[list(tokens).index(ds.unknown_rr)])
    assert [ds.rr_ratio(t) for t in tokens[2:-3]] == pytest.approx(want[2:-3], rel=1e-12)


def test_long_rr_is_the_beats_interval_against_the_upper_quartile_of_earlier_beats(hlm):
    """``long_rr``: the last token before ``<beat?>`` is rr(i) / q75(last N intervals) at 0.8 s, by hand;
    a synthetic premature example shows its drawn (early) interval there, scaled the same way."""
    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.data_builders.rr_features import NORMAL_RR_S
    from hlmtune.ecg_tokenizer.vocab import rr_edges

    tk = hlm["tk"]
    v, p = tk.vocab, tk.params
    e = [float(x) for x in rr_edges(p)]
    width = e[1] - e[0]
    sec = lambda t: (e[t - v.rr_base] + e[t - v.rr_base + 1]) / 2  # noqa: E731

    def upper_quartile(table, j, beats=48):
        known = sorted(float(x) for x in table["rr"][max(0, j - beats + 1): j + 1] if x > 0)
        pos = 0.75 * (len(known) - 1)
        lo = int(pos)
        return known[lo] + (known[min(lo + 1, len(known) - 1)] - known[lo]) * (pos - lo) if known else None

    def by_hand(table, j):
        q = upper_quartile(table, j)
        if table["rr"][j] <= 0 or q is None:
            return v.rr_base + p.rr_bins
        ratio_s = NORMAL_RR_S * float(table["rr"][j]) / q
        return v.rr_base + min(p.rr_bins - 1, max(0, int((ratio_s - p.rr_min_s) // width)))

    ds = ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), balance=None, context_beats=8,
                                         beat_samples=96, normalized_rr=64, long_rr=48, premature_synth=0.3)
    real = synthetic = 0
    for k in range(len(ds)):
        ex = ds.example(k)
        idx = int(ds.index[k])
        i, j = int(ds.rec[idx]), int(ds.beat[idx])
        long_tok = ex.feature_tokens[-1]
        assert ex.tokens[-2] == long_tok and len(ex.feature_tokens) == 1
        if not ds.synthetic[k]:
            real += 1
            assert long_tok == by_hand(ds.beats.tables[i], j), k
            continue
        synthetic += 1  # its drawn interval (0.55-0.85 of the context's cycle), against the long reference
        t = ds.beats.tables[i]  # the shown token is rr / median(last 64) at 0.8 s: rescaled to the quartile
        median = statistics.median(float(x) for x in t["rr"][max(0, j - 63): j + 1] if x > 0)
        scale = median / upper_quartile(t, j)
        assert abs(sec(long_tok) - min(max(sec(ex.rr_token) * scale, e[0]), e[-1])) <= width, k
    assert real > 50 and synthetic > 10
    plain = ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), balance=None, context_beats=8,
                                            beat_samples=96, normalized_rr=64)
    assert all(ds.prompt(k)[:-2] == plain.prompt(k)[:-1] for k in range(0, len(ds), 7) if not ds.synthetic[k])


def test_premature_synth_with_an_irregularity_limit_skips_irregular_contexts(hlm):
    """With premature_max_irregularity, a synthetic S example's context rhythm is regular by a
    slow reference; the limited draw is a subset of the unlimited one, which does reach irregular
    contexts (atrial fibrillation in the records), so the limit changes something."""
    import statistics

    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.vocab import SEP_ID, rr_edges

    tk = hlm["tk"]
    v = tk.vocab
    e = [float(x) for x in rr_edges(tk.params)]
    sec = lambda t: (e[t - v.rr_base] + e[t - v.rr_base + 1]) / 2  # noqa: E731

    def irregularity(prompt):  # the context RR tokens are the prompt's tokens before the target's <sep>
        ctx = [sec(t) for t in prompt[1 : prompt.index(SEP_ID)] if v.rr_base <= t < v.rr_base + tk.params.rr_bins]
        if len(ctx) < 3:
            return float("inf")
        return statistics.median(abs(b - a) for a, b in zip(ctx, ctx[1:])) / statistics.median(ctx)

    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=8, beat_samples=96, premature_synth=0.5)
    free = ecg_beat_classification_dataset(tk, **kw)
    limited = ecg_beat_classification_dataset(tk, premature_max_irregularity=0.1, **kw)
    fs, ls = np.flatnonzero(free.synthetic), np.flatnonzero(limited.synthetic)
    assert set(ls) <= set(fs) and len(ls) > 20
    assert all(irregularity(limited.prompt(k)) <= 0.1 + 1e-9 for k in ls)
    dropped = sorted(set(fs) - set(ls))
    assert len(dropped) > 5 and all(irregularity(free.prompt(k)) > 0.1 for k in dropped)
    for k in dropped[:20]:  # not synthesized: the example is the plain N beat
        assert limited.label_of(k) == "N" and limited.prompt(k) == ecg_beat_classification_dataset(
            tk, **{**kw, "premature_synth": 0.0}).prompt(k)
    with pytest.raises(ValueError, match="needs premature_synth"):
        ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), premature_max_irregularity=0.1)
    with pytest.raises(ValueError, match="premature_max_irregularity must be"):
        ecg_beat_classification_dataset(tk, **{**kw, "premature_max_irregularity": -1})


def test_irregular_synth_shows_n_beats_in_a_fibrillating_rhythm_and_never_in_evaluation(hlm):
    """A share p of the drawn N examples that are not made premature: same waveform and template,
    every known RR token (context, own, following) redrawn around the context's cycle with an
    irregularity of fibrillation (slow reference), answer still N. Other examples and
    evaluation are untouched; premature and irregular examples never overlap."""
    import statistics

    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.vocab import SEP_ID, rr_edges

    tk = hlm["tk"]
    v = tk.vocab
    e = [float(x) for x in rr_edges(tk.params)]
    sec = lambda t: (e[t - v.rr_base] + e[t - v.rr_base + 1]) / 2  # noqa: E731
    is_rr = lambda t: v.rr_base <= t < v.rr_base + tk.params.rr_bins  # noqa: E731

    def intervals(prompt):  # known RR tokens: the context, the beat's own (after <sep>), the following one
        sep = prompt.index(SEP_ID)
        return [sec(t) for t in prompt[1:sep] + [prompt[sep + 1], prompt[-2]] if is_rr(t)]

    def irregularity(x):  # median |successive difference| / median interval, written out
        return statistics.median(abs(b - a) for a, b in zip(x, x[1:])) / statistics.median(x)

    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=16, beat_samples=96)
    plain = ecg_beat_classification_dataset(tk, **kw)
    irr = ecg_beat_classification_dataset(tk, irregular_synth=0.5, **kw)
    n_id = v.label_base + v.classes.index("N")
    changed, n_total, before, after, shift = 0, 0, [], [], []
    for k in range(len(plain)):
        a, b = plain.prompt(k), irr.prompt(k)
        assert irr.label_of(k) == plain.label_of(k)  # the class never changes
        if plain.label_of(k) != "N":
            assert b == a
            continue
        n_total += 1
        if b == a:
            continue
        changed += 1
        assert irr[k]["tokens"][len(b)] == n_id and irr[k]["labels"][len(b)] == n_id
        sep = a.index(SEP_ID)
        assert len(b) == len(a) and b[sep + 2 : -2] == a[sep + 2 : -2] and b[:1] == a[:1]  # waveform, template
        assert all(is_rr(x) == is_rr(y) for x, y in zip(a, b))  # only RR tokens moved; unknown ones stay unknown
        x, y = intervals(a), intervals(b)
        if len(x) >= 8:
            before.append(irregularity(x))
            after.append(irregularity(y))
            # around the patient's cycle: the median of ~18 draws with sigma <= 0.45 strays from it
            # by ~0.13 in log (1.25 sigma / sqrt(n)); 0.6 is beyond 4 of those
            shift.append(abs(math.log(statistics.median(y) / statistics.median(x))))
            assert shift[-1] < 0.6, k
    assert n_total > 50 and 0.4 < changed / n_total < 0.6
    # sinus rhythm in most of these records: a few percent; redrawn: as irregular as the N beats of
    # DS1's atrial fibrillation (records 201 and 203: 10th / 50th / 90th percentile 0.15 / 0.27 / 0.45)
    q10, q50, q90 = np.percentile(after, [10, 50, 90])
    assert statistics.median(shift) < 0.12  # the cycle is kept
    assert statistics.median(before) < 0.06 and 0.1 < q10 and 0.2 < q50 < 0.4 and q90 < 0.65, (q10, q50, q90)
    both = ecg_beat_classification_dataset(tk, irregular_synth=0.5, premature_synth=0.5, **kw)
    assert both.irregular.any() and both.synthetic.any() and not (both.irregular & both.synthetic).any()
    ev = dict(shards_dir=None, split="DS2", records=None, split_file=str(hlm["split_file"]), context_beats=8,
              classes=None, balance=None, num_examples=None, seed=0, random_test_fraction=0.2, evaluation=True)
    e1, e2 = _evaluation_set(tk, irregular_synth=1.0, **ev), _evaluation_set(tk, **ev)
    assert all(e1[k] == e2[k] for k in range(0, len(e1), 5))
    with pytest.raises(ValueError, match="irregular_synth must be 0..1"):
        ecg_beat_classification_dataset(tk, **{**kw, "irregular_synth": 1.5})
    with pytest.raises(ValueError, match="lack N"):
        ecg_beat_classification_dataset(tk, **{**kw, "classes": ["S", "V"], "irregular_synth": 0.2})


def test_irregular_no_p_wave_takes_the_p_wave_away_only_in_synthetic_fibrillation(hlm):
    """With irregular_no_p_wave, irregular_synth's examples (and no others) show a template whose
    0.25..0.05 s before R is a straight line (the P wave gone, the rest untouched) and a beat
    that differs from the flattened one by a 4-9 Hz wave of at most 0.08 mV; RR tokens and the
    answer are those of irregular_synth alone; evaluation never changes."""
    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.vocab import SEP_ID, dequantize, quantizer_edges

    tk = hlm["tk"]
    v, rate = tk.vocab, float(tk.params.target_rate)
    edges = quantizer_edges(tk.params)
    mv = lambda toks: dequantize(np.asarray(toks) - v.sample_base, edges)  # noqa: E731
    n = 96  # beat_samples: R sits at a third of them (ecg.py _crop), 32 = 0.25 s at 128 Hz
    r = n // 3
    end = r - round(0.05 * rate)  # the QRS onset: 6 samples before R

    def straightness(x):  # largest distance of x[0..end] from the line through its ends, mV
        line = [x[0] + (x[end] - x[0]) * i / end for i in range(end + 1)]
        return max(abs(a - b) for a, b in zip(x[: end + 1], line))

    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=16, beat_samples=n,
              template_beats=64, normalize_amplitude=True, irregular_synth=0.5)
    irr = ecg_beat_classification_dataset(tk, **kw)
    nop = ecg_beat_classification_dataset(tk, irregular_no_p_wave=True, **kw)
    assert (irr.irregular == nop.irregular).all() and irr.irregular.sum() > 50
    p_before, p_after, checked = [], [], 0
    for k in range(len(irr)):
        a, b = irr.prompt(k), nop.prompt(k)
        assert nop.label_of(k) == irr.label_of(k) and nop[k]["labels"] == irr[k]["labels"]
        if not irr.irregular[k]:
            assert b == a  # every other example as before
            continue
        sep = a.index(SEP_ID)
        assert len(b) == len(a) and b.index(SEP_ID) == sep > n  # <bos> template(n) ctx-RR <sep> rr beat(n) rr <beat?>
        assert b[n + 1 : sep + 2] == a[n + 1 : sep + 2] and b[sep + 2 + n :] == a[sep + 2 + n :]  # RR, query
        ta, tb = mv(a[1 : 1 + n]), mv(b[1 : 1 + n])
        assert (tb[end + 1 :] == ta[end + 1 :]).all()  # the template from the QRS onset on: untouched
        p_before.append(straightness(ta))
        p_after.append(straightness(tb))
        # the beat: the flattened beat plus a small wave, also over the QRS and T
        ba, bb = mv(a[sep + 2 : sep + 2 + n]), mv(b[sep + 2 : sep + 2 + n])
        flat = np.concatenate([np.linspace(ba[0], ba[end], end + 1), ba[end + 1 :]])
        wave = bb - flat
        step = np.diff(edges).max()  # coarsest level: the largest rounding error of a sample
        assert np.abs(wave).max() <= 0.08 + step, k
        low = np.abs(flat) < 0.3  # where levels are fine (mu-law): the wave is not lost in rounding
        if low.sum() > 40 and checked < 60:
            w = wave[low] - wave[low].mean()
            spectrum = np.abs(np.fft.rfft(wave - wave.mean(), 4 * n))
            hz = np.fft.rfftfreq(4 * n, 1 / rate)[spectrum.argmax()]
            assert np.abs(w).max() > 0.01 and 3.0 <= hz <= 10.0, (k, hz)  # f waves of 4-9 Hz
            checked += 1
    # the fixture's P waves bend the template by ~0.1 mV; after: a line up to rounding
    assert np.median(p_before) > 0.05 and max(p_after) < 0.01, (np.median(p_before), max(p_after))
    assert checked > 20
    ev = dict(shards_dir=None, split="DS2", records=None, split_file=str(hlm["split_file"]), context_beats=8,
              classes=None, balance=None, num_examples=None, seed=0, random_test_fraction=0.2, evaluation=True,
              template_beats=64, beat_samples=n)
    e1 = _evaluation_set(tk, irregular_synth=1.0, irregular_no_p_wave=True, **ev)
    e2 = _evaluation_set(tk, **ev)
    assert all(e1[k] == e2[k] for k in range(0, len(e1), 5))
    with pytest.raises(ValueError, match="irregular_no_p_wave .* needs irregular_synth > 0"):
        ecg_beat_classification_dataset(tk, **{**kw, "irregular_synth": 0.0, "irregular_no_p_wave": True})


def test_rr_target_labels_the_target_beats_own_interval_and_nothing_else(hlm):
    """With rr_target, each training example has a second target: the token right after the
    target beat's <sep> (its own RR, as shown, synthetic prematurity included), unless unknown;
    tokens and every other label are those without it; evaluation keeps one target."""
    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.vocab import SEP_ID

    tk = hlm["tk"]
    v = tk.vocab
    rr_bins = int(tk.params.rr_bins)
    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=8, beat_samples=96,
              template_beats=64, normalized_rr=64, premature_synth=0.5)
    plain = ecg_beat_classification_dataset(tk, **kw)
    aux = ecg_beat_classification_dataset(tk, rr_target=True, **kw)
    labelled = unknown = synthetic = 0
    for k in range(len(aux)):
        a, b = plain[k], aux[k]
        assert a["tokens"] == b["tokens"]
        toks = b["tokens"]
        seps = [i for i, t in enumerate(toks) if t == SEP_ID]
        assert len(seps) == 1  # template (samples) and context (RR) hold no <sep>: this is the beat's
        at = seps[0] + 1
        diff = [i for i, (x, y) in enumerate(zip(a["labels"], b["labels"])) if x != y]
        if toks[at] == v.rr_base + rr_bins:  # the unknown interval (a record's first beat) is no target
            assert diff == []
            unknown += 1
            continue
        assert diff == [at] and b["labels"][at] == toks[at] and v.rr_base <= toks[at] < v.rr_base + rr_bins
        assert b["labels"][-2] == a["labels"][-2] != -100  # the class stays a target
        labelled += 1
        synthetic += bool(aux.synthetic[k])
    assert labelled > 100 and unknown >= 1 and synthetic > 10
    ev = _evaluation_set(tk, shards_dir=None, split="DS2", records=None, split_file=str(hlm["split_file"]),
                         context_beats=8, classes=None, balance=None, num_examples=None, seed=0,
                         random_test_fraction=0.2, evaluation=True, rr_target=True)
    assert all(sum(lab != -100 for lab in ev[k]["labels"]) == 1 for k in range(0, len(ev), 7))


def _stretch_reference(tokens, r, factor, base, edges):
    """Slow reference of a time stretch around sample r: each output sample looks up its source
    position by hand and blends the two neighbouring samples (ends held)."""
    from hlmtune.ecg_tokenizer.vocab import dequantize, quantize

    mv = [float(x) for x in dequantize(np.asarray(tokens) - base, edges)]
    out = []
    for x in range(len(mv)):
        pos = r + (x - r) / factor
        if pos <= 0:
            out.append(mv[0])
        elif pos >= len(mv) - 1:
            out.append(mv[-1])
        else:
            lo = int(math.floor(pos))
            w = pos - lo
            out.append(mv[lo] * (1 - w) + mv[lo + 1] * w)
    return (base + quantize(np.array(out), edges)).tolist()


def test_augment_stretch_scales_beat_and_template_in_time_around_r(hlm):
    """augment_stretch: the beat and the template are the plain example's, stretched by one factor
    per example around their R peak (checked against a slow reference, with and without the
    crop shift of augment); RR tokens, labels and the query stay; evaluation never stretches."""
    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.vocab import SEP_ID, quantizer_edges

    tk = hlm["tk"]
    base, edges, n = tk.vocab.sample_base, quantizer_edges(tk.params), 96
    pre, window = int(tk.params.pre), int(tk.params.window)
    offset = min(max(0, pre - n // 3), window - n)  # the crop keeps R at a third of the kept samples
    kw = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=8, beat_samples=n,
              template_beats=64, normalized_rr=64, premature_synth=0.2, num_examples=None)
    for augment in (False, True):
        plain = ecg_beat_classification_dataset(tk, augment=augment, **kw)
        st = ecg_beat_classification_dataset(tk, augment=augment, augment_stretch=0.15, **kw)
        assert plain.offset == offset
        factors, widened = [], 0
        for k in range(0, len(st), 3):
            a, b = plain[k], st[k]
            assert a["labels"] == b["labels"] and len(a["tokens"]) == len(b["tokens"])
            sep = b["tokens"].index(SEP_ID)
            f = st.stretch_factor(k)
            factors.append(f)
            off = offset
            if augment:  # the crop shift of augment: the same seeded draw as the dataset's
                off = int(np.clip(offset + np.random.default_rng((0, k)).integers(-2, 3), 0, window - n))
            ta, tb = a["tokens"][1 : 1 + n], b["tokens"][1 : 1 + n]
            ba, bb = a["tokens"][sep + 2 : sep + 2 + n], b["tokens"][sep + 2 : sep + 2 + n]
            assert tb == _stretch_reference(ta, pre - offset, f, base, edges), k
            assert bb == _stretch_reference(ba, pre - off, f, base, edges), k
            assert bb[pre - off] == ba[pre - off]  # R stays where it was
            # everything but the two waveforms is the plain example's: RR tokens, <sep>, query
            assert b["tokens"][1 + n : sep + 2] == a["tokens"][1 + n : sep + 2]
            assert b["tokens"][sep + 2 + n :] == a["tokens"][sep + 2 + n :]
            widened += f > 1.05 and bb != ba
        factors = np.log(factors)
        assert factors.min() >= -math.log(1.15) - 1e-9 and factors.max() <= math.log(1.15) + 1e-9
        assert factors.min() < -0.1 and factors.max() > 0.1 and abs(factors.mean()) < 0.03
        assert widened > 20
    ev = dict(shards_dir=None, split="DS2", records=None, split_file=str(hlm["split_file"]), context_beats=8,
              classes=None, balance=None, num_examples=None, seed=0, random_test_fraction=0.2, evaluation=True,
              template_beats=64, beat_samples=n)
    e1, e2 = _evaluation_set(tk, augment_stretch=0.3, **ev), _evaluation_set(tk, **ev)
    assert all(e1[k] == e2[k] for k in range(0, len(e1), 5))
    with pytest.raises(ValueError, match="augment_stretch must be"):
        ecg_beat_classification_dataset(tk, augment_stretch=0.6, **kw)


def test_templates_are_causal_after_the_warm_up():
    """A block's template never reads its own or later beats once the record is past the warm-up."""
    from hlmtune.data_builders.ecg import beat_templates

    rng = np.random.default_rng(0)
    waves = rng.normal(size=(300, 5))
    got = beat_templates(waves, beats=50, block=20)
    assert got.shape == (15, 5)
    for b in range(got.shape[0]):
        s = b * 20
        window = waves[s - 50 : s] if s >= 50 else waves[:50]
        assert np.allclose(got[b], np.median(window, axis=0))
    late = waves.copy()
    late[100:] += 10.0  # a change at beat 100 reaches blocks starting at 120, not earlier ones
    moved = np.abs(beat_templates(late, beats=50, block=20) - got).max(axis=1) > 0
    assert moved.tolist() == [False] * 6 + [True] * 9


# Every input option of the beat prompt switched on (training-time variations included): what
# the label-leak check runs the real builder with.
EVERY_INPUT = dict(context_beats=8, normalized_rr=64, normalize_amplitude=True, beat_samples=80, next_rr=True,
                   rr_reference="mean", local_rr=10, average_rr_s=300.0, long_rr=512, p_wave_beats=8,
                   template_beats=32, template_delta=True, show_template=True, augment=True, template_swap=0.2,
                   previous_swap=0.2, premature_synth=0.2, premature_max_irregularity=0.5, irregular_synth=0.2,
                   irregular_no_p_wave=True, rr_target=True, augment_stretch=0.15, second_lead=32,
                   record_balance=0.5, num_examples=300)


def _assert_no_label_in_inputs(ds, v) -> int:
    """Every example: no class token before the answer; returns the examples checked."""
    is_label = lambda t: v.label_base <= t < v.rr_base  # noqa: E731
    for k in range(len(ds)):
        item = ds[k]
        toks = item["tokens"]
        answer = len(toks) - 2  # prompt, answer, <eos>
        assert not any(is_label(t) for t in toks[:answer]), (k, toks)
        assert is_label(toks[answer]) and item["labels"][answer] == toks[answer]
        # other trained positions (rr_target) are RR tokens of the prompt, never a class
        assert all(not is_label(lab) for lab in item["labels"][:answer] if lab != -100)
    return len(ds)


def test_no_label_reaches_the_inputs_with_every_option_on(hlm):
    """The real builder (through the one prompt owner) with every input feature switched on."""
    from hlmtune.data_builders import ecg_beat_classification_dataset, ecg_beat_dpo_dataset

    tk = hlm["tk"]
    ds = ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), **EVERY_INPUT)
    assert ds.synthetic.any() and ds.irregular.any()  # the synthetic variations ran too
    assert _assert_no_label_in_inputs(ds, tk.vocab) == 300
    dpo = {k: x for k, x in EVERY_INPUT.items() if k not in ("rr_target", "augment_stretch")}
    pairs = ecg_beat_dpo_dataset(tk, split_file=str(hlm["split_file"]), **dpo)
    is_label = lambda t: tk.vocab.label_base <= t < tk.vocab.rr_base  # noqa: E731
    for k in range(0, len(pairs), 3):
        for side in ("chosen_input_ids", "rejected_input_ids"):
            assert not any(is_label(t) for t in pairs[k][side][:-2])


def test_a_label_leak_would_be_caught(hlm, monkeypatch):
    """Guard of the guard: a prompt owner that put a class token into the context fails the check."""
    from hlmtune.data_builders import ecg as builders

    tk = hlm["tk"]
    real = builders.assemble_prompt

    def leaky(*, context_rr, **kw):
        return real(context_rr=[*context_rr, tk.vocab.label_base], **kw)

    monkeypatch.setattr(builders, "assemble_prompt", leaky)
    ds = builders.ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), **EVERY_INPUT)
    with pytest.raises(AssertionError):
        _assert_no_label_in_inputs(ds, tk.vocab)


def _stream_reference(tk, shards, record, first, n_beats, beat_samples):
    """Slow, readable window of ``n_beats`` beats from ``first``, from the shard files directly."""
    from hlmtune.ecg_tokenizer.shards import stem

    v = tk.vocab
    tokens = np.load(Path(shards) / "records" / f"{stem(record)}.tokens.npy", mmap_mode="r")
    table = np.load(Path(shards) / "records" / f"{stem(record)}.beats.npy")
    window = tk.params.window
    r_at = window // 3  # the R peak's index in the tokenizer's window
    crop_start = min(max(0, r_at - beat_samples // 3), window - beat_samples)
    out = [v.ids["<bos>"]]
    for b in range(first, first + n_beats):
        at = int(table["token_start"][b])
        assert tokens[at] == v.ids["<sep>"]
        out.append(v.ids["<sep>"])
        out.append(v.rr_base + int(table["rr_bin"][b]))
        levels = [int(tokens[at + 2 + i]) for i in range(window)]
        out.extend(levels[crop_start : crop_start + beat_samples])
        if b + 1 < len(table):
            out.append(v.rr_base + int(table["rr_bin"][b + 1]))
        else:
            out.append(v.rr_base + tk.params.rr_bins)  # unknown RR
        out.append(v.ids["<beat?>"])
    out.append(v.ids["<eos>"])
    return out


@pytest.mark.parametrize("beat_samples", [80, 128])
def test_stream_windows_match_reference_and_hold_no_label(hlm, beat_samples):
    """Windows of consecutive beats: signal only; each class is the label after its beat's <beat?>."""
    from hlmtune.data_builders import ecg_beat_stream_dataset

    tk, v = hlm["tk"], hlm["tk"].vocab
    ds = ecg_beat_stream_dataset(tk, split_file=str(hlm["split_file"]), max_seq_len=1024,
                                 beat_samples=beat_samples, context_beats=2, num_examples=300)
    assert ds.k == (1024 - 2) // (beat_samples + 4)
    is_label = lambda t: v.label_base <= t < v.rr_base  # noqa: E731
    query = v.ids["<beat?>"]
    for k in range(len(ds)):
        item = ds[k]
        toks, labels = item["tokens"], item["labels"]
        assert len(toks) == len(labels) <= 1024
        assert not any(is_label(t) or v.rhythm_base <= t < v.task_base for t in toks)  # no class, no rhythm
        i, first, n_beats, _, anchor = (int(x) for x in ds.windows[k])
        record = hlm["train"][i]
        if k < 40:
            assert toks == _stream_reference(tk, hlm["shards"], record, first, n_beats, beat_samples)
        table = _beats(hlm, record)
        trained = [p for p, lab in enumerate(labels) if lab != -100]
        assert trained, "every training window trains at least its anchor"
        for p in trained:
            assert toks[p - 1] == query  # the class is predicted from the <beat?> position
            b = first + (p - 2) // (beat_samples + 4)
            assert labels[p] - v.label_base == table["label"][b]
        anchor_pos = 1 + (anchor - first + 1) * (beat_samples + 4)
        assert anchor_pos in trained and anchor - first >= min(2, anchor)  # context unless at the start


def test_stream_evaluation_labels_every_target_beat_once(hlm):

    tk = hlm["tk"]
    ds = _evaluation_set(tk, builder="ecg_beat_stream_dataset", shards_dir=None, split="DS2", records=None, split_file=str(hlm["split_file"]), max_seq_len=600,
                 beat_samples=96, context_beats=3, classes=["N", "V"], balance=0.5, num_examples=50, seed=0,
                 random_test_fraction=0.2, evaluation=True)
    seen = {}
    for k in range(len(ds)):
        i, first, n_beats, lab, anchor = (int(x) for x in ds.windows[k])
        assert anchor == -1 and ds.record_of(k) == hlm["test"][i]
        tokens, query_at, cls = ds.window(k)
        for q, c in zip(query_at, cls):
            b = first + (q - 1) // 100
            assert tokens[q] == tk.vocab.ids["<beat?>"] and (i, b) not in seen
            assert b - first >= 3 or first == 0  # context before every classified beat but a record's first
            seen[(i, b)] = c
    for i, record in enumerate(hlm["test"]):
        table = _beats(hlm, record)
        want = {b for b, lab in enumerate(table["label"]) if tk.vocab.classes[lab] in ("N", "V")}
        assert {b for (j, b) in seen if j == i} == want
        assert all(ds.classes[seen[(i, b)]] == tk.vocab.classes[table["label"][b]] for b in want)


def test_record_of_names_each_test_examples_patient(hlm):
    """Evaluation examples come record by record, every labelled beat once: the record of each
    example (what ``hlmtune eval``'s per-record table groups by) against the raw beat tables."""

    tk = hlm["tk"]
    ds = _evaluation_set(tk, shards_dir=None, split="DS2", records=None, split_file=str(hlm["split_file"]),
                         context_beats=4, classes=["N", "S", "V"], balance=None, num_examples=None, seed=0,
                         random_test_fraction=0.2, evaluation=True, beat_samples=96)
    want = []
    for record in hlm["test"]:
        labels = _beats(hlm, record)["label"]
        want += [record] * sum(tk.vocab.classes[lab] in ("N", "S", "V") for lab in labels)
    assert len(set(want)) > 1 and [ds.record_of(k) for k in range(len(ds))] == want
    # a class-balanced training draw: example k's beat (<sep> rr q...q) is found in record_of(k)'s shard
    from hlmtune.data_builders import ecg_beat_classification_dataset

    tr = ecg_beat_classification_dataset(tk, split_file=str(hlm["split_file"]), context_beats=0, num_examples=300)
    shard = {r: np.load(Path(hlm["shards"]) / "records" / f"{_stem(r)}.tokens.npy", mmap_mode="r") for r in hlm["train"]}
    for k in range(0, len(tr), 7):
        rec, j = tr.record_of(k), int(tr.beat[tr.index[k]])
        start = int(_beats(hlm, rec)["token_start"][j])
        assert tr.prompt(k)[1:-2] == shard[rec][start : start + 130].tolist()


def test_stream_rejects_a_window_too_short_for_its_context(hlm):
    from hlmtune.data_builders import ecg_beat_stream_dataset

    with pytest.raises(ValueError, match="max_seq_len 200 holds 2 beats of 84 tokens"):
        ecg_beat_stream_dataset(hlm["tk"], split_file=str(hlm["split_file"]), max_seq_len=200, context_beats=2)
    with pytest.raises(ValueError, match="beat_samples must be 16..128"):
        ecg_beat_stream_dataset(hlm["tk"], split_file=str(hlm["split_file"]), beat_samples=200)


def test_pretraining_windows_are_signal_only(hlm):
    from hlmtune.data_builders import ecg_pretrain_dataset

    tk, v = hlm["tk"], hlm["tk"].vocab
    ds = ecg_pretrain_dataset(tk, split_file=str(hlm["split_file"]), max_seq_len=256)
    assert len(ds) > 10
    for k in range(len(ds)):
        toks = ds[k]["tokens"]
        assert len(toks) <= 256 and not any(v.label_base <= t < v.rr_base or t >= v.rhythm_base for t in toks)


def test_ds2_is_refused_for_training(hlm):
    from hlmtune.data_builders import ecg_beat_classification_dataset, ecg_pretrain_dataset
    from hlmtune.ecg_tokenizer.splits import SplitError

    test_rec = hlm["test"][0]
    for build in (ecg_pretrain_dataset, ecg_beat_classification_dataset):
        with pytest.raises(SplitError, match="read only by `hlmtune eval`"):
            build(hlm["tk"], split_file=str(hlm["split_file"]), records=[hlm["train"][0], test_rec])


def test_class_balance_shares(hlm):
    """balance=0 gives equal classes, 1 the recorded shares; repeats only where a class is short."""
    from collections import Counter

    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.data_builders.ecg import balanced_indices

    labels = np.array([0] * 900 + [1] * 90 + [2] * 10)
    eq = Counter(labels[balanced_indices(labels, balance=0.0, num_examples=300, seed=0)])
    assert eq == {0: 100, 1: 100, 2: 100}
    assert len(balanced_indices(labels, balance=0.5, num_examples=301, seed=0)) == 301  # rounding handed out
    nat = Counter(labels[balanced_indices(labels, balance=1.0, num_examples=1000, seed=0)])
    assert nat == {0: 900, 1: 90, 2: 10}
    sq = balanced_indices(labels, balance=0.5, num_examples=1000, seed=0)
    c = Counter(labels[sq])
    assert abs(c[0] / c[1] - (900 / 90) ** 0.5) < 0.05 and len(set(sq[labels[sq] == 0])) == c[0]
    with pytest.raises(ValueError, match="balance must be in"):
        balanced_indices(labels, balance=2.0, num_examples=None, seed=0)
    ds = ecg_beat_classification_dataset(hlm["tk"], split_file=str(hlm["split_file"]), balance=0.0,
                                         num_examples=400, classes=["N", "V"])
    assert Counter(ds.label_of(k) for k in range(len(ds))) == {"N": 200, "V": 200}


def test_record_balance_spreads_a_class_over_its_patients(hlm):
    """Within a class, record shares follow count ** record_balance; 1 keeps the old draw exactly."""
    from collections import Counter

    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.data_builders.ecg import balanced_indices

    # class 1 (the rare one): record 0 holds 81 beats, records 1 and 2 hold 9 each; class 0: 900 in record 3
    labels = np.array([0] * 900 + [1] * 99)
    groups = np.array([3] * 900 + [0] * 81 + [1] * 9 + [2] * 9)
    base = balanced_indices(labels, balance=0.0, num_examples=600, seed=1)
    same = balanced_indices(labels, balance=0.0, num_examples=600, seed=1, groups=groups, group_balance=1.0)
    np.testing.assert_array_equal(base, same)
    for gb, want in ((0.0, {0: 100, 1: 100, 2: 100}), (0.5, {0: 180, 1: 60, 2: 60})):
        idx = balanced_indices(labels, balance=0.0, num_examples=600, seed=1, groups=groups, group_balance=gb)
        assert Counter(labels[idx]) == {0: 300, 1: 300}  # class shares untouched
        assert Counter(groups[idx[labels[idx] == 1]]) == want  # 81**.5 : 9**.5 : 9**.5 = 3 : 1 : 1
        for g in (1, 2):  # a small record is cycled through whole before any beat repeats
            drawn = Counter(idx[groups[idx] == g])
            assert max(drawn.values()) - min(drawn.values()) <= 1 and len(drawn) == 9
    with pytest.raises(ValueError, match="record_balance must be in"):
        balanced_indices(labels, balance=0.0, num_examples=10, seed=0, groups=groups, group_balance=-0.5)
    # through the builder: with record_balance 0 every training record with V beats gets an equal share
    ds = ecg_beat_classification_dataset(hlm["tk"], split_file=str(hlm["split_file"]), balance=0.0,
                                         num_examples=800, classes=["N", "V"], record_balance=0.0)
    v_rec = Counter(int(ds.rec[ds.index[k]]) for k in range(len(ds)) if ds.label_of(k) == "V")
    assert len(v_rec) >= 2 and max(v_rec.values()) - min(v_rec.values()) <= 1, v_rec


def test_early_n_weight_draws_more_of_the_n_beats_that_come_early(hlm):
    """Within a class, weighted candidates share its draws by count x weight; early_n_weight weights
    the N beats whose own RR token is under 0.8 x the running reference, class shares unchanged."""
    from collections import Counter

    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.data_builders.ecg import balanced_indices

    labels = np.array([0] * 900 + [1] * 100)
    w = np.where(np.arange(1000) < 100, 4.0, 1.0)  # class 0: 100 beats of weight 4, 800 of weight 1
    plain = balanced_indices(labels, balance=0.0, num_examples=600, seed=2)
    np.testing.assert_array_equal(plain, balanced_indices(labels, balance=0.0, num_examples=600, seed=2,
                                                          weights=np.ones(1000)))
    idx = balanced_indices(labels, balance=0.0, num_examples=600, seed=2, weights=w)
    assert Counter(labels[idx]) == {0: 300, 1: 300}
    assert int(np.sum(idx < 100)) == 100  # 300 x (100 x 4) / (100 x 4 + 800 x 1)
    with pytest.raises(ValueError, match="weights must be"):
        balanced_indices(labels, balance=0.0, num_examples=10, seed=0, weights=-w)

    kw = dict(split_file=str(hlm["split_file"]), balance=0.5, num_examples=3000, classes=["N", "S", "V"],
              context_beats=8, normalized_rr=32)
    base = ecg_beat_classification_dataset(hlm["tk"], **kw)
    boosted = ecg_beat_classification_dataset(hlm["tk"], **kw, early_n_weight=4.0)

    def early_n(ds):  # drawn N examples whose own RR token (as the prompt shows it) is under 0.8
        return sum(ds.label_of(k) == "N" and ds.rr_ratio(ds.rr_tokens[int(ds.rec[ds.index[k]])][
            int(ds.beat[ds.index[k]])]) < 0.8 for k in range(len(ds)))

    assert Counter(map(base.label_of, range(len(base)))) == Counter(map(boosted.label_of, range(len(boosted))))
    cand = base.label == base.vocab.classes.index("N")
    ratios = np.array([base.rr_ratio(base.rr_tokens[r][b]) for r, b in zip(base.rec, base.beat)])
    share = float(np.mean(ratios[cand] < 0.8))
    assert 0.0 < share < 0.2, share  # the synthetic records hold a few early N beats
    n_drawn = sum(base.label_of(k) == "N" for k in range(len(base)))
    want = n_drawn * 4 * share / (4 * share + 1 - share)
    assert early_n(base) < 1.5 * n_drawn * share + 5
    assert abs(early_n(boosted) - want) <= 1, (early_n(boosted), want)
    with pytest.raises(ValueError, match="early_n_weight needs normalized_rr"):
        ecg_beat_classification_dataset(hlm["tk"], **{**kw, "normalized_rr": 0}, early_n_weight=4.0)
    with pytest.raises(ValueError, match="early_n_weight must be > 0"):
        ecg_beat_classification_dataset(hlm["tk"], **kw, early_n_weight=0.0)


def test_a_dpo_runs_test_set_reads_its_keys_as_the_dpo_builder_does():
    """`hlmtune eval` parses a DPO run's dataset section with the DPO builder's options: its excluded
    keys are refused there too (before any shard is read)."""
    with pytest.raises(TypeError, match=r"ecg_beat_dpo_dataset\(\) got an unexpected keyword argument 'rr_target'"):
        _evaluation_set(None, builder="ecg_beat_dpo_dataset", rr_target=True)


def test_dpo_pairs_reject_the_confusion_that_matters(hlm):
    from hlmtune.data_builders import ecg_beat_dpo_dataset

    tk = hlm["tk"]
    ds = ecg_beat_dpo_dataset(tk, split_file=str(hlm["split_file"]), classes=["N", "S", "V"], num_examples=200)
    seen = set()
    for k in range(len(ds)):
        item, truth, bad = ds[k], ds.base.label_of(k), ds.rejected_label(k)
        assert truth != bad and {"N": {"S", "V"}, "S": {"N"}, "V": {"N"}}[truth] >= {bad}
        assert item["chosen_input_ids"][:-2] == item["rejected_input_ids"][:-2]
        assert tk.id_to_token(item["chosen_input_ids"][-2]) == truth and tk.id_to_token(item["rejected_input_ids"][-2]) == bad
        seen.add((truth, bad))
    assert ("N", "S") in seen and ("N", "V") in seen


def test_af_targets_come_from_rhythms_never_the_input(hlm, tmp_path):
    """AF segments read one token per beat (symbols of annotation shards); the answer is the rhythm."""
    from hlmtune.data_builders import ecg_af_dataset
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams
    from hlmtune.hlm.pipeline import synthetic_database

    db = synthetic_database(tmp_path / "db", n_records=4, duration_s=300)
    names = json.loads((db / "splits.json").read_text())
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"DS1": names["DS1"] + names["DS2"][:-1], "DS2": names["DS2"][-1:]}))
    tokenize_directory(db, tmp_path / "ann", params=TokenizerParams(scheme="annotation"), options=RecordOptions(),
                       progress=False)
    tk = ECGTokenizer(manifest_path=str(tmp_path / "ann"))
    ds = ecg_af_dataset(tk, split_file=str(split), segment_beats=41, balance=None)
    v = tk.vocab
    answers = {True: v.ids["<af>"], False: v.ids["<not_af>"]}
    yes = 0
    for k in range(len(ds)):
        item = ds[k]
        body = item["tokens"][1:-3]
        assert len(body) == 41 and all(v.label_base <= t < v.rr_base for t in body)  # beat symbols only
        assert not any(v.rhythm_base <= t < v.task_base for t in item["tokens"])  # no rhythm token
        assert item["tokens"][-2] == answers[ds.is_af(k)] and item["labels"][-2] == item["tokens"][-2]
        yes += ds.is_af(k)
    assert 0 < yes < len(ds)  # the synthetic records hold AF episodes and sinus rhythm
    # segments of 41 beats every 41 beats, record by record (balance None: each one once, in order)
    want = []
    for record in names["DS1"] + names["DS2"][:-1]:
        n_beats = int(np.load(tmp_path / "ann" / "records" / f"{_stem(record)}.beats.npy", mmap_mode="r").size)
        want += [record] * ((n_beats - 41) // 41 + 1)
    assert [ds.record_of(k) for k in range(len(ds))] == want

    # The target is a strict majority of the segment's beats in (AFIB, read here straight from
    # the beat tables and the records' rhythm lists: with an even length and stride 1 the windows
    # that slide over an episode's edge hold exactly half, and a tie is not AF.
    ds = ecg_af_dataset(tk, split_file=str(split), segment_beats=40, stride_beats=1, balance=None)
    ties = 0
    for k in range(len(ds)):
        stem_ = _stem(ds.record_of(k))
        table = np.load(tmp_path / "ann" / "records" / f"{stem_}.beats.npy", mmap_mode="r")
        names_ = json.loads((tmp_path / "ann" / "records" / f"{stem_}.json").read_text())["rhythms"]
        start = int(ds.start[ds.index[k]])
        n_af = sum(int(r) >= 0 and names_[int(r)] == "(AFIB" for r in table["rhythm"][start:start + 40])
        assert ds.is_af(k) == (n_af > 20), (k, n_af)
        ties += n_af == 20
    assert ties > 0
    # split: random holds out beats, not segments: AF would be tested on its training segments
    with pytest.raises(ValueError, match="split 'random' holds out beats, not AF segments"):
        ecg_af_dataset(tk, split="random", split_file=str(split))


def test_annotation_shards_are_refused_for_beat_classes(tmp_path):
    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, tokenize_directory
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams
    from hlmtune.hlm.pipeline import synthetic_database

    db = synthetic_database(tmp_path / "db", n_records=2, duration_s=60)
    tokenize_directory(db, tmp_path / "ann", params=TokenizerParams(scheme="annotation"), options=RecordOptions(),
                       progress=False)
    with pytest.raises(ValueError, match="annotators' labels"):
        ecg_beat_classification_dataset(ECGTokenizer(manifest_path=str(tmp_path / "ann")),
                                        split_file=str(db / "splits.json"))


def test_p_wave_beats_token_is_the_earlier_beats_p_wave_regularity_last_before_the_query(hlm):
    """``p_wave_beats``: the last token before ``<beat?>`` is the record's p_wave_regularity of the
    target beat (from the shard's samples, read here by hand), an RR token; a synthetic fibrillating
    example without P waves shows a value in the fibrillating range; nothing else in the prompt moves."""
    from hlmtune.data_builders import ecg_beat_classification_dataset
    from hlmtune.data_builders.ecg import FIBRILLATING_P_REGULARITY
    from hlmtune.data_builders.p_wave import p_wave_regularity
    from hlmtune.ecg_tokenizer.dataset import open_token_shard
    from hlmtune.ecg_tokenizer.shards import read_manifest
    from hlmtune.ecg_tokenizer.vocab import dequantize, quantizer_edges

    tk = hlm["tk"]
    v, p = tk.vocab, tk.params
    man = read_manifest(str(hlm["shards"]))
    by_name = {r["record"]: r for r in man["records"]}
    expect = {}
    for r in hlm["train"]:
        t = _beats(hlm, r)
        toks = open_token_shard(Path(hlm["shards"]), by_name[r])
        waves = np.stack([toks[s + 2: s + 2 + p.window] for s in t["token_start"]]).astype(np.int64) - v.sample_base
        vals = p_wave_regularity(dequantize(waves, quantizer_edges(p)), pre=p.window // 3, fs=p.target_rate, beats=6)
        expect[r] = [v.rr_base + p.rr_bins if np.isnan(x) else v.rr_base + min(p.rr_bins - 1, int((x + 1) / 2 * p.rr_bins))
                     for x in vals]
    opts = dict(split_file=str(hlm["split_file"]), balance=None, context_beats=8, beat_samples=96, normalized_rr=64)
    ds = ecg_beat_classification_dataset(tk, p_wave_beats=6, **opts)
    plain = ecg_beat_classification_dataset(tk, **opts)
    known = 0
    for k in range(len(ds)):
        ex = ds.example(k)
        e = int(ds.index[k])
        want = expect[ds.beats.names[int(ds.rec[e])]][int(ds.beat[e])]
        assert ex.feature_tokens == [want] and ex.tokens[-2] == want, k
        assert ex.tokens[:-2] + ex.tokens[-1:] == plain.example(k).tokens, k  # only the one token added
        known += want != v.rr_base + p.rr_bins
    assert known > 0.9 * len(ds)
    fib = ecg_beat_classification_dataset(tk, p_wave_beats=6, irregular_synth=0.5, irregular_no_p_wave=True, **opts)
    lo, hi = (v.rr_base + int((x + 1) / 2 * p.rr_bins) for x in FIBRILLATING_P_REGULARITY)
    drawn = [fib.example(k).feature_tokens[-1] for k in range(len(fib)) if fib.irregular[k]]
    assert len(drawn) > 20 and all(lo <= t <= hi for t in drawn) and len(set(drawn)) > 3
