"""The pack's attention fast path gives torchtune's loss and gradients, and is used where it pays."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hlmtune.training.fastpath import (
    prunable_last_layer, causal_sdpa_blocked, gqa_pays, inference_fastpath, query_logits, target_logits_applies,
    target_positions_only, use_addmm_lora,
    use_blocked_causal_attention, use_complex_rope, use_gqa_attention, use_onednn_linear, onednn_linear,
    onednn_linear_pays,
)

needs_onednn = pytest.mark.skipif(not hasattr(torch.ops.mkldnn, "_linear_pointwise"), reason="torch without oneDNN")


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


def _attention_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention written out (the reference: no SDPA, no blocks)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (b, n_h, s, h_d)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (b, n_h, s, s)
    s = q.shape[2]
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("s,block,heads", [(40, 8, (4, 2)), (37, 8, (4, 4)), (33, 16, (6, 2)), (31, 16, (2, 2))])
def test_blocked_causal_attention_matches_attention_by_hand(s, block, heads):
    """Every block size and ragged last block: outputs and q/k/v gradients of the written-out math."""
    g = torch.Generator().manual_seed(s)
    q = torch.randn(2, heads[0], s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, heads[1], s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, heads[1], s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, heads[0], s, 8, generator=g, dtype=torch.float64)
    outs, grads = [], []
    for fn in (_attention_by_hand, lambda *t: causal_sdpa_blocked(*t, block=block, enable_gqa=heads[0] != heads[1])):
        out = fn(q, k, v)
        outs.append(out.detach())
        grads.append(torch.autograd.grad((out * w).sum(), (q, k, v)))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-10)
    for got, ref in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_blocked_attention_in_the_model_matches_torchtune():
    tokens = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(3))
    for heads in ((4, 2), (2, 2)):  # grouped heads, and plain multi-head (routed now too)
        ref = _loss_and_grads(_model(*heads), tokens)
        fast = _model(*heads)
        assert use_blocked_causal_attention(fast, block=8) == 2
        assert fast.layers[0].attn._causal_block == 8
        _assert_same(ref, _loss_and_grads(fast, tokens))
        # and with the GQA path taken first, in the recipe's order
        fast = _model(*heads)
        use_gqa_attention(fast)
        assert use_blocked_causal_attention(fast, block=16) == 2
        _assert_same(ref, _loss_and_grads(fast, tokens))


def test_blocked_attention_leaves_masks_and_short_rows_to_one_call(monkeypatch):
    """Packed masks, and rows shorter than two blocks, call SDPA once, as before."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[0].shape[2]) or sdpa(*a, **kw))
    m = _model()
    use_blocked_causal_attention(m, block=16)
    attn = m.layers[0].attn
    x = torch.randn(1, 40, 64)
    attn(x, x)
    assert calls == [16, 16, 8]  # rows 0-15 causal, 16-31 and 32-39 over the keys they see
    calls.clear()
    attn(x[:, :31], x[:, :31])
    assert calls == [31]
    calls.clear()
    attn(x, x, mask=torch.ones(1, 40, 40, dtype=torch.bool).tril())
    assert calls == [40]


@needs_onednn
@pytest.mark.parametrize("bias,trains", [(False, False), (True, True), (False, True)])
def test_onednn_linear_matches_float64_by_hand(bias, trains):
    """Output, input, weight and bias gradients of 3-D input, against float64 products written out."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 37, 24, generator=g, requires_grad=True)
    w = torch.randn(40, 24, generator=g, requires_grad=trains)
    b = torch.randn(40, generator=g, requires_grad=trains) if bias else None
    dy = torch.randn(3, 37, 40, generator=g)
    out = onednn_linear(x, w, b)
    ref = x.detach().double() @ w.detach().double().T + (b.detach().double() if bias else 0)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    out.backward(dy)
    torch.testing.assert_close(x.grad.double(), dy.double() @ w.detach().double(), rtol=1e-5, atol=1e-5)
    if trains:
        dw = dy.double().reshape(-1, 40).T @ x.detach().double().reshape(-1, 24)
        torch.testing.assert_close(w.grad.double(), dw, rtol=1e-5, atol=1e-5)
        if bias:
            torch.testing.assert_close(b.grad.double(), dy.double().sum((0, 1)), rtol=1e-5, atol=1e-5)
    else:
        assert w.grad is None


@needs_onednn
def test_onednn_linear_in_the_model_matches_torchtune(monkeypatch):
    """LoRA model (frozen base, trained adapters and output): torchtune's loss and gradients to fp32 rounding."""
    from hlmtune.training import fastpath
    from hlmtune.training.fastpath import use_addmm_lora

    tokens = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(5))
    ref = _loss_and_grads(_model(lora_output=True), tokens)
    fast = _model(lora_output=True)
    use_addmm_lora(fast)
    # 2 layers x (q, v LoRA bases + their A, B; k, o, w1, w2, w3) + the output's LoRA base, A, B
    assert use_onednn_linear(fast) == 2 * (2 + 4 + 5) + 3
    assert all(m.forward.__func__.__name__ == "_onednn_linear_forward" for m in fast.modules()
               if type(m) is torch.nn.Linear)
    calls = []
    product = fastpath._mkldnn_linear
    monkeypatch.setattr(fastpath, "_mkldnn_linear", lambda *a: calls.append(a[0].shape) or product(*a))
    with torch.no_grad():
        fast(tokens)
    # every product of the forward but LoRA's B (inside the addmm): per layer q and v (base, A)
    # and k, o, w1, w2, w3; then the output's base and A
    assert len(calls) == 2 * (2 * 2 + 5) + 2
    got = _loss_and_grads(fast, tokens)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    assert ref[1].keys() == got[1].keys()
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    assert isinstance(onednn_linear_pays(), bool)


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


