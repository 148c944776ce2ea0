"""DPO of all weights on 1..N ranks against a frozen reference model (``ref_checkpointer``).

Same name and config keys as torchtune's ``full_dpo_distributed`` plus the pack keys.
Without ``ref_checkpointer`` the reference is a frozen copy of the starting checkpoint.

    hlmtune run --nproc_per_node 2 full_dpo_distributed --config <config>
"""

import sys

import torch
from omegaconf import DictConfig
from torchtune import config, training

from hlmtune.training.dpo import DPORecipe
from hlmtune.training.spec import RecipeSpec


class FullDPORecipeDistributed(DPORecipe):
    """DPO where every policy weight trains and the reference is a second, frozen model."""

    SPEC = RecipeSpec(
        name="full_dpo_distributed",
        method="full_dpo",
        mirrors="full_dpo_distributed",
        summary="DPO of all weights against a separate frozen reference model",
        requires=("checkpointer",),
    )

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(cfg)
        self._ref_model = None  # frozen reference, built in setup_model
        self._ref_inner = None  # the same, unwrapped

    def setup_model(self, cfg: DictConfig, base_sd):
        model = super().setup_model(cfg, base_sd)
        ref_sd = base_sd
        if cfg.get("ref_checkpointer", None) is not None:
            ref_sd = config.instantiate(cfg.ref_checkpointer).load_checkpoint()[training.MODEL_KEY]
        # No gradients to sync: shard the reference under FSDP (memory), else keep it plain.
        ref_dp = "fsdp" if self._data_parallel == "fsdp" else "none"
        self._ref_model, self._ref_inner = self.build_model(cfg, ref_sd, frozen=True, data_parallel=ref_dp)
        self._ref_model.eval()
        return model

    def reference_log_probs(self, input_ids: torch.Tensor, labels: torch.Tensor):
        chosen, rejected, _ = self.concatenated_forward(self._ref_model, input_ids, labels, self._ref_inner)
        return chosen, rejected


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    config.log_config(recipe_name="FullDPORecipeDistributed", cfg=cfg)
    recipe = FullDPORecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
