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
import os
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from hlmtune.hlm.detection import NO_BEAT

# Figures and report rendering live in their own modules; their names are importable from here too.
from hlmtune.hlm.metrics import (  # noqa: F401
    PREMATURE_RATIO, TIMING_BUCKETS, by_timing, class_metrics, confusion_matrix, per_record, summarize,
)
from hlmtune.hlm.report import (  # noqa: F401
    BASELINES, RECORD_TABLE_LEGEND, TIMING_TABLE_LEGEND, baseline_table, class_table, eval_report_markdown, headline,
    held_out_described, ordered_results, plot_confusion, record_table, timing_table, trained_on,
)


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

    from hlmtune.compat import ensure_torchao_aliases

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

    (Over 80 lines: half of it is this docstring; the batching loop and its compiled step share
    state that a split would pass around.)

    By default the query is a prompt's last token; ``positions`` gives, per prompt, every
    position whose next-token prediction is a query (windows of consecutive beats classify
    several beats in one forward pass).

    Prompts are right-padded (a causal model's earlier positions do not see the padding) and
    grouped by length so that padding is rare. With ``compile`` the model runs through
    ``torch.compile`` on batches of one fixed shape (every batch padded to ``batch_size`` rows
    of the longest prompt), so it compiles once; at dim 128 the elementwise RoPE / RMSNorm ops
    cost as much as the matmuls and fusing them pays (1.4x measured on 2 CPU cores, after a
    compile of about a minute). The first compiled batch is also run eagerly: logits that differ by
    more than rounding (a miscompiled graph, seen with inductor's cache filled under other ATen
    kernels) make the whole call eager, with a message; a later compiled batch that is not finite
    is computed again eagerly.

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

    from hlmtune.training.fastpath import (inductor_cache_for_kernels, inference_fastpath, prunable_last_layer,
                                           query_logits)

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
    recomputed = 0  # batches whose compiled logits were not finite, computed again eagerly
    compiled = compile  # False once the first compiled batch disagrees with the eager model
    if compile:
        inductor_cache_for_kernels()  # a cache filled under other ATen kernels gave wrong code
    fixed_width = max((len(p) for p in prompts), default=1)
    fast = (fast and isinstance(model, TransformerDecoder) and not model.output_hidden_states
            and prunable_last_layer(model) is not None)
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
            width = fixed_width if compiled else max(len(prompts[i]) for i in idx)
            x = torch.zeros(batch_size if compiled else len(idx), width, dtype=torch.long)  # pad 0; extra rows ignored
            for r, i in enumerate(idx):
                x[r, : len(prompts[i])] = torch.tensor(prompts[i])
            rows = torch.tensor([r for r, i in enumerate(idx) for _ in positions[i]], dtype=torch.long)
            if fast:
                tq = fixed_queries if compiled else max(1, max(len(positions[i]) for i in idx))
                at = torch.zeros(x.shape[0], tq, dtype=torch.long)  # (B, Tq): queries, padded with 0
                for r, i in enumerate(idx):
                    at[r, : len(positions[i])] = torch.tensor(positions[i], dtype=torch.long)
                slots = torch.tensor([s for i in idx for s in range(len(positions[i]))], dtype=torch.long)
                last = run(x, at)[rows, slots]  # (B, Tq, V) -> (Q, V): the next-token distribution per query
                again = lambda: step(x[: len(idx), : max(len(prompts[i]) for i in idx)], at[: len(idx)])[rows, slots]
            else:
                cols = torch.tensor([q for i in idx for q in positions[i]], dtype=torch.long)
                last = run(x)[rows, cols]  # (B, T, V) -> (Q, V)
                again = lambda: model(x[: len(idx), : max(len(prompts[i]) for i in idx)])[rows, cols]
            if compiled and b == 0:  # the compiled graph, checked once against the eager model
                eager = again()
                if not _same_logits(last, eager):
                    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default")
                    print(f"hlmtune eval: the compiled model's logits differ from the eager model's at the first "
                          f"batch of {desc} (largest difference {_largest_difference(last, eager):.3g}): evaluating "
                          f"eagerly; inductor's cache was {cache}", file=sys.stderr)
                    compiled, run, last = False, (step if fast else model), eager
            if not bool(torch.isfinite(last).all()):
                last = _finite_again(last, again, compiled=compiled)
                recomputed += 1
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
    if recomputed:
        print(f"hlmtune eval: the compiled model gave non-finite logits in {recomputed} batch(es) of {desc}; "
              "computed again eagerly, without the fixed-shape padding", file=sys.stderr)
    return (out, off_vocab, logprobs) if return_logprobs else (out, off_vocab)


def _same_logits(compiled: Any, eager: Any) -> bool:
    """Whether a compiled batch's (Q, V) logits are the eager model's up to fp32 rounding.

    Rounding moves the HLM's logits (up to about 15) by at most 5e-5; a miscompiled graph moved them
    by 2 to 50 (:func:`hlmtune.training.fastpath.inductor_cache_for_kernels`). Eager logits that are
    not finite are the model's own, for :func:`_finite_again` to refuse: not the compiler's fault.
    """
    import torch

    if not bool(torch.isfinite(eager).all()):
        return True
    scale = max(1.0, float(eager.abs().max()))
    return bool(torch.isfinite(compiled).all()) and bool(torch.allclose(compiled, eager, rtol=0.0, atol=1e-3 * scale))


def _largest_difference(compiled: Any, eager: Any) -> float:
    """max |compiled - eager| over a batch's logits (inf where the compiled ones are not finite)."""
    d = (compiled - eager).abs()
    return float(d.nan_to_num(float("inf")).max())


def _finite_again(last: Any, again: Callable[[], Any], *, compiled: bool) -> Any:
    """A batch's query logits once more, eagerly and unpadded, when the first pass gave NaN or inf.

    Seen on 2026-12-07 (docs/hlm-experiments.md): a fine-tune's compiled fixed-shape pass gave NaN at
    most queries (class log-probabilities NaN, argmax class 0: every beat N) where the eager pass gave
    finite logits for every one. Eager logits that are still not finite are the model's own: refused.

    Raises:
        RuntimeError: the eager pass is not finite either (or there was no compiled pass to redo).
    """
    import torch

    if compiled:
        last = again()
    bad = int((~torch.isfinite(last)).any(-1).sum())
    if bad:
        raise RuntimeError(f"hlmtune eval: the model's next-token logits are not finite for {bad} queries"
                           + (" (eagerly too)" if compiled else "") + ": its weights or inputs are broken, "
                           "and a NaN would be scored as the first class")
    return last


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


def _detector_test_set(tokenizer: Any, comp: str, section: Dict[str, Any], test_manifest: Dict[str, Any],
                       test: Sequence[str], out: Path, detector: str) -> Tuple[Any, Any]:
    """(test dataset of detected beats, their :class:`~hlmtune.hlm.detection.Matching`) for ``--beats detector``."""
    from hlmtune.data_builders import ecg as builders
    from hlmtune.ecg_tokenizer import splits as sp
    from hlmtune.ecg_tokenizer.detector import MATCH_WINDOW_S
    from hlmtune.ecg_tokenizer.shards import read_manifest
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams, Vocabulary
    from hlmtune.hlm import detection

    if builders.BEAT_BUILDERS.get(comp) != "beat":
        raise ValueError(f"--beats detector scores per-beat prompts; this run's dataset is {comp}")
    det = read_manifest(detection.detector_shards(test_manifest, test, out, detector=detector))
    vocab = Vocabulary(TokenizerParams.from_dict(det["params"]))
    classes = list(section.get("classes") or vocab.classes[:-1])
    class_ids = [vocab.classes.index(c) for c in classes]
    matching = detection.detector_matching(det, class_ids=class_ids, placeholder=class_ids[0],
                                           label_mode=vocab.params.label_mode, window_s=MATCH_WINDOW_S)
    section = {**section, "shards_dir": det["_dir"], "split_file": None, "extra_records": None}
    d = builders.beat_test_dataset(tokenizer, comp, section, split=sp.TEST, records=list(test), labels=matching.labels)
    # class ids of the vocabulary -> indices of the run's classes
    matching.missed = [(r, classes.index(vocab.classes[c])) for r, c in matching.missed]
    return d, matching


def _test_dataset(cfg: Any, tokenizer: Any, split: str, *, external: Optional[Dict[str, Any]] = None,
                  detector: Optional[str] = None, out: Optional[Path] = None):
    """(kind, test dataset, training records, test records) built from the run's dataset section.

    The training records are those the run's section names (its split or ``records``, and
    ``extra_records``); they must meet no test record, by id or by signal, and neither may the
    records of any run its weights come from. ``external`` (:func:`external_test_shards`) tests
    on another folder's records instead of ``split``; ``detector`` (``gqrs`` / ``xqrs``) tests on
    the beats that detector finds in them (a sixth element: the matching; else None).
    """
    from omegaconf import OmegaConf

    from hlmtune.data_builders import ecg as builders
    from hlmtune.ecg_tokenizer import splits as sp

    ds = OmegaConf.to_container(cfg.dataset, resolve=True)
    comp = str(ds.pop("_component_")).rsplit(".", 1)[-1]
    train_split = ds.get("split", sp.TRAIN)
    manifest, _ = builders.read_shards(tokenizer, ds.get("shards_dir"))
    available = [r["record"] for r in manifest["records"]]
    # what the run trained on: its saved config's record keys, whatever this evaluation overrides
    train_records = builders.training_records(manifest, {**ds, **recorded_records_keys(cfg)})
    digests = builders.signal_digests(manifest)
    if external is not None:
        if comp not in builders.BEAT_BUILDERS:
            raise ValueError(f"--test-records scores beat classes; this run's dataset is {comp}")
        test = [r["record"] for r in external["manifest"]["records"]]
        # one recording under two ids (another folder's copy of a training record) is one patient
        training = set(train_records)
        both = {**{r: d for r, d in digests.items() if r in training}, **builders.signal_digests(external["manifest"])}
        trained = sp.shared_with_training(train_records, test, digests=both)
        if trained and external["skip_trained"]:  # scored without them; the report names them
            skip = set(trained)
            test = [r for r in test if r not in skip]
            if not test:
                raise sp.SplitError(f"--test-records {external['folder']}: the run trained on every record of it "
                                    f"({', '.join(trained)})")
        try:
            sp.check_disjoint(train_records, test, digests=both, what="run")
        except sp.SplitError as e:
            raise sp.SplitError(f"{e} (--skip-trained-records scores the folder's other records)") from None
        check_base_models(cfg, test)
        if detector:
            d, matching = _detector_test_set(tokenizer, comp, ds, external["manifest"], test, out, detector)
            return "beat", d, train_records, test, matching
        section = {**ds, "shards_dir": str(external["shards"]), "split_file": None, "extra_records": None}
        d = builders.beat_test_dataset(tokenizer, comp, section, split=sp.TEST, records=test)
        return builders.BEAT_BUILDERS[comp], d, train_records, test, None
    if train_split == sp.RANDOM:
        test_split = sp.RANDOM  # the held-out beats of the same records
        test = train_records
    else:
        test_split = split
        test = sp.resolve_records(split=split, records=None, split_file=ds.get("split_file"), available=available,
                                  evaluation=True)
        sp.check_disjoint(train_records, test, digests=digests)
        check_base_models(cfg, test)
    if detector:
        if test_split == sp.RANDOM:
            raise sp.SplitError("--beats detector: split 'random' holds out annotated beats, not recordings")
        d, matching = _detector_test_set(tokenizer, comp, ds, manifest, test, out, detector)
        return "beat", d, train_records, list(test), matching
    if comp in builders.BEAT_BUILDERS:
        # Under the random split the held-out beats are those of the run's own records (an
        # explicit `records` list included); otherwise the records are the test split's.
        recs = ds.get("records") if test_split == sp.RANDOM else None
        d = builders.beat_test_dataset(tokenizer, comp, ds, split=test_split, records=recs)
        return builders.BEAT_BUILDERS[comp], d, train_records, list(test), None
    if comp == "ecg_af_dataset":
        if train_split == sp.RANDOM:  # the builder refuses it too: no held-out AF segments
            raise sp.SplitError("ecg_af_dataset: split 'random' holds out beats, not AF segments; "
                                "AF is evaluated on the test patients (DS2) only")
        recs = test
        d = builders.ECGAFDataset(manifest, recs, segment_beats=ds.get("segment_beats", 41),
                                  stride_beats=ds.get("stride_beats"), balance=None, num_examples=None, seed=0)
        return "af", d, train_records, list(recs), None
    raise ValueError(f"hlmtune eval evaluates the HLM's classification datasets; the config's dataset is {comp}")


RECORD_KEYS = ("split", "records", "split_file", "extra_records")


def recorded_records_keys(cfg: Any) -> Dict[str, Any]:
    """The dataset keys that chose a run's training records, as the run saved them.

    ``hlmtune eval --config RUN dataset.split_file=OTHER.json`` tests on OTHER's DS2, but the
    run trained on what its own ``torchtune_config.yaml`` says: the report header and the overlap
    check use that. A saved split file that is gone (a moved job) leaves the current value.

    Returns:
        Dict[str, Any]: the keys of :data:`RECORD_KEYS` the saved config has (empty without one).
    """
    saved = Path(str(cfg.get("output_dir", ""))) / "torchtune_config.yaml"
    if not saved.is_file():
        return {}
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.to_container(load_run_config(str(saved.parent), []).get("dataset"), resolve=True)
    except Exception:  # an unreadable saved config: the evaluation's own keys stand
        return {}
    if not isinstance(node, dict):
        return {}
    keys = {k: node.get(k) for k in RECORD_KEYS if k in node}
    if keys.get("split_file") and not Path(str(keys["split_file"])).is_file():
        keys.pop("split_file")
    return keys


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


def _check_member(cfg: Any, kind: str, ds: Any, run: Path, member_cfg: Any, split: str, *,
                  external: Optional[Dict[str, Any]] = None, detector: Optional[str] = None,
                  out: Optional[Path] = None) -> List[str]:
    """Refuse an ensemble member whose test prompts are not ``ds``'s; returns its training records.

    The member's own test set is built from its own config and the same test beats as the first
    run's (``split``, or ``external``'s folder, at the annotations' or ``detector``'s positions), so
    its training records are checked against the test records like the first run's; the two sets
    must hold the same prompts: the same number of examples, and the same tokens at 257
    spread-out examples (first and last included).
    """
    from omegaconf import OmegaConf
    from torchtune import config

    mkind, mds, mtrain, _, _ = _test_dataset(member_cfg, config.instantiate(member_cfg.tokenizer), split,
                                             external=external, detector=detector, out=out)

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


# ----------------------------------------------------------------------------- evaluation stages


@dataclass
class EvalSet:
    """The prompts of an evaluation and what each classified beat (or segment) is.

    Attributes:
        kind (str): ``beat`` or ``af``.
        classes (List[str]): class names, in index order.
        choices (List[int]): the class tokens, in the same order.
        prompts (List[List[int]]): what the model reads (windows for stream runs).
        truth (List[int]): true class index per classified beat.
        records (List[str]): record (patient) per classified beat.
        positions (Optional[List[List[int]]]): per window, the query positions (stream runs).
        ratios (Optional[List[float]]): the target beat's RR ratio per beat (``normalized_rr``).
        n (int): classified beats evaluated.
        n_total (int): classified beats of the whole test set.
        beats_per_prompt (int): classified beats per prompt (1; windows: ``K - context``).
        missed (List[Tuple[str, int]]): detector mode: (record, class index) of every reference
            beat no detection found; scored as predicted "no beat".
        no_beat (bool): detector mode: index ``len(classes)`` is "no beat" (the truth of an extra
            detection, the prediction of a missed beat).
    """

    kind: str
    classes: List[str]
    choices: List[int]
    prompts: List[List[int]]
    truth: List[int]
    records: List[str]
    positions: Optional[List[List[int]]] = None
    ratios: Optional[List[float]] = None
    n: int = 0
    n_total: int = 0
    beats_per_prompt: int = 1
    missed: List[Tuple[str, int]] = field(default_factory=list)
    no_beat: bool = False


def collect_prompts(kind: str, ds: Any, max_examples: Optional[int]) -> EvalSet:
    """Stage 1: the test set's prompts, truths and records (the first ``max_examples`` only).

    Args:
        kind (str): ``beat``, ``stream`` or ``af`` (:func:`_test_dataset`).
        ds (Any): the test dataset.
        max_examples (Optional[int]): smoke runs: stop after this many classified beats.

    Returns:
        EvalSet: what the scoring stage reads.
    """
    if kind == "stream":  # windows of consecutive beats, several classified beats each
        prompts, positions, truth, records = [], [], [], []
        n_total = int(sum(int((t >= 0).sum()) for t in ds.target))
        for k in range(len(ds)):
            if max_examples is not None and len(truth) >= int(max_examples):
                break
            tokens, query_at, cls = ds.window(k)
            prompts.append(tokens)
            positions.append(query_at)
            truth.extend(cls)
            records.extend([ds.record_of(k)] * len(cls))
        v = ds.vocab
        return EvalSet("beat", list(ds.classes), [v.label_base + v.classes.index(c) for c in ds.classes], prompts,
                       truth, records, positions=positions, n=len(truth), n_total=n_total,
                       beats_per_prompt=max(1, ds.k - ds.context_beats))
    n_total = len(ds)
    n = n_total if max_examples is None else min(n_total, int(max_examples))
    records = [ds.record_of(k) for k in range(n)]
    if kind == "af":
        return EvalSet("af", ["AF", "not AF"], [ds.yes_id, ds.no_id], [ds.prompt(k) for k in range(n)],
                       [0 if ds.is_af(k) else 1 for k in range(n)], records, n=n, n_total=n_total)
    examples = [ds.example(k) for k in range(n)]  # the prompt owner records the target's RR
    classes, v = list(ds.classes), ds.vocab
    return EvalSet("beat", classes, [v.label_base + v.classes.index(c) for c in classes], [x.tokens for x in examples],
                   [classes.index(ds.label_of(k)) for k in range(n)], records,
                   ratios=[float(x.rr_ratio) for x in examples] if getattr(ds, "normalized_rr", False) else None,
                   n=n, n_total=n_total)


def apply_matching(test: EvalSet, ds: Any, matching: Any, *, complete: bool) -> None:
    """Detector mode: extra detections score as true "no beat"; missed reference beats join as
    predicted "no beat" (all of them, or none in a smoke run of the first examples)."""
    c = len(test.classes)
    for k in range(test.n):
        e = int(ds.index[k])
        if matching.extra[ds.record_of(k)][int(ds.beat[e])]:
            test.truth[k] = c
    test.missed = list(matching.missed) if complete else []
    test.no_beat = True


def result_row(test: EvalSet, pred: Sequence[int], **extra: Any) -> Dict[str, Any]:
    """One row of ``metrics.json``'s results: the figures of ``pred``, per record and by timing.

    In detector mode the missed reference beats join as predicted "no beat" (index ``C``).
    """
    c = len(test.classes)
    size = c + 1 if test.no_beat else c
    truth = [*test.truth, *(k for _, k in test.missed)]
    pred = [*pred, *([c] * len(test.missed))]
    records = [*test.records, *(r for r, _ in test.missed)]
    m = confusion_matrix(truth, pred, size)
    r = summarize(m, test.classes)
    r.update({"confusion": m, "classes": test.classes, **extra,
              "per_record": per_record(truth, pred, records, test.classes, size=size)})
    if test.ratios is not None:
        ratios = [*test.ratios, *([float("nan")] * len(test.missed))]
        r["by_timing"] = by_timing(truth, pred, ratios, test.classes, size=size)
    return r


def models_to_score(cfg: Any, members: Sequence[Tuple[Path, Any]], *, quantized: bool,
                    ptq_run: Optional[Path]) -> List[Tuple[str, Path, Any, bool, Any]]:
    """Stage 2: (row name, weights, quantizer config or None, weights already quantized, run config) per model."""
    output_dir = Path(cfg.output_dir)
    if members:
        return [(f"member {i + 1} ({d.name})", _last_export(d), None, False, c)
                for i, (d, c) in enumerate([(output_dir, cfg), *members])]
    models = [("HLM (this run)", _last_export(output_dir), None, False, cfg)]
    if quantized:
        qfiles = sorted((output_dir / "quantized").glob("*.pt"))
        if not qfiles:
            raise FileNotFoundError(f"--quantized: no quantized export in {output_dir / 'quantized'} (a QAT run writes one)")
        qcfg = cfg.get("quantize", {}).get("quantizer", None) or cfg.quantizer
        models = [("float (QAT-trained)", models[0][1], None, False, cfg),
                  ("int4 weights, QAT", qfiles[-1], qcfg, True, cfg)]
        if ptq_run is not None:
            models.append(("int4 weights, post-training (no QAT)", _last_export(Path(ptq_run)), qcfg, False, cfg))
    return models


def score(models: Sequence[Tuple[str, Path, Any, bool, Any]], test: EvalSet, *, batch_size: int,
          compile: bool) -> Tuple[Dict[str, Dict[str, Any]], List[Any]]:
    """Stage 3: every model's predictions; (result rows by name, (Q, C) class log-probabilities per model)."""
    results: Dict[str, Dict[str, Any]] = {}
    logprobs = []
    batch = max(1, batch_size // test.beats_per_prompt)  # --batch-size counts classified beats
    for name, weights, qcfg, is_q, mcfg in models:
        model = load_model(mcfg, weights, quantizer_cfg=qcfg, quantized_weights=is_q)
        run = dict(batch_size=batch, desc=f"eval {name}", positions=test.positions, return_logprobs=True)
        try:
            pred, off, lp = predict(model, test.prompts, test.choices, compile=compile and qcfg is None, **run)
        except Exception as e:  # inductor needs a C++ compiler; without one, eager gives the same answers
            if not (compile and qcfg is None):
                raise
            print(f"hlmtune eval: torch.compile failed ({type(e).__name__}: {str(e)[:120]}); evaluating eagerly",
                  file=sys.stderr)
            pred, off, lp = predict(model, test.prompts, test.choices, **run)
        logprobs.append(lp)
        results[name] = result_row(test, pred, weights=str(weights), off_vocabulary_argmax=off)
        del model
    return results, logprobs


def combine(results: Dict[str, Dict[str, Any]], logprobs: List[Any], test: EvalSet, *, ensemble: bool,
            bias: Any, calibration: Optional[Path]) -> Tuple[Dict[str, Dict[str, Any]], List[Any], Optional[str]]:
    """Stage 4: the ensemble's row (mean log-probability) and the calibrated row, each put first.

    Returns:
        Tuple: (result rows, (Q, C) log-probabilities per row in the same order, the calibrated
        row's name or None).
    """
    import torch

    rows = [lp.numpy() for lp in logprobs]
    if ensemble:  # the ensemble's row first: it is the result (report, README, benchmark)
        mean = torch.stack(logprobs).mean(0)  # (K, Q, C) -> (Q, C)
        r = result_row(test, mean.argmax(-1).tolist(), weights=[v["weights"] for v in results.values()],
                       off_vocabulary_argmax=None)  # no single LM's free argmax: see the members' rows
        results = {f"HLM ensemble of {len(logprobs)} runs (mean class log-prob)": r, **results}
        rows = [mean.numpy(), *rows]
    calibrated = None
    if bias is not None:
        from hlmtune.hlm.calibrate import apply_bias

        r = result_row(test, apply_bias(rows[0], bias).tolist(), weights=next(iter(results.values()))["weights"],
                       off_vocabulary_argmax=None, class_bias=dict(zip(test.classes, map(float, bias))),
                       calibration=str(calibration))
        calibrated = f"{next(iter(results))} + class bias fitted on DS1 CV"
        results = {calibrated: r, **results}
        rows = [rows[0] + bias[None, :].astype("float32"), *rows]
    return results, rows, calibrated


def write_outputs(out: Path, metrics: Dict[str, Any], test: EvalSet, rows: List[Any], *, title: str,
                  model_runs: Sequence[Path]) -> None:
    """Stage 5: ``predictions.npz``, ``metrics.json``, ``confusion.csv`` / ``.png`` and ``report.md`` (atomic writes)."""
    import numpy as np

    from hlmtune.files import atomic_write_bytes

    out.mkdir(parents=True, exist_ok=True)
    results = metrics["results"]
    first = results[metrics["result"]]
    # Every row's class log-probabilities per test example (the calibrated row: + its bias), for
    # pooling out-of-fold predictions (hlmtune cv) and for analysis; row order = results order.
    buf = io.BytesIO()
    np.savez(buf, truth=np.asarray(test.truth, dtype=np.int64), logprobs=np.stack(rows).astype(np.float32),
             rows=np.array(list(results)), classes=np.array(test.classes), record=np.array(test.records, dtype=str),
             **({"rr_ratio": np.asarray(test.ratios, dtype=np.float32)} if test.ratios is not None else {}))
    atomic_write_bytes(out / "predictions.npz", buf.getvalue())
    atomic_write_bytes(out / "metrics.json", (json.dumps(metrics, indent=1, sort_keys=True) + "\n").encode())
    text = io.StringIO()
    w = csv.writer(text)
    labels = [*test.classes, *([NO_BEAT] if test.no_beat else [])]  # detector mode: missed / extra beats
    w.writerow(["true \\ predicted", *labels])
    for c, row in zip(labels, first["confusion"]):
        w.writerow([c, *row])
    atomic_write_bytes(out / "confusion.csv", text.getvalue().encode())
    plot_confusion(first["confusion"], labels, out / "confusion.png", metrics["notice"][:90])
    atomic_write_bytes(out / "report.md", eval_report_markdown(metrics, title=title, model_runs=model_runs).encode())


def evaluate(
    cfg: Any, *, split: str = "DS2", batch_size: int = 256, out_dir: Optional[Path] = None,
    quantized: bool = False, ptq_run: Optional[Path] = None, max_examples: Optional[int] = None,
    compile: bool = False, ensemble: Sequence[Path] = (), overrides: Sequence[str] = (),
    calibration: Optional[Path] = None, test_records: Optional[Path] = None, beats: str = "annotations",
    detector: str = "gqrs", skip_trained: bool = False,
) -> Dict[str, Any]:
    """Evaluate a trained HLM run and write its report: a driver over the stages above.

    (Over 80 lines for its Args section; the body is the driver: runs, test set, scores, rows, files.)

    Args:
        cfg (DictConfig): the run's config (as trained; ``output_dir`` holds its exports).
        split (str): test split (``DS2``); ignored for ``split: random`` runs (their test beats).
        batch_size (int): classified beats per forward pass.
        out_dir (Optional[Path]): where to write (default ``<output_dir>/eval``).
        quantized (bool): also evaluate ``<output_dir>/quantized/*.pt`` (QAT runs).
        ptq_run (Optional[Path]): output_dir of the same model trained without fake quantization:
            its float weights are quantized after training and evaluated beside the QAT export
            (needs ``quantized``).
        max_examples (Optional[int]): evaluate only the first N test examples (smoke runs; the
            report says so).
        compile (bool): run the float model through ``torch.compile`` (see :func:`predict`).
        ensemble (Sequence[Path]): output_dirs of more runs trained for the same prompts. The
            prediction is the class with the highest mean log-probability over ``cfg``'s run and
            these; each member's own figures are reported too. Every member's training records
            are checked against the test records, and its test prompts must be the first run's.
        overrides (Sequence[str]): the ``key=value`` overrides ``cfg`` was loaded with; they
            apply to every ensemble member too, except ``output_dir``.
        calibration (Optional[Path]): a class-bias file of ``hlmtune cv`` (refused when fitted on
            a test record): ``argmax(log p + bias)`` is reported first, the uncalibrated rows after.
        test_records (Optional[Path]): a WFDB folder to test on instead of ``split``: every
            beat-annotated record, at any sampling rate (:func:`external_test_shards`).
        beats (str): ``annotations`` (the reference annotations' R-peak positions, as the
            published baselines) or ``detector`` (the beats ``detector`` finds, matched to the
            reference beats within 150 ms: :mod:`hlmtune.hlm.detection`).
        detector (str): ``gqrs`` (the tokenizer's) or ``xqrs`` (wfdb's) for ``beats: detector``.
        skip_trained (bool): with ``test_records``, score the folder's records that no run here
            trained on and name the others (``test_records_left_out``) instead of refusing them.

    Returns:
        Dict[str, Any]: what ``metrics.json`` holds.
    """
    import torch
    from torchtune import config

    from hlmtune.ecg_tokenizer import splits as sp

    torch.manual_seed(0)
    conflict = flag_conflict(quantized=quantized, ptq_run=ptq_run, ensemble=ensemble, calibration=calibration)
    if conflict:
        raise ValueError(conflict)
    members = ensemble_members(cfg, ensemble, overrides)
    out = Path(out_dir) if out_dir is not None else Path(cfg.output_dir) / "eval"
    tokenizer = config.instantiate(cfg.tokenizer)
    if skip_trained and test_records is None:
        raise ValueError("--skip-trained-records applies to --test-records (a split's test records are never trained on)")
    external = (external_test_shards(cfg, Path(test_records), out, skip_trained=skip_trained)
                if test_records is not None else None)
    if beats not in ("annotations", "detector"):
        raise ValueError(f"--beats must be annotations or detector, got {beats!r}")
    found_by = detector if beats == "detector" else None  # None: the reference annotations' positions
    kind, ds, train_records, test_ids, matching = _test_dataset(
        cfg, tokenizer, split, external=external, detector=found_by, out=out)
    for d, mcfg in members:
        train_records = list(dict.fromkeys([*train_records, *_check_member(
            cfg, kind, ds, d, mcfg, split, external=external, detector=found_by, out=out)]))
    test = collect_prompts(kind, ds, max_examples)
    if matching is not None:
        apply_matching(test, ds, matching, complete=max_examples is None)
    bias = None
    if calibration is not None:  # checked before any model runs: a bad file fails at once
        from hlmtune.hlm.calibrate import load_calibration

        if test.kind != "beat":
            raise ValueError("--calibration applies to beat classification runs (hlmtune cv fits it)")
        bias = load_calibration(Path(calibration), classes=test.classes, test_records=test_ids)
    models = models_to_score(cfg, members, quantized=quantized, ptq_run=ptq_run)
    results, logprobs = score(models, test, batch_size=batch_size, compile=compile)
    results, rows, calibrated = combine(results, logprobs, test, ensemble=bool(members), bias=bias,
                                        calibration=calibration)
    random_split = str(cfg.dataset.get("split", sp.TRAIN)) == sp.RANDOM
    first = results[models[1][0]] if quantized else next(iter(results.values()))
    split_file = cfg.dataset.get("split_file")
    tested = (external_described(external, test_ids) if external
              else held_out_described(split, test_ids, split_file=split_file))
    notice = sp.RANDOM_SPLIT_NOTICE if random_split else (
        f"Inter-patient evaluation: trained on {len(train_records)} records "
        f"({trained_on(train_records, test_ids, split_file=split_file)}), tested on {tested}"
    )
    subset = f"; first {test.n} of {test.n_total} test examples only (smoke run)" if test.n < test.n_total else ""
    positions = ("beats found by the {} QRS detector, matched to the reference beats within 150 ms".format(detector)
                 if matching is not None else "beats at the reference annotations' R-peak positions")
    notice = f"{notice}; {positions}"
    metrics = {
        "split_kind": "random_beats" if random_split else "inter_patient",
        "notice": notice + subset,
        "task": test.kind,
        "test_split": sp.RANDOM if random_split else (f"records of {external['folder']}" if external else split),
        "test_databases": sorted({sp.database_of(r) or "" for r in test_ids} - {""}),
        "train_records": list(train_records),
        "n_examples": test.n,
        "n_test_examples": test.n_total,
        "classes": test.classes,
        "results": results,
        "baselines": BASELINES if test.kind == "beat" else [],
        "config": {"model": str(cfg.model._component_), "dataset": str(cfg.dataset._component_)},
        "ensemble": [str(w) for _, w, _, _, _ in models] if members else [],
        "calibration": str(calibration) if calibrated else None,
        # metrics.json sorts its keys: these two keep the rows' order and name the headline row
        "row_order": list(results),
        "result": next(name for name, r in results.items() if r is first),
    }
    if external:
        kept = set(test_ids)
        metrics["test_records_dropped"] = sum(int(r["n_dropped"]) for r in external["manifest"]["records"]
                                              if r["record"] in kept)
        metrics["test_records_left_out"] = left_out(external, test_ids)
    metrics["beats"] = {"positions": beats, **({"detector": detector, **matching.detector} if matching else {})}
    if test.kind == "af":
        for r in results.values():
            r["af_f1"] = r["per_class"]["AF"]["f1"]
    write_outputs(out, metrics, test, rows, title=str(cfg.model._component_),
                  model_runs=[w.parent.parent for _, w, _, _, _ in models])
    metrics["out_dir"] = str(out)
    return metrics


def ensemble_members(cfg: Any, ensemble: Sequence[Path], overrides: Sequence[str]) -> List[Tuple[Path, Any]]:
    """Every run of the evaluation recognised as an HLM run before any work; (folder, config) of the others."""
    check_hlm_run(cfg, str(cfg.get("output_dir")))
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
    return members


def left_out(external: Dict[str, Any], test: Sequence[str]) -> List[str]:
    """The records of ``--test-records``' folder that are not among the ``test`` records scored:
    those ``--skip-trained-records`` left out because a run trained on them (folder order)."""
    scored = set(test)
    return [r["record"] for r in external["manifest"]["records"] if r["record"] not in scored]


def external_described(external: Dict[str, Any], test: Sequence[str]) -> str:
    """The test records of ``--test-records`` for the report's first line: how many, the
    database, the folder and the rates, and the records left out because a run trained on them."""
    scored = set(test)
    rates = sorted({float(r["fs"]) for r in external["manifest"]["records"] if r["record"] in scored})
    left = left_out(external, test)
    return (f"{len(test)} records of {external['db']} ({external['folder']}; {', '.join(f'{r:g}' for r in rates)} Hz)"
            + (f", {len(left)} more left out because the run trained on them ({', '.join(left)})" if left else ""))


def external_test_shards(cfg: Any, folder: Path, out: Path, *, skip_trained: bool = False) -> Dict[str, Any]:
    """Tokenize a WFDB folder of test patients as the run's shards were (``--test-records``).

    Every record with a beat annotation file (its ``RECORDS`` list, else every ``*.hea``) is
    read at its own sampling rate and resampled as the training records were (with its second lead
    when the run's prompts show one: ``dataset.second_lead``); its ids are ``<folder name>/<record>``. Beat symbols outside the WFDB table are dropped and counted
    (strict for training data, lenient for a test folder: a report says how many).

    Args:
        cfg (DictConfig): the run's config (its tokenizer's shards give the parameters).
        folder (Path): the WFDB folder.
        out (Path): the evaluation folder (the tokens go to ``out/test_tokens``; a rerun resumes).
        skip_trained (bool): the test set leaves out the records a run trained on instead of
            refusing them (``--skip-trained-records``; kept in the result for every ensemble member).

    Returns:
        Dict[str, Any]: ``shards`` (folder), ``manifest``, ``folder``, ``db`` (the database name
        of its ids), ``skip_trained``.

    Raises:
        FileNotFoundError: no folder, or no beat-annotated record in it.
        RuntimeError: a record that cannot be read (named).
    """
    from hlmtune.ecg_tokenizer.pipeline import RecordOptions, RecordSource, database_name, tokenize_sources
    from hlmtune.ecg_tokenizer.records import list_records
    from hlmtune.ecg_tokenizer.shards import read_manifest
    from hlmtune.ecg_tokenizer.vocab import TokenizerParams

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"--test-records {folder}: no such folder")
    names = [n for n in list_records(folder) if (folder / f"{n}.atr").is_file()]
    if not names:
        raise FileNotFoundError(f"--test-records {folder}: no record with a beat annotation file (.atr)")
    run_shards = read_manifest(Path(str(cfg.tokenizer.get("manifest_path") or cfg.get("shards_dir"))))
    params = TokenizerParams.from_dict(run_shards["params"])
    db = database_name(folder)
    second = bool((cfg.get("dataset") or {}).get("second_lead"))  # the run's prompts show the second lead
    summary = tokenize_sources([RecordSource(folder, db, names)], out / "test_tokens", params=params,
                               options=RecordOptions(on_unknown_symbols="drop", on_missing_annotations="error",
                                                     second_lead=second),
                               workers=1, progress=False)
    if not summary.ok:
        raise RuntimeError(f"--test-records {folder}: records that cannot be read:\n" + summary.format())
    manifest = read_manifest(out / "test_tokens")
    return {"shards": out / "test_tokens", "manifest": manifest, "folder": str(folder), "db": db,
            "skip_trained": skip_trained}


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
                   help="the run's config: pack name (ecg_lora), YAML path, a run's output_dir (reads the "
                        "torchtune_config.yaml the run wrote), or a job folder of `hlmtune demo --out` / "
                        "`benchmarks/ecg_quality.py --out` (its final model, or its ensemble)")
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
    p.add_argument("--test-records", type=Path, default=None, metavar="FOLDER",
                   help="test on every beat-annotated record of a WFDB folder (its RECORDS file, else every record "
                        "with an .atr; any sampling rate) instead of --split; records the run, or a run its weights "
                        "come from, trained on are refused (by id and by signal)")
    p.add_argument("--skip-trained-records", action="store_true",
                   help="with --test-records: score the folder's records no run here trained on and name the others "
                        "in the report (test_records_left_out) instead of refusing the folder (e.g. a whole svdb "
                        "folder, half of which the shipped configs train on)")
    p.add_argument("--beats", choices=("annotations", "detector"), default="annotations",
                   help="where the test beats are: the reference annotations' R-peak positions (as the published "
                        "baselines) or where a QRS detector finds them, matched to the reference beats within 150 ms "
                        "(a missed beat is a false negative of its class, an extra detection a false positive)")
    p.add_argument("--detector", choices=("gqrs", "xqrs"), default="gqrs",
                   help="the QRS detector of --beats detector (gqrs: the tokenizer's; xqrs: wfdb's)")
    p.set_defaults(func=_main)