def test_chunked_head_gives_the_same_loss_and_gradients_without_whole_logits(monkeypatch):
    from hlmtune.training import fastpath

    tokens = torch.randint(0, 96, (3, 32), generator=torch.Generator().manual_seed(4))
    labels = _labels(tokens, seed=5)
    keep = labels != -100
    n = int(keep.sum())

    def run(chunked: bool):
        model = _model(lora_output=True)
        with target_positions_only(model, keep, chunked=chunked):
            logits = model(tokens)
        loss = fastpath.chunked_cross_entropy(logits, labels[keep]) / n
        loss.backward()
        return logits, (loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})

    whole, ref = run(chunked=False)  # one (N, V) tensor: the chunk is larger than the logits
    assert isinstance(whole, torch.Tensor) and whole.shape == (n, 96)
    monkeypatch.setattr(fastpath, "CE_CHUNK_ELEMENTS", 10 * 96)  # 10 rows per chunk, the last one partial
    chunks, got = run(chunked=True)
    assert isinstance(chunks, list) and [c.shape[0] for c in chunks[:-1]] == [10] * (len(chunks) - 1)
    assert sum(c.shape[0] for c in chunks) == n and 0 < chunks[-1].shape[0] <= 10 and n % 10 != 0
    assert any("output.lora" in k for k in got[1])  # the output adapter's gradient comes through the chunks
    _assert_same(ref, got)
    # Without chunked=True (the DPO shared-prompt path reads whole logits) the head stays one call.
    m = _model()
    with target_positions_only(m, keep):
        assert isinstance(m(tokens), torch.Tensor)


def test_chunked_cross_entropy_takes_row_chunks():
    from hlmtune.training import fastpath

    torch.manual_seed(1)
    logits = torch.randn(23, 50, dtype=torch.float64)
    targets = torch.randint(0, 50, (23,))
    per_row = torch.logsumexp(logits, dim=-1) - logits[torch.arange(23), targets]  # the textbook formula
    parts = list(logits.split([9, 9, 5]))
    assert torch.allclose(fastpath.chunked_cross_entropy(parts, targets), per_row.sum(), rtol=1e-12)
    assert torch.allclose(fastpath.chunked_cross_entropy(parts, targets, reduction="none"), per_row, rtol=1e-12)
    with pytest.raises(ValueError, match="18 rows, targets 23"):
        fastpath.chunked_cross_entropy(parts[:2], targets)
    assert fastpath.ce_chunk_rows(23, 50, torch.device("cpu")) == 0  # fits one chunk
    monkeypatch_rows = fastpath.CE_CHUNK_ELEMENTS // 8000
    assert fastpath.ce_chunk_rows(2044, 8000, torch.device("cpu")) == monkeypatch_rows
    assert fastpath.ce_chunk_rows(2044, 8000, torch.device("meta")) == 0  # not CPU: one call


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


def _mlp_seq_lens(model: torch.nn.Module) -> list:
    """Sequence lengths the last layer's MLP sees (a hook), to tell the pruned layer from torchtune's."""
    seen: list = []
    model.layers[-1].mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    return seen


