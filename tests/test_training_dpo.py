"""DPO's completion log-probabilities: the target-position path gives torchtune's numbers and gradients."""

from __future__ import annotations

import contextlib

import torch

from hlmtune.training.dpo import DPORecipe


def _policy(seed: int = 0) -> torch.nn.Module:
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    torch.manual_seed(seed)
    m = lora_llama3(lora_attn_modules=["q_proj", "v_proj"], vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                    embed_dim=64, max_seq_len=64, intermediate_dim=96, lora_rank=4, lora_alpha=8)
    set_trainable_params(m, get_adapter_params(m))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_b" in n:
                p.normal_(std=0.1)
    return m


def _recipe(inner: torch.nn.Module) -> DPORecipe:
    r = DPORecipe.__new__(DPORecipe)  # only the state concatenated_forward reads
    r._inner_model = inner
    r._activations_ctx = contextlib.nullcontext()
    return r


def _batch() -> tuple:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (4, 24), generator=g)  # rows 0-1 chosen, 2-3 rejected
    labels = ids.clone()
    for row, (prompt, end) in enumerate([(5, 24), (9, 20), (5, 18), (9, 24)]):  # masked prompt and padding
        labels[row, :prompt] = -100
        labels[row, end:] = -100
    return ids, labels


class _Wrapped(torch.nn.Module):
    """Not a ``TransformerDecoder``: the recipe must take torchtune's full-logit path."""

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.m(tokens)


def test_completion_log_probs_match_torchtunes_full_logits():
    from torchtune import rlhf

    ids, labels = _batch()
    ref_model = _policy()
    logits = ref_model(ids)  # (4, 24, V)
    ref = rlhf.get_batch_log_probs(logits, labels)  # (4,)
    ref.sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}
    keep = torch.cat([labels[:, 1:] != -100, torch.zeros(4, 1, dtype=torch.bool)], dim=1)
    ref_mean = logits[keep].mean()

    model = _policy()
    seen = []
    model.layers[-1].mlp.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    chosen, rejected, mean_logit = _recipe(model).concatenated_forward(model, ids, labels)
    assert seen == [int(keep.sum(1).max())]  # the last layer ran at completion positions only
    got = torch.cat([chosen, rejected])
    torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean_logit, ref_mean.detach(), rtol=1e-5, atol=1e-6)
    got.sum().backward()
    for n, g in ref_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=1e-4, atol=1e-6)

    # A model that is not a TransformerDecoder: torchtune's path, same numbers.
    wrapped = _Wrapped(_policy())
    c2, r2, m2 = _recipe(wrapped).concatenated_forward(wrapped, ids, labels)
    torch.testing.assert_close(torch.cat([c2, r2]), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m2, ref_mean.detach(), rtol=1e-5, atol=1e-6)


def test_reference_model_is_read_through_its_own_unwrapped_module():
    ids, labels = _batch()
    policy, reference = _policy(seed=0), _policy(seed=3)
    r = _recipe(policy)
    with torch.no_grad():
        own = torch.cat(r.concatenated_forward(reference, ids, labels, reference)[:2])
        full = torch.cat(_recipe(_Wrapped(reference)).concatenated_forward(_Wrapped(reference), ids, labels)[:2])
    torch.testing.assert_close(own, full, rtol=1e-5, atol=1e-5)
