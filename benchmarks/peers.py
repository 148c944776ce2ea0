"""Shared inputs for the side-by-side benchmark against peer frameworks (``benchmarks/peer_throughput.py``).

Three frameworks train on the very same token rows: the pack's recipes, torchtune's own
single-device recipes (``tune run``, unmodified: they only get a config whose ``dataset``
is :func:`token_rows_dataset`) and TRL + PEFT (:func:`run_trl`, in its own process). The rows
are fixed-length, so no framework pads and the first-step losses can be compared exactly.

Row files are ``.npz`` archives written once per benchmark:

* SFT: ``tokens`` and ``labels``, int64 (N, T); ``labels`` is ``-100`` where no loss is taken
  (torchtune's convention: label t belongs to token t, the recipe shifts).
* DPO: ``chosen_tokens``, ``chosen_labels``, ``rejected_tokens``, ``rejected_labels``.

TRL and PEFT are an optional extra (``pip install hlmtune[bench]``), never a runtime
dependency: nothing here imports them at module level.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from hlmtune.files import atomic_write_bytes, atomic_write_text

IGNORE_INDEX = -100
SFT_KEYS = ("tokens", "labels")
DPO_KEYS = ("chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels")

# "Shipped defaults" (benchmarks/peer_throughput.py --peer-defaults / --pack-defaults): the
# implementation choices each framework makes in the Llama3-8B config a user starts from. Only
# knobs that change speed or memory, never the model, data, batch or precision.
SHIPPED_CONFIGS = {  # --recipe: (the pack's config, torchtune's config as `tune cp` names it)
    "lora": ("llama3_8b_lora_alpaca.yaml", "llama3/8B_lora_single_device"),
    "qlora": ("llama3_8b_qlora_alpaca.yaml", "llama3/8B_qlora_single_device"),
    "dpo": ("llama3_8b_lora_dpo_hh_rlhf.yaml", "llama3_1/8B_lora_dpo_single_device"),
}
DEFAULT_KNOBS = ("enable_activation_checkpointing", "enable_activation_offloading", "compile", "optimizer.fused")
CUDA_ONLY_KNOBS = ("enable_activation_offloading",)


def torchtune_config_file(name: str) -> Path:
    """The YAML torchtune ships for a config name (``tune cp`` copies it), e.g. ``llama3/8B_lora_single_device``."""
    import torchtune

    path = Path(torchtune.__file__).resolve().parent.parent / "recipes" / "configs" / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"torchtune config {name!r} not found at {path} (is torchtune 0.6.1 installed?)")
    return path


def shipped_knobs(config_file: str | os.PathLike, device: str = "cpu") -> Dict[str, Any]:
    """The :data:`DEFAULT_KNOBS` a config file sets, as ``{dotted key: value}``.

    CUDA-only knobs set to True are left out on another device (torchtune's recipes refuse
    activation offloading on CPU).

    Args:
        config_file (str | os.PathLike): a YAML config.
        device (str): where the benchmark runs.

    Returns:
        Dict[str, Any]: the knobs present in the file.
    """
    import yaml

    data = yaml.safe_load(Path(config_file).read_text()) or {}
    out: Dict[str, Any] = {}
    for key in DEFAULT_KNOBS:
        node: Any = data
        for part in key.split("."):
            node = node.get(part, None) if isinstance(node, dict) else None
        if node is None:
            continue
        if key in CUDA_ONLY_KNOBS and node is True and device != "cuda":
            continue
        out[key] = node
    return out


def write_rows(path: str | os.PathLike, arrays: Dict[str, np.ndarray]) -> Path:
    """Write a row file atomically.

    Args:
        path (str | os.PathLike): ``.npz`` file to write.
        arrays (Dict[str, np.ndarray]): exactly :data:`SFT_KEYS` or :data:`DPO_KEYS`, each
            an integer array of the same shape (N, T).

    Returns:
        Path: the file written.

    Raises:
        ValueError: other keys, mismatched shapes or non-integer arrays.
    """
    keys = tuple(sorted(arrays))
    if keys not in (tuple(sorted(SFT_KEYS)), tuple(sorted(DPO_KEYS))):
        raise ValueError(f"{path}: row arrays must be {SFT_KEYS} or {DPO_KEYS}, got {keys}")
    shapes = {k: np.asarray(v).shape for k, v in arrays.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"{path}: row arrays must share one (N, T) shape, got {shapes}")
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v, dtype=np.int64) for k, v in arrays.items()})
    out = Path(path)
    atomic_write_bytes(out, buf.getvalue())
    return out


def read_rows(path: str | os.PathLike) -> Dict[str, np.ndarray]:
    """Read a row file written by :func:`write_rows` (no pickles).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a row file (names the file and the keys found).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such row file (written by peers.write_rows)")
    with np.load(p, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    if tuple(sorted(arrays)) not in (tuple(sorted(SFT_KEYS)), tuple(sorted(DPO_KEYS))):
        raise ValueError(f"{p}: not a row file: keys {sorted(arrays)}, expected {SFT_KEYS} or {DPO_KEYS}")
    return arrays


class TokenRows:
    """Map-style dataset over a row file, in the item layout torchtune's collates expect.

    SFT items are ``{"tokens", "labels"}`` (``padded_collate_sft``); DPO items are
    ``{"chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"}``
    (``padded_collate_dpo``).

    Args:
        path (str | os.PathLike): row file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self._arrays = read_rows(path)
        self.is_dpo = "chosen_tokens" in self._arrays
        self._n = len(next(iter(self._arrays.values())))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Dict[str, List[int]]:
        a = self._arrays
        if self.is_dpo:
            return {
                "chosen_input_ids": a["chosen_tokens"][i].tolist(),
                "chosen_labels": a["chosen_labels"][i].tolist(),
                "rejected_input_ids": a["rejected_tokens"][i].tolist(),
                "rejected_labels": a["rejected_labels"][i].tolist(),
            }
        return {"tokens": a["tokens"][i].tolist(), "labels": a["labels"][i].tolist()}


def token_rows_dataset(tokenizer: Any, path: str, packed: bool = False) -> TokenRows:
    """Dataset builder for configs (``dataset._component_: peers.token_rows_dataset``, with benchmarks/ on PYTHONPATH).

    Args:
        tokenizer (Any): passed by every recipe; unused (rows are already tokens).
        path (str): row file.
        packed (bool): must be False (torchtune's recipes read this key; rows are fixed-length).

    Returns:
        TokenRows: the dataset.
    """
    if packed:
        raise ValueError("token_rows_dataset: packed=True is not supported (rows are already fixed-length)")
    return TokenRows(path)


def sft_rows_from_text(tokenizer: Any, data_file: str, n_rows: int, seq_len: int, *,
                       train_on_input: bool = False) -> Dict[str, np.ndarray]:
    """Real instruction rows: alpaca samples tokenized with the model's tokenizer, concatenated
    (packed) and cut into ``n_rows`` windows of ``seq_len`` tokens (prompt tokens keep label
    -100 unless ``train_on_input``: then every position is a target).

    Args:
        tokenizer (Any): a torchtune tokenizer (``llama3_tokenizer``).
        data_file (str): alpaca-format JSONL (``instruction``, ``input``, ``output``).
        n_rows (int): rows wanted.
        seq_len (int): tokens per row.
        train_on_input (bool): label the prompt tokens too.

    Returns:
        Dict[str, np.ndarray]: ``tokens``, ``labels`` (n_rows, seq_len).

    Raises:
        ValueError: the file holds too few tokens.
    """
    from torchtune.datasets import alpaca_dataset

    ds = alpaca_dataset(tokenizer, source="json", data_files=data_file, split="train", train_on_input=train_on_input)
    need = n_rows * seq_len
    toks: List[int] = []
    labs: List[int] = []
    for i in range(len(ds)):
        item = ds[i]
        toks.extend(item["tokens"])
        labs.extend(item["labels"])
        if len(toks) >= need:
            break
    if len(toks) < need:
        raise ValueError(f"{data_file}: {len(toks)} tokens, need {need} ({n_rows} rows x {seq_len})")
    tokens = np.asarray(toks[:need], dtype=np.int64).reshape(n_rows, seq_len)
    # train_on_input: every position a target (torchtune still masks each example's BOS).
    labels = tokens.copy() if train_on_input else np.asarray(labs[:need], dtype=np.int64).reshape(n_rows, seq_len)
    return {"tokens": tokens, "labels": labels}


def synthetic_sft_rows(n_rows: int, seq_len: int, vocab_size: int, seed: int = 0) -> Dict[str, np.ndarray]:
    """Uniform random tokens, every position a target (for runs without text data)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, size=(n_rows, seq_len), dtype=np.int64)
    return {"tokens": tokens, "labels": tokens.copy()}


def dpo_rows_from_sft(sft: Dict[str, np.ndarray], prompt_len: int) -> Dict[str, np.ndarray]:
    """Preference pairs of a fixed length from SFT rows: both completions share row i's first
    ``prompt_len`` tokens (masked); chosen continues with row i, rejected with row i+1.

    The benchmark needs identical, unpadded tensors in every framework; the text is real
    but the pairing is arbitrary (speed, not preference quality, is measured).

    Args:
        sft (Dict[str, np.ndarray]): ``tokens``/``labels`` (N, T), N >= 2.
        prompt_len (int): shared prompt tokens, 0 < prompt_len < T.

    Returns:
        Dict[str, np.ndarray]: the four DPO arrays, (N - 1, T).
    """
    tokens = sft["tokens"]
    n, t = tokens.shape
    if n < 2 or not 0 < prompt_len < t:
        raise ValueError(f"dpo rows need >= 2 SFT rows and 0 < prompt_len < {t}, got {n} rows, prompt_len {prompt_len}")
    chosen = tokens[:-1].copy()
    rejected = np.concatenate([tokens[:-1, :prompt_len], tokens[1:, prompt_len:]], axis=1)
    labels_c, labels_r = chosen.copy(), rejected.copy()
    labels_c[:, :prompt_len] = IGNORE_INDEX
    labels_r[:, :prompt_len] = IGNORE_INDEX
    return {"chosen_tokens": chosen, "chosen_labels": labels_c, "rejected_tokens": rejected, "rejected_labels": labels_r}


# Forks the measured command from a fresh, small interpreter: a child's ru_maxrss starts at
# the resident size of the process it was forked from (the kernel folds the pre-exec memory
# map into it), so forking straight from a benchmark holding torch would floor every reading
# at the benchmark's own size.
_RSS_WRAPPER = """
import json, os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"maxrss_kib": usage.ru_maxrss, "returncode": os.waitstatus_to_exitcode(status)}, f)
"""


def peak_rss_gib_of(cmd: Sequence[str], env: Dict[str, str], log_path: Optional[Path] = None) -> Dict[str, Any]:
    """Run a command; return its exit status and the peak RSS of its process tree.

    ``os.wait4`` gives the child's own resource usage, with ``ru_maxrss`` covering the child
    and the descendants it waited for: the same measure for a recipe that runs in process
    (``tune run``) and one that runs under torchrun (``hlmtune run``). The command is forked
    from a small wrapper interpreter (see ``_RSS_WRAPPER``), not from the caller.

    Args:
        cmd (Sequence[str]): command.
        env (Dict[str, str]): environment.
        log_path (Optional[Path]): stdout+stderr go here (default: discarded).

    Returns:
        Dict[str, Any]: ``returncode``, ``peak_rss_gib``, ``wall_s``.
    """
    import subprocess
    import tempfile

    fd, report = tempfile.mkstemp(suffix=".json", prefix="hlm_rss_")
    os.close(fd)
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-S", "-c", _RSS_WRAPPER, report, *cmd], stdout=out,
                              stderr=subprocess.STDOUT, env=env)
        got = json.loads(Path(report).read_text() or "{}")
    finally:
        if log_path:
            out.close()
        os.unlink(report)
    if "returncode" not in got:  # the wrapper itself failed (exec of a missing program ...)
        return {"returncode": proc.returncode or 1, "peak_rss_gib": 0.0, "wall_s": time.perf_counter() - t0}
    return {"returncode": got["returncode"], "peak_rss_gib": got["maxrss_kib"] * 1024 / 2**30,
            "wall_s": time.perf_counter() - t0}