def _target_loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, **kw) -> tuple:
    model.zero_grad(set_to_none=True)
    keep = labels != -100
    with target_positions_only(model, keep):
        logits = model(tokens, **kw)  # (N, V)
    loss = torch.nn.functional.cross_entropy(logits, labels[keep], reduction="sum") / keep.sum()
    loss.backward()  # after the block, as in the recipe
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference_loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, **kw) -> tuple:
    model.zero_grad(set_to_none=True)
    logits = model(tokens, **kw)  # (B, T, V): torchtune's model, unmodified
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("gqa", [False, True])
def test_last_layer_runs_only_at_target_positions_with_torchtunes_gradients(gqa):
    tokens = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(6))
    labels = _labels(tokens, seed=7)
    labels[2] = -100  # a row without any target: only padding slots in the last layer
    ref = _reference_loss_and_grads(_model(), tokens, labels)
    fast = _model()
    if gqa:
        use_gqa_attention(fast)
    seen = _mlp_seq_lens(fast)
    got = _target_loss_and_grads(fast, tokens, labels)
    assert seen == [int((labels != -100).sum(1).max())] and seen[0] < 32  # kept positions only
    _assert_same(ref, got)
    assert "forward" not in fast.layers[-1].__dict__  # torchtune's layer again after the block
    fast(tokens)
    assert seen[-1] == 32


def test_last_layer_at_targets_with_packed_mask_and_positions():
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, 96, (2, 24), generator=g)
    doc = torch.tensor([0] * 10 + [1] * 14)
    mask = ((doc[:, None] == doc[None, :]) & torch.ones(24, 24, dtype=torch.bool).tril()).expand(2, 24, 24)
    input_pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    labels = _labels(tokens, seed=9)
    labels[:, 9] = -100  # no target across the document boundary
    ref = _reference_loss_and_grads(_model(), tokens, labels, mask=mask, input_pos=input_pos)
    fast = _model()
    seen = _mlp_seq_lens(fast)
    got = _target_loss_and_grads(fast, tokens, labels, mask=mask, input_pos=input_pos)
    assert seen[0] < 24
    _assert_same(ref, got)


def test_checkpointed_last_layer_keeps_torchtunes_layer():
    # The recompute in backward runs after the block: a swapped forward would not match it.
    from hlmtune.training.recipe import apply_activation_checkpointing

    tokens = torch.randint(0, 96, (3, 32), generator=torch.Generator().manual_seed(10))
    labels = _labels(tokens, seed=11)
    ref = _reference_loss_and_grads(_model(), tokens, labels)
    fast = _model()
    seen = _mlp_seq_lens(fast)
    apply_activation_checkpointing(fast, [0, 1])
    got = _target_loss_and_grads(fast, tokens, labels)
    assert seen and all(s == 32 for s in seen)  # forward and recompute: every position
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    for n, g_ in got[1].items():
        torch.testing.assert_close(g_, ref[1][n.replace("._checkpoint_wrapped_module", "")], rtol=1e-5, atol=1e-7)


def test_compiled_or_already_patched_last_layer_is_left_alone():
    m = _model()
    assert prunable_last_layer(m) is m.layers[-1]
    m.layers[-1].compile()  # lazy: nothing compiles until called
    assert prunable_last_layer(m) is None
    m = _model()
    m.layers[-1].forward = m.layers[-1].forward  # someone else's instance forward
    assert prunable_last_layer(m) is None


def test_last_layer_with_another_mask_kind_runs_whole_then_selects():
    # A mask the row selection does not handle (here an additive float mask; on CUDA flex
    # attention's BlockMask): torchtune's whole layer, then the kept rows.
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(12))
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    mask = torch.zeros(2, 24, 24).masked_fill(~causal, float("-inf"))
    labels = _labels(tokens, seed=13)
    ref = _reference_loss_and_grads(_model(), tokens, labels, mask=mask)
    fast = _model()
    seen = _mlp_seq_lens(fast)
    got = _target_loss_and_grads(fast, tokens, labels, mask=mask)
    assert seen == [24]
    _assert_same(ref, got)


def _lora_linear(quantize_base: bool = False, dropout: float = 0.0, bias: bool = False, seed: int = 0) -> torch.nn.Module:
    from torchtune.modules.peft import LoRALinear

    torch.manual_seed(seed)
    m = LoRALinear(128, 256, rank=8, alpha=12, dropout=dropout, quantize_base=quantize_base,
                   use_bias=bias)  # NF4: 32768 elements
    with torch.no_grad():
        m.lora_b.weight.normal_(std=0.1)
        if bias:
            m.bias.normal_()
            m.bias.requires_grad_(False)  # torchtune starts B at zero; non-zero so every path matters
    m.weight.requires_grad_(False)  # the frozen base, as in fine-tuning
    return m


@pytest.mark.parametrize("quantize_base,dropout,bias", [(False, 0.0, False), (True, 0.0, False), (False, 0.3, False),
                                                        (True, 0.0, True), (False, 0.0, True)])
