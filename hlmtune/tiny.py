"""Tiny Llama3 assets made on the spot: a byte-level BPE tokenizer and an HF-layout checkpoint.

Model weights cannot be downloaded everywhere (CI, air-gapped clusters), so tests, the demo
and the benchmarks build a real ``torchtune.models.llama3`` architecture at a small size and
write it in the same Hugging Face layout that ``tune download meta-llama/Meta-Llama-3-8B-Instruct``
produces (``config.json`` + ``*.safetensors`` + ``original/tokenizer.model``), so the very same
checkpointer and tokenizer code paths as the 8B configs are exercised.

The tokenizer is a real tiktoken BPE file (``base64(token) rank`` per line) trained here with a
plain byte-pair-merge loop, plus a ``tokenizer.json`` holding the 256 Llama3 special tokens
remapped right after the BPE vocabulary (``special_tokens_path`` of ``llama3_tokenizer``).
"""

from __future__ import annotations

import base64
import collections
import json
import os
import re
from pathlib import Path
from typing import Dict, List, Optional

from hlmtune.files import atomic_write_bytes, atomic_write_text

# A few paragraphs of plain English so the merges look like a language tokenizer's.
_CORPUS = """
Below is an instruction that describes a task. Write a response that appropriately completes
the request. Correct this to standard English. Summarize this dialogue. The quick brown fox
jumps over the lazy dog. A heart beat is a contraction of the heart; the electrocardiogram
records its electrical activity. Normal beats, ventricular ectopic beats and atrial
fibrillation are labelled by cardiologists. Large language models are fine-tuned with low
rank adapters, quantization aware training and direct preference optimization on graphics
processing units. Iteration time, peak memory, speedup and efficiency are measured for one,
two and four devices. The user asked a question and the assistant gave a helpful answer.
"""