def _hf_tokenizer(vocab_size: int, pad_id: int):
    """A word-level HF tokenizer over ids ``t0..t{V-1}``: TRL insists on one for padding;
    rows arrive as ids, so it never tokenizes text."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")))
    tok.pad_token = f"t{pad_id}"
    tok.eos_token = f"t{pad_id}"
    return tok


def _peft_without_torchao() -> None:
    """Let PEFT wrap plain ``nn.Linear`` layers next to the pack's torchao pin.

    PEFT (0.21) probes every target layer with its torchao dispatcher, whose availability
    check raises on torchao < 0.16, while the pack pins torchao < 0.12 (torchtune 0.6.1).
    The benchmark's base model is plain fp32 (no torchao tensors), so the dispatcher has
    nothing to do: report torchao as absent to it.
    """
    try:
        import peft.tuners.lora.torchao as peft_torchao
    except ImportError:  # an older PEFT without the torchao dispatcher
        return
    peft_torchao.is_torchao_available = lambda: False


def run_trl(*, kind: str, model_dir: str, rows: str, out: str, batch_size: int, steps: int, lr: float,
            lora_rank: int, lora_alpha: float, target_modules: Sequence[str], beta: float = 0.1,
            warmup_steps: int = 2, weight_decay: float = 0.01, seed: int = 0,
            activation_checkpointing: bool = False) -> None:
    """Train with TRL (``SFTTrainer`` or ``DPOTrainer``) + PEFT LoRA on a row file.

    Writes one JSON line per optimizer step to ``out``: ``step``, ``loss`` (exact, from the
    trainer's ``compute_loss``), ``iteration_time_s`` (wall time between step ends, so data
    loading counts as in the pack's ``iteration_time_s``), ``process_cpu_s`` (the process's
    CPU time at the step end, as the collector records it) and ``tokens`` (target tokens for
    SFT, all tokens for DPO, as the recipes count them).

    Args:
        kind (str): ``sft`` or ``dpo``.
        model_dir (str): HF-layout checkpoint (``config.json`` + safetensors).
        rows (str): row file (:func:`write_rows`).
        out (str): JSONL to write.
        batch_size (int): rows per step.
        steps (int): optimizer steps.
        lr (float): peak learning rate (cosine with ``warmup_steps`` linear warmup, as the
            recipes' ``get_cosine_schedule_with_warmup``).
        lora_rank (int): LoRA rank.
        lora_alpha (float): LoRA alpha.
        target_modules (Sequence[str]): HF module names (``q_proj``, ``v_proj`` ...).
        beta (float): DPO beta.
        warmup_steps (int): warmup steps.
        weight_decay (float): AdamW weight decay.
        seed (int): seed.
        activation_checkpointing (bool): TRL's own default (True) instead of the pack's and
            torchtune's (False); precision stays fp32 either way.
    """
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback

    _peft_without_torchao()
    arrays = read_rows(rows)
    n = batch_size * steps
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = int(model.config.vocab_size)
    tok = _hf_tokenizer(vocab, pad_id=vocab - 1)
    peft_cfg = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=list(target_modules),
                          bias="none", task_type="CAUSAL_LM")
    common = dict(
        output_dir=str(Path(out).parent / "trl_out"), per_device_train_batch_size=batch_size, max_steps=steps,
        learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=warmup_steps, weight_decay=weight_decay,
        logging_steps=1, save_strategy="no", report_to=[], seed=seed, use_cpu=True,
        train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True,
        # TRL's configs default to bf16 autocast and activation checkpointing; the pack and
        # torchtune configs compared here run fp32 without checkpointing (same settings).
        bf16=False, fp16=False, gradient_checkpointing=activation_checkpointing,
    )
    records: List[Dict[str, float]] = []
    losses: List[float] = []
    marks = {"t": None}

    class _Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: D102 - first step's start
            if marks["t"] is None:
                marks["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: D102
            now = time.perf_counter()
            records.append({"step": state.global_step, "iteration_time_s": now - marks["t"],
                            "process_cpu_s": time.process_time()})
            marks["t"] = now

    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        toks, labs = arrays["tokens"][:n], arrays["labels"][:n]
        ds = Dataset.from_dict({"input_ids": toks.tolist(), "completion_mask": (labs != IGNORE_INDEX).astype(int).tolist()})
        tokens_per_row = [int((labs[i, 1:] != IGNORE_INDEX).sum()) for i in range(n)]

        class _SFT(SFTTrainer):
            def compute_loss(self, *a, **kw):  # noqa: D102 - keep the exact loss
                res = super().compute_loss(*a, **kw)
                losses.append(float((res[0] if isinstance(res, tuple) else res).detach()))
                return res

        cfg = SFTConfig(max_length=toks.shape[1], completion_only_loss=True, packing=False, **common)
        trainer = _SFT(model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=peft_cfg,
                       callbacks=[_Timer()])
    elif kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        ct, cl, rt = arrays["chosen_tokens"][:n], arrays["chosen_labels"][:n], arrays["rejected_tokens"][:n]
        p = int((cl[0] == IGNORE_INDEX).sum())  # shared prompt length (dpo_rows_from_sft)
        ds = Dataset.from_dict({"prompt_ids": ct[:, :p].tolist(), "chosen_ids": ct[:, p:].tolist(),
                                "rejected_ids": rt[:, p:].tolist()})
        tokens_per_row = [2 * ct.shape[1]] * n

        class _DPO(DPOTrainer):
            def _prepare_dataset(self, dataset, *a, **kw):  # noqa: D102 - rows are already token ids
                return dataset  # prompt_ids / chosen_ids / rejected_ids: what DataCollatorForPreference reads

            def compute_loss(self, *a, **kw):  # noqa: D102 - keep the exact loss
                res = super().compute_loss(*a, **kw)
                losses.append(float((res[0] if isinstance(res, tuple) else res).detach()))
                return res

        cfg = DPOConfig(beta=beta, max_length=None, **common)
        trainer = _DPO(model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=peft_cfg,
                       callbacks=[_Timer()])
    else:
        raise ValueError(f"kind must be 'sft' or 'dpo', got {kind!r}")
    trainer.train()
    lines = []
    for i, r in enumerate(records):
        r["loss"] = losses[i] if i < len(losses) else None
        r["tokens"] = float(sum(tokens_per_row[i * batch_size:(i + 1) * batch_size]))
        lines.append(json.dumps(r))
    atomic_write_text(Path(out), "\n".join(lines) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python benchmarks/peers.py trl ...``: one TRL run of the benchmark, in its own process."""
    ap = argparse.ArgumentParser(prog="python benchmarks/peers.py", description="one TRL + PEFT run of benchmarks/peer_throughput.py")
    ap.add_argument("command", choices=["trl"], help="trl: train with TRL + PEFT on a row file")
    ap.add_argument("--kind", choices=["sft", "dpo"], required=True, help="SFTTrainer or DPOTrainer")
    ap.add_argument("--model-dir", required=True, help="HF-layout checkpoint folder")
    ap.add_argument("--rows", required=True, help="row file (.npz) from peers.write_rows")
    ap.add_argument("--out", required=True, help="steps JSONL to write")
    ap.add_argument("--batch-size", type=int, required=True, help="rows per optimizer step")
    ap.add_argument("--steps", type=int, required=True, help="optimizer steps")
    ap.add_argument("--lr", type=float, required=True, help="peak learning rate")
    ap.add_argument("--lora-rank", type=int, required=True, help="LoRA rank")
    ap.add_argument("--lora-alpha", type=float, required=True, help="LoRA alpha")
    ap.add_argument("--targets", required=True, help="comma-separated HF module names, e.g. q_proj,v_proj")
    ap.add_argument("--beta", type=float, default=0.1, help="DPO beta (default 0.1)")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="keep TRL's default activation checkpointing (default: off, as the pack's configs)")
    a = ap.parse_args(argv)
    try:
        import peft  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        print(f"TRL/PEFT not installed ({e}); pip install 'hlmtune[bench]'", file=sys.stderr)
        return 2
    run_trl(kind=a.kind, model_dir=a.model_dir, rows=a.rows, out=a.out, batch_size=a.batch_size, steps=a.steps,
            lr=a.lr, lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, target_modules=a.targets.split(","), beta=a.beta,
            activation_checkpointing=a.activation_checkpointing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