def test_addmm_lora_matches_torchtunes_lora_linear(quantize_base, dropout, bias):
    x = torch.randn(3, 10, 128, generator=torch.Generator().manual_seed(14), requires_grad=True)

    def run(m):
        torch.manual_seed(15)  # the same dropout mask
        out = m(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        gx = x.grad.clone()
        x.grad = None
        return out.detach(), grads, gx

    ref_m = _lora_linear(quantize_base, dropout, bias)
    ref = run(ref_m)
    fast_m = _lora_linear(quantize_base, dropout, bias)
    assert use_addmm_lora(fast_m) == 1 and use_addmm_lora(fast_m) == 0
    got = run(fast_m)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    assert set(got[1]) == set(ref[1]) == {"lora_a.weight", "lora_b.weight"}
    # Rounding differs (the scale applies inside the GEMM): tolerances relative to each tensor's scale.
    for n in ref[1]:
        torch.testing.assert_close(got[1][n], ref[1][n], rtol=1e-5, atol=1e-5 * float(ref[1][n].abs().max()))
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-5 * float(ref[2].abs().max()))
    fast_m.disabled = ref_m.disabled = True  # adapters off (DPO's reference pass): the base alone
    torch.testing.assert_close(fast_m(x), ref_m(x), rtol=0, atol=0)


def test_addmm_lora_in_a_model_keeps_torchtunes_loss_and_gradients():
    tokens = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(16))
    ref = _loss_and_grads(_model(lora_output=True), tokens)
    fast = _model(lora_output=True)
    assert use_addmm_lora(fast) == 5  # q and v of 2 layers, and the output
    _assert_same(ref, _loss_and_grads(fast, tokens))


def test_addmm_lora_leaves_dora_and_qat_lora_alone():
    from torchtune.modules.peft import DoRALinear
    from torchtune.modules.peft.lora import QATLoRALinear

    assert use_addmm_lora(DoRALinear(64, 64, rank=4, alpha=8)) == 0
    assert use_addmm_lora(QATLoRALinear(64, 64, rank=4, alpha=8)) == 0  # a LoRALinear subclass, own forward


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("positions", ["none", "packed", "1d"])
def test_complex_rope_matches_torchtunes_rotation(scaled, positions):
    from torchtune.models.llama3_1 import Llama3ScaledRoPE
    from torchtune.modules import RotaryPositionalEmbeddings

    def rope():
        return (Llama3ScaledRoPE(32, 64, 500_000) if scaled else RotaryPositionalEmbeddings(32, 64, 10_000))

    g = torch.Generator().manual_seed(17)
    x = torch.randn(2, 20, 3, 32, generator=g, requires_grad=True)
    packed = torch.stack([torch.cat([torch.arange(7), torch.arange(13)]), torch.cat([torch.arange(15), torch.arange(5)])])
    pos = {"none": None, "packed": packed,  # (2, 20): different documents per row
           "1d": torch.arange(30, 50)}[positions]
    grad_out = torch.randn(2, 20, 3, 32, generator=g)
    ref_out = rope()(x, input_pos=pos)
    (gx_ref,) = torch.autograd.grad(ref_out, x, grad_out)
    fast = rope()
    assert use_complex_rope(fast) == 1 and use_complex_rope(fast) == 0
    out = fast(x, input_pos=pos)
    (gx,) = torch.autograd.grad(out, x, grad_out)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    # Half precision in, half precision out (computed in fp32, as torchtune does).
    assert fast(x.detach().bfloat16(), input_pos=pos).dtype == torch.bfloat16


def test_complex_rope_in_a_model_keeps_torchtunes_loss_and_gradients():
    tokens = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(18))
    ref = _loss_and_grads(_model(), tokens)
    fast = _model()
    assert use_complex_rope(fast) == 2  # one RoPE module per layer's attention
    use_gqa_attention(fast)
    use_addmm_lora(fast)
    _assert_same(ref, _loss_and_grads(fast, tokens))


def test_complex_rope_refuses_an_unbuilt_cache_as_torchtune_does():
    from torchtune.models.llama3_1 import Llama3ScaledRoPE

    r = Llama3ScaledRoPE(32, 64, 500_000)
    use_complex_rope(r)
    r.is_cache_built = False
    with pytest.raises(RuntimeError, match="rope_init"):
        r(torch.zeros(1, 4, 2, 32))


@pytest.mark.parametrize("gqa", [False, True])
def test_query_logits_are_torchtunes_logits_at_the_chosen_positions(gqa):
    tokens = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(20))
    model = _model()
    with torch.inference_mode():
        ref = model(tokens)  # (B, T, V)
        if gqa:
            use_gqa_attention(model)
        idx = torch.tensor([[39, 0, 17], [5, 5, 0], [2, 38, 21]])  # any order, repeats, padding 0
        got = query_logits(model, tokens, idx)
    assert got.shape == (3, 3, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref.gather(1, idx[:, :, None].expand(-1, -1, 96)), rtol=1e-5, atol=1e-5)


