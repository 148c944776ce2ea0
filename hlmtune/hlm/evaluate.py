"""``hlmtune eval``: the Heart Language Model on unseen patients (MIT-BIH DS2), as a classifier.

The language model is the classifier: for every test beat the prompt of the training dataset
(signal only, ending in ``<beat?>``) is fed to the model, and its prediction is the class
token it generates next (greedy, among the dataset's class tokens; how often the unconstrained
next token was not a class token is reported too). Batched, no gradient.

Outputs in ``--out`` (default ``<output_dir>/eval``): ``metrics.json`` (every figure below),
``confusion.csv`` and ``confusion.png``, ``report.md`` (the table beside the published
inter-patient baselines, a per-record table, and one by the target beat's timing: premature
or not by its normalized RR token), ``predictions.npz`` (each row's class log-probabilities per
test beat, with its record and RR ratio). Per class: sensitivity (Se, recall), positive
predictivity (+P, precision), F1 and support; macro-F1 over the evaluated classes; accuracy;
the same per record (patient). For the atrial fibrillation task: AF Se, +P, F1.

Guards: the test records must not meet the run's training records (:func:`splits.check_disjoint`);
with ``split: random`` every report's first line says the numbers are not comparable.
QAT runs (``--quantized``) are also evaluated through their int8/int4 export, beside the same
model trained without fake quantization and quantized after training (``--ptq-run``).

Ensembles (``--ensemble RUN ...``): runs trained for the same prompts (typically the same config
with other seeds) each give their class-token log-probabilities, renormalized over the class
tokens; the prediction is the class with the highest mean. Every member's training records are
checked against the test split, its test prompts must be the first run's, and each member's own
figures are reported beside the ensemble's.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

# Published inter-patient results on MIT-BIH DS2 (train DS1), as the papers state them.
# Se / +P in percent; F1 as a fraction. Only figures the papers give.
BASELINES: List[Dict[str, Any]] = [
    {"method": "de Chazal et al. 2004 (linear discriminants)", "S_se": 75.9, "S_ppv": 38.5, "V_se": 77.7, "V_ppv": 81.9},
    {"method": "Zhang et al. 2014 (feature selection + SVM)", "S_se": 79.1, "S_ppv": 36.0, "V_se": 85.5, "V_ppv": 92.7},
    {"method": "Niu et al. 2020 (symbolized beats + CNN)", "S_f1": 0.766, "V_f1": 0.897},
]


# ----------------------------------------------------------------------------- metrics


def confusion_matrix(truth: Sequence[int], pred: Sequence[int], n: int) -> List[List[int]]:
    """Counts ``m[t][p]`` of true class ``t`` predicted as ``p``."""
    m = [[0] * n for _ in range(n)]
    for t, p in zip(truth, pred):
        m[int(t)][int(p)] += 1
    return m


def class_metrics(m: List[List[int]], classes: Sequence[str]) -> Dict[str, Dict[str, Optional[float]]]:
    """Se, +P, F1 and support per class from a confusion matrix (None where undefined).

    Se = TP / (TP + FN), +P = TP / (TP + FP), F1 = 2 Se +P / (Se + +P).
    """
    out: Dict[str, Dict[str, Optional[float]]] = {}
    n = len(classes)
    for k, c in enumerate(classes):
        tp = m[k][k]
        fn = sum(m[k]) - tp
        fp = sum(m[t][k] for t in range(n)) - tp
        se = tp / (tp + fn) if tp + fn else None
        ppv = tp / (tp + fp) if tp + fp else None
        f1 = 2 * se * ppv / (se + ppv) if se is not None and ppv is not None and se + ppv > 0 else (0.0 if se is not None else None)
        out[c] = {"se": se, "ppv": ppv, "f1": f1, "support": tp + fn, "tp": tp, "fn": fn, "fp": fp}
    return out


def summarize(m: List[List[int]], classes: Sequence[str]) -> Dict[str, Any]:
    """Per-class metrics, macro-F1 over classes with test beats, accuracy."""
    per = class_metrics(m, classes)
    f1s = [v["f1"] for v in per.values() if v["support"] and v["f1"] is not None]
    total = sum(map(sum, m))
    return {
        "per_class": per,
        "macro_f1": sum(f1s) / len(f1s) if f1s else None,
        "accuracy": sum(m[k][k] for k in range(len(classes))) / total if total else None,
        "n": total,
    }


def per_record(truth: Sequence[int], pred: Sequence[int], records: Sequence[str],
               classes: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """:func:`summarize` (and the confusion matrix) of each record's beats on its own.

    Inter-patient results hinge on a few patients (one DS2 record can hold most of a class's
    beats), so a pooled figure needs its per-patient view beside it.

    Args:
        truth (Sequence[int]): true class index per test example.
        pred (Sequence[int]): predicted class index per test example.
        records (Sequence[str]): the record (patient) of each test example.
        classes (Sequence[str]): class names, in index order.

    Returns:
        Dict[str, Dict[str, Any]]: per record, in order of first appearance: ``per_class``,
        ``macro_f1``, ``accuracy``, ``n`` and ``confusion``.
    """
    if not len(truth) == len(pred) == len(records):
        raise ValueError(f"per_record: {len(truth)} truths, {len(pred)} predictions, {len(records)} records")
    rows: Dict[str, List[int]] = {}
    for k, r in enumerate(records):
        rows.setdefault(str(r), []).append(k)
    out: Dict[str, Dict[str, Any]] = {}
    for r, ks in rows.items():
        m = confusion_matrix([truth[k] for k in ks], [pred[k] for k in ks], len(classes))
        out[r] = {**summarize(m, classes), "confusion": m}
    return out


# A beat whose interval is below this share of the patient's running median RR counts as
# premature: the cut docs/hlm.md's rule on held-out DS1 records uses ("RR below 0.8 of the running
# median"), where 84% of DS1's S beats and 2% of its N beats fall (annotations, 256-beat median).
PREMATURE_RATIO = 0.8
TIMING_BUCKETS = ("premature", "on_time", "unknown")


def trained_on(train: Sequence[str], test: Sequence[str], *, split_file: Optional[str]) -> str:
    """Where a run's training records come from, for the report header (``DS1 22 + svdb 39``).

    Records of the test records' database (or bare ids) count as the split's DS1; the others by
    their database.
    """
    from hlmtune.ecg_tokenizer.splits import database_of

    home = {database_of(t) for t in test} or {""}
    own = "DS1" if split_file is None else "split file DS1"
    counts: Dict[str, int] = {}
    for r in train:
        db = database_of(r)
        key = own if db in home or not db else db
        counts[key] = counts.get(key, 0) + 1
    if list(counts) == [own]:
        return own
    return " + ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: kv[0] != own))


def _timing(ratio: float, threshold: float) -> str:
    if math.isnan(ratio):
        return "unknown"
    return "premature" if ratio < threshold else "on_time"


def by_timing(truth: Sequence[int], pred: Sequence[int], ratio: Sequence[float], classes: Sequence[str],
              threshold: float = PREMATURE_RATIO) -> Dict[str, Dict[str, Any]]:
    """:func:`summarize` of the test beats split by their timing: premature, on time, unknown.

    An S beat is by definition a normally conducted beat that comes early; how many of the test
    S beats do (and how many of those the model finds) says what a classifier that reads the
    interval can reach on a test set, apart from the waveform.

    Args:
        truth (Sequence[int]): true class index per test example.
        pred (Sequence[int]): predicted class index per test example.
        ratio (Sequence[float]): each example's RR relative to its running median (NaN: unknown).
        classes (Sequence[str]): class names, in index order.
        threshold (float): ratios below it are premature.

    Returns:
        Dict[str, Dict[str, Any]]: per bucket with beats (``premature``: ratio < threshold,
        ``on_time``, ``unknown``), ``per_class``, ``macro_f1``, ``accuracy``, ``n`` and ``confusion``.
    """
    if not len(truth) == len(pred) == len(ratio):
        raise ValueError(f"by_timing: {len(truth)} truths, {len(pred)} predictions, {len(ratio)} ratios")
    out: Dict[str, Dict[str, Any]] = {}
    for bucket in TIMING_BUCKETS:
        ks = [k for k, x in enumerate(ratio) if _timing(x, threshold) == bucket]
        if ks:
            m = confusion_matrix([truth[k] for k in ks], [pred[k] for k in ks], len(classes))
            out[bucket] = {**summarize(m, classes), "confusion": m}
    return out


# ----------------------------------------------------------------------------- model


def _last_export(output_dir: Path) -> Path:
    epochs = sorted((p for p in output_dir.glob("epoch_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
    for d in reversed(epochs):
        for name in ("model-00001-of-00001.bin", "model.pt"):
            if (d / name).is_file():
                return d / name
    raise FileNotFoundError(
        f"no trained model under {output_dir}/epoch_*/ (model.pt or model-00001-of-00001.bin): train the run first"
    )


def base_builder_config(cfg_model: Any) -> Any:
    """The plain (no LoRA, no NF4) model config of a ``[q]lora_`` builder config."""
    from omegaconf import OmegaConf

    comp = str(cfg_model._component_)
    mod, _, fn = comp.rpartition(".")
    for prefix in ("qlora_", "lora_"):
        if fn.startswith(prefix):
            fn = fn[len(prefix):]
            break
    drop = ("lora_", "apply_lora", "quantize_base", "use_dora")
    kept = {k: v for k, v in OmegaConf.to_container(cfg_model, resolve=True).items()
            if k != "_component_" and not k.startswith(drop)}
    return OmegaConf.create({"_component_": f"{mod}.{fn}", **kept})


def load_model(cfg: Any, weights: Path, *, quantizer_cfg: Any = None, quantized_weights: bool = False):
    """The trained model on CPU in eval mode.

    Args:
        cfg (DictConfig): the run's config.
        weights (Path): merged float weights, or a quantized state dict.
        quantizer_cfg (Optional[DictConfig]): a QAT quantizer: build ``prepare`` + ``convert``.
        quantized_weights (bool): ``weights`` is already quantized (load after convert);
            otherwise float weights are loaded, then converted (post-training quantization).
    """
    import torch
    from torchtune import config

    from hlmtune._compat import ensure_torchao_aliases

    model_cfg = base_builder_config(cfg.model)
    with torch.device("cpu"):
        model = config.instantiate(model_cfg)
    sd = torch.load(weights, map_location="cpu", weights_only=True)
    if quantizer_cfg is not None:
        ensure_torchao_aliases()
        quantizer = config.instantiate(quantizer_cfg)
        model = quantizer.prepare(model)
        if quantized_weights:
            model = quantizer.convert(model)
            model.load_state_dict(sd)
        else:
            model.load_state_dict(sd)
            model = quantizer.convert(model)
    else:
        model.load_state_dict(sd)
    model.eval()
    return model


def predict(model: Any, prompts: List[List[int]], choices: Sequence[int], *, batch_size: int, desc: str,
            compile: bool = False, positions: Optional[List[List[int]]] = None,
            return_logprobs: bool = False, fast: bool = True) -> Tuple[Any, ...]:
    """Greedy next token among ``choices`` at the query positions of every prompt, batched.

    By default the query is a prompt's last token; ``positions`` gives, per prompt, every
    position whose next-token prediction is a query (windows of consecutive beats classify
    several beats in one forward pass).

    Prompts are right-padded (a causal model's earlier positions do not see the padding) and
    grouped by length so that padding is rare. With ``compile`` the model runs through
    ``torch.compile`` on batches of one fixed shape (every batch padded to ``batch_size`` rows
    of the longest prompt), so it compiles once; at dim 128 the elementwise RoPE / RMSNorm ops
    cost as much as the matmuls and fusing them pays (1.4x measured on 2 CPU cores, after a
    compile of about a minute).

    With ``fast`` (the default; a torchtune ``TransformerDecoder`` whose last layer is a plain
    self-attention layer), only the query positions reach the last layer's queries and MLP, the
    final norm and the vocabulary projection (``fastpath.query_logits``, the recipes'
    ``target_positions_only`` as one function: every other position only feeds that layer's keys
    and values); eagerly, RoPE and the SwiGLU feed-forward also run their inference paths
    (``fastpath.inference_fastpath``). The same logits at the queries up to fp32 rounding
    (``benchmarks/eval_throughput.py`` times both ways). ``fast=False`` computes every
    position's logits, as torchtune's forward does.

    Returns:
        Tuple[List[int], int]: index into ``choices`` per query (prompt order, then position
        order), and how many queries' unconstrained argmax was not one of ``choices``; with
        ``return_logprobs`` a third item, the (Q, len(choices)) float32 tensor of the next
        token's log-probabilities renormalized over ``choices`` (what an ensemble averages).
    """
    import contextlib

    import torch
    from torchtune.modules import TransformerDecoder
    from tqdm import tqdm

    from hlmtune.training.fastpath import _prunable_last_layer, inference_fastpath, query_logits

    if positions is None:
        positions = [[len(p) - 1] for p in prompts]
    first = [0]
    for q in positions:
        first.append(first[-1] + len(q))  # prompt i's queries are out[first[i] : first[i + 1]]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = [0] * first[-1]
    off_vocab = 0
    choice_t = torch.tensor(list(choices))
    logprobs = torch.zeros(first[-1], len(choices)) if return_logprobs else None
    fixed_width = max((len(p) for p in prompts), default=1)
    fast = (fast and isinstance(model, TransformerDecoder) and not model.output_hidden_states
            and _prunable_last_layer(model) is not None)
    if fast:
        def step(tokens: Any, idx: Any) -> Any:  # (B, T), (B, Tq) -> (B, Tq, V)
            return query_logits(model, tokens, idx)

        run = torch.compile(step, dynamic=False) if compile else step
        # complex tensors are a weak spot of inductor: the compiled step fuses torchtune's RoPE
        levers = contextlib.nullcontext() if compile else inference_fastpath(model)
        fixed_queries = max((len(q) for q in positions), default=1) or 1  # compiled: one shape
    else:
        run = torch.compile(model, dynamic=False) if compile else model
        levers = contextlib.nullcontext()
    with torch.inference_mode(), levers, tqdm(total=first[-1], desc=desc, unit="beat", file=sys.stderr,
                                              dynamic_ncols=True) as bar:
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            width = fixed_width if compile else max(len(prompts[i]) for i in idx)
            x = torch.zeros(batch_size if compile else len(idx), width, dtype=torch.long)  # pad 0; extra rows ignored
            for r, i in enumerate(idx):
                x[r, : len(prompts[i])] = torch.tensor(prompts[i])
            rows = torch.tensor([r for r, i in enumerate(idx) for _ in positions[i]], dtype=torch.long)
            if fast:
                tq = fixed_queries if compile else max(1, max(len(positions[i]) for i in idx))
                at = torch.zeros(x.shape[0], tq, dtype=torch.long)  # (B, Tq): queries, padded with 0
                for r, i in enumerate(idx):
                    at[r, : len(positions[i])] = torch.tensor(positions[i], dtype=torch.long)
                slots = torch.tensor([s for i in idx for s in range(len(positions[i]))], dtype=torch.long)
                last = run(x, at)[rows, slots]  # (B, Tq, V) -> (Q, V): the next-token distribution per query
            else:
                cols = torch.tensor([q for i in idx for q in positions[i]], dtype=torch.long)
                last = run(x)[rows, cols]  # (B, T, V) -> (Q, V)
            free = last.argmax(-1)
            off_vocab += int((~torch.isin(free, choice_t)).sum())
            among = last[:, choice_t].float()  # (Q, C)
            pick = among.argmax(-1).tolist()  # (Q,)
            lp = torch.log_softmax(among, -1) if logprobs is not None else None
            k = 0
            for i in idx:
                out[first[i] : first[i + 1]] = pick[k : k + len(positions[i])]
                if lp is not None:
                    logprobs[first[i] : first[i + 1]] = lp[k : k + len(positions[i])]
                k += len(positions[i])
            bar.update(k)
    return (out, off_vocab, logprobs) if return_logprobs else (out, off_vocab)


# ----------------------------------------------------------------------------- datasets

# The ECG builders whose test sets hlmtune eval builds: the beat builders of the data layer
# (hlmtune.data_builders.ecg.BEAT_BUILDERS, through beat_test_dataset), then AF.
def _eval_builders() -> Tuple[str, ...]:
    from hlmtune.data_builders.ecg import BEAT_BUILDERS

    return (*BEAT_BUILDERS, "ecg_af_dataset")


EVAL_BUILDERS = _eval_builders()


def check_hlm_run(cfg: Any, run: str) -> None:
    """Refuse, naming it, a run that is not an HLM (ECG) run with a test set to evaluate.

    A run is recognised by its dataset builder, not by a ``shards_dir`` key: the builder is what
    builds the prompts being evaluated, an HLM run may name its shards through its tokenizer's
    ``manifest_path`` alone, and any other config may carry a ``shards_dir`` of its own. So a
    run whose ``dataset._component_`` ends in one of :data:`EVAL_BUILDERS` is evaluated; one
    whose builder is another of ``hlmtune.data_builders.ecg``'s (pretraining) is an HLM run
    without classes to predict; anything else (a text LLM's dataset, a list of datasets, none)
    is not an HLM run. Checked before its tokenizer is built (a text LLM's needs its own files).

    Args:
        cfg (DictConfig): the run's config.
        run (str): the run as the user named it (``--config TARGET``, ``--ensemble FOLDER``).

    Raises:
        ValueError: not an HLM (ECG) run, or an HLM run of a builder without a test set.
    """
    from omegaconf import DictConfig

    from hlmtune.data_builders import ecg as builders

    ds = cfg.get("dataset")
    full = str(ds.get("_component_")) if isinstance(ds, DictConfig) else None
    comp = full.rsplit(".", 1)[-1] if full else None
    if comp in EVAL_BUILDERS:
        return
    if comp and comp.startswith("ecg_") and callable(getattr(builders, comp, None)):
        raise ValueError(f"{run}: an HLM run of {comp}, which has no classes to predict (pretraining); "
                         f"hlmtune eval evaluates runs of {', '.join(EVAL_BUILDERS)}")
    what = f"its dataset builder is {full}" if full else (
        "its dataset is a list of datasets" if ds is not None and not isinstance(ds, DictConfig) else
        "its config has no dataset builder")
    raise ValueError(f"{run} is not an HLM (ECG) run: {what}; hlmtune eval evaluates runs of "
                     f"{', '.join(EVAL_BUILDERS)}")


def _test_dataset(cfg: Any, tokenizer: Any, split: str):
    """(kind, test dataset, training records, test records) built from the run's dataset section."""
    from omegaconf import OmegaConf

    from hlmtune.data_builders import ecg as builders
    from hlmtune.ecg_tokenizer import splits as sp

    ds = OmegaConf.to_container(cfg.dataset, resolve=True)
    comp = str(ds.pop("_component_")).rsplit(".", 1)[-1]
    train_split = ds.get("split", sp.TRAIN)
    manifest, _ = builders.read_shards(tokenizer, ds.get("shards_dir"))
    available = [r["record"] for r in manifest["records"]]
    train_records = builders.training_records(manifest, ds)  # the split's records and extra_records
    if train_split == sp.RANDOM:
        test_split = sp.RANDOM  # the held-out beats of the same records
        test = train_records
    else:
        test_split = split
        test = sp.resolve_records(split=split, records=None, split_file=ds.get("split_file"), available=available,
                                  evaluation=True)
        sp.check_disjoint(train_records, test, digests=builders.signal_digests(manifest))
        check_base_models(cfg, test)
    if comp in builders.BEAT_BUILDERS:
        # Under the random split the held-out beats are those of the run's own records (an
        # explicit `records` list included); otherwise the records are the test split's.
        recs = ds.get("records") if test_split == sp.RANDOM else None
        d = builders.beat_test_dataset(tokenizer, comp, ds, split=test_split, records=recs)
        return builders.BEAT_BUILDERS[comp], d, train_records, list(test)
    if comp == "ecg_af_dataset":
        if train_split == sp.RANDOM:  # the builder refuses it too: no held-out AF segments
            raise sp.SplitError("ecg_af_dataset: split 'random' holds out beats, not AF segments; "
                                "AF is evaluated on the test patients (DS2) only")
        recs = test
        d = builders.ECGAFDataset(manifest, recs, segment_beats=ds.get("segment_beats", 41),
                                  stride_beats=ds.get("stride_beats"), balance=None, num_examples=None, seed=0)
        return "af", d, train_records, list(recs)
    raise ValueError(f"hlmtune eval evaluates the HLM's classification datasets; the config's dataset is {comp}")


def check_base_models(cfg: Any, test: Sequence[str]) -> None:
    """Refuse a run whose starting weights were trained on test records.

    A fine-tune starts from ``checkpointer.checkpoint_dir``: a pretraining's (or, for DPO, the
    LoRA run's) export inside that run's folder. Each such run up the chain is read from the
    ``torchtune_config.yaml`` it saved, and the records its dataset section asked for (a
    pretraining with ``split: random`` reads the test patients' signal too) must not meet
    ``test``. Weights from elsewhere (no saved run config beside them) are not checked.

    Raises:
        SplitError: naming the run and the shared records.
    """
    from omegaconf import OmegaConf

    from hlmtune.ecg_tokenizer import splits as sp
    from hlmtune.training.schema import dataset_nodes

    seen = set()
    ckpt = (cfg.get("checkpointer") or {}).get("checkpoint_dir")
    while ckpt:
        d = Path(str(ckpt))
        run = next((p for p in (d, d.parent) if (p / "torchtune_config.yaml").is_file()), None)
        if run is None or run.resolve() in seen:
            return
        seen.add(run.resolve())
        up = OmegaConf.to_container(load_run_config(str(run), []), resolve=True)
        for _, node in dataset_nodes(up):
            if not isinstance(node, dict):  # a run without a dataset section read no records
                continue
            asked = sp.records_asked(split=str(node.get("split", sp.TRAIN)), records=node.get("records"),
                                     lists=sp.load_split_file(node.get("split_file")))
            # names as asked (a bare 100 or mitdb/100) against the test ids, by id and by record name
            test_keys = set(test) | {t.rsplit("/", 1)[-1] for t in test}
            both = sorted(a for a in set(asked) if a in test_keys or (
                "/" in a and a.rsplit("/", 1)[-1] in test_keys and not any("/" in t for t in test)))
            if both:
                raise sp.SplitError(f"the run starts from weights trained on test records {both} (the run in {run}, "
                                    f"dataset split {node.get('split', sp.TRAIN)!r}); inter-patient results need "
                                    "base models that never read the test patients")
        ckpt = (up.get("checkpointer") or {}).get("checkpoint_dir")


def _check_member(cfg: Any, kind: str, ds: Any, run: Path, member_cfg: Any, split: str) -> List[str]:
    """Refuse an ensemble member whose test prompts are not ``ds``'s; returns its training records.

    The member's own test set is built from its own config (so its training records are checked
    against the test split like the first run's); the two sets must hold the same prompts: the
    same number of examples, and the same tokens at 257 spread-out examples (first and last
    included).
    """
    from omegaconf import OmegaConf
    from torchtune import config

    mkind, mds, mtrain, _ = _test_dataset(member_cfg, config.instantiate(member_cfg.tokenizer), split)

    def probe(d: Any, k: int) -> List[int]:
        return list(d.window(k)[0]) if kind == "stream" else list(d.prompt(k))

    n = len(ds)
    same = mkind == kind and len(mds) == n and all(
        probe(ds, k) == probe(mds, k) for k in sorted({(n - 1) * j // 256 for j in range(257)}) if n)
    if not same:
        a = OmegaConf.to_container(cfg.dataset, resolve=True)
        b = OmegaConf.to_container(member_cfg.dataset, resolve=True)
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if OmegaConf.to_container(cfg.tokenizer, resolve=True) != OmegaConf.to_container(member_cfg.tokenizer, resolve=True):
            keys.append("tokenizer")
        raise ValueError(
            f"--ensemble {run}: its test prompts differ from those of {cfg.output_dir} "
            f"(keys that differ: {', '.join(f'dataset.{k}' if k != 'tokenizer' else k for k in keys) or 'none'}); "
            "an ensemble's runs must be trained for the same prompts"
        )
    return list(mtrain)


# ----------------------------------------------------------------------------- report


def ordered_results(metrics: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """``metrics["results"]`` in the evaluation's row order (``metrics.json`` sorts its keys),
    the headline row (``metrics["result"]``: calibrated, else the ensemble, else the run) first."""
    res = metrics["results"]
    order = [n for n in metrics.get("row_order", []) if n in res] or list(res)
    head = metrics.get("result")
    if head in res:
        order = [head, *(n for n in order if n != head)]
    return {n: res[n] for n in order}


def headline(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """The row an evaluation reports as its result (see :func:`ordered_results`)."""
    return next(iter(ordered_results(metrics).values()))


def _fmt(v: Optional[float], pct: bool = True) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}" if pct else f"{v:.3f}"


def baseline_table(results: Dict[str, Dict[str, Any]]) -> str:
    """Markdown table: our S and V figures per evaluated model beside the published baselines."""
    lines = [
        "| method | S Se % | S +P % | S F1 | V Se % | V +P % | V F1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s, v = r["per_class"].get("S", {}), r["per_class"].get("V", {})
        lines.append(
            f"| **{name}** | {_fmt(s.get('se'))} | {_fmt(s.get('ppv'))} | {_fmt(s.get('f1'), False)} | "
            f"{_fmt(v.get('se'))} | {_fmt(v.get('ppv'))} | {_fmt(v.get('f1'), False)} |"
        )
    for b in BASELINES:
        cell = lambda k, pct: (f"{b[k]:.1f}" if pct else f"{b[k]:.3f}") if k in b else "-"  # noqa: E731
        lines.append(
            f"| {b['method']} | {cell('S_se', 1)} | {cell('S_ppv', 1)} | {cell('S_f1', 0)} | "
            f"{cell('V_se', 1)} | {cell('V_ppv', 1)} | {cell('V_f1', 0)} |"
        )
    return "\n".join(lines)


def class_table(r: Dict[str, Any], classes: Optional[Sequence[str]] = None) -> str:
    """Markdown per-class table of one result, rows in ``classes`` order (``metrics.json``
    stores ``per_class`` with sorted keys: pass ``metrics["classes"]`` to keep N S V F)."""
    lines = ["| class | support | Se % | +P % | F1 |", "|---|---|---|---|---|"]
    for c in (classes or list(r["per_class"])):
        v = r["per_class"][c]
        lines.append(f"| {c} | {v['support']} | {_fmt(v['se'])} | {_fmt(v['ppv'])} | {_fmt(v['f1'], False)} |")
    lines.append(f"| macro | {r['n']} | | | {_fmt(r['macro_f1'], False)} |")
    return "\n".join(lines)


# How to read a cell of record_table(), for the reports that print one (eval, demo, cv).
RECORD_TABLE_LEGEND = ("Per class: beats of the class classified as it / beats of the class (+ beats of other "
                       "classes classified as it).")


def _found_cell(x: Dict[str, Any]) -> str:
    """``found / beats (+ false)`` of one class (see :data:`RECORD_TABLE_LEGEND`)."""
    return f"{x['tp']} / {x['support']}" + (f" (+{x['fp']})" if x["fp"] else "")


def record_table(r: Dict[str, Any], classes: Sequence[str]) -> str:
    """Markdown table of a result's ``per_record`` figures: per class, found / beats (+ false).

    A cell ``12 / 1382 (+3)`` reads: of the record's 1,382 beats of the class, 12 were
    classified as it, and 3 beats of other classes were classified as it.
    """
    lines = ["| record | beats | " + " | ".join(classes) + " | accuracy % |",
             "|---|---|" + "---|" * len(classes) + "---|"]
    for rec, v in r["per_record"].items():
        cells = [_found_cell(v["per_class"][c]) for c in classes]
        lines.append(f"| {rec} | {v['n']} | " + " | ".join(cells) + f" | {_fmt(v['accuracy'])} |")
    return "\n".join(lines)


# How to read timing_table(), for the reports that print one (eval, demo, cv).
TIMING_TABLE_LEGEND = ("The target beat's RR token as the model read it (its interval relative to the patient's "
                       "running median RR). An S beat is a normal beat that comes early: S beats that are not "
                       "premature by this token must be told by their waveform alone. " + RECORD_TABLE_LEGEND)


def timing_table(r: Dict[str, Any], classes: Sequence[str], threshold: float = PREMATURE_RATIO) -> str:
    """Markdown table of a result's ``by_timing`` figures (cells as :func:`record_table`'s)."""
    names = {"premature": f"premature (RR < {threshold:g} x running median)",
             "on_time": f"on time (>= {threshold:g})", "unknown": "interval unknown (record start)"}
    lines = ["| target beat's RR token | beats | " + " | ".join(classes) + " |",
             "|---|---|" + "---|" * len(classes)]
    for bucket, v in r["by_timing"].items():
        cells = [_found_cell(v["per_class"][c]) for c in classes]
        lines.append(f"| {names[bucket]} | {v['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_confusion(m: List[List[int]], classes: Sequence[str], path: Path, title: str) -> None:
    """Row-normalised confusion matrix with counts, as PNG (atomic write)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hlmtune._io import atomic_write_bytes

    n = len(classes)
    rows = [[m[i][j] / max(1, sum(m[i])) for j in range(n)] for i in range(n)]
    fig, ax = plt.subplots(figsize=(1.2 * n + 2, 1.2 * n + 1.5))
    ax.imshow(rows, vmin=0, vmax=1, cmap="Blues")
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{m[i][j]}\n{100 * rows[i][j]:.0f}%", ha="center", va="center",
                    color="white" if rows[i][j] > 0.5 else "black", fontsize=8)
    ax.set_xticks(range(n), classes)
    ax.set_yticks(range(n), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true (annotation)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def evaluate(
    cfg: Any, *, split: str = "DS2", batch_size: int = 256, out_dir: Optional[Path] = None,
    quantized: bool = False, ptq_run: Optional[Path] = None, max_examples: Optional[int] = None,
    compile: bool = False, ensemble: Sequence[Path] = (), overrides: Sequence[str] = (),
    calibration: Optional[Path] = None,
) -> Dict[str, Any]:
    """Evaluate a trained HLM run and write its report.

    Args:
        cfg (DictConfig): the run's config (as trained; ``output_dir`` holds its exports).
        split (str): test split (``DS2``); ignored for ``split: random`` runs (their test beats).
        batch_size (int): prompts per forward pass.
        out_dir (Optional[Path]): where to write (default ``<output_dir>/eval``).
        quantized (bool): also evaluate ``<output_dir>/quantized/*.pt`` (QAT runs).
        ptq_run (Optional[Path]): output_dir of the same model trained without fake quantization:
            its float weights are quantized after training and evaluated beside the QAT export
            (needs ``quantized``).
        max_examples (Optional[int]): evaluate only the first N test examples (smoke runs; the
            report says so).
        compile (bool): run the float model through ``torch.compile`` (see :func:`predict`).
        ensemble (Sequence[Path]): output_dirs of more runs trained for the same prompts (e.g.
            the same config with other seeds). The prediction is then the class with the highest
            mean log-probability over ``cfg``'s run and these (each LM's next-token distribution
            renormalized over the class tokens); each member's own figures are reported too.
            Every member's training records are checked against the test split, and its test
            prompts must be the first run's.
        overrides (Sequence[str]): the ``key=value`` overrides ``cfg`` was loaded with; they
            apply to every ensemble member too (e.g. ``shards_dir=`` after the tokens moved),
            except ``output_dir``, which is each member's own folder.
        calibration (Optional[Path]): a class-bias file of ``hlmtune cv`` (fitted on DS1
            out-of-fold predictions; refused when fitted on a test record): the prediction is
            then ``argmax(log p + bias)`` of the run (or the ensemble's mean), reported first,
            the uncalibrated rows after it.

    Returns:
        Dict[str, Any]: what ``metrics.json`` holds.
    """
    import torch
    from torchtune import config

    from hlmtune._io import atomic_write_bytes
    from hlmtune.ecg_tokenizer import splits as sp

    torch.manual_seed(0)
    conflict = flag_conflict(quantized=quantized, ptq_run=ptq_run, ensemble=ensemble, calibration=calibration)
    if conflict:
        raise ValueError(conflict)
    check_hlm_run(cfg, str(cfg.get("output_dir")))
    # every run is recognised before any work (the first run's test set is built next)
    seen = {Path(cfg.output_dir).resolve()}
    for d in ensemble:
        if not (Path(d) / "torchtune_config.yaml").is_file():
            raise FileNotFoundError(f"--ensemble {d}: not a run folder (no torchtune_config.yaml in it)")
        if Path(d).resolve() in seen:
            raise ValueError(f"--ensemble {d}: that run is already in the ensemble")
        seen.add(Path(d).resolve())
    shared = [o for o in overrides if not o.split("=", 1)[0].strip().lstrip("+~").startswith("output_dir")]
    members = [(Path(d), load_run_config(str(d), shared)) for d in ensemble]
    for d, mcfg in members:
        check_hlm_run(mcfg, f"--ensemble {d}")
    tokenizer = config.instantiate(cfg.tokenizer)
    kind, ds, train_records, test_records = _test_dataset(cfg, tokenizer, split)
    for d, mcfg in members:
        train_records = list(dict.fromkeys([*train_records, *_check_member(cfg, kind, ds, d, mcfg, split)]))
    random_split = str(cfg.dataset.get("split", sp.TRAIN)) == sp.RANDOM
    positions: Optional[List[List[int]]] = None
    records: List[str] = []  # the record (patient) of each classified beat / segment
    if kind == "stream":  # windows of consecutive beats, several classified beats each
        prompts, positions, truth = [], [], []
        n_total = int(sum(int((t >= 0).sum()) for t in ds.target))
        for k in range(len(ds)):
            if max_examples is not None and len(truth) >= int(max_examples):
                break
            tokens, query_at, cls = ds.window(k)
            prompts.append(tokens)
            positions.append(query_at)
            truth.extend(cls)
            records.extend([ds.record_of(k)] * len(cls))
        n = len(truth)
        kind = "beat"
    else:
        n_total = len(ds)
        n = n_total if max_examples is None else min(n_total, int(max_examples))
        examples = [ds.example(k) for k in range(n)] if kind == "beat" else []
        prompts = [x.tokens for x in examples] if kind == "beat" else [ds.prompt(k) for k in range(n)]
        records = [ds.record_of(k) for k in range(n)]
    if kind == "beat":
        classes = list(ds.classes)
        v = ds.vocab
        choices = [v.label_base + v.classes.index(c) for c in classes]
        if positions is None:
            truth = [classes.index(ds.label_of(k)) for k in range(n)]
    else:
        classes = ["AF", "not AF"]
        choices = [ds.yes_id, ds.no_id]
        truth = [0 if ds.is_af(k) else 1 for k in range(n)]
    ratios: Optional[List[float]] = None  # the target beat's RR relative to the patient's rhythm
    if kind == "beat" and positions is None and getattr(ds, "normalized_rr", False):
        ratios = [float(x.rr_ratio) for x in examples]

    def breakdowns(pred: Sequence[int]) -> Dict[str, Any]:
        """A result row's per-record figures, and per timing of the target beat when known."""
        out = {"per_record": per_record(truth, pred, records, classes)}
        if ratios is not None:
            out["by_timing"] = by_timing(truth, pred, ratios, classes)
        return out

    bias = None
    if calibration is not None:  # checked before any model runs: a bad file fails at once
        from hlmtune.hlm.calibrate import apply_bias, load_calibration

        if kind != "beat":
            raise ValueError("--calibration applies to beat classification runs (hlmtune cv fits it)")
        bias = load_calibration(Path(calibration), classes=classes, test_records=test_records)
    output_dir = Path(cfg.output_dir)
    out = Path(out_dir) if out_dir is not None else output_dir / "eval"
    models: List[Tuple[str, Path, Any, bool]] = [("HLM (this run)", _last_export(output_dir), None, False)]
    if members:
        models = [(f"member {i + 1} ({d.name})", _last_export(d), None, False)
                  for i, d in enumerate([output_dir, *(d for d, _ in members)])]
    if quantized:
        qfiles = sorted((output_dir / "quantized").glob("*.pt"))
        if not qfiles:
            raise FileNotFoundError(f"--quantized: no quantized export in {output_dir / 'quantized'} (a QAT run writes one)")
        qcfg = cfg.get("quantize", {}).get("quantizer", None) or cfg.quantizer
        models = [("float (QAT-trained)", models[0][1], None, False), ("int4 weights, QAT", qfiles[-1], qcfg, True)]
        if ptq_run is not None:
            models.append(("int4 weights, post-training (no QAT)", _last_export(Path(ptq_run)), qcfg, False))
    results: Dict[str, Dict[str, Any]] = {}
    if positions is not None:  # --batch-size counts classified beats: windows of ~(K - context) each
        batch_size = max(1, batch_size // max(1, ds.k - ds.context_beats))
    model_cfgs = [cfg, *(mcfg for _, mcfg in members)] if members else [cfg] * len(models)
    logprobs = []
    for (name, weights, qcfg, is_q), mcfg in zip(models, model_cfgs):
        model = load_model(mcfg, weights, quantizer_cfg=qcfg, quantized_weights=is_q)
        try:
            pred, off, lp = predict(model, prompts, choices, batch_size=batch_size, desc=f"eval {name}",
                                    compile=compile and qcfg is None, positions=positions, return_logprobs=True)
        except Exception as e:  # inductor needs a C++ compiler; without one, eager gives the same answers
            if not (compile and qcfg is None):
                raise
            print(f"hlmtune eval: torch.compile failed ({type(e).__name__}: {str(e)[:120]}); evaluating eagerly",
                  file=sys.stderr)
            pred, off, lp = predict(model, prompts, choices, batch_size=batch_size, desc=f"eval {name}",
                                    positions=positions, return_logprobs=True)
        logprobs.append(lp)
        m = confusion_matrix(truth, pred, len(classes))
        r = summarize(m, classes)
        r.update({"confusion": m, "classes": classes, "weights": str(weights), "off_vocabulary_argmax": off,
                  **breakdowns(pred)})
        results[name] = r
        del model
    rows = [lp.numpy() for lp in logprobs]  # per result row, (Q, C): saved in predictions.npz
    if members:  # the ensemble's row first: it is the result (report, README, benchmark)
        mean = torch.stack(logprobs).mean(0)  # (K, Q, C) -> (Q, C)
        pred = mean.argmax(-1).tolist()
        m = confusion_matrix(truth, pred, len(classes))
        r = summarize(m, classes)
        r.update({"confusion": m, "classes": classes, "weights": [str(w) for _, w, _, _ in models],
                  "off_vocabulary_argmax": None,  # no single LM's free argmax: see the members' rows
                  **breakdowns(pred)})
        results = {f"HLM ensemble of {len(models)} runs (mean class log-prob)": r, **results}
        rows = [mean.numpy(), *rows]
    calibrated = None
    if bias is not None:
        pred = apply_bias(rows[0], bias).tolist()
        m = confusion_matrix(truth, pred, len(classes))
        r = summarize(m, classes)
        r.update({"confusion": m, "classes": classes, "weights": next(iter(results.values()))["weights"],
                  "off_vocabulary_argmax": None, "class_bias": dict(zip(classes, map(float, bias))),
                  "calibration": str(calibration), **breakdowns(pred)})
        calibrated = f"{next(iter(results))} + class bias fitted on DS1 CV"
        results = {calibrated: r, **results}
        rows = [rows[0] + bias[None, :].astype("float32"), *rows]
    first = results[models[1][0]] if quantized else next(iter(results.values()))
    notice = sp.RANDOM_SPLIT_NOTICE if random_split else (
        f"Inter-patient evaluation: trained on {len(train_records)} records "
        f"({trained_on(train_records, test_records, split_file=cfg.dataset.get('split_file'))}), "
        f"tested on {split} (unseen patients)"
    )
    subset = f"; first {n} of {n_total} test examples only (smoke run)" if n < n_total else ""
    metrics = {
        "split_kind": "random_beats" if random_split else "inter_patient",
        "notice": notice + subset,
        "task": kind,
        "test_split": sp.RANDOM if random_split else split,
        "train_records": list(train_records),
        "n_examples": n,
        "n_test_examples": n_total,
        "classes": classes,
        "results": results,
        "baselines": BASELINES if kind == "beat" else [],
        "config": {"model": str(cfg.model._component_), "dataset": str(cfg.dataset._component_)},
        "ensemble": [str(w) for _, w, _, _ in models] if members else [],
    }
    if kind == "af":
        for r in results.values():
            r["af_f1"] = r["per_class"]["AF"]["f1"]
    out.mkdir(parents=True, exist_ok=True)
    # Every row's class log-probabilities per test example (the calibrated row: + its bias), for
    # pooling out-of-fold predictions (hlmtune cv) and for analysis; row order = results order.
    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, truth=np.asarray(truth, dtype=np.int64), logprobs=np.stack(rows).astype(np.float32),
             rows=np.array(list(results)), classes=np.array(classes), record=np.array(records, dtype=str),
             **({"rr_ratio": np.asarray(ratios, dtype=np.float32)} if ratios is not None else {}))
    atomic_write_bytes(out / "predictions.npz", buf.getvalue())
    metrics["calibration"] = str(calibration) if calibrated else None
    # metrics.json sorts its keys: these two keep the rows' order and name the headline row
    metrics["row_order"] = list(results)
    metrics["result"] = next(name for name, r in results.items() if r is first)
    atomic_write_bytes(out / "metrics.json", (json.dumps(metrics, indent=1, sort_keys=True) + "\n").encode())
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["true \\ predicted", *classes])
    for c, row in zip(classes, first["confusion"]):
        w.writerow([c, *row])
    atomic_write_bytes(out / "confusion.csv", buf.getvalue().encode())
    plot_confusion(first["confusion"], classes, out / "confusion.png", notice[:90])
    md = [f"**{notice}**{subset}", "", f"# HLM evaluation: {cfg.model._component_}", ""]
    for name, r in results.items():
        md += [f"## {name}", "", class_table(r), "",
               f"Next token outside the class tokens (unconstrained argmax): {r['off_vocabulary_argmax']} of {r['n']}."
               if r["off_vocabulary_argmax"] is not None else
               f"The row below with a class bias added to its log-probabilities "
               f"({', '.join(f'{c} {b:+.2f}' for c, b in r['class_bias'].items())}), fitted on out-of-fold "
               f"predictions for DS1 patients (`{r['calibration']}`), never on the test split."
               if "class_bias" in r else
               f"Mean over the {len(models)} runs below of each one's class-token log-probabilities; "
               f"runs: {', '.join(f'`{w.parent.parent}`' for _, w, _, _ in models)}.", ""]
    if kind == "beat":
        md += ["## Beside the published inter-patient baselines (MIT-BIH DS1 -> DS2)", "",
               baseline_table(results), "",
               "Baseline figures as the papers state them; ours from `metrics.json`."
               + (" Not comparable: random beat split." if random_split else ""), ""]
    md += ["![confusion matrix](confusion.png)", "",
           f"## Per record: {metrics['result']}", "",
           RECORD_TABLE_LEGEND, "", record_table(first, classes), ""]
    if "by_timing" in first:
        md += [f"## By the target beat's timing: {metrics['result']}", "", TIMING_TABLE_LEGEND, "",
               timing_table(first, classes), ""]
    atomic_write_bytes(out / "report.md", "\n".join(md).encode())
    metrics["out_dir"] = str(out)
    return metrics


# ----------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> None:
    """Add ``hlmtune eval``."""
    p = subparsers.add_parser(
        "eval",
        help="evaluate a trained Heart Language Model on unseen patients (MIT-BIH DS2)",
        description=(
            "Evaluate a trained HLM run: per-class sensitivity, positive predictivity and F1, macro-F1 and "
            "the confusion matrix on the test split, beside the published inter-patient baselines. The LM is "
            "the classifier: its next token after <beat?> is the prediction. Writes metrics.json (with the "
            "figures of each test record, and by the target beat's timing: premature or not by its normalized RR "
            "token), confusion.csv/.png, predictions.npz and report.md (with both tables) to --out (default "
            "<output_dir>/eval)."
        ),
    )
    p.add_argument("--config", required=True,
                   help="the run's config: pack name (ecg_lora), YAML path, or a run's output_dir "
                        "(reads the torchtune_config.yaml the run wrote)")
    p.add_argument("overrides", nargs="*",
                   help="key=value overrides, as given to `hlmtune run` (e.g. output_dir=...); with --ensemble they "
                        "apply to every run (output_dir excepted)")
    p.add_argument("--split", default="DS2", help="test split (default DS2: MIT-BIH inter-patient test records)")
    p.add_argument("--batch-size", type=int, default=256, help="prompts per forward pass (default 256)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default <output_dir>/eval)")
    p.add_argument("--quantized", action="store_true", help="QAT run: also evaluate its int8/int4 export")
    p.add_argument("--ptq-run", type=Path, default=None,
                   help="needs --quantized: output_dir of the same model trained without fake quantization; "
                        "it is quantized after training and evaluated beside the QAT export")
    p.add_argument("--max-examples", type=int, default=None, help="only the first N test examples (smoke runs)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the float model (fixed-shape batches; pays off on the full DS2, ~50k beats)")
    p.add_argument("--ensemble", type=Path, nargs="+", default=[], metavar="RUN",
                   help="output_dirs of more runs trained for the same prompts (e.g. other seeds): predict the "
                        "class with the highest mean log-probability over all runs; each run is reported too")
    p.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                   help="class-bias file of `hlmtune cv` (calibration.json, fitted on DS1 out-of-fold "
                        "predictions): report argmax(log p + bias) first, the uncalibrated rows after it")
    p.set_defaults(func=_main)


def load_run_config(target: str, overrides: Sequence[str]) -> Any:
    """A run's config from a pack name, a YAML path or a run folder, with overrides applied."""
    from omegaconf import OmegaConf

    from hlmtune._compat import load_config
    from hlmtune.registry import resolve_config

    p = Path(target)
    run_dir = p if p.is_dir() else None
    if run_dir is not None:
        p = p / "torchtune_config.yaml"
        if not p.is_file():
            raise FileNotFoundError(f"{target}: no torchtune_config.yaml (give the run's config instead)")
    else:
        p = resolve_config(target)
    cfg = load_config(str(p), list(overrides))
    OmegaConf.resolve(cfg)
    if run_dir is not None:
        # A copied or moved run (or job) folder: its saved config names where it ran, not where it is.
        import yaml

        recorded = (yaml.safe_load(p.read_text()) or {}).get("output_dir")
        moved = relocation(str(recorded), run_dir) if recorded else None
        if moved is not None:
            given = {o.split("=", 1)[0].strip().lstrip("+~") for o in overrides}
            _moved(cfg, *moved, given=given)
    return cfg


def relocation(recorded: str, actual: Path) -> Optional[Tuple[str, str]]:
    """Where a run folder's job was and where it is now, from its recorded and actual paths.

    The two paths share their last components (the run's place inside the job: ``fold1/runs/lora``
    after ``cp -r outputs/cv outputs/cv_b``); what precedes them is the old and the new job folder.

    Args:
        recorded (str): the run's ``output_dir`` as its config saved it (absolute).
        actual (Path): the run folder as given now.

    Returns:
        Optional[Tuple[str, str]]: (old prefix, new prefix), or None when the folder has not moved
        or the two paths share no last component (nothing says which parts correspond).
    """
    here = Path(actual).resolve()
    if Path(recorded) == here or Path(recorded).resolve() == here:  # the same folder (through a link)
        return None
    old, new = Path(recorded).parts, here.parts
    tail = 0
    while tail < min(len(old), len(new)) - 1 and old[-1 - tail] == new[-1 - tail]:
        tail += 1
    if tail == 0:
        return None
    return str(Path(*old[:-tail])), str(Path(*new[:-tail]))


def _moved(cfg: Any, old: str, new: str, *, given: Set[str], prefix: str = "") -> None:
    """Rewrite, in place, each path of ``cfg`` under ``old`` to the same path under ``new``
    when that path exists there (a run folder copied alone keeps reading the job's shared
    tokens and pretrained model where they are). Keys in ``given`` (overrides) are left as given."""
    from omegaconf import DictConfig, ListConfig

    items = cfg.items() if isinstance(cfg, DictConfig) else enumerate(cfg) if isinstance(cfg, ListConfig) else ()
    for key, value in list(items):
        name = f"{prefix}{key}"
        if name in given:
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            _moved(value, old, new, given=given, prefix=name + ".")
        elif isinstance(value, str) and value.startswith("/") and Path(value).is_relative_to(old):
            there = Path(new) / Path(value).relative_to(old)  # path components: /a/cv never matches /a/cv_b
            if there.exists():
                cfg[key] = str(there)


def flag_conflict(*, quantized: bool, ptq_run: Optional[Path], ensemble: Sequence[Path],
                  calibration: Optional[Path]) -> Optional[str]:
    """Why these ``hlmtune eval`` flags do not go together, or None.

    A flag documented "with X" is refused without X rather than silently ignored: ``--ptq-run``
    is only read beside ``--quantized``'s QAT export. (The other flags stand on their own; the
    overrides apply to the run, and to every ``--ensemble`` run when there are some.)

    Args:
        quantized (bool): ``--quantized``.
        ptq_run (Optional[Path]): ``--ptq-run``.
        ensemble (Sequence[Path]): ``--ensemble``.
        calibration (Optional[Path]): ``--calibration``.

    Returns:
        Optional[str]: a one-line message naming the flags, or None when they combine.
    """
    if ptq_run is not None and not quantized:
        return "--ptq-run needs --quantized (its run is quantized after training and evaluated beside the QAT export)"
    if ensemble and quantized:
        return "--ensemble and --quantized do not combine: evaluate a QAT run's export on its own"
    if calibration is not None and quantized:
        return "--calibration and --quantized do not combine: calibrate the float run"
    return None


def _main(args: argparse.Namespace) -> int:
    from hlmtune.ecg_tokenizer.splits import SplitError

    for flag, v in (("--batch-size", args.batch_size), ("--max-examples", args.max_examples)):
        if v is not None and v < 1:
            print(f"hlmtune eval: {flag} must be >= 1, got {v}", file=sys.stderr)
            return 2
    conflict = flag_conflict(quantized=args.quantized, ptq_run=args.ptq_run, ensemble=args.ensemble,
                             calibration=args.calibration)
    if conflict:  # argument errors first: before any config is read
        print(f"hlmtune eval: {conflict}", file=sys.stderr)
        return 2
    try:
        cfg = load_run_config(args.config, args.overrides)
        check_hlm_run(cfg, f"--config {args.config}")
        metrics = evaluate(cfg, split=args.split, batch_size=args.batch_size, out_dir=args.out,
                           quantized=args.quantized, ptq_run=args.ptq_run, max_examples=args.max_examples,
                           compile=args.compile, ensemble=args.ensemble, overrides=args.overrides,
                           calibration=args.calibration)
    except (FileNotFoundError, SplitError, ValueError) as e:
        print(f"hlmtune eval: {e}", file=sys.stderr)
        return 2
    print(metrics["notice"])
    for name, r in ordered_results(metrics).items():
        print(f"\n{name}")
        print(class_table(r, metrics["classes"]))
    if metrics["task"] == "beat":
        print("\n" + baseline_table(ordered_results(metrics)))
    print(f"\nreport: {Path(metrics['out_dir']) / 'report.md'}")
    return 0