def job_runs(folder: Path) -> Optional[List[Path]]:
    """The final fine-tune(s) of a job folder (``hlmtune demo --out``, ``benchmarks/ecg_quality.py --out``).

    The runs the job's report scored (its ``report/metrics.json``: the ensemble's members, in
    order), else those a train-only job fine-tuned (its ``training.json``), found by name under
    ``folder/runs`` so a moved job still works; else ``runs/lora``.

    Returns:
        Optional[List[Path]]: the runs (the first is the ``--config`` run, the rest its ensemble),
        or None when ``folder`` is not a job folder.
    """
    runs = Path(folder) / "runs"
    if (Path(folder) / "torchtune_config.yaml").is_file() or not runs.is_dir():
        return None
    metrics = Path(folder) / "report" / "metrics.json"
    training = Path(folder) / "training.json"  # benchmarks/ecg_quality.py --train-only: no report yet
    found: List[Path] = []
    if metrics.is_file():
        found = [runs / Path(w).parent.parent.name for w in json.loads(metrics.read_text()).get("ensemble") or []]
    elif training.is_file():
        found = [runs / Path(r["run"]).name for r in json.loads(training.read_text()).get("runs", [])
                 if r.get("stage") == "finetune"]
    if found and all((r / "torchtune_config.yaml").is_file() for r in found):
        return found
    return [runs / "lora"] if (runs / "lora" / "torchtune_config.yaml").is_file() else None