def test_inference_fastpath_gives_torchtunes_logits_and_undoes_itself():
    """In place SwiGLU + complex RoPE: the same logits without autograd, and with it torchtune's
    gradients (autograd keeps what the in-place ops need); every patch undone on exit."""
    from torchtune.modules import FeedForward

    tokens = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(19))
    model = _model()
    with torch.inference_mode():
        ref = model(tokens)  # (B, T, V), torchtune's modules
    ref_grads = _loss_and_grads(model, tokens)
    with inference_fastpath(model) as counts:
        assert counts == {"rope": 2, "swiglu": 2}  # one of each per layer
        with torch.inference_mode():
            got = model(tokens)
        with torch.no_grad():
            got_ng = model(tokens)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_ng, ref, rtol=1e-5, atol=1e-5)
        _assert_same(ref_grads, _loss_and_grads(model, tokens))
    assert not any("forward" in m.__dict__ for m in model.modules())
    # a feed-forward without a SiLU gate (or without w3) is not SwiGLU: left to torchtune
    other = FeedForward(gate_proj=torch.nn.Linear(8, 16), down_proj=torch.nn.Linear(16, 8),
                        up_proj=torch.nn.Linear(8, 16), activation=torch.nn.GELU())
    with inference_fastpath(other) as counts:
        assert counts == {"rope": 0, "swiglu": 0}


@needs_onednn
def test_onednn_probe_decides_once_per_host_and_keeps_it(tmp_path, monkeypatch):
    """The first decision on a host is written down and every later one reads it (a timing
    taken under load must not flip a later run's GEMM library); the env var overrides both."""
    import json

    from hlmtune.training import fastpath

    monkeypatch.setenv("HLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HLM_ONEDNN_LINEAR", raising=False)
    assert fastpath.probe_cache_path() == tmp_path / "cache" / "onednn_linear.json"
    probes = []

    def probe(answer, clear=True):
        def run(shapes=None):
            probes.append(answer)
            return {"onednn": answer, "clear": clear, "ratios": [1.5 if answer else 1.0] * 3, "mkl_ms": 3.0,
                    "onednn_ms": 2.0 if answer else 3.0}
        return run

    def ask():
        fastpath.onednn_linear_decision.cache_clear()  # a new process
        return fastpath.onednn_linear_pays()

    try:
        monkeypatch.setattr(fastpath, "_probe_onednn", probe(True))
        assert ask() is True and probes == [True]
        kept = json.loads(fastpath.probe_cache_path().read_text())
        key = f"{fastpath._probe_key()} | linear (1024, 512) x 512"  # the default shape's key
        assert kept[key]["onednn"] is True and kept[key]["mkl_ms"] == 3.0 and "measured" in kept[key]
        assert f"{torch.get_num_threads()} threads" in key and f"torch {torch.__version__}" in key
        # a later run whose timing would say no (a loaded host) takes the kept answer, unmeasured
        monkeypatch.setattr(fastpath, "_probe_onednn", probe(False))
        assert ask() is True and probes == [True]
        # other threads: another key, measured and added beside the first
        monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
        assert ask() is False and probes == [True, False]
        assert len(json.loads(fastpath.probe_cache_path().read_text())) == 2
        # other kernels (MKL held to AVX2): another key too, measured again
        monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
        assert ask() is False and probes == [True, False, False]
        assert any(k.endswith(" MKL_ENABLE_INSTRUCTIONS=AVX2 | linear (1024, 512) x 512")
                   for k in json.loads(fastpath.probe_cache_path().read_text()))
        monkeypatch.undo()
        monkeypatch.setenv("HLM_CACHE_DIR", str(tmp_path / "cache"))
        monkeypatch.delenv("HLM_ONEDNN_LINEAR", raising=False)
        monkeypatch.setattr(fastpath, "_probe_onednn", probe(False))
        # forced by the environment: neither measured nor written
        for forced, want in (("0", False), ("1", True)):
            monkeypatch.setenv("HLM_ONEDNN_LINEAR", forced)
            assert ask() is want
        assert probes == [True, False, False]
        monkeypatch.delenv("HLM_ONEDNN_LINEAR")
        # an unreadable file is measured again and rewritten, not an error
        fastpath.probe_cache_path().write_text("{not json")
        assert ask() is False and probes == [True, False, False, False]
        assert json.loads(fastpath.probe_cache_path().read_text())[key]["onednn"] is False
    finally:
        fastpath.onednn_linear_decision.cache_clear()


