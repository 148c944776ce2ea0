"""The pack's attention fast path gives torchtune's loss and gradients, and is used where it pays."""

from __future__ import annotations

import pytest
import torch

from hlmtune.training.fastpath import gqa_pays, use_gqa_attention


def _model(num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0) -> torch.nn.Module:
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    torch.manual_seed(seed)
    m = lora_llama3(lora_attn_modules=["q_proj", "v_proj"], vocab_size=96, num_layers=2, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, embed_dim=64, max_seq_len=64, intermediate_dim=96, lora_rank=4,
                    lora_alpha=8)
    set_trainable_params(m, get_adapter_params(m))
    with torch.no_grad():  # non-zero B so the adapters' gradients depend on the attention output
        for n, p in m.named_parameters():
            if "lora_b" in n:
                p.normal_(std=0.1)
    return m


def _loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor, **kw) -> tuple:
    model.zero_grad(set_to_none=True)
    logits = model(tokens, **kw)  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ref: tuple, got: tuple) -> None:
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    assert ref[1].keys() == got[1].keys() and len(ref[1]) == 8  # q and v adapters (A, B) of 2 layers
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")


def test_gqa_path_matches_torchtune_causal():
    tokens = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(1))
    ref = _loss_and_grads(_model(), tokens)
    fast = _model()
    assert use_gqa_attention(fast) == 2
    _assert_same(ref, _loss_and_grads(fast, tokens))


def test_gqa_path_matches_torchtune_with_packed_mask_and_positions():
    # Packed rows: a block-causal boolean mask (B, T, T) and per-document positions.
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 96, (2, 24), generator=g)
    doc = torch.tensor([0] * 10 + [1] * 14)
    mask = (doc[:, None] == doc[None, :]) & torch.ones(24, 24, dtype=torch.bool).tril()
    mask = mask.expand(2, 24, 24)
    input_pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    ref = _loss_and_grads(_model(), tokens, mask=mask, input_pos=input_pos)
    fast = _model()
    use_gqa_attention(fast)
    _assert_same(ref, _loss_and_grads(fast, tokens, mask=mask, input_pos=input_pos))


def test_gqa_path_leaves_full_attention_and_decoding_to_torchtune():
    # No grouped heads: nothing to change.
    assert use_gqa_attention(_model(num_heads=2, num_kv_heads=2)) == 0
    # Twice on one model: changed once.
    m = _model()
    assert use_gqa_attention(m) == 2 and use_gqa_attention(m) == 0
    # Streaming decode (y=None without a KV cache) is torchtune's forward, with its error.
    attn = m.layers[0].attn
    with pytest.raises(ValueError, match="Must provide y input or use kv_cache"):
        attn(torch.zeros(1, 3, 64), None)


def test_gqa_pays_per_device_and_dtype():
    assert gqa_pays(torch.device("cpu"), torch.float32)
    assert gqa_pays(torch.device("cpu"), torch.bfloat16)
    assert gqa_pays(torch.device("cuda"), torch.bfloat16)
    assert gqa_pays(torch.device("cuda"), torch.float16)
    assert not gqa_pays(torch.device("cuda"), torch.float32)  # no flash kernel: math fallback
    assert not gqa_pays(torch.device("meta"), torch.float32)
