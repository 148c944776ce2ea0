"""Evaluation arithmetic against hand-computed values, the baseline table, and the report guards."""

from __future__ import annotations

import json
import math

import pytest

from hlmtune.hlm import evaluate as ev


def test_metrics_match_a_hand_computed_confusion():
    # true N: 90 N, 6 S, 4 V; true S: 3 N, 7 S; true V: 1 N, 1 S, 8 V
    m = [[90, 6, 4], [3, 7, 0], [1, 1, 8]]
    assert ev.confusion_matrix([0, 0, 1, 2, 2], [0, 1, 1, 2, 0], 3) == [[1, 1, 0], [0, 1, 0], [1, 0, 1]]
    r = ev.summarize(m, ["N", "S", "V"])
    s = r["per_class"]["S"]
    assert s["support"] == 10 and s["tp"] == 7 and s["fn"] == 3 and s["fp"] == 7
    assert s["se"] == pytest.approx(0.7) and s["ppv"] == pytest.approx(0.5)
    assert s["f1"] == pytest.approx(2 * 0.7 * 0.5 / 1.2)
    v = r["per_class"]["V"]
    assert v["se"] == pytest.approx(0.8) and v["ppv"] == pytest.approx(8 / 12)
    n = r["per_class"]["N"]
    assert n["se"] == pytest.approx(0.9) and n["ppv"] == pytest.approx(90 / 94)
    assert r["macro_f1"] == pytest.approx((n["f1"] + s["f1"] + v["f1"]) / 3)
    assert r["accuracy"] == pytest.approx(105 / 120) and r["n"] == 120


def test_undefined_figures_are_none_not_zero():
    r = ev.summarize([[5, 0], [0, 0]], ["N", "S"])
    assert r["per_class"]["S"]["se"] is None and r["per_class"]["S"]["ppv"] is None
    assert r["macro_f1"] == pytest.approx(1.0)  # classes without test beats do not count
    r = ev.summarize([[5, 0], [2, 0]], ["N", "S"])
    assert r["per_class"]["S"]["se"] == 0.0 and r["per_class"]["S"]["ppv"] is None and r["per_class"]["S"]["f1"] == 0.0


def test_baselines_are_the_papers_figures():
    """Only what the papers state (developers' guide): de Chazal, Zhang Se/+P; Niu F1."""
    b = {x["method"].split(" ")[0]: x for x in ev.BASELINES}
    assert (b["de"]["S_se"], b["de"]["S_ppv"], b["de"]["V_se"], b["de"]["V_ppv"]) == (75.9, 38.5, 77.7, 81.9)
    assert (b["Zhang"]["S_se"], b["Zhang"]["S_ppv"], b["Zhang"]["V_se"], b["Zhang"]["V_ppv"]) == (79.1, 36.0, 85.5, 92.7)
    assert (b["Niu"]["S_f1"], b["Niu"]["V_f1"]) == (0.766, 0.897) and "S_se" not in b["Niu"]
    ours = {"ours": ev.summarize([[90, 6, 4], [3, 7, 0], [1, 1, 8]], ["N", "S", "V"])}
    table = ev.baseline_table(ours)
    assert "| **ours** | 70.0 | 50.0 | 0.583 | 80.0 | 66.7 | 0.727 |" in table
    assert "| Niu et al. 2020 (symbolized beats + CNN) | - | - | 0.766 | - | - | 0.897 |" in table


def test_base_builder_of_lora_and_qlora_configs():
    from omegaconf import OmegaConf

    for comp in ("hlmtune.hlm.model.lora_hlm_1m", "hlmtune.hlm.model.qlora_hlm_1m"):
        cfg = OmegaConf.create({"_component_": comp, "lora_rank": 8, "apply_lora_to_mlp": True, "manifest_path": "x",
                                "lora_attn_modules": ["q_proj"], "quantize_base": True})
        base = ev.base_builder_config(cfg)
        assert base._component_ == "hlmtune.hlm.model.hlm_1m" and set(base) == {"_component_", "manifest_path"}


def _hlm_and_prompts(seed: int, n: int):
    """A seeded random 1M-parameter HLM (eval mode) and n prompts of 5-29 tokens drawn with ``seed``."""
    import torch

    from hlmtune.hlm.model import hlm_1m

    torch.manual_seed(0)
    model = hlm_1m(vocab_size=303).eval()
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 30, (n,), generator=g)
    return model, [torch.randint(4, 303, (int(k),), generator=g).tolist() for k in lengths]