@needs_onednn
def test_a_borderline_probe_is_this_run_s_only_and_old_entries_are_measured_again(tmp_path, monkeypatch):
    import json

    from hlmtune.training import fastpath

    monkeypatch.setenv("HLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HLM_ONEDNN_LINEAR", raising=False)
    calls = []

    def ask(found):
        def probe(shapes=None):
            calls.append(found)
            return found
        monkeypatch.setattr(fastpath, "_probe_onednn", probe)
        fastpath.onednn_linear_decision.cache_clear()  # a new process
        return fastpath.onednn_linear_decision()

    try:
        # 1.15-1.16x in each round (a timing under load): not taken, not written, measured next run
        border = {"onednn": True, "clear": False, "ratios": [1.16, 1.15, 1.16], "mkl_ms": 2.92, "onednn_ms": 2.55}
        taken, why = ask(border)
        assert taken is False and "borderline" in why and "not kept" in why and "1.16, 1.15, 1.16" in why
        assert not fastpath.probe_cache_path().exists()
        assert ask(border)[0] is False and len(calls) == 2
        # an entry written by the one-round probe of before: measured again, then replaced
        key = f"{fastpath._probe_key()} | linear (1024, 512) x 512"
        fastpath.probe_cache_path().parent.mkdir(parents=True, exist_ok=True)
        fastpath.probe_cache_path().write_text(json.dumps({key: {"onednn": False, "mkl_ms": 2.92, "onednn_ms": 2.55}}))
        clear = {"onednn": True, "clear": True, "ratios": [1.8, 1.7, 1.9], "mkl_ms": 5.9, "onednn_ms": 3.4}
        taken, why = ask(clear)
        assert taken is True and len(calls) == 3 and "kept in" in why and "oneDNN" in why
        assert json.loads(fastpath.probe_cache_path().read_text())[key]["clear"] is True
        taken, why = ask(border)  # kept now: a later borderline timing does not move it
        assert taken is True and len(calls) == 3 and why.startswith("kept for this host")
    finally:
        fastpath.onednn_linear_decision.cache_clear()


def test_the_probe_decides_by_every_round():
    from hlmtune.training import fastpath

    found = fastpath._probe_onednn()
    if "why" in found:
        pytest.skip(found["why"])
    assert len(found["ratios"]) == fastpath.PROBE_ROUNDS
    assert found["onednn"] == (min(found["ratios"]) >= fastpath.TAKE_AT)
    inside = any(fastpath.KEEP_BELOW < r < fastpath.KEEP_ABOVE for r in found["ratios"])
    assert found["clear"] == (not inside and (min(found["ratios"]) >= fastpath.KEEP_ABOVE or max(found["ratios"]) <= fastpath.KEEP_BELOW))


@needs_onednn
def test_onednn_probe_measures_both_libraries():
    from hlmtune.training import fastpath

    found = fastpath._probe_onednn()
    # a (1024, 512) x (512, 512) product forward and backward: well under a second either way
    assert isinstance(found["onednn"], bool) and 0 < found["mkl_ms"] < 1000 and 0 < found["onednn_ms"] < 1000


@needs_onednn
def test_onednn_probe_runs_each_shape_forward_and_backward_in_both_libraries(monkeypatch):
    import torch.nn.functional as F

    from hlmtune.training import fastpath

    seen = {"mkl": [], "onednn": []}
    backward = {"mkl": 0, "onednn": 0}
    real_linear, real_apply = F.linear, fastpath._OneDnnLinear.apply

    def recorder(side, fn):
        def run(x, w, b=None):
            out = fn(x, w, b)
            seen[side].append((tuple(x.shape), tuple(w.shape), w.requires_grad, out.requires_grad))
            if out.requires_grad:
                out.register_hook(lambda g: backward.__setitem__(side, backward[side] + 1))
            return out
        return run

    monkeypatch.setattr(fastpath.F, "linear", recorder("mkl", real_linear))
    monkeypatch.setattr(fastpath._OneDnnLinear, "apply", recorder("onednn", real_apply))
    shapes = ((96, 64, 32, False), (40, 8, 64, True))
    found = fastpath._probe_onednn(shapes)
    monkeypatch.undo()
    want = [((96, 64), (32, 64), False, True), ((40, 8), (64, 8), True, True)]
    for side in ("mkl", "onednn"):
        # the agreement check (mkl) then rounds x trials timings, every shape in each
        calls = seen[side][-2 * fastpath.PROBE_ROUNDS * fastpath.PROBE_TRIALS:]
        assert calls == want * (fastpath.PROBE_ROUNDS * fastpath.PROBE_TRIALS), side
        assert backward[side] == 2 * fastpath.PROBE_ROUNDS * fastpath.PROBE_TRIALS, side  # every timed product's backward too
    assert len(found["ratios"]) == fastpath.PROBE_ROUNDS


