"""enable_activation_checkpointing: auto: the layer probe, its extrapolation, the choice of layers.

The probe counts the storages autograd saves; the reference here is the CPU allocator's own
accounting (the profiler's memory events: bytes allocated minus bytes freed while the
forward runs), which shares nothing with the saved-tensor hooks.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hlmtune.training.activation_memory import (
    LayerCost,
    checkpointed_layer_count,
    choose_checkpointed_layers,
    probe_layer,
)

CPU = torch.device("cpu")
GIB = 1024 ** 3


def _tiny_llama(trainable: str = "lora", max_seq_len: int = 1024, dropout: float = 0.0) -> torch.nn.Module:
    """3 layers x 128; trainable: ``lora`` (adapters), ``all``, or ``qlora`` (NF4 base, 256 wide:
    NF4 needs each quantized weight's numel divisible by 16384)."""
    from torchtune.models.llama3 import lora_llama3

    torch.manual_seed(0)
    qlora = trainable == "qlora"
    m = lora_llama3(lora_attn_modules=["q_proj", "v_proj"], vocab_size=512, num_layers=3, num_heads=4, num_kv_heads=2,
                    embed_dim=256 if qlora else 128, max_seq_len=max_seq_len, intermediate_dim=512 if qlora else 384,
                    lora_rank=4, lora_alpha=8, lora_dropout=dropout, quantize_base=qlora)
    for n, p in m.named_parameters():
        p.requires_grad_(trainable == "all" or "lora_" in n)
    return m


def _allocator_live_bytes(layers, h: torch.Tensor) -> int:
    """Bytes the forward through ``layers`` leaves allocated, by the CPU allocator's events,
    minus the output (held by the caller, not saved), plus the first layer's input ``h``
    (allocated before; the first layer saves it)."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = layers[0](h)
        for layer in layers[1:]:
            x = layer(x)
    net = sum(e.self_cpu_memory_usage for e in prof.events())
    return net - x.numel() * x.element_size() + h.numel() * h.element_size()


@pytest.mark.parametrize("trainable", ["lora", "all", "qlora"])
@pytest.mark.parametrize("rows,seq_len", [(4, 256), (2, 700)])
def test_probe_extrapolates_to_the_allocators_count(trainable, rows, seq_len):
    """Two one-row probes of layer 0 at 128 and 256 tokens predict every layer's saved bytes
    at (rows, seq_len), as the allocator measures them for the whole stack."""
    m = _tiny_llama(trainable)
    d = m.tok_embeddings.embedding_dim
    cost = probe_layer(m.layers[0], embed_dim=d, dtype=torch.float32, device=CPU, max_seq_len=1024)
    tokens = torch.randint(0, 512, (rows, seq_len))
    h = m.tok_embeddings(tokens).detach().requires_grad_(True)  # (B, T, D)
    measured = _allocator_live_bytes(m.layers, h)
    predicted = len(m.layers) * cost.layer_bytes(rows, seq_len)
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)
    assert cost.input_bytes(rows, seq_len) == rows * seq_len * d * 4


class _ScoresLayer(torch.nn.Module):
    """Attention that materialises its (B, T, T) scores: memory quadratic in T."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)  # (B, T, D)
        scores = torch.softmax(q @ x.transpose(1, 2), dim=-1)  # (B, T, T)
        return scores @ x


def test_probe_finds_the_quadratic_part():
    torch.manual_seed(0)
    layer = _ScoresLayer(32)
    cost = probe_layer(layer, embed_dim=32, dtype=torch.float32, device=CPU, max_seq_len=2048)
    assert cost.bytes_per_token_sq > 0
    h = torch.randn(2, 600, 32, requires_grad=True)
    measured = _allocator_live_bytes([layer], h)
    assert cost.layer_bytes(2, 600) == pytest.approx(measured, rel=0.02)
    linear_only = LayerCost(cost.bytes_per_token + cost.bytes_per_token_sq * 256, 0.0, cost.input_bytes_per_token)
    assert linear_only.layer_bytes(2, 600) < 0.8 * measured  # what a single probe would have missed


def test_probe_caps_lengths_and_keeps_the_random_state():
    m = _tiny_llama(dropout=0.5)
    m.train()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    cost = probe_layer(m.layers[0], embed_dim=128, dtype=torch.float32, device=CPU, max_seq_len=64)
    assert torch.equal(torch.rand(3), expected)  # dropout draws of the probe do not shift training
    assert cost.bytes_per_token_sq == 0.0 and cost.bytes_per_token > 0  # one probe at 64 tokens


def _need(L, k, layer, inp, fixed):
    """Independent restatement of the rule: un-checkpointed layers keep everything, checkpointed
    ones their input, and backward recomputes one layer at a time (so k = 1 never beats k = 0)."""
    return (L - k) * layer + k * inp + (layer if k else 0) + fixed


@pytest.mark.parametrize("budget", [0, 50, 99, 100, 101, 130, 160, 175, 400, 10_000])
def test_checkpointed_layer_count_is_the_fewest_that_fit(budget):
    L, layer, inp, fixed = 6, 30.0, 2.0, 10.0
    k = checkpointed_layer_count(L, layer, inp, fixed, budget)
    fitting = [j for j in range(L + 1) if _need(L, j, layer, inp, fixed) <= budget]
    assert k == (min(fitting) if fitting else None)
    if k is not None and k > 0:  # one fewer would not fit
        assert _need(L, k - 1, layer, inp, fixed) > budget


def test_choice_follows_the_budget(caplog):
    m = _tiny_llama()
    kw = dict(rows=4, max_seq_len=256, dtype=torch.float32, device=CPU)
    msgs = []
    assert choose_checkpointed_layers(m, budget_gib=100.0, log_fn=msgs.append, **kw) == []
    assert "checkpointing 0 of 3 layers" in msgs[-1] and "ac_auto_budget_gib" in msgs[-1]
    cost = probe_layer(m.layers[0], embed_dim=128, dtype=torch.float32, device=CPU, max_seq_len=256)
    layer, inp = cost.layer_bytes(4, 256), cost.input_bytes(4, 256)
    fixed = 4 * 256 * 512 * 8 + 3 * sum(p.numel() for p in m.parameters() if p.requires_grad) * 4
    budget = (_need(3, 2, layer, inp, fixed) + _need(3, 1, layer, inp, fixed)) / 2  # fits 2, not 1
    assert choose_checkpointed_layers(m, budget_gib=budget / GIB, log_fn=msgs.append, **kw) == [0, 1]
    with caplog.at_level(logging.WARNING):
        assert choose_checkpointed_layers(m, budget_gib=1e-6, log_fn=msgs.append, **kw) == [0, 1, 2]
    assert "does not fit even with every layer checkpointed" in caplog.text
    # Without a budget: 0.9 x the memory available now (a 3-layer toy fits).
    assert choose_checkpointed_layers(m, budget_gib=None, log_fn=msgs.append, **kw) == []
    assert "MemAvailable" in msgs[-1]


@pytest.mark.parametrize("tied", [False, True])
def test_the_logits_are_counted_for_a_head_tied_to_the_embeddings(monkeypatch, tied):
    """torchtune's TiedLinear has neither out_features nor weight: its logits were counted as 0 bytes."""
    from torchtune.modules import TiedLinear

    from hlmtune.training import activation_memory

    m = _tiny_llama()
    if tied:  # as torchtune's tied builders set it (TiedLinear is no nn.Module)
        del m._modules["output"]
        m.output = TiedLinear(m.tok_embeddings)
    seen = []
    real = activation_memory.checkpointed_layer_count
    monkeypatch.setattr(activation_memory, "checkpointed_layer_count",
                        lambda n, layer_b, input_b, fixed_b, budget: seen.append(fixed_b) or real(n, layer_b, input_b, fixed_b, budget))
    choose_checkpointed_layers(m, rows=4, max_seq_len=256, dtype=torch.float32, device=CPU, budget_gib=100.0,
                               log_fn=lambda _: None)
    n_train = sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert seen == [4 * 256 * 512 * 4 * 2 + 3 * n_train * 4]  # fp32 logits + their gradient, vocabulary 512


@pytest.mark.parametrize("trainable", ["lora", "qlora"])
def test_meta_built_model_is_measured_on_a_materialised_copy(trainable, caplog):
    """FSDP builds the model on meta before loading: the probe runs on a real copy of layer 0
    (NF4 weights included, whose to_empty leaves parts on meta) and decides as on the real model."""
    real = _tiny_llama(trainable)
    with torch.device("meta"):
        meta = _tiny_llama(trainable)
    d = real.tok_embeddings.embedding_dim
    kw = dict(rows=4, max_seq_len=256, dtype=torch.float32, device=CPU, log_fn=lambda _m: None)
    cost = probe_layer(real.layers[0], embed_dim=d, dtype=torch.float32, device=CPU, max_seq_len=256)
    fixed = 4 * 256 * 512 * 8 + 3 * sum(p.numel() for p in real.parameters() if p.requires_grad) * 4
    budget = _need(3, 2, cost.layer_bytes(4, 256), cost.input_bytes(4, 256), fixed) * 1.001
    assert choose_checkpointed_layers(real, budget_gib=budget / GIB, **kw) == [0, 1]
    with caplog.at_level(logging.WARNING):
        assert choose_checkpointed_layers(meta, budget_gib=budget / GIB, **kw) == [0, 1]
    assert "could not measure" not in caplog.text
    assert all(p.is_meta for p in meta.parameters())  # the model itself stays on meta


def test_unbuilt_parameters_come_out_of_the_free_memory(monkeypatch):
    """Without ac_auto_budget_gib: 0.9 x free memory; a meta-built model's parameters are not
    allocated yet, so they are taken off that budget (here: enough to need checkpointing)."""
    import hlmtune.training.activation_memory as am

    real = _tiny_llama()
    with torch.device("meta"):
        meta = _tiny_llama()
    cost = probe_layer(real.layers[0], embed_dim=128, dtype=torch.float32, device=CPU, max_seq_len=256)
    fixed = 4 * 256 * 512 * 8 + 3 * sum(p.numel() for p in real.parameters() if p.requires_grad) * 4
    params = sum(p.numel() * 4 for p in real.parameters())
    need0 = _need(3, 0, cost.layer_bytes(4, 256), cost.input_bytes(4, 256), fixed)
    free = (need0 + params / 2) / am.BUDGET_FRACTION  # fits all layers, but not once the parameters are in
    monkeypatch.setattr(am, "free_memory_bytes", lambda device: (int(free), "test"))
    kw = dict(rows=4, max_seq_len=256, dtype=torch.float32, device=CPU, budget_gib=None, log_fn=lambda _m: None)
    assert choose_checkpointed_layers(real, **kw) == []
    assert choose_checkpointed_layers(meta, **kw) != []
