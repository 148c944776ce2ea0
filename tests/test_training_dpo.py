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


def _torchtune_reference(ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    """torchtune's two-row log-probs over full logits, their parameter gradients, the mean logit."""
    from torchtune import rlhf

    ref_model = _policy()
    logits = ref_model(ids)  # (2B, T, V)
    ref = rlhf.get_batch_log_probs(logits, labels)  # (2B,)
    ref.sum().backward()
    grads = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}
    keep = torch.cat([labels[:, 1:] != -100, torch.zeros(len(ids), 1, dtype=torch.bool)], dim=1)
    return ref.detach(), grads, logits[keep].mean().detach(), keep


def _assert_matches(model: torch.nn.Module, got: torch.Tensor, mean_logit: torch.Tensor, reference: tuple) -> None:
    ref, ref_grads, ref_mean, _ = reference
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean_logit, ref_mean, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    for n, g in ref_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=1e-4, atol=1e-6)


def test_completion_log_probs_match_torchtunes_full_logits():
    ids, labels = _batch()
    reference = _torchtune_reference(ids, labels)
    keep = reference[3]

    model = _policy()
    seen = []
    model.layers[-1].mlp.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    chosen, rejected, mean_logit = _recipe(model).concatenated_forward(model, ids, labels)
    assert seen == [int(keep.sum(1).max())]  # the last layer ran at completion positions only
    _assert_matches(model, torch.cat([chosen, rejected]), mean_logit, reference)

    # A model that is not a TransformerDecoder: torchtune's path, same numbers.
    wrapped = _Wrapped(_policy())
    c2, r2, m2 = _recipe(wrapped).concatenated_forward(wrapped, ids, labels)
    torch.testing.assert_close(torch.cat([c2, r2]), reference[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m2, reference[2], rtol=1e-5, atol=1e-6)


def test_completion_log_probs_in_logit_chunks_match(monkeypatch):
    from hlmtune.training import fastpath

    ids, labels = _batch()
    reference = _torchtune_reference(ids, labels)
    model = _policy()
    rows = int(reference[3].sum()) // 3  # about three chunks of the completion positions' logits
    monkeypatch.setattr(fastpath, "CE_CHUNK_ELEMENTS", rows * model.output.out_features)
    made = []
    model.output.register_forward_hook(lambda m, a, o: made.append(o.shape[0]))
    chosen, rejected, mean_logit = _recipe(model).concatenated_forward(model, ids, labels)
    assert len(made) >= 3 and max(made) == rows  # the head ran in row chunks
    _assert_matches(model, torch.cat([chosen, rejected]), mean_logit, reference)


def test_reference_model_is_read_through_its_own_unwrapped_module():
    ids, labels = _batch()
    policy, reference = _policy(seed=0), _policy(seed=3)
    r = _recipe(policy)
    with torch.no_grad():
        own = torch.cat(r.concatenated_forward(reference, ids, labels, reference)[:2])
        full = torch.cat(_recipe(_Wrapped(reference)).concatenated_forward(_Wrapped(reference), ids, labels)[:2])
    torch.testing.assert_close(own, full, rtol=1e-5, atol=1e-5)


def _shared_batch() -> tuple:
    """Pairs whose chosen and rejected rows share their prompt (as every DPO dataset builds them)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 96, (6, 26), generator=g)  # rows 0-2 chosen, 3-5 rejected
    labels = torch.full_like(ids, -100)
    # (prompt, chosen end, rejected end): prompts of 3, 7 and 12 tokens; completions of 1-14 tokens
    for i, (p, c_end, r_end) in enumerate([(3, 17, 9), (7, 8, 26), (12, 20, 20)]):
        ids[3 + i, :p] = ids[i, :p]
        ids[i, c_end:] = 0
        ids[3 + i, r_end:] = 0  # padding
        labels[i, p:c_end] = ids[i, p:c_end]
        labels[3 + i, p:r_end] = ids[3 + i, p:r_end]
    return ids, labels


def test_shared_prompt_layout_gives_the_two_row_log_probs_and_gradients():
    """Prompt once per pair (rejected masked from chosen, positions continued): same numbers as
    torchtune's two rows over full logits, same gradients; the model sees one row per pair."""
    from hlmtune.training import dpo

    ids, labels = _shared_batch()
    reference = _torchtune_reference(ids, labels)  # two rows per pair
    shared = dpo.shared_prompt_batch(ids, labels)
    assert shared is not None and shared.tokens.shape == (3, 12 + 8 + 8)  # widest pair: prompt 12, 8 + 8
    model = _policy()
    rows = []
    model.layers[0].register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
    chosen, rejected, mean_logit = _recipe(model).concatenated_forward(model, ids, labels)
    assert rows == [3]  # one row per pair
    _assert_matches(model, torch.cat([chosen, rejected]), mean_logit, reference)


def test_shared_prompt_layout_applies_only_to_plain_shared_prompts():
    from hlmtune.training.dpo import shared_prompt_batch

    ids, labels = _shared_batch()
    assert shared_prompt_batch(*_batch()) is None  # prompts of different tokens
    other = ids.clone()
    other[4, 2] = (other[4, 2] + 1) % 96  # pair 1's rejected prompt differs in one token
    assert shared_prompt_batch(other, labels) is None
    gap = labels.clone()
    gap[0, 8] = -100  # a hole inside a completion
    assert shared_prompt_batch(ids, gap) is None
    whole = labels.clone()
    whole[:, 0] = ids[:, 0]  # train_on_input-like: labelled from position 0
    assert shared_prompt_batch(ids, whole) is None
    assert shared_prompt_batch(ids[:0], labels[:0]) is None
    # worth it only when the prompt is a large share: 3 x 28 layout tokens vs 6 x 26 two-row (0.538)
    assert shared_prompt_batch(ids, labels, max_share=0.53) is None
    assert shared_prompt_batch(ids, labels, max_share=0.54) is not None