def test_linear_shapes_are_the_model_s_layers_at_a_step_s_rows():
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    from hlmtune.training import fastpath

    m = lora_llama3(lora_attn_modules=["q_proj", "v_proj"], vocab_size=4096, num_layers=2, num_heads=4, num_kv_heads=2,
                    embed_dim=128, max_seq_len=256, intermediate_dim=384, lora_rank=8, lora_alpha=16)
    set_trainable_params(m, get_adapter_params(m))
    rows = fastpath.PROBE_ROWS  # 1024
    # by hand: head (128 -> 4096) in the loss's chunks of 2^21 / 4096 = 512 rows; the MLP's
    # 128 <-> 384; q and o 128x128 (q's base frozen: LoRA), k/v 128 -> 64; LoRA's B (8 -> 128
    # for q, 8 -> 64 for v) trains, A (128 -> 8) trains: the six largest, largest first
    assert fastpath.linear_shapes(m) == (
        (512, 128, 4096, False), (rows, 128, 384, False), (rows, 384, 128, False), (rows, 128, 128, False),
        (rows, 128, 64, False), (rows, 8, 128, True))
    # a model whose forward over all shapes would pass PROBE_FLOP: rows scaled down together
    big = torch.nn.Sequential(torch.nn.Linear(4096, 4096))
    (shape,) = fastpath.linear_shapes(big)
    assert shape[1:] == (4096, 4096, True) and abs(shape[0] - fastpath.PROBE_FLOP / (2 * 4096 * 4096)) <= 1  # 238
    assert fastpath.linear_shapes(torch.nn.Sequential(torch.nn.ReLU())) == fastpath.DEFAULT_LINEAR_SHAPES