def load_run_config(target: str, overrides: Sequence[str]) -> Any:
    """A run's config from a pack name, a YAML path or a run folder, with overrides applied."""
    from omegaconf import OmegaConf

    from hlmtune.compat import load_config
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
        target, ensemble = args.config, list(args.ensemble)
        job = job_runs(Path(args.config)) if Path(args.config).is_dir() else None
        if job is not None:  # a job folder: its final model(s), as the job evaluated them
            if ensemble:
                raise ValueError(f"--config {args.config} is a job folder (its ensemble is its own): drop --ensemble")
            target, ensemble = str(job[0]), job[1:]
            print(f"hlmtune eval: job {args.config}: {' + '.join(r.name for r in job)}", file=sys.stderr)
        cfg = load_run_config(target, args.overrides)
        check_hlm_run(cfg, f"--config {args.config}")
        metrics = evaluate(cfg, split=args.split, batch_size=args.batch_size, out_dir=args.out,
                           quantized=args.quantized, ptq_run=args.ptq_run, max_examples=args.max_examples,
                           compile=args.compile, ensemble=ensemble, overrides=args.overrides,
                           calibration=args.calibration, test_records=args.test_records, beats=args.beats,
                           detector=args.detector, skip_trained=args.skip_trained_records)
    except (FileNotFoundError, SplitError, ValueError, RuntimeError) as e:
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