def test_predict_batches_and_compiled_path_agree_with_one_by_one():
    """Right padding, length grouping and the fixed-shape compiled path change no prediction."""
    import torch

    model, prompts = _hlm_and_prompts(1, 11)
    choices = [4, 5, 6, 7]
    with torch.inference_mode():
        ref = [int(model(torch.tensor([p]))[0, -1, choices].argmax()) for p in prompts]
    got, _ = ev.predict(model, prompts, choices, batch_size=4, desc="t")
    assert got == ref
    got_c, off = ev.predict(model, prompts, choices, batch_size=4, desc="t", compile=True)
    assert got_c == ref and 0 <= off <= len(prompts)
    # the class log-probabilities an ensemble averages: the next token's, renormalized over choices
    with torch.inference_mode():
        ref_lp = torch.stack([torch.log_softmax(model(torch.tensor([p]))[0, -1, choices], -1) for p in prompts])
    got, _, lp = ev.predict(model, prompts, choices, batch_size=4, desc="t", return_logprobs=True)
    assert got == ref and lp.shape == (len(prompts), len(choices))
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    _, _, lp_full = ev.predict(model, prompts, choices, batch_size=4, desc="t", return_logprobs=True, fast=False)
    torch.testing.assert_close(lp_full, ref_lp, rtol=1e-5, atol=1e-5)


def test_predict_computes_a_compiled_batch_with_nonfinite_logits_again_eagerly(monkeypatch, capsys):
    """A compiled pass that gives NaN (seen on a fine-tune's fixed-shape batches) is not scored as
    class 0: that batch runs again eagerly; a model that is NaN eagerly too is refused."""
    import torch

    model, prompts = _hlm_and_prompts(2, 9)
    choices = [4, 5, 6, 7]
    ref, _, ref_lp = ev.predict(model, prompts, choices, batch_size=4, desc="t", return_logprobs=True)

    def nan_on_second_call(fn, **_):  # stands in for torch.compile: its second batch comes back NaN
        calls = []

        def run(*args):
            calls.append(1)
            out = fn(*args)
            return out.fill_(float("nan")) if len(calls) == 2 else out
        return run

    monkeypatch.setattr(torch, "compile", nan_on_second_call)
    for fast in (True, False):
        got, _, lp = ev.predict(model, prompts, choices, batch_size=4, desc="t", compile=True, return_logprobs=True,
                                fast=fast)
        assert got == ref and bool(torch.isfinite(lp).all())
        torch.testing.assert_close(lp, ref_lp, rtol=1e-4, atol=1e-4)
        assert "non-finite logits in 1 batch(es) of t; computed again eagerly" in capsys.readouterr().err
    with torch.no_grad():
        model.norm.scale.fill_(float("nan"))  # the model's own logits are NaN: refused, eagerly or compiled
    for compile in (False, True):
        with pytest.raises(RuntimeError, match=r"not finite for 4 queries.*scored as the first class"):
            ev.predict(model, prompts, choices, batch_size=4, desc="t", compile=compile)


def test_predict_evaluates_eagerly_when_the_compiled_graph_disagrees_at_the_first_batch(monkeypatch, capsys):
    """A miscompiled graph (seen: inductor's cache filled under other ATen kernels, logits 2-50 off,
    finite) is caught at the first batch: that batch and every later one run eagerly, with a message;
    a compiled graph that agrees stays in use."""
    import torch

    model, prompts = _hlm_and_prompts(3, 9)
    choices = [4, 5, 6, 7]
    ref, _, ref_lp = ev.predict(model, prompts, choices, batch_size=4, desc="t", return_logprobs=True)
    calls = []

    def off_by(delta):
        def fake_compile(fn, **_):  # stands in for torch.compile: finite logits, shifted for class 5
            def run(*args):
                calls.append(1)
                out = fn(*args)
                out[..., 5] += delta
                return out
            return run
        return fake_compile

    for fast in (True, False):
        calls.clear()
        monkeypatch.setattr(torch, "compile", off_by(3.0))
        got, _, lp = ev.predict(model, prompts, choices, batch_size=4, desc="t", compile=True, return_logprobs=True,
                                fast=fast)
        assert got == ref and len(calls) == 1  # only the first batch went through the compiled graph
        torch.testing.assert_close(lp, ref_lp, rtol=1e-4, atol=1e-4)
        err = capsys.readouterr().err
        assert "the compiled model's logits differ from the eager model's at the first batch of t" in err
        assert "largest difference 3" in err and "evaluating eagerly" in err
        calls.clear()
        monkeypatch.setattr(torch, "compile", off_by(1e-6))  # rounding: the compiled graph is kept
        got, _ = ev.predict(model, prompts, choices, batch_size=4, desc="t", compile=True, fast=fast)
        assert got == ref and len(calls) == 3 and "differ" not in capsys.readouterr().err


