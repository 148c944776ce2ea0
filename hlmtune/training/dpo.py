"""Direct Preference Optimization: the per-micro-batch step shared by both DPO recipes."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torchtune import rlhf

from hlmtune.training.fastpath import target_positions_only
from hlmtune.training.recipe import RecipeBase


class DPORecipe(RecipeBase):
    """DPO loss on ``padded_collate_dpo`` batches: chosen rows first, rejected rows second.

    Subclasses provide :meth:`reference_log_probs` (adapters disabled, or a separate frozen
    model). The logged ``loss`` is the mean DPO loss over ranks and micro-batches (torchtune's
    ``lora_dpo_distributed`` logs the sum over ranks instead).
    """

    DEFAULT_COLLATE = "torchtune.data.padded_collate_dpo"

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
        if isinstance(inner, TransformerDecoder) and not inner.output_hidden_states:
            # Position t predicts token t+1; the last position predicts nothing.
            ignore = torch.full_like(labels[:, :1], -100)
            shifted = torch.cat([labels[:, 1:], ignore], dim=1)  # (2B, T)
            keep = shifted != -100
            with self._activations_ctx, target_positions_only(inner, keep):
                logits = model(input_ids)  # (N, V), N = keep.sum(), row-major
            token_logps = -F.cross_entropy(logits, shifted[keep], reduction="none")  # (N,)
            rows = keep.nonzero()[:, 0]  # (N,) the row of each kept position
            logps = torch.zeros(input_ids.shape[0], dtype=token_logps.dtype, device=token_logps.device)
            logps = logps.index_add(0, rows, token_logps)  # (2B,)
        else:
            with self._activations_ctx:
                logits = model(input_ids)  # (2B, T, V)
            keep = torch.cat([labels[:, 1:] != -100, torch.zeros_like(labels[:, :1], dtype=torch.bool)], dim=1)
            logps = rlhf.get_batch_log_probs(logits, labels)  # (2B,)
            logits = logits[keep]  # (N, V): the logged mean covers the same positions on both paths
        mean_logit = logits.detach().float().mean()
        del logits
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
