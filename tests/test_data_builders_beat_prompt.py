"""The beat prompt's one owner: option objects, the block layout, and ``assemble_prompt``."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

from hlmtune.data_builders.beat_prompt import (
    TRAINING_ONLY, BeatBlock, BeatDraw, BeatPromptOptions, BeatSource, assemble_prompt, builder_signature,
    option_docs, parse_options,
)
from hlmtune.ecg_tokenizer.vocab import BOS_ID, SEP_ID

# One value per prompt option that switches it on (with what it needs switched on beside it).
ON = {
    "context_beats": dict(context_beats=3),
    "normalized_rr": dict(normalized_rr=32),
    "normalize_amplitude": dict(normalize_amplitude=True),
    "beat_samples": dict(beat_samples=64),
    "next_rr": dict(next_rr=False),
    "rr_reference": dict(normalized_rr=32, rr_reference="mean"),
    "local_rr": dict(local_rr=10),
    "average_rr_s": dict(average_rr_s=300.0, normalized_rr=64),
    "long_rr": dict(long_rr=64, premature_synth=0.5),
    "p_wave_beats": dict(p_wave_beats=8, irregular_synth=0.5, irregular_no_p_wave=True),
    "template_beats": dict(template_beats=32),
    "template_delta": dict(template_beats=32, template_delta=True),
    "show_template": dict(template_beats=32, show_template=False, template_delta=True),
    "second_lead": dict(second_lead=32),
    "augment": dict(augment=True),
    "template_swap": dict(template_beats=32, template_swap=0.5),
    "previous_swap": dict(previous_swap=0.5),
    "premature_synth": dict(premature_synth=0.5),
    "premature_max_irregularity": dict(premature_synth=0.5, premature_max_irregularity=0.3),
    "irregular_synth": dict(irregular_synth=0.5),
    "irregular_no_p_wave": dict(irregular_synth=0.5, irregular_no_p_wave=True),
    "rr_target": dict(rr_target=True),
    "augment_stretch": dict(augment_stretch=0.2, template_beats=32),
}


def test_every_prompt_option_has_a_switch_here_and_a_meaning():
    names = [f.name for f in dataclasses.fields(BeatPromptOptions)]
    assert sorted(ON) == sorted(names)
    docs = option_docs()
    for cls in (BeatSource, BeatDraw, BeatPromptOptions):
        for f in dataclasses.fields(cls):
            assert len(docs.get(f.name, "")) > 20, f.name


def test_builder_signatures_are_the_option_fields():
    from hlmtune.data_builders import ecg_beat_classification_dataset, ecg_beat_dpo_dataset

    sig = inspect.signature(ecg_beat_classification_dataset)
    fields = [f for cls in (BeatSource, BeatDraw, BeatPromptOptions) for f in dataclasses.fields(cls)]
    assert list(sig.parameters) == ["tokenizer", *[f.name for f in fields]]
    assert all(sig.parameters[f.name].default == f.default for f in fields)
    assert all(p.kind is p.KEYWORD_ONLY for n, p in sig.parameters.items() if n != "tokenizer")
    assert sig.return_annotation == "ECGBeatClassificationDataset"  # read by the recipe pairing check
    dpo = inspect.signature(ecg_beat_dpo_dataset)
    assert dpo.parameters["balance"].default == 0.25
    assert "rr_target" not in dpo.parameters and "augment_stretch" not in dpo.parameters
    assert dpo.return_annotation == "ECGBeatPreferenceDataset"
    assert builder_signature(ecg_beat_dpo_dataset, exclude=("seed",)).parameters.get("seed") is None


def test_parse_options_names_the_closest_key_and_honours_builder_defaults():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'templat_beats' \(did you mean 'template_beats'"):
        parse_options("b", {"templat_beats": 3})
    with pytest.raises(TypeError, match="'rr_target'"):
        parse_options("b", {"rr_target": True}, exclude=("rr_target",))
    source, draw, prompt = parse_options("b", {"split_file": "s.json", "seed": 3, "next_rr": False},
                                         defaults={"balance": 0.25})
    assert source == BeatSource(split_file="s.json")
    assert draw == BeatDraw(balance=0.25, seed=3)
    assert prompt == BeatPromptOptions(next_rr=False)


@pytest.mark.parametrize("bad, match", [
    (dict(context_beats=1001), "context_beats must be 0..1000"),
    (dict(template_swap=0.5), "needs template_beats > 0"),
    (dict(template_delta=True), "template_delta shows the beat minus"),
    (dict(show_template=False), "show_template: False hides"),
    (dict(previous_swap=1.5), "previous_swap must be 0..1"),
    (dict(premature_synth=-0.1), "premature_synth must be 0..1"),
    (dict(premature_max_irregularity=0.3), "it needs premature_synth > 0"),
    (dict(premature_synth=0.1, premature_max_irregularity=11), r"must be in \(0, 10\]"),
    (dict(irregular_no_p_wave=True), "it needs irregular_synth > 0"),
    (dict(augment_stretch=0.6), "augment_stretch must be 0"),
    (dict(rr_reference="mode"), "rr_reference must be one of .'median', 'mean', 'gated', 'gated_regular'."),
    (dict(local_rr=-1), "local_rr must be 0"),
    (dict(long_rr=-5), "long_rr must be 0"),
    (dict(p_wave_beats=2), "p_wave_beats must be 0 .off. or the earlier beats compared .3..1000."),
    (dict(average_rr_s=4000), "average_rr_s must be 0"),
    (dict(second_lead=4), r"second_lead must be 0 \(off\) or the second lead's samples shown"),
])
def test_option_checks_name_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        BeatPromptOptions(**bad)


def test_evaluation_turns_every_training_variation_off_and_keeps_the_inputs():
    on = {k: v for opts in ON.values() for k, v in opts.items() if k != "show_template"}
    opts = BeatPromptOptions(**on)
    ev = opts.for_evaluation()
    default = BeatPromptOptions()
    # written out here, not read from TRAINING_ONLY: what evaluation must never vary
    varied = {"augment", "template_swap", "previous_swap", "premature_synth", "premature_max_irregularity",
              "irregular_synth", "irregular_no_p_wave", "rr_target", "augment_stretch"}
    assert set(TRAINING_ONLY) == varied
    for f in dataclasses.fields(BeatPromptOptions):
        want = getattr(default, f.name) if f.name in varied else getattr(opts, f.name)
        assert getattr(ev, f.name) == want, f.name
    assert BeatDraw(balance=0.3, num_examples=9, seed=4).for_evaluation() == BeatDraw(balance=None, seed=4)


def test_assemble_prompt_layout():
    p = assemble_prompt(template=[70, 71], context_rr=[40, 41, 42], beat=[SEP_ID, 43, 80, 81, 82],
                        next_rr=44, query_id=9, rr_ratio=0.5)
    assert p.tokens == [BOS_ID, 70, 71, 40, 41, 42, SEP_ID, 43, 80, 81, 82, 44, 9]
    assert p.tokens[p.target_at] == SEP_ID and p.rr_token == 43 and p.next_rr_token == 44 and p.rr_ratio == 0.5
    q = assemble_prompt(template=[], context_rr=[], beat=[SEP_ID, 43, 80], next_rr=None, query_id=9)
    assert q.tokens == [BOS_ID, SEP_ID, 43, 80, 9] and q.target_at == 1 and q.next_rr_token is None
    block = BeatBlock(3)
    assert (block.SEP, block.RR, block.WAVE, block.next_rr_at, block.query_at, len(block)) == (0, 1, 2, 5, 6, 7)
    assert (BeatBlock(3, features=2).features_at, BeatBlock(3, features=2).query_at, len(BeatBlock(3, features=2))) == (6, 8, 9)
    f = assemble_prompt(template=[], context_rr=[40], beat=[SEP_ID, 43, 80], next_rr=44, query_id=9, features=[45, 46])
    assert f.tokens == [BOS_ID, 40, SEP_ID, 43, 80, 44, 45, 46, 9] and f.feature_tokens == [45, 46]
    assert BeatBlock(3, next_rr=False).query_at == 5 and BeatBlock(3, query=False).query_at is None


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from hlm_fixtures import make_shards
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer

    info = make_shards(tmp_path_factory.mktemp("beat_prompt"))
    info["tk"] = ECGTokenizer(manifest_path=str(info["shards"]), max_seq_len=1024)
    return info


@pytest.mark.parametrize("option", sorted(ON))
def test_every_option_goes_through_the_one_owner(shards, option):
    """Per option: the tokens the dataset yields are the owner's, and its record of the target holds."""
    from hlmtune.data_builders import ecg_beat_classification_dataset

    tk = shards["tk"]
    v = tk.vocab
    ds = ecg_beat_classification_dataset(tk, split_file=str(shards["split_file"]), num_examples=60, **ON[option])
    n_samples = ds.beat_samples
    for k in range(len(ds)):
        ex = ds.example(k)
        item = ds[k]
        assert item["tokens"][: len(ex.tokens)] == ex.tokens == ds.prompt(k)
        t = ex.tokens
        assert t[0] == BOS_ID and t[-1] == v.ids["<beat?>"] and t.count(SEP_ID) == 1
        assert t[ex.target_at] == SEP_ID and t[ex.target_at + BeatBlock.RR] == ex.rr_token
        # the block's waveform: the first lead's samples, then the second lead's (second_lead)
        assert ds.block.samples == n_samples + ds.second_lead and len(ds.block) == len(t) - ex.target_at
        tail = len(t) - (ex.target_at + BeatBlock.WAVE + ds.block.samples)  # [rr(i+1)] [features] <beat?>
        n_feat = sum(bool(getattr(ds.options, f)) for f in ("local_rr", "average_rr_s", "long_rr", "p_wave_beats"))
        assert len(ex.feature_tokens) == n_feat and tail == (2 if ds.next_rr else 1) + n_feat
        assert t[len(t) - 1 - n_feat : -1] == ex.feature_tokens
        assert all(v.rr_base <= f <= v.rr_base + tk.params.rr_bins for f in ex.feature_tokens)
        if ds.next_rr:
            assert t[-2 - n_feat] == ex.next_rr_token
        else:
            assert ex.next_rr_token is None
        head = ex.target_at - 1  # template and context before <sep>
        assert head == (n_samples if ds.templates is not None and ds.show_template else 0) + min(
            ds.context_beats, int(ds.beat[ds.index[k]]))
        if ds.normalized_rr:
            b = ex.rr_token - v.rr_base
            assert math.isnan(ex.rr_ratio) if b >= tk.params.rr_bins else 0 < ex.rr_ratio < 4
        else:
            assert ex.rr_ratio is None
        trained = [i for i, lab in enumerate(item["labels"]) if lab != -100]
        extra = [ex.target_at + BeatBlock.RR] if ds.rr_target and ex.rr_token != ds.unknown_rr else []
        assert trained == sorted(extra + [len(ex.tokens)])


def test_stream_windows_are_blocks_of_the_same_layout(shards):
    from hlmtune.data_builders import ecg_beat_stream_dataset

    ds = ecg_beat_stream_dataset(shards["tk"], split_file=str(shards["split_file"]), max_seq_len=600, num_examples=5)
    assert ds.per_beat == len(BeatBlock(ds.beat_samples)) == ds.beat_samples + 4
    tokens, query_at, _ = ds.window(0)
    body = tokens[1:-1]
    for j in range(ds.k):
        blk = body[j * ds.per_beat : (j + 1) * ds.per_beat]
        assert blk[BeatBlock.SEP] == SEP_ID and blk[ds.block.query_at] == ds.query_id
    assert all(tokens[q] == ds.query_id for q in query_at)
