"""Direct Preference Optimization: the per-micro-batch step shared by both DPO recipes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torchtune import rlhf
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX as IGNORE

from hlmtune.training.fastpath import chunked_cross_entropy, target_positions_only
from hlmtune.training.recipe import RecipeBase

# Off switch of the shared-prompt layout (A/B measurements; same log-probs either way).
SHARED_PROMPT = os.environ.get("HLM_DPO_SHARED_PROMPT", "1") != "0"
# The layout is taken when its tokens are at most this share of the two-row batch's (padded).
# Its attention reads an explicit (L, L) mask over the longer row instead of the causal kernel,
# so short prompts do not pay: one LoRA DPO step on 1 CPU thread (benchmarks/dpo_shared_prompt.py,
# 2026-11-25) ran 0.96x at a 64-token prompt of 256-token rows (token share 0.875), 1.18-1.23x
# at 128 (0.75), 1.48-1.53x at 192 (0.625), and 2.1x on the ECG DPO batches (213-token prompt,
# one class token: 0.5).
SHARED_MAX_SHARE = 0.8


@dataclass
class SharedPromptBatch:
    """Each preference pair as one row: prompt, chosen completion, rejected completion.

    The rejected completion sees the prompt and itself, never the chosen completion (``mask``),
    and its positions continue from the prompt's end as in its own row (``input_pos``), so every
    log-probability equals the one of the two separate rows, while the prompt is computed once
    per pair instead of twice (in the policy and the reference forward alike).

    Attributes:
        tokens (torch.Tensor): (B, L) prompt + chosen + rejected tokens, right-padded.
        input_pos (torch.Tensor): (B, L) RoPE positions.
        mask (torch.Tensor): (B, L, L) bool, True = attend.
        keep (torch.Tensor): (B, L) bool, the positions whose next-token prediction is used.
        chosen_at (torch.Tensor): (Nc,) index of each chosen target's position among ``keep``'s
            True entries (row-major); ``chosen_tgt`` (Nc,) its token; ``chosen_row`` (Nc,) its pair.
        rejected_at, rejected_tgt, rejected_row (torch.Tensor): the same for rejected targets.
    """

    tokens: torch.Tensor
    input_pos: torch.Tensor
    mask: torch.Tensor
    keep: torch.Tensor
    chosen_at: torch.Tensor
    chosen_tgt: torch.Tensor
    chosen_row: torch.Tensor
    rejected_at: torch.Tensor
    rejected_tgt: torch.Tensor
    rejected_row: torch.Tensor


def shared_prompt_batch(input_ids: torch.Tensor, labels: torch.Tensor, pad_id: int = 0,
                        max_share: float = SHARED_MAX_SHARE) -> Optional[SharedPromptBatch]:
    """The shared-prompt layout of a ``padded_collate_dpo`` batch, or None where it does not apply.

    It applies when, in every pair, the chosen and rejected rows start with the same masked
    prompt (P tokens, labels ``-100``) followed by one contiguous run of labelled completion
    tokens (labels = the row's tokens). Tokens after that run (padding, an unlabelled EOS as the
    ECG DPO builder writes) are dropped: under causal attention they change no log-probability
    of the run. Anything else (``train_on_input``, a label-free row, prompts that differ) returns
    None and the caller takes the two-row path, as it does when the layout would hold more than
    ``max_share`` of the two-row batch's tokens (short prompts: see ``SHARED_MAX_SHARE``).

    Args:
        input_ids (torch.Tensor): (2B, T) chosen rows, then rejected rows.
        labels (torch.Tensor): (2B, T) the same tokens with prompt and padding at ``-100``.
        pad_id (int): padding token.
        max_share (float): largest (B x L) / (2B x T) token share worth the explicit mask.

    Returns:
        Optional[SharedPromptBatch]: tensors on ``input_ids``'s device.
    """
    two_b, t = input_ids.shape
    b = two_b // 2
    if b == 0 or two_b != 2 * b:
        return None
    ids, lab = input_ids.cpu(), labels.cpu()  # the layout is bookkeeping: build it on the host
    spans = []  # (P, C, R) per pair
    for i in range(b):
        ends = []
        for row in (i, b + i):
            at = (lab[row] != IGNORE).nonzero()[:, 0]  # labelled positions, ascending
            if at.numel() == 0 or int(at[0]) == 0 or int(at[-1]) - int(at[0]) + 1 != at.numel():
                return None  # no completion, nothing to condition on, or a gap in it
            ends.append((int(at[0]), int(at[-1]) + 1))
        (p, c_end), (p_r, r_end) = ends
        if p != p_r or not torch.equal(ids[i, :p], ids[b + i, :p]):
            return None
        if not (torch.equal(ids[i, p:c_end], lab[i, p:c_end]) and torch.equal(ids[b + i, p:r_end], lab[b + i, p:r_end])):
            return None  # labels that are not the row's own tokens: not a plain completion
        spans.append((p, c_end - p, r_end - p))
    width = max(p + c + r for p, c, r in spans)
    if b * width > max_share * two_b * t:
        return None
    tokens = torch.full((b, width), pad_id, dtype=ids.dtype)
    pos = torch.zeros((b, width), dtype=torch.long)
    mask = torch.ones(width, width, dtype=torch.bool).tril().repeat(b, 1, 1)  # (B, L, L) causal
    keep = torch.zeros((b, width), dtype=torch.bool)
    targets = {"c": ([], [], []), "r": ([], [], [])}  # position in row, target token, pair
    for i, (p, c, r) in enumerate(spans):
        tokens[i, :p + c] = ids[i, :p + c]
        tokens[i, p + c:p + c + r] = ids[b + i, p:p + r]
        pos[i, :p + c] = torch.arange(p + c)
        pos[i, p + c:p + c + r] = torch.arange(p, p + r)
        mask[i, p + c:p + c + r, p:p + c] = False  # rejected never sees chosen
        # Chosen token p + j is predicted at p + j - 1; rejected token j at the prompt's last
        # position (j = 0) or at its own previous token.
        for k, (where, tok) in (("c", (range(p - 1, p + c - 1), ids[i, p:p + c])),
                                ("r", ([p - 1, *range(p + c, p + c + r - 1)], ids[b + i, p:p + r]))):
            where = list(where)
            keep[i, where] = True
            targets[k][0].extend(i * width + w for w in where)
            targets[k][1].append(tok)
            targets[k][2].extend([i] * len(where))
    rank = keep.flatten().cumsum(0) - 1  # flat position -> its index among the kept positions
    dev = input_ids.device

    def out(k: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat, tok, row = targets[k]
        return (rank[torch.tensor(flat)].to(dev), torch.cat(tok).to(dev), torch.tensor(row).to(dev))

    (ca, ct, cr), (ra, rt, rr) = out("c"), out("r")
    return SharedPromptBatch(tokens.to(dev), pos.to(dev), mask.to(dev), keep.to(dev), ca, ct, cr, ra, rt, rr)


class DPORecipe(RecipeBase):
    """DPO loss on ``padded_collate_dpo`` batches: chosen rows first, rejected rows second.

    Subclasses provide :meth:`reference_log_probs` (adapters disabled, or a separate frozen
    model). The logged ``loss`` is the mean DPO loss over ranks and micro-batches (torchtune's
    ``lora_dpo_distributed`` logs the sum over ranks instead).
    """

    DEFAULT_COLLATE = "torchtune.data.padded_collate_dpo"
    ROWS_PER_EXAMPLE = 2  # chosen and rejected (the shared-prompt layout puts fewer tokens through)

    def concatenated_forward(self, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                             inner: Optional[torch.nn.Module] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities of chosen and rejected completions in one forward pass.

        With a torchtune ``TransformerDecoder`` (``inner``), logits are made only at completion
        positions (``fastpath.target_positions_only``: the output projection, and the last
        layer's queries and MLP, skip the prompt and padding); the sums equal torchtune's
        ``rlhf.get_batch_log_probs`` over full logits, the path taken otherwise.

        Args:
            model (torch.nn.Module): policy or reference model (as called: possibly wrapped).
            input_ids (torch.Tensor): (2B, T) chosen rows then rejected rows.
            labels (torch.Tensor): (2B, T), prompt and padding masked with the ignore index.
            inner (Optional[torch.nn.Module]): ``model`` unwrapped; None = the policy's.

        Returns:
            Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: chosen (B,), rejected (B,) summed
            log-probs, and the mean logit over completion positions (for logging).
        """
        from torchtune.modules import TransformerDecoder

        half = input_ids.shape[0] // 2
        inner = self._inner_model if inner is None else inner
        fast = isinstance(inner, TransformerDecoder) and not inner.output_hidden_states
        shared = shared_prompt_batch(input_ids, labels, getattr(getattr(self, "_tokenizer", None), "pad_id", 0),
                                     max_share=SHARED_MAX_SHARE) if fast and SHARED_PROMPT else None
        if shared is not None:
            with self._activations_ctx, target_positions_only(inner, shared.keep):
                logits = model(shared.tokens, mask=shared.mask, input_pos=shared.input_pos)  # (N, V)
            logp = torch.log_softmax(logits, dim=-1)  # (N, V)
            sums = []
            for at, tgt, row in ((shared.chosen_at, shared.chosen_tgt, shared.chosen_row),
                                 (shared.rejected_at, shared.rejected_tgt, shared.rejected_row)):
                token_logps = logp[at, tgt]  # (Nc,) or (Nr,)
                sums.append(torch.zeros(half, dtype=logp.dtype, device=logp.device).index_add(0, row, token_logps))
            # The logged mean logit over the completion positions of both rows, as the other paths
            # log it (the prompt's last position counts for each completion).
            per_row = logits.detach().float().sum(-1)  # (N,)
            n = shared.chosen_at.numel() + shared.rejected_at.numel()
            mean_logit = (per_row[shared.chosen_at].sum() + per_row[shared.rejected_at].sum()) / (n * logits.shape[-1])
            del logits, logp
            return sums[0], sums[1], mean_logit
        if fast:
            # Position t predicts token t+1; the last position predicts nothing.
            ignore = torch.full_like(labels[:, :1], -100)
            shifted = torch.cat([labels[:, 1:], ignore], dim=1)  # (2B, T)
            keep = shifted != -100
            with self._activations_ctx, target_positions_only(inner, keep, chunked=True):
                logits = model(input_ids)  # (N, V) or its row chunks, N = keep.sum(), row-major
            token_logps = -chunked_cross_entropy(logits, shifted[keep], reduction="none")  # (N,)
            rows = keep.nonzero()[:, 0]  # (N,) the row of each kept position
            logps = torch.zeros(input_ids.shape[0], dtype=token_logps.dtype, device=token_logps.device)
            logps = logps.index_add(0, rows, token_logps)  # (2B,)
        else:
            with self._activations_ctx:
                logits = model(input_ids)  # (2B, T, V)
            keep = torch.cat([labels[:, 1:] != -100, torch.zeros_like(labels[:, :1], dtype=torch.bool)], dim=1)
            logps = rlhf.get_batch_log_probs(logits, labels)  # (2B,)
            logits = logits[keep]  # (N, V): the logged mean covers the same positions on both paths
        chunks = logits if isinstance(logits, list) else [logits]  # row chunks from the fast path, or one tensor
        mean_logit = sum(c.detach().float().sum() for c in chunks) / sum(c.numel() for c in chunks)
        del logits, chunks
        return logps[:half], logps[half:], mean_logit

    def reference_log_probs(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Reference model log-probs of (chosen, rejected); no gradients."""
        raise NotImplementedError

    def train_step(self, batch) -> Dict[str, torch.Tensor]:
        """Forward/backward of one preference micro-batch."""
        input_ids, labels = batch  # (2B, T), (2B, T)
        with self.mark("forward"):
            pol_c, pol_r, mean_logit = self.concatenated_forward(self._model, input_ids, labels)
            with torch.no_grad():
                ref_c, ref_r = self.reference_log_probs(input_ids, labels)
            losses, chosen_rewards, rejected_rewards = self._loss_fn(pol_c, pol_r, ref_c, ref_r)
            loss = losses.mean()
        with self.mark("backward"):
            (loss / self._gradient_accumulation_steps).backward()
        pad = getattr(self._tokenizer, "pad_id", 0)
        return {
            "loss_sum": loss.detach(),
            "num_tokens": (input_ids != pad).sum(),
            "rewards/chosen": chosen_rewards.mean().detach(),
            "rewards/rejected": rejected_rewards.mean().detach(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().detach(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean().detach(),
            "log_probs/chosen": pol_c.detach().mean(),
            "log_probs/rejected": pol_r.detach().mean(),
            "logits/mean": mean_logit,
        }

    def logged_loss(self, total_loss: float, total_tokens: float) -> float:
        # loss_sum holds one mean per micro-batch per rank.
        return total_loss / (self.world_size * self._gradient_accumulation_steps)
