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


class QATRecipeDistributed(QATMixin, SFTRecipe):
    """Every weight trains through fake-quantized linears."""

    RECIPE = "qat_distributed"
    METHOD = "qat"

    def quantized_model_config(self) -> DictConfig:
        qcfg = self._cfg.get("quantize", None) or {}
        return qcfg.get("model", None) or self._cfg.model


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    config.log_config(recipe_name="QATRecipeDistributed", cfg=cfg)
    recipe = QATRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