def test_predict_projects_only_the_query_positions_and_leaves_the_model_as_it_was():
    """The fast path is taken: the vocabulary projection sees one row per query, not every
    position; afterwards the model runs torchtune's modules again."""
    import torch

    from hlmtune.hlm.model import hlm_1m

    torch.manual_seed(0)
    model = hlm_1m(vocab_size=303).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 303, (n,), generator=g).tolist() for n in (30, 12, 25)]
    rows = []
    hook = model.output.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[:-1].numel()))
    ev.predict(model, prompts, [4, 5], batch_size=8, desc="t")
    assert rows == [3]  # one batch, three queries
    ev.predict(model, prompts, [4, 5], batch_size=8, desc="t", fast=False)
    assert rows == [3, 3 * 30]  # every position of the padded batch
    hook.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_predict_reads_every_query_position_of_a_window():
    """Windows of several beats: one forward pass, a prediction at each query, in prompt order."""
    import torch

    from hlmtune.hlm.model import hlm_1m

    torch.manual_seed(0)
    model = hlm_1m(vocab_size=303).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 303, (int(n),), generator=g).tolist() for n in (40, 12, 33, 25, 40, 21)]
    positions = [[3, 17, 39], [11], [0, 5, 6, 32], [], [39], [20, 2]]  # the last out of order
    choices = [4, 5, 6, 7]
    with torch.inference_mode():
        ref = [int(model(torch.tensor([p]))[0, q, choices].argmax()) for p, qs in zip(prompts, positions) for q in qs]
    got, off, lp = ev.predict(model, prompts, choices, batch_size=2, desc="t", positions=positions,
                              return_logprobs=True)
    assert got == ref and len(got) == 11 and 0 <= off <= 11
    with torch.inference_mode():
        ref_lp = torch.stack([torch.log_softmax(model(torch.tensor([p]))[0, q, choices], -1)
                              for p, qs in zip(prompts, positions) for q in qs])
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)  # each query's own distribution
    got_c, _, lp_c = ev.predict(model, prompts, choices, batch_size=2, desc="t", positions=positions, compile=True,
                                return_logprobs=True)
    assert got_c == ref
    torch.testing.assert_close(lp_c, ref_lp, rtol=1e-5, atol=1e-5)


def test_eval_builds_test_prompts_with_every_key_of_the_runs_dataset(tmp_path):
    """The DS2 prompts are laid out as the run's training prompts: every dataset key is honoured."""
    from omegaconf import OmegaConf

    from hlm_fixtures import make_shards
    from hlmtune.data_builders.beat_prompt import BeatDraw, BeatPromptOptions
    from hlmtune.data_builders.ecg import ECGBeatClassificationDataset
    from hlmtune.ecg_tokenizer.shards import read_manifest
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer

    info = make_shards(tmp_path)
    tk = ECGTokenizer(manifest_path=str(info["shards"]), max_seq_len=1024)
    keys = dict(shards_dir=str(info["shards"]), split_file=str(info["split_file"]), context_beats=5,
                normalized_rr=32, normalize_amplitude=True, beat_samples=64, classes=["N", "V"])
    cfg = OmegaConf.create({"dataset": {"_component_": "hlmtune.data_builders.ecg_beat_classification_dataset",
                                        "augment": True, **keys}})
    kind, ds, train, _, _ = ev._test_dataset(cfg, tk, "DS2")
    # built by hand: every prompt key of the run, augmentation off, every DS2 beat once
    prompt = BeatPromptOptions(**{k: keys[k] for k in ("context_beats", "normalized_rr", "normalize_amplitude",
                                                         "beat_samples")})
    want = ECGBeatClassificationDataset(read_manifest(info["shards"]), list(info["test"]), prompt=prompt,
                                        draw=BeatDraw(classes=keys["classes"], balance=None))
    assert kind == "beat" and train == list(info["train"]) and len(ds) == len(want) > 0
    assert all(ds.prompt(k) == want.prompt(k) for k in range(0, len(ds), 11))
    assert len(ds.prompt(len(ds) - 1)) == 1 + 5 + 2 + 64 + 2  # bos, 5 RR, <sep> rr, 64 samples, rr <beat?>


