"""Heart Language Model builders: Llama3 architecture sized for heartbeat-token vocabularies.

Usable as ``model._component_`` in any torchtune recipe (torchtune's own or the pack's)::

    model:
      _component_: hlmtune.hlm.model.lora_hlm_1m
      manifest_path: ${shards_dir}/manifest.json   # vocabulary size read from the tokenizer manifest
      lora_attn_modules: [q_proj, k_proj, v_proj, output_proj]
      ...

Sizes (``vocab_size`` = the manifest's, padded to a multiple of 128; 303 -> 384 by default):

========== ===== ====== ===== ======== ========= ===========
builder    dim   layers heads kv heads mlp dim   parameters
========== ===== ====== ===== ======== ========= ===========
hlm_1m     128   4      4     4        384       0.95 M
hlm_10m    256   12     8     4        768       9.6 M
hlm_100m   768   16     12    4        2048      101 M
========== ===== ====== ===== ======== ========= ===========

Every linear weight's element count is a multiple of 16,384: torchao's NF4 (QLoRA) quantizes
in blocks of 64 values with one scale per 256 blocks (64 x 256 = 16,384), and
:func:`nf4_compatible` checks it. That is why the vocabulary is padded (a 303 x 128 output
projection would not be) and why ``hlm_1m`` keeps as many K/V heads as query heads
(4 x 32 x 128 = 16,384; 2 K/V heads would give 8,192).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torchtune.models.llama3 import llama3, lora_llama3
from torchtune.modules import TransformerDecoder

# Architectures by name. head_dim = embed_dim / num_heads.
ARCHS: Dict[str, Dict[str, int]] = {
    "hlm_1m": dict(embed_dim=128, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_dim=384),
    "hlm_10m": dict(embed_dim=256, num_layers=12, num_heads=8, num_kv_heads=4, intermediate_dim=768),
    "hlm_100m": dict(embed_dim=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_dim=2048),
}
VOCAB_MULTIPLE = 128  # pad the vocabulary: NF4-compatible output projection, aligned matmuls
NF4_BLOCK = 64 * 256  # torchao NF4: block_size 64 x scaler_block_size 256
DEFAULT_MAX_SEQ_LEN = 1024  # the papers' largest context window
ROPE_BASE = 10_000  # contexts are at most a few thousand tokens: Llama3's 500,000 is not needed


def padded_vocab_size(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`VOCAB_MULTIPLE`."""
    return -(-int(n) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def resolve_vocab_size(vocab_size: Optional[int], manifest_path: Optional[str]) -> int:
    """The model's (padded) vocabulary size from an explicit size or a token manifest.

    Args:
        vocab_size (Optional[int]): explicit size (padded up if needed).
        manifest_path (Optional[str]): ``hlmtune tokenize`` manifest (or its directory).

    Returns:
        int: padded vocabulary size.

    Raises:
        ValueError: neither given, or both given and they disagree.
    """
    from_manifest = None
    if manifest_path is not None:
        p = Path(manifest_path)
        p = p / "manifest.json" if p.is_dir() else p
        try:
            from_manifest = int(json.loads(p.read_text())["vocab"]["size"])
        except FileNotFoundError:
            raise FileNotFoundError(f"model.manifest_path: no token manifest at {p} (run `hlmtune tokenize` first)") from None
        except (KeyError, ValueError) as e:
            raise ValueError(f"model.manifest_path: {p} is not an ECG token manifest ({e})") from None
    if vocab_size is None and from_manifest is None:
        raise ValueError("HLM builders need manifest_path (the tokenizer manifest) or vocab_size")
    if vocab_size is not None and from_manifest is not None and padded_vocab_size(vocab_size) != padded_vocab_size(from_manifest):
        raise ValueError(f"vocab_size={vocab_size} disagrees with {manifest_path} ({from_manifest} tokens)")
    return padded_vocab_size(from_manifest if from_manifest is not None else vocab_size)


def _base(name: str, vocab_size: Optional[int], manifest_path: Optional[str], max_seq_len: int) -> TransformerDecoder:
    return llama3(
        vocab_size=resolve_vocab_size(vocab_size, manifest_path), max_seq_len=int(max_seq_len),
        rope_base=ROPE_BASE, **ARCHS[name],
    )


def _lora(
    name: str, vocab_size: Optional[int], manifest_path: Optional[str], max_seq_len: int,
    lora_attn_modules: List[str], apply_lora_to_mlp: bool, apply_lora_to_output: bool,
    lora_rank: int, lora_alpha: float, lora_dropout: float, use_dora: bool, quantize_base: bool,
) -> TransformerDecoder:
    return lora_llama3(
        lora_attn_modules=list(lora_attn_modules), apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output, vocab_size=resolve_vocab_size(vocab_size, manifest_path),
        max_seq_len=int(max_seq_len), rope_base=ROPE_BASE, lora_rank=lora_rank, lora_alpha=lora_alpha,
        lora_dropout=lora_dropout, use_dora=use_dora, quantize_base=quantize_base, **ARCHS[name],
    )


# Explicit signatures (no **kwargs): config validation checks every key against them.
def hlm_1m(*, manifest_path: Optional[str] = None, vocab_size: Optional[int] = None,
           max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> TransformerDecoder:
    """~1M-parameter HLM (dim 128, 4 layers). Args: see :func:`resolve_vocab_size`; max_seq_len (int)."""
    return _base("hlm_1m", vocab_size, manifest_path, max_seq_len)


def hlm_10m(*, manifest_path: Optional[str] = None, vocab_size: Optional[int] = None,
            max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> TransformerDecoder:
    """~10M-parameter HLM (dim 256, 12 layers, GQA 8/4)."""
    return _base("hlm_10m", vocab_size, manifest_path, max_seq_len)


def hlm_100m(*, manifest_path: Optional[str] = None, vocab_size: Optional[int] = None,
             max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> TransformerDecoder:
    """~100M-parameter HLM (dim 768, 16 layers, GQA 12/4)."""
    return _base("hlm_100m", vocab_size, manifest_path, max_seq_len)


def lora_hlm_1m(
    *, lora_attn_modules: List[str], apply_lora_to_mlp: bool = False, apply_lora_to_output: bool = False,
    lora_rank: int = 8, lora_alpha: float = 16, lora_dropout: float = 0.0, use_dora: bool = False,
    quantize_base: bool = False, manifest_path: Optional[str] = None, vocab_size: Optional[int] = None,
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
) -> TransformerDecoder:
    """:func:`hlm_1m` with LoRA adapters (torchtune ``lora_llama3`` arguments)."""
    return _lora("hlm_1m", vocab_size, manifest_path, max_seq_len, lora_attn_modules, apply_lora_to_mlp,
                 apply_lora_to_output, lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base)


def lora_hlm_10m(
    *, lora_attn_modules: List[str], apply_lora_to_mlp: bool = False, apply_lora_to_output: bool = False,
    lora_rank: int = 8, lora_alpha: float = 16, lora_dropout: float = 0.0, use_dora: bool = False,
    quantize_base: bool = False, manifest_path: Optional[str] = None, vocab_size: Optional[int] = None,
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
) -> TransformerDecoder:
    """:func:`hlm_10m` with LoRA adapters."""
    return _lora("hlm_10m", vocab_size, manifest_path, max_seq_len, lora_attn_modules, apply_lora_to_mlp,
                 apply_lora_to_output, lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base)


def lora_hlm_100m(
    *, lora_attn_modules: List[str], apply_lora_to_mlp: bool = False, apply_lora_to_output: bool = False,
    lora_rank: int = 8, lora_alpha: float = 16, lora_dropout: float = 0.0, use_dora: bool = False,
    quantize_base: bool = False, manifest_path: Optional[str] = None, vocab_size: Optional[int] = None,
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
) -> TransformerDecoder:
    """:func:`hlm_100m` with LoRA adapters."""
    return _lora("hlm_100m", vocab_size, manifest_path, max_seq_len, lora_attn_modules, apply_lora_to_mlp,
                 apply_lora_to_output, lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base)


def qlora_hlm_1m(
    *, lora_attn_modules: List[str], apply_lora_to_mlp: bool = False, apply_lora_to_output: bool = False,
    lora_rank: int = 8, lora_alpha: float = 16, lora_dropout: float = 0.0, use_dora: bool = False,
    manifest_path: Optional[str] = None, vocab_size: Optional[int] = None, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
) -> TransformerDecoder:
    """:func:`lora_hlm_1m` with an NF4-quantized frozen base (QLoRA)."""
    return _lora("hlm_1m", vocab_size, manifest_path, max_seq_len, lora_attn_modules, apply_lora_to_mlp,
                 apply_lora_to_output, lora_rank, lora_alpha, lora_dropout, use_dora, True)


def qlora_hlm_10m(
    *, lora_attn_modules: List[str], apply_lora_to_mlp: bool = False, apply_lora_to_output: bool = False,
    lora_rank: int = 8, lora_alpha: float = 16, lora_dropout: float = 0.0, use_dora: bool = False,
    manifest_path: Optional[str] = None, vocab_size: Optional[int] = None, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
) -> TransformerDecoder:
    """:func:`lora_hlm_10m` with an NF4-quantized frozen base (QLoRA)."""
    return _lora("hlm_10m", vocab_size, manifest_path, max_seq_len, lora_attn_modules, apply_lora_to_mlp,
                 apply_lora_to_output, lora_rank, lora_alpha, lora_dropout, use_dora, True)


def qlora_hlm_100m(
    *, lora_attn_modules: List[str], apply_lora_to_mlp: bool = False, apply_lora_to_output: bool = False,
    lora_rank: int = 8, lora_alpha: float = 16, lora_dropout: float = 0.0, use_dora: bool = False,
    manifest_path: Optional[str] = None, vocab_size: Optional[int] = None, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
) -> TransformerDecoder:
    """:func:`lora_hlm_100m` with an NF4-quantized frozen base (QLoRA)."""
    return _lora("hlm_100m", vocab_size, manifest_path, max_seq_len, lora_attn_modules, apply_lora_to_mlp,
                 apply_lora_to_output, lora_rank, lora_alpha, lora_dropout, use_dora, True)


def nf4_compatible(name: str, vocab_size: int = VOCAB_MULTIPLE * 3) -> Dict[str, int]:
    """Element count of every linear weight of an architecture that is *not* a multiple of 16,384.

    Args:
        name (str): a key of :data:`ARCHS`.
        vocab_size (int): padded vocabulary size.

    Returns:
        Dict[str, int]: offending weight -> numel (empty when every weight can be NF4).
    """
    a = ARCHS[name]
    d, hd = a["embed_dim"], a["embed_dim"] // a["num_heads"]
    shapes = {
        "q_proj": d * d, "k_proj": d * a["num_kv_heads"] * hd, "v_proj": d * a["num_kv_heads"] * hd,
        "output_proj": d * d, "w1": d * a["intermediate_dim"], "w2": d * a["intermediate_dim"],
        "w3": d * a["intermediate_dim"], "output": d * padded_vocab_size(vocab_size),
    }
    return {k: v for k, v in shapes.items() if v % NF4_BLOCK}


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters (NF4 tensors count their logical size)."""
    return sum(p.numel() for p in model.parameters())
