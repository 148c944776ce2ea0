"""HLM builders: sizes, NF4-compatible dimensions, vocabulary from the tokenizer manifest."""

from __future__ import annotations

import json

import pytest
import torch
from torchao.dtypes.nf4tensor import NF4Tensor

from hlmtune.hlm import model as hm

LORA = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
            apply_lora_to_output=True)


@pytest.mark.parametrize("name,lo,hi", [("hlm_1m", 0.8e6, 1.2e6), ("hlm_10m", 8e6, 12e6), ("hlm_100m", 90e6, 110e6)])
def test_sizes_are_as_named(name, lo, hi):
    with torch.device("meta"):
        m = getattr(hm, name)(vocab_size=303)
    assert lo <= hm.count_parameters(m) <= hi


@pytest.mark.parametrize("name", sorted(hm.ARCHS))
def test_every_linear_weight_fits_nf4_blocks(name):
    """Counted from the architecture table, and seen on the built QLoRA model (meta device)."""
    assert hm.nf4_compatible(name, 303) == {}
    with torch.device("meta"):
        m = getattr(hm, f"lora_{name}")(vocab_size=303, **LORA)
    linears = {n: p.numel() for n, p in m.named_parameters() if n.endswith(".weight") and p.dim() == 2
               and "lora_" not in n and "tok_embeddings" not in n}
    assert linears and all(v % hm.NF4_BLOCK == 0 for v in linears.values()), {
        n: v for n, v in linears.items() if v % hm.NF4_BLOCK}


def test_qlora_base_is_nf4_and_runs():
    torch.manual_seed(0)
    m = hm.qlora_hlm_1m(vocab_size=303, **LORA)
    base = {n: mod.weight for n, mod in m.named_modules() if hasattr(mod, "lora_a")}
    # every transformer-layer linear is NF4; torchtune's lora_llama3 keeps the output head float
    assert len(base) == 4 * 7 + 1 and all(isinstance(w, NF4Tensor) for n, w in base.items() if n != "output")
    assert not isinstance(base["output"], NF4Tensor)
    logits = m(torch.randint(0, 303, (2, 12)))
    assert logits.shape == (2, 12, 384) and torch.isfinite(logits).all()


def test_vocab_from_manifest_is_padded(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"vocab": {"size": 303}}))
    assert hm.resolve_vocab_size(None, str(tmp_path)) == 384
    assert hm.resolve_vocab_size(303, str(tmp_path / "manifest.json")) == 384
    with torch.device("meta"):
        assert hm.hlm_1m(manifest_path=str(tmp_path)).output.weight.shape == (384, 128)
    with pytest.raises(ValueError, match="disagrees"):
        hm.resolve_vocab_size(500, str(tmp_path))
    with pytest.raises(ValueError, match="manifest_path .* or vocab_size"):
        hm.resolve_vocab_size(None, None)
    with pytest.raises(FileNotFoundError, match="hlmtune tokenize"):
        hm.resolve_vocab_size(None, str(tmp_path / "nope"))