# GPT-style pre-tokenization (words with their leading space, numbers, punctuation).
_PRETOKENIZE = re.compile(r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+")


def train_bpe_ranks(text: str, num_merges: int) -> Dict[bytes, int]:
    """Learn byte-level BPE merges on ``text``.

    Args:
        text (str): training text.
        num_merges (int): number of merges to learn (fewer if the text runs out of pairs).

    Returns:
        Dict[bytes, int]: tiktoken mergeable ranks: the 256 single bytes at ranks 0..255, then
        each merged token at the rank of its merge. Every merged token is the concatenation of
        two lower-ranked tokens, which is what tiktoken requires.
    """
    ranks: Dict[bytes, int] = {bytes([b]): b for b in range(256)}
    words = collections.Counter(m.group(0).encode("utf-8") for m in _PRETOKENIZE.finditer(text))
    # Each word as a list of current tokens, with its frequency.
    seqs: List[List[bytes]] = []
    freqs: List[int] = []
    for word, count in words.items():
        seqs.append([bytes([b]) for b in word])
        freqs.append(count)
    for _ in range(num_merges):
        pairs: collections.Counter = collections.Counter()
        for seq, count in zip(seqs, freqs):
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        # Ties broken by the pair's bytes so training is deterministic.
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merged = a + b
        ranks[merged] = len(ranks)
        for seq in seqs:
            i = 0
            while i < len(seq) - 1:
                if seq[i] == a and seq[i + 1] == b:
                    seq[i : i + 2] = [merged]
                else:
                    i += 1
    return ranks


def llama3_special_token_names() -> List[str]:
    """Names of the 256 Llama3 special tokens in id order (from torchtune's table)."""
    from hlmtune.compat import llama3_special_tokens

    return [name for name, _ in sorted(llama3_special_tokens().items(), key=lambda kv: kv[1])]


def write_tiny_tokenizer(out_dir: str | os.PathLike, *, num_merges: int = 256) -> Dict[str, str]:
    """Write a tiny Llama3-compatible tokenizer.

    Args:
        out_dir (str | os.PathLike): directory to write ``tokenizer.model`` and ``tokenizer.json``.
        num_merges (int): BPE merges on top of the 256 bytes.

    Returns:
        Dict[str, str]: ``path``, ``special_tokens_path`` (for ``llama3_tokenizer``) and
        ``vocab_size`` (as a string-free int under that key).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = train_bpe_ranks(_CORPUS, num_merges)
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    atomic_write_text(out / "tokenizer.model", "\n".join(lines) + "\n")
    names = llama3_special_token_names()
    added = [{"id": len(ranks) + i, "content": name, "special": True} for i, name in enumerate(names)]
    atomic_write_text(out / "tokenizer.json", json.dumps({"added_tokens": added}, indent=1))
    return {
        "path": str(out / "tokenizer.model"),
        "special_tokens_path": str(out / "tokenizer.json"),
        "vocab_size": len(ranks) + len(names),
    }


def write_tiny_llama3_checkpoint(
    out_dir: str | os.PathLike,
    *,
    vocab_size: int,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    embed_dim: int = 256,
    intermediate_dim: int = 512,
    max_seq_len: int = 512,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised Llama3 in Hugging Face layout (what ``tune download`` gives).

    The default sizes make every linear weight a multiple of 16384 elements, as NF4 (QLoRA)
    requires: q/o 256x256, k/v 128x256, MLP 512x256.

    Args:
        out_dir (str | os.PathLike): checkpoint directory (``config.json``, ``model.safetensors``).
        vocab_size (int): vocabulary size (tokenizer's BPE ranks + special tokens).
        num_layers (int): transformer layers.
        num_heads (int): attention heads.
        num_kv_heads (int): key/value heads (GQA).
        embed_dim (int): model width.
        intermediate_dim (int): MLP hidden width.
        max_seq_len (int): maximum sequence length.
        seed (int): RNG seed for the weights.

    Returns:
        Path: the checkpoint directory.
    """
    import torch
    from torchtune.models.convert_weights import tune_to_hf
    from torchtune.models.llama3 import llama3

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = llama3(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        max_seq_len=max_seq_len,
        intermediate_dim=intermediate_dim,
    )
    # torchtune initialises the output projection with zeros-free defaults but the embedding
    # at N(0, 1): scale it down so the initial loss is near log(vocab) and training is stable.
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(0.02)
    sd = tune_to_hf(model.state_dict(), num_heads=num_heads, num_kv_heads=num_kv_heads, dim=embed_dim)
    sd = {k: v.contiguous().clone() for k, v in sd.items()}
    from safetensors.torch import save as save_bytes

    atomic_write_bytes(out / "model.safetensors", save_bytes(sd, metadata={"format": "pt"}))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": embed_dim,
        "intermediate_size": intermediate_dim,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers,
        "head_dim": embed_dim // num_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    atomic_write_text(out / "config.json", json.dumps(config, indent=2))
    return out


def write_tiny_assets(out_dir: str | os.PathLike, *, embed_dim: int = 256, num_layers: int = 2,
                      intermediate_dim: Optional[int] = None, max_seq_len: int = 512,
                      vocab_size: Optional[int] = None, num_heads: Optional[int] = None,
                      num_kv_heads: Optional[int] = None) -> Dict[str, object]:
    """Write tokenizer and checkpoint in the layout of ``tune download`` for Llama3-8B-Instruct.

    ``<out>/original/tokenizer.model`` (+ ``tokenizer.json`` for the special tokens) and the
    HF safetensors with ``config.json`` directly in ``<out>``.

    Args:
        out_dir (str | os.PathLike): model directory.
        embed_dim (int): model width (multiple of 64 keeps NF4 happy).
        num_layers (int): transformer layers.
        intermediate_dim (Optional[int]): MLP width; ``2 * embed_dim`` when None.
        max_seq_len (int): maximum sequence length.
        vocab_size (Optional[int]): rows of the embedding and output layers (None: the
            tokenizer's ids). A larger value pads the vocabulary: the model does the work of
            that vocabulary (the output projection and the loss over every id) while the
            tokenizer emits only its own ids.
        num_heads (Optional[int]): attention heads (None: ``embed_dim // 64``).
        num_kv_heads (Optional[int]): key/value heads (None: half the heads).

    Returns:
        Dict[str, object]: ``model_dir``, ``tokenizer_path``, ``special_tokens_path``,
        ``vocab_size`` (the model's), ``tokenizer_vocab_size`` and the architecture sizes.

    Raises:
        ValueError: ``vocab_size`` smaller than the tokenizer's ids.
    """
    out = Path(out_dir)
    tok = write_tiny_tokenizer(out / "original")
    if vocab_size is not None and vocab_size < int(tok["vocab_size"]):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok['vocab_size']} ids")
    model_vocab = int(vocab_size or tok["vocab_size"])
    inter = intermediate_dim or 2 * embed_dim
    num_heads = num_heads or max(1, embed_dim // 64)
    num_kv_heads = num_kv_heads or max(1, num_heads // 2)
    write_tiny_llama3_checkpoint(
        out,
        vocab_size=model_vocab,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=inter,
        max_seq_len=max_seq_len,
    )
    return {
        "model_dir": str(out),
        "tokenizer_path": tok["path"],
        "special_tokens_path": tok["special_tokens_path"],
        "vocab_size": model_vocab,
        "tokenizer_vocab_size": int(tok["vocab_size"]),
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "embed_dim": embed_dim,
        "intermediate_dim": inter,
        "max_seq_len": max_seq_len,
    }