def test_attention_probe_forced_short_kept_and_borderline(tmp_path, monkeypatch):
    import json

    from hlmtune.training import fastpath

    monkeypatch.setenv("HLM_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def probe(found):
        def run(*shape):
            calls.append(shape)
            return found
        return run

    monkeypatch.setenv("HLM_BLOCKED_ATTENTION", "0")
    assert fastpath.blocked_attention_decision(8, 4, 64, 512) == (False, "HLM_BLOCKED_ATTENTION=0 (no probe)")
    monkeypatch.delenv("HLM_BLOCKED_ATTENTION")
    monkeypatch.setattr(fastpath, "_probe_blocked_attention", probe(None))
    taken, why = fastpath.blocked_attention_decision(8, 4, 64, 200)  # under two blocks: nothing to decide
    assert taken is False and "one causal call" in why and not calls
    # borderline (1.02-1.06x): this run takes the probe's answer, nothing is kept, the next run measures again
    border = {"blocked": True, "clear": False, "ratios": [1.02, 1.06, 1.04], "sdpa_ms": 10.0, "blocked_ms": 9.7,
              "band": "0.95-1.1"}
    monkeypatch.setattr(fastpath, "_probe_blocked_attention", probe(border))
    taken, why = fastpath.blocked_attention_decision(8, 4, 64, 1024)
    assert taken is True and "borderline" in why and "not kept" in why and calls == [(8, 4, 64, 512)]  # capped at 512
    assert not fastpath.probe_cache_path("blocked_attention").exists()
    # clear (2 threads where many small calls lose: 0.8x): kept off for this host, shape and threads
    slow = {"blocked": False, "clear": True, "ratios": [0.8, 0.82, 0.79], "sdpa_ms": 8.0, "blocked_ms": 10.0}
    monkeypatch.setattr(fastpath, "_probe_blocked_attention", probe(slow))
    assert fastpath.blocked_attention_decision(8, 4, 64, 512)[0] is False and len(calls) == 2
    kept = json.loads(fastpath.probe_cache_path("blocked_attention").read_text())
    (key, entry), = kept.items()
    assert "attention 8/4 heads x 64 at 512 tokens" in key and f"{torch.get_num_threads()} threads" in key
    monkeypatch.setattr(fastpath, "_probe_blocked_attention", probe(border))
    taken, why = fastpath.blocked_attention_decision(8, 4, 64, 512)
    assert taken is False and why.startswith("kept for this host") and len(calls) == 2


def test_attention_probe_measures_both_paths():
    from hlmtune.training import fastpath

    found = fastpath._probe_blocked_attention(4, 2, 32, 256)
    assert len(found["ratios"]) == fastpath.PROBE_ROUNDS and found["sdpa_ms"] > 0 and found["blocked_ms"] > 0
    assert found["blocked"] == (min(found["ratios"]) >= 1.0)


def test_chunked_cross_entropy_equals_the_formula(monkeypatch):
    from hlmtune.training import fastpath

    torch.manual_seed(0)
    monkeypatch.setattr(fastpath, "CE_CHUNK_ELEMENTS", 7 * 50)  # 7 rows per chunk: 4 chunks, the last partial
    logits = torch.randn(23, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (23,))
    got = fastpath.chunked_cross_entropy(logits, targets)
    (g_got,) = torch.autograd.grad(got, logits)
    # reference: the textbook formula, no torch cross-entropy
    per_row = torch.logsumexp(logits, dim=-1) - logits[torch.arange(23), targets]  # (N,)
    (g_ref,) = torch.autograd.grad(per_row.sum(), logits, retain_graph=True)
    assert torch.allclose(got, per_row.sum(), rtol=1e-12) and torch.allclose(g_got, g_ref, rtol=1e-12)
    rows = fastpath.chunked_cross_entropy(logits, targets, reduction="none")
    assert rows.shape == (23,) and torch.allclose(rows, per_row, rtol=1e-12)
    with pytest.raises(ValueError, match="reduction='mean'"):
        fastpath.chunked_cross_entropy(logits, targets, reduction="mean")
    few = logits[:5]  # under one chunk: one call
    assert torch.allclose(fastpath.chunked_cross_entropy(few, targets[:5]),
                          (torch.logsumexp(few, -1) - few[torch.arange(5), targets[:5]]).sum(), rtol=1e-12)


def test_every_rank_routing_through_onednn_bounds_its_primitive_cache(monkeypatch):
    """Only rank 0 runs the probe, so the routing itself sets the cache size (a user's value stands)."""
    import os

    from hlmtune.training import fastpath

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    fastpath.use_onednn_linear(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    fastpath.use_onednn_linear(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"


def test_kernel_isa_is_atens_and_the_avx2_environment_holds_it_there():
    from hlmtune.training.fastpath import AVX2_KERNELS_ENV, kernel_isa

    assert kernel_isa() == torch.backends.cpu.get_cpu_capability()
    code = "from hlmtune.training.fastpath import kernel_isa; print(kernel_isa())"
    env = {**os.environ, **AVX2_KERNELS_ENV}
    held = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    # AVX2 where the CPU has it; a CPU without AVX2 keeps what it has (the variable only caps)
    assert held.stdout.strip() in ("AVX2", "DEFAULT", "NO AVX")
    if kernel_isa().startswith(("AVX2", "AVX512")):
        assert held.stdout.strip() == "AVX2"


def test_inductor_cache_gets_a_folder_per_kernel_set(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from hlmtune.training.fastpath import inductor_cache_for_kernels, kernel_isa

    leaf = "aten-" + kernel_isa().lower()
    env = {}
    assert inductor_cache_for_kernels(env) == os.path.join(default_cache_dir(), leaf) == env["TORCHINDUCTOR_CACHE_DIR"]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")}  # the user's folder: ours goes inside it
    assert inductor_cache_for_kernels(env) == str(tmp_path / "mine" / leaf)
    assert inductor_cache_for_kernels(env) == str(tmp_path / "mine" / leaf)  # again: not nested twice
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine" / "aten-avx2x")}  # a parent's, under other kernels
    assert inductor_cache_for_kernels(env) == str(tmp_path / "mine" / leaf)


_COMPILED_VS_EAGER = """
import torch
from hlmtune.hlm.model import hlm_1m
from hlmtune.training.fastpath import inductor_cache_for_kernels, query_logits
inductor_cache_for_kernels()
torch.manual_seed(0)
model = hlm_1m(vocab_size=303).eval()
x = torch.randint(4, 303, (64, 120), generator=torch.Generator().manual_seed(1))
at = torch.full((64, 1), 119)
with torch.inference_mode():
    eager = query_logits(model, x, at)
    compiled = torch.compile(lambda a, b: query_logits(model, a, b), dynamic=False)(x, at)
print(float((compiled - eager).abs().max()))
"""


def _has_avx512() -> bool:
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return any("avx512" in str(isa) for isa in valid_vec_isa_list())


@pytest.mark.skipif(not _has_avx512(), reason="the cache mix-up needs a CPU with both AVX-512 and AVX2 kernels")
def test_a_compile_under_avx2_kernels_does_not_take_the_code_an_avx512_process_cached(tmp_path):
    """Seen 2026-12-07: with one inductor cache, a 1M-parameter HLM compiled under
    ATEN_CPU_CAPABILITY=avx2 after an AVX-512 process gave logits 2.1 off the eager ones."""
    from hlmtune.training.fastpath import AVX2_KERNELS_ENV

    def largest_difference(kernels):
        env = {k: v for k, v in os.environ.items() if k not in AVX2_KERNELS_ENV}
        env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), **kernels)
        done = subprocess.run([sys.executable, "-c", _COMPILED_VS_EAGER], capture_output=True, text=True, env=env,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return float(done.stdout.split()[-1])

    assert largest_difference({}) < 1e-4  # fills the cache with AVX-512 code
    assert largest_difference({"ATEN_CPU_CAPABILITY": "avx2"}) < 1e-4
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["aten-avx2", "aten-avx512"]
