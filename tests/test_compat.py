"""The torchtune/torchao compatibility layer."""

from __future__ import annotations

from hlmtune import compat


def test_load_config_applies_overrides_like_tune_run(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("a: 1\nmodel:\n  _component_: x.y\n  n: 2\nkeep: 3\n")
    cfg = compat.load_config(str(f), ["a=5", "model=x.z", "model.n=4", "~keep"])
    assert cfg.a == 5 and cfg.model._component_ == "x.z" and cfg.model.n == 4 and "keep" not in cfg


def test_special_tokens_and_fake_quant_toggles():
    tokens = compat.llama3_special_tokens()
    assert tokens["<|begin_of_text|>"] == 128000 and len(tokens) == 256
    disable, enable = compat.fake_quant_toggles("8da4w-qat")
    assert callable(disable) and callable(enable)


def test_torchao_alias_is_idempotent():
    from torchao.quantization import qat

    compat.ensure_torchao_aliases()
    compat.ensure_torchao_aliases()
    assert hasattr(qat, "FakeQuantizeConfig")


def test_builtin_recipes_listing():
    recipes, root = compat.builtin_recipes()
    names = {r.name for r in recipes}
    assert "lora_finetune_single_device" in names and (root / "configs").is_dir()


_PROBE = """
import json, sys
heavy = [m for m in ("datasets", "pyarrow", "pandas") if m in sys.modules]
import recipes.lora_finetune_distributed, hlmtune.data_builders  # what a pack rank imports to train
heavy_after_recipe = [m for m in ("datasets", "pyarrow", "pandas") if m in sys.modules]
from torchtune.datasets._sft import load_dataset  # torchtune's bound name: the forwarder
rows = load_dataset("json", data_files=sys.argv[1], split="train")
import datasets
print(json.dumps({"heavy": heavy, "heavy_after_recipe": heavy_after_recipe, "rows": rows.num_rows,
                  "real": isinstance(rows, datasets.Dataset), "version": datasets.__version__}))
"""


def _rank_probe(tmp_path, env_extra):
    """Run the probe as ``hlmtune run`` runs a rank (``python -m hlmtune._rank script``)."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "rows.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    (tmp_path / "probe.py").write_text(_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "HLM_EAGER_HF_DATASETS"} | env_extra
    proc = subprocess.run([sys.executable, "-m", "hlmtune._rank", str(tmp_path / "probe.py"),
                           str(tmp_path / "rows.jsonl")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_rank_imports_torchtune_without_hf_datasets_until_a_dataset_is_loaded(tmp_path):
    """No datasets/pyarrow/pandas in a rank until ``load_dataset`` is called; then the real package."""
    got = _rank_probe(tmp_path, {})
    assert got["heavy"] == [] and got["heavy_after_recipe"] == []
    assert got["rows"] == 2 and got["real"] and got["version"]
    eager = _rank_probe(tmp_path, {"HLM_EAGER_HF_DATASETS": "1"})  # the switch back to torchtune's import
    assert "pyarrow" in eager["heavy_after_recipe"] and eager["rows"] == 2


def test_deferral_is_a_no_op_once_torchtune_is_imported():
    import torchtune  # noqa: F401  (already imported by this test session)

    assert compat.import_torchtune_deferring_hf_datasets() is False
