"""The pack's attention fast path gives torchtune's loss and gradients, and is used where it pays."""

from __future__ import annotations

import pytest
import torch

from hlmtune.training.fastpath import gqa_pays, target_logits_applies, target_positions_only, use_gqa_attention


def _model(num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0, lora_output: bool = False) -> torch.nn.Module:
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    torch.manual_seed(seed)
    m = lora_llama3(lora_attn_modules=["q_proj", "v_proj"], vocab_size=96, num_layers=2, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, embed_dim=64, max_seq_len=64, intermediate_dim=96, lora_rank=4,
                    lora_alpha=8, apply_lora_to_output=lora_output)
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
    assert ref[1].keys() == got[1].keys() and len(ref[1]) >= 8  # q and v adapters (A, B) of 2 layers (+ output)
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


def _labels(tokens: torch.Tensor, seed: int) -> torch.Tensor:
    """Shifted labels with a masked prompt per row and masked padding at the end (the recipe's layout)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)  # (B, T)
    for row in range(labels.shape[0]):
        p = int(torch.randint(1, labels.shape[1] // 2, (1,), generator=g))
        labels[row, :p] = -100
    labels[0, -5:] = -100
    return labels


def test_target_positions_only_gives_torchtunes_chunked_loss_and_gradients():
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    tokens = torch.randint(0, 96, (3, 32), generator=torch.Generator().manual_seed(4))
    labels = _labels(tokens, seed=5)
    loss_fn = CEWithChunkedOutputLoss(num_output_chunks=4)

    ref_model = _model(lora_output=True)
    ref_model.set_num_output_chunks(loss_fn.num_output_chunks)
    ref_loss = loss_fn(ref_model(tokens), labels)
    ref_loss.backward()
    ref = (ref_loss.detach(), {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None})

    fast_model = _model(lora_output=True)
    fast_model.set_num_output_chunks(loss_fn.num_output_chunks)  # as the recipe sets it; bypassed inside
    assert target_logits_applies(fast_model, loss_fn)
    keep = labels != -100
    with target_positions_only(fast_model, keep):
        logits = fast_model(tokens)
    assert logits.shape == (int(keep.sum()), 96) and logits.dtype == torch.float32
    loss = torch.nn.functional.cross_entropy(logits, labels[keep], reduction="sum") / keep.sum()
    loss.backward()
    got = (loss.detach(), {n: p.grad.clone() for n, p in fast_model.named_parameters() if p.grad is not None})
    assert any("output.lora" in n for n in got[1])  # the output adapter trains through the new path
    _assert_same(ref, got)
    # Outside the block the model is torchtune's again: chunked full-sequence logits.
    out = fast_model(tokens)
    assert isinstance(out, list) and sum(c.shape[1] for c in out) == 32
    assert "unembed" not in fast_model.__dict__


def test_target_logits_applies_only_to_token_mean_cross_entropy():
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    m = _model()
    assert target_logits_applies(m, CEWithChunkedOutputLoss())
    assert target_logits_applies(m, torch.nn.CrossEntropyLoss())
    assert not target_logits_applies(m, torch.nn.CrossEntropyLoss(reduction="sum"))
    assert not target_logits_applies(m, torch.nn.CrossEntropyLoss(label_smoothing=0.1))
    assert not target_logits_applies(torch.nn.Linear(2, 2), CEWithChunkedOutputLoss())
    m.output_hidden_states = [0]  # the forward would return a list with hidden states
    assert not target_logits_applies(m, CEWithChunkedOutputLoss())
