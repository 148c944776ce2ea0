"""Direct Preference Optimization: the per-micro-batch step shared by both DPO recipes."""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torchtune import rlhf

from hlmtune.training.recipe import RecipeBase


class DPORecipe(RecipeBase):
    """DPO loss on ``padded_collate_dpo`` batches: chosen rows first, rejected rows second.

    Subclasses provide :meth:`reference_log_probs` (adapters disabled, or a separate frozen
    model). The logged ``loss`` is the mean DPO loss over ranks and micro-batches (torchtune's
    ``lora_dpo_distributed`` logs the sum over ranks instead).
    """

    DEFAULT_COLLATE = "torchtune.data.padded_collate_dpo"

    def concatenated_forward(self, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probabilities of chosen and rejected completions in one forward pass.

        Args:
            model (torch.nn.Module): policy or reference model.
            input_ids (torch.Tensor): (2B, T) chosen rows then rejected rows.
            labels (torch.Tensor): (2B, T), prompt and padding masked with the ignore index.

        Returns:
            Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: chosen (B,), rejected (B,) summed
            log-probs, and the mean logit (for logging).
        """
        half = input_ids.shape[0] // 2
        with self._activations_ctx:
            logits = model(input_ids)  # (2B, T, V)
        logps = rlhf.get_batch_log_probs(logits, labels)  # (2B,)
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
