"""Full fine-tuning on 1..N ranks; trains from random initialisation when there is no checkpointer.

Same name and config keys as torchtune's ``full_finetune_distributed`` plus the pack keys.
Without a ``checkpointer`` section the model starts from its builder's initialisation (the
ECG language model is trained from scratch) and each epoch is exported as
``<output_dir>/epoch_<N>/model.pt``.

    hlmtune run --nproc_per_node 2 full_finetune_distributed --config <config>
"""

import sys

from omegaconf import DictConfig
from torchtune import config

from hlmtune.training.recipe import SFTRecipe
from hlmtune.training.spec import RecipeSpec


class FullFinetuneRecipeDistributed(SFTRecipe):
    """Every parameter trains."""

    SPEC = RecipeSpec(
        name="full_finetune_distributed",
        method="full",
        mirrors="full_finetune_distributed",
        summary="full fine-tuning; trains from scratch without a checkpointer (ECG model)",
    )

    def method_name(self, cfg: DictConfig) -> str:
        return "full" if cfg.get("checkpointer", None) is not None else "pretrain"


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    config.log_config(recipe_name="FullFinetuneRecipeDistributed", cfg=cfg)
    recipe = FullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
