"""Quantization-aware full fine-tuning on 1..N ranks, ending in a quantized model.

Same name and config keys as torchtune's ``qat_distributed`` (``quantizer``,
``fake_quant_after_n_steps`` ...) plus the pack keys and ``quantize`` (the final step:
``enabled``, ``quantizer``, ``model``, ``output_name``). The last epoch's weights are
converted to int8 dynamic activations + int4 weights in ``<output_dir>/quantized/``.

    hlmtune run --nproc_per_node 4 qat_distributed --config llama3_8b_qat_alpaca
"""

import sys

from omegaconf import DictConfig
from torchtune import config

from hlmtune.training.qat import QATMixin
from hlmtune.training.recipe import SFTRecipe
from hlmtune.training.spec import RecipeSpec


class QATRecipeDistributed(QATMixin, SFTRecipe):
    """Every weight trains through fake-quantized linears."""

    SPEC = RecipeSpec(
        name="qat_distributed",
        method="qat",
        mirrors="qat_distributed",
        summary="quantization-aware full fine-tuning, then int8-activation/int4-weight quantization",
        adds=("quantize",),
        requires=("checkpointer", "quantizer"),
    )

    def quantized_model_config(self) -> DictConfig:
        # Full QAT trains the plain model: quantize that unless `quantize.model` says otherwise.
        return self._cfg.quantize.model if self.options.quantize.model is not None else self._cfg.model


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    config.log_config(recipe_name="QATRecipeDistributed", cfg=cfg)
    recipe = QATRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