def test_random_split_evaluates_the_held_out_beats_of_the_runs_own_records(tmp_path):
    """split: random with an explicit records list: its test beats are those records' held-out
    beats (no other patient's), and no training beat; AF under it is refused."""
    from omegaconf import OmegaConf

    from hlm_fixtures import make_shards
    from hlmtune.data_builders.ecg import ecg_beat_classification_dataset
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer
    from hlmtune.ecg_tokenizer.splits import SplitError

    info = make_shards(tmp_path)
    tk = ECGTokenizer(manifest_path=str(info["shards"]), max_seq_len=1024)
    mine = [info["train"][0], info["test"][0]]
    keys = dict(shards_dir=str(info["shards"]), split_file=str(info["split_file"]), split="random", records=mine,
                context_beats=4, balance=None)
    cfg = OmegaConf.create({"dataset": {"_component_": "hlmtune.data_builders.ecg_beat_classification_dataset",
                                        **keys}})
    _, ds, train_records, test_records, _ = ev._test_dataset(cfg, tk, "DS2")
    assert train_records == test_records and sorted(train_records) == sorted(mine)
    assert {ds.record_of(k) for k in range(len(ds))} == set(mine)
    trained = ecg_beat_classification_dataset(tk, **keys)
    def beats(d):  # (record, beat index) of every example's target beat
        return {(d.record_of(k), int(d.beat[d.index[k]])) for k in range(len(d))}

    assert beats(ds) and not beats(ds) & beats(trained)
    cfg.dataset._component_ = "hlmtune.data_builders.ecg_af_dataset"
    with pytest.raises(SplitError, match="holds out beats, not AF segments"):
        ev._test_dataset(cfg, tk, "DS2")


def test_a_run_whose_base_model_read_test_patients_is_refused(tmp_path):
    """Up the chain of starting weights (DPO <- LoRA <- pretraining), each run's saved config says
    which records it read: a pretraining with split: random (DS2 signal included) is refused."""
    from omegaconf import OmegaConf

    from hlmtune.ecg_tokenizer.splits import SplitError

    split = tmp_path / "split.json"
    split.write_text('{"DS1": ["a", "b"], "DS2": ["c"]}')

    def run(name, dataset, start=None):
        d = tmp_path / name
        d.mkdir()
        cfg = {"output_dir": str(d), "dataset": {"split_file": str(split), **dataset}}
        if start is not None:
            cfg["checkpointer"] = {"checkpoint_dir": str(tmp_path / start / "epoch_0")}
        OmegaConf.save(OmegaConf.create(cfg), d / "torchtune_config.yaml")
        return OmegaConf.create(cfg)

    run("pre", {"split": "DS1"})
    run("pre_random", {"split": "random"})
    run("lora", {"split": "DS1"}, start="pre")
    run("lora_on_random", {}, start="pre_random")
    ev.check_base_models(run("dpo", {}, start="lora"), ["c"])
    with pytest.raises(SplitError, match=r"weights trained on test records \['c'\] \(the run in .*pre_random, "
                                         r"dataset split 'random'\)"):
        ev.check_base_models(run("dpo_b", {}, start="lora_on_random"), ["c"])
    run("pre_list", {"records": ["a", "c"]})
    with pytest.raises(SplitError, match=r"\['c'\]"):
        ev.check_base_models(OmegaConf.create({"checkpointer": {"checkpoint_dir": str(tmp_path / "pre_list")}}), ["c"])
    ev.check_base_models(OmegaConf.create({"checkpointer": {"checkpoint_dir": str(tmp_path / "elsewhere")}}), ["c"])


def test_eval_checks_the_base_model_before_building_the_test_set(tmp_path):
    """`hlmtune eval`'s test set (of the run and of each ensemble member) is built only for a run
    whose pretrained model did not read the test records."""
    from omegaconf import OmegaConf

    from hlm_fixtures import make_shards
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer
    from hlmtune.ecg_tokenizer.splits import SplitError

    info = make_shards(tmp_path)
    pre = tmp_path / "pre"
    pre.mkdir()
    OmegaConf.save(OmegaConf.create({"output_dir": str(pre), "dataset": {"split": "random",
                                                                          "split_file": str(info["split_file"])}}),
                   pre / "torchtune_config.yaml")
    cfg = OmegaConf.create({"checkpointer": {"checkpoint_dir": str(pre / "epoch_0")},
                            "dataset": {"_component_": "hlmtune.data_builders.ecg_beat_classification_dataset",
                                        "shards_dir": str(info["shards"]), "split_file": str(info["split_file"])}})
    tk = ECGTokenizer(manifest_path=str(info["shards"]), max_seq_len=1024)
    with pytest.raises(SplitError, match="starts from weights trained on test records"):
        ev._test_dataset(cfg, tk, "DS2")


def test_target_rr_ratio_is_the_beats_interval_over_its_running_median(tmp_path):
    """The ratio each test prompt records for its target beat matches the beat table's intervals
    over a running median computed here by plain loops (to the width of one RR bin)."""
    import statistics

    from omegaconf import OmegaConf

    from hlm_fixtures import make_shards
    from hlmtune.data_builders.ecg import NORMAL_RR_S
    from hlmtune.ecg_tokenizer.tokenizer import ECGTokenizer
    from hlmtune.ecg_tokenizer.vocab import rr_edges

    info = make_shards(tmp_path)
    tk = ECGTokenizer(manifest_path=str(info["shards"]), max_seq_len=1024)
    median_beats = 32
    cfg = OmegaConf.create({"dataset": {"_component_": "hlmtune.data_builders.ecg_beat_classification_dataset",
                                        "shards_dir": str(info["shards"]), "split_file": str(info["split_file"]),
                                        "context_beats": 4, "normalized_rr": median_beats, "beat_samples": 64}})
    _, ds, _, _, _ = ev._test_dataset(cfg, tk, "DS2")
    ks = list(range(0, len(ds), 7))
    got = [ds.example(k).rr_ratio for k in ks]  # what eval's timing table reads
    edges = rr_edges(ds.vocab.params)
    half_bin = (edges[1] - edges[0]) / 2 / NORMAL_RR_S
    lo, hi = edges[0] / NORMAL_RR_S, edges[-1] / NORMAL_RR_S
    checked = 0
    for k, ratio in zip(ks, got):
        e = int(ds.index[k])
        rr = [float(x) for x in ds.beats.tables[int(ds.rec[e])]["rr"]]
        j = int(ds.beat[e])
        if rr[j] <= 0:
            assert math.isnan(ratio)
            continue
        known = [x for x in rr[max(0, j - median_beats + 1): j + 1] if x > 0]
        want = min(max(rr[j] / statistics.median(known), lo), hi)  # the end bins hold everything beyond
        assert abs(ratio - want) <= half_bin + 1e-9, (k, ratio, want)
        checked += 1
    assert checked > 50


def test_by_timing_splits_beats_at_the_premature_ratio():
    """Hand-counted buckets: below 0.8 premature, 0.8 and above on time, NaN unknown."""
    nan = float("nan")
    classes = ["N", "S", "V"]
    truth = [0, 1, 1, 1, 0, 2, 1, 0]
    pred = [1, 1, 0, 0, 0, 2, 1, 0]
    ratio = [0.5, 0.6, 0.79, 0.8, 1.0, 0.7, nan, 1.2]
    got = ev.by_timing(truth, pred, ratio, classes)
    assert list(got) == ["premature", "on_time", "unknown"]
    pre, on, unk = got["premature"], got["on_time"], got["unknown"]
    # premature: beats 0 (N called S), 1 (S found), 2 (S called N), 5 (V found)
    assert pre["n"] == 4 and pre["confusion"] == [[0, 1, 0], [1, 1, 0], [0, 0, 1]]
    # on time: beats 3 (S at exactly 0.8, called N), 4 and 7 (N found)
    assert on["n"] == 3 and on["confusion"] == [[2, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert unk["n"] == 1 and unk["per_class"]["S"]["tp"] == 1
    table = ev.timing_table({"by_timing": got}, classes)
    assert "| premature (RR < 0.8 x running reference) | 4 | 0 / 1 (+1) | 1 / 2 (+1) | 1 / 1 |" in table
    assert "| on time (>= 0.8) | 3 | 2 / 2 (+1) | 0 / 1 | 0 / 0 |" in table
    assert list(ev.by_timing([0], [0], [1.0], classes)) == ["on_time"]  # empty buckets are left out
    with pytest.raises(ValueError, match="2 ratios"):
        ev.by_timing([0], [0], [1.0, 1.0], classes)


def test_class_table_rows_follow_the_class_order_not_the_json_key_order():
    """metrics.json sorts keys (F N S V); a table built from it keeps the classes' own order."""
    import json

    from hlmtune.hlm.evaluate import class_table, summarize

    r = summarize([[5, 1, 0, 0], [1, 3, 0, 0], [0, 0, 4, 1], [0, 0, 1, 2]], ["N", "S", "V", "F"])
    reloaded = json.loads(json.dumps(r, sort_keys=True))
    rows = [line.split("|")[1].strip() for line in class_table(reloaded, ["N", "S", "V", "F"]).splitlines()[2:]]
    assert rows == ["N", "S", "V", "F", "macro"]
    assert class_table(reloaded, ["N", "S", "V", "F"]) == class_table(r)


def test_per_record_confusions_match_a_hand_count_and_sum_to_the_whole():
    import random

    from hlmtune.hlm.evaluate import confusion_matrix, per_record, record_table

    rng = random.Random(0)
    classes = ["N", "S", "V", "F"]
    records = [r for r in ("232", "100", "105") for _ in range(rng.randrange(5, 40))]
    truth = [rng.randrange(4) for _ in records]
    pred = [t if rng.random() < 0.6 else rng.randrange(4) for t in truth]
    got = per_record(truth, pred, records, classes)
    assert list(got) == ["232", "100", "105"]  # order of first appearance, as the test set runs
    for rec, v in got.items():
        # by hand: a dict of counts per (true, predicted) pair of this record's beats
        counts = {}
        for r, t, p in zip(records, truth, pred):
            if r == rec:
                counts[(t, p)] = counts.get((t, p), 0) + 1
        assert v["confusion"] == [[counts.get((t, p), 0) for p in range(4)] for t in range(4)]
        assert v["n"] == records.count(rec)
        s = v["per_class"]["S"]
        assert s["tp"] == counts.get((1, 1), 0) and s["support"] == sum(counts.get((1, p), 0) for p in range(4))
        assert s["fp"] == sum(counts.get((t, 1), 0) for t in (0, 2, 3))
    total = [[sum(v["confusion"][t][p] for v in got.values()) for p in range(4)] for t in range(4)]
    assert total == confusion_matrix(truth, pred, 4)
    table = record_table({"per_record": got}, classes)
    x = got["232"]["per_class"]["V"]
    assert f"| 232 | {got['232']['n']} |" in table and f"{x['tp']} / {x['support']} (+{x['fp']})" in table
    with pytest.raises(ValueError, match="3 records"):
        per_record([0, 1], [0, 1], ["a", "b", "c"], classes)



def test_a_copied_run_folder_reads_its_own_paths(tmp_path):
    """A run's saved config names where it ran; read from a copy, its paths follow the copy when
    what they name was copied too, and stay where they were otherwise."""
    import shutil

    import yaml

    from hlmtune.hlm.evaluate import load_run_config, relocation

    job = tmp_path / "cv"
    run = job / "fold1" / "runs" / "lora"
    for d in (run / "epoch_0", job / "tokens", job / "fold1" / "runs" / "pretrain" / "epoch_0", tmp_path / "cv_x"):
        d.mkdir(parents=True)
    saved = {
        "output_dir": str(run),
        "shards_dir": str(job / "tokens"),
        "checkpointer": {"checkpoint_dir": str(job / "fold1" / "runs" / "pretrain" / "epoch_0"), "output_dir": str(run)},
        "notes": [str(job / "fold1" / "db" / "splits.json"), str(tmp_path / "cv_x"), "hlmtune.hlm.model.hlm_1m"],
        "log_dir": str(run / "logs"),
    }
    (run / "torchtune_config.yaml").write_text(yaml.safe_dump(saved))
    (job / "fold1" / "db").mkdir()
    (job / "fold1" / "db" / "splits.json").write_text("{}")
    assert load_run_config(str(run), [])["output_dir"] == str(run)  # in place: as saved

    # the whole job copied, the original gone: everything that exists in the copy is read there
    new = tmp_path / "moved" / "cv_b"
    shutil.copytree(job, new)
    shutil.rmtree(job)
    assert relocation(str(run), new / "fold1" / "runs" / "lora") == (str(job), str(new))
    cfg = load_run_config(str(new / "fold1" / "runs" / "lora"), [f"shards_dir={tmp_path / 'elsewhere'}"])
    assert cfg.output_dir == cfg.checkpointer.output_dir == str(new / "fold1" / "runs" / "lora")
    assert cfg.checkpointer.checkpoint_dir == str(new / "fold1" / "runs" / "pretrain" / "epoch_0")
    assert cfg.notes[0] == str(new / "fold1" / "db" / "splits.json")
    assert cfg.notes[1:] == [str(tmp_path / "cv_x"), "hlmtune.hlm.model.hlm_1m"]  # not inside the job: as saved
    assert cfg.shards_dir == str(tmp_path / "elsewhere")  # an override is what was asked for
    assert cfg.log_dir == str(run / "logs")  # no logs/ in the copy: nothing there to read, left as saved

    # the run folder alone copied: its own files follow it, the job's shared ones stay put
    alone = tmp_path / "alone" / "lora"
    shutil.copytree(new / "fold1" / "runs" / "lora", alone)
    cfg = load_run_config(str(alone), [])
    assert cfg.output_dir == str(alone) and cfg.shards_dir == str(job / "tokens")
    assert relocation(str(run), tmp_path / "other") is None  # no shared last component: nothing to map
    # a run saved under a symlinked folder and read through its target has not moved
    (tmp_path / "link").symlink_to(new)
    assert relocation(str(tmp_path / "link" / "fold1" / "runs" / "lora"), new / "fold1" / "runs" / "lora") is None


def _eval_cli(capsys, *argv):
    """``hlmtune eval ARGV`` in process; returns (exit code, stderr)."""
    from hlmtune.cli import main

    rc = main(["eval", *map(str, argv)])
    return rc, capsys.readouterr().err


def _text_run(folder):
    """A run folder of a tiny text LLM LoRA run (its saved config only: nothing is trained)."""
    import yaml

    folder.mkdir(parents=True)
    (folder / "epoch_0").mkdir()
    saved = {
        "output_dir": str(folder),
        "tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer", "path": str(folder / "no.model")},
        "model": {"_component_": "torchtune.models.llama3.lora_llama3", "lora_attn_modules": ["q_proj"]},
        "dataset": {"_component_": "hlmtune.data_builders.alpaca_cleaned_dataset", "source": "json",
                    "data_files": str(folder / "alpaca_cleaned.jsonl"), "split": "train"},
    }
    (folder / "torchtune_config.yaml").write_text(yaml.safe_dump(saved))
    return folder


def test_flags_documented_with_another_flag_are_refused_without_it(tmp_path, capsys):
    """``--ptq-run`` ("with --quantized") alone is an argument error, before any config is read
    (the config named here does not exist); so are the flags that do not combine."""
    missing = tmp_path / "no_such_run"
    rc, err = _eval_cli(capsys, "--config", missing, "--ptq-run", tmp_path / "ptq")
    assert rc == 2 and err.strip() == (
        "hlmtune eval: --ptq-run needs --quantized (its run is quantized after training and evaluated beside "
        "the QAT export)")
    rc, err = _eval_cli(capsys, "--config", missing, "--quantized", "--calibration", tmp_path / "c.json")
    assert rc == 2 and err.strip() == (
        "hlmtune eval: --calibration and --quantized do not combine: calibrate the float run")
    rc, err = _eval_cli(capsys, "--config", missing, "--quantized", "--ensemble", tmp_path / "b")
    assert rc == 2 and "--ensemble and --quantized do not combine" in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="--ptq-run needs --quantized"):  # the Python API refuses it too
        ev.evaluate(None, ptq_run=tmp_path / "ptq")
    for flag in ("--batch-size", "--max-examples"):  # counts: at least one
        for value in ("0", "-5"):
            rc, err = _eval_cli(capsys, "--config", missing, flag, value)
            assert rc == 2 and err.strip() == f"hlmtune eval: {flag} must be >= 1, got {value}"


def test_a_run_that_is_not_an_hlm_run_is_named(tmp_path, capsys):
    """--config or --ensemble of a text LLM run: one line naming that run and its builder,
    not the ECG builders' "need shards_dir"; an HLM pretraining run is named as such."""
    text = _text_run(tmp_path / "tiny_lora")
    want = (f"is not an HLM (ECG) run: its dataset builder is hlmtune.data_builders.alpaca_cleaned_dataset; "
            f"hlmtune eval evaluates runs of {', '.join(ev.EVAL_BUILDERS)}")
    rc, err = _eval_cli(capsys, "--config", text)
    assert rc == 2 and err.strip() == f"hlmtune eval: --config {text} {want}"
    hlm = [f"shards_dir={tmp_path / 'tokens'}", f"output_dir={tmp_path / 'hlm'}"]  # checked before shards are read
    rc, err = _eval_cli(capsys, "--config", "ecg_lora", *hlm, "--ensemble", text)
    assert rc == 2 and err.strip() == f"hlmtune eval: --ensemble {text} {want}"
    rc, err = _eval_cli(capsys, "--config", "ecg_pretrain", *hlm)
    assert rc == 2 and err.strip().startswith("hlmtune eval: --config ecg_pretrain: an HLM run of ecg_pretrain_dataset")
    assert "shards_dir" not in err and err.count("\n") == 1


def test_hlm_runs_are_recognised_by_their_dataset_builder():
    from omegaconf import OmegaConf

    from hlmtune.data_builders import ecg

    four = ("ecg_beat_classification_dataset", "ecg_beat_dpo_dataset", "ecg_beat_stream_dataset", "ecg_af_dataset")
    assert set(ev.EVAL_BUILDERS) == set(four) and all(callable(getattr(ecg, c, None)) for c in four)
    for comp in four:  # as the packs and as hlmtune.data_builders.ecg name them
        for prefix in ("hlmtune.data_builders.", "hlmtune.data_builders.ecg."):
            ev.check_hlm_run(OmegaConf.create({"dataset": {"_component_": prefix + comp}}), "run")
    for cfg, why in [({"shards_dir": "/t", "dataset": {"_component_": "x.text_dataset"}}, "builder is x.text_dataset"),
                     ({"dataset": [{"_component_": "hlmtune.data_builders.ecg_af_dataset"}]}, "a list of datasets"),
                     ({"shards_dir": "/t"}, "no dataset builder")]:
        with pytest.raises(ValueError, match=f"^r1 is not an HLM \\(ECG\\) run: its (config has )?.*{why}"):
            ev.check_hlm_run(OmegaConf.create(cfg), "r1")


def test_a_train_only_job_folder_evaluates_its_ensemble(tmp_path):
    """``--config JOB`` finds the job's final fine-tunes: the report's ensemble, else (a job of
    ``ecg_quality.py --train-only``, no report yet) the fine-tunes training.json lists, else runs/lora."""
    from hlmtune.hlm.evaluate import job_runs

    job = tmp_path / "job"
    for r in ("pretrain", "lora", "lora_seed1", "lora_seed2"):
        (job / "runs" / r).mkdir(parents=True)
        (job / "runs" / r / "torchtune_config.yaml").write_text("seed: 0\n")
    assert job_runs(job) == [job / "runs" / "lora"]
    elsewhere = "/elsewhere/job/runs"  # a moved job: found by name under its own runs/
    runs = [{"stage": "pretrain", "run": f"{elsewhere}/pretrain"},
            *({"stage": "finetune", "run": f"{elsewhere}/{r}"} for r in ("lora", "lora_seed1", "lora_seed2"))]
    (job / "training.json").write_text(json.dumps({"timings": {}, "runs": runs}))
    assert job_runs(job) == [job / "runs" / r for r in ("lora", "lora_seed1", "lora_seed2")]
    (job / "report").mkdir()
    (job / "report" / "metrics.json").write_text(json.dumps(
        {"ensemble": [f"{elsewhere}/lora/epoch_0/m.bin", f"{elsewhere}/lora_seed2/epoch_0/m.bin"]}))
    assert job_runs(job) == [job / "runs" / "lora", job / "runs" / "lora_seed2"]  # what the report scored
