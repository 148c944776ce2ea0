"""Every shipped config (``configs/*.yaml``).

All configs: registered in ``hlmtune.registry`` (and every registered name has a file), valid
for their recipe, and documented (a comment header with launch commands that name the right
recipe and config, and an override example).

The 18 Llama3-8B configs: the real hub layout of ``tune download
meta-llama/Meta-Llama-3-8B-Instruct`` under one ``model_dir``, the defaults of the papers' runs
(docs/configs.md), the expected model built on the meta device, the paper's override string from the header
validating, typos naming the closest key, and the header's local-data override building the
dataset from the real samples in ``$HLM_DATA/text``. ``hlmtune validate`` runs as a subprocess.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple
from unittest import mock

import pytest
from omegaconf import DictConfig, OmegaConf

from hlmtune import registry
from hlmtune.compat import load_config
from hlmtune.training.schema import RECIPE_KEYS, ConfigError, build_model_on_meta, validate_config

CONFIGS_DIR = registry.configs_dir()
ALL_CONFIGS = sorted(registry.CONFIGS)

# The 18 Llama3-8B configs (the papers' method x dataset matrix, docs/configs.md) -> (recipe, model component).
SFT_DATASETS = ("alpaca", "grammar", "samsum", "slimorca")
PREF_DATASETS = ("stack_exchange", "hh_rlhf")
METHODS: Dict[str, Tuple[str, str]] = {
    "lora": ("lora_finetune_distributed", "torchtune.models.llama3.lora_llama3_8b"),
    "qlora": ("lora_finetune_distributed", "torchtune.models.llama3.qlora_llama3_8b"),
    "qat": ("qat_distributed", "torchtune.models.llama3.llama3_8b"),
    "qat_lora": ("qat_lora_finetune_distributed", "torchtune.models.llama3.lora_llama3_8b"),
    "lora_dpo": ("lora_dpo_distributed", "torchtune.models.llama3.lora_llama3_8b"),
}
LLAMA3_8B: Dict[str, Tuple[str, str]] = {
    **{f"llama3_8b_{m}_{d}": (m, d) for m in ("lora", "qlora", "qat", "qat_lora") for d in SFT_DATASETS},
    **{f"llama3_8b_lora_dpo_{d}": ("lora_dpo", d) for d in PREF_DATASETS},
}
LLAMA3_8B_NAMES = sorted(LLAMA3_8B)
BUILDERS = {
    "alpaca": "hlmtune.data_builders.alpaca_cleaned_dataset",
    "grammar": "hlmtune.data_builders.grammar_dataset",
    "samsum": "hlmtune.data_builders.samsum_dataset",
    "slimorca": "hlmtune.data_builders.slimorca_dataset",
    "stack_exchange": "hlmtune.data_builders.stack_exchange_paired_dataset",
    "hh_rlhf": "hlmtune.data_builders.hh_rlhf_dataset",
}
# Prompt template per SFT dataset (dataset.prompt_template; alpaca's builder applies the
# instruct prompt itself and has no such argument).
TEMPLATES = {
    "grammar": "torchtune.data.GrammarErrorCorrectionTemplate",
    "samsum": "torchtune.data.SummarizeTemplate",
    "slimorca": None,
}
MODEL_DIR = "/tmp/Meta-Llama-3-8B-Instruct"
PAPER_OVERRIDES = (
    "batch_size=2 optimizer.lr=3e-4 lr_scheduler.num_warmup_steps=100 epochs=1 dtype=fp32 "
    "enable_activation_checkpointing=False gradient_accumulation_steps=1"
).split()

# Llama3-8B (torchtune.models.llama3.llama3_8b): vocab V=128256, width D=4096, L=32 layers,
# 32 query heads and 8 KV heads of 128 (KV width 1024), MLP hidden H=14336, RMSNorm scales
# only, untied output projection.
_V, _D, _L, _KV, _H = 128256, 4096, 32, 1024, 14336
LLAMA3_8B_PARAMS = 2 * _V * _D + _L * (2 * _D * _D + 2 * _D * _KV + 3 * _D * _H + 2 * _D) + _D
# LoRA rank r on q_proj (D->D), v_proj (D->KV), output_proj (D->D) and w1/w3 (D->H), w2 (H->D):
# an adapter on an (in -> out) linear has r * (in + out) weights.
_R = 8
LORA_PARAMS = _L * _R * ((_D + _D) + (_D + _KV) + (_D + _D) + 3 * (_D + _H))

HLMTUNE = Path(sys.executable).parent / "hlmtune"


def _path(name: str) -> Path:
    return CONFIGS_DIR / f"{name}.yaml"


def _header(name: str) -> List[str]:
    """The leading comment block of a config, '#' and one space stripped."""
    out = []
    for line in _path(name).read_text().splitlines():
        if not line.startswith("#"):
            break
        out.append(line[1:].removeprefix(" "))
    return out


def _header_overrides(name: str, title: str) -> List[str]:
    """Overrides on the first line after the header line starting with ``title``.

    For an ``hlmtune run ... --config <name> k=v ...`` line: the tokens after the config name;
    for a bare override line: all tokens.
    """
    lines = _header(name)
    i = next(i for i, line in enumerate(lines) if line.startswith(title))
    tokens = shlex.split(lines[i + 1], posix=True)
    if "--config" in tokens:
        j = tokens.index("--config")
        assert tokens[j + 1] == name, f"{name}: '{title}' example runs config {tokens[j + 1]}"
        tokens = tokens[j + 2:]
    return tokens


@pytest.fixture
def load(monkeypatch: pytest.MonkeyPatch):
    """Load a pack config with overrides, as ``hlmtune run`` does.

    The tiny configs read ``${oc.env:HLM_DATA}``; validation never opens data files, so any
    value works when the real data is not needed.
    """
    if not os.environ.get("HLM_DATA"):
        monkeypatch.setenv("HLM_DATA", "/hlm_data_not_read_by_validation")

    def _load(name: str, overrides: List[str] = ()) -> DictConfig:
        return load_config(str(_path(name)), list(overrides))

    return _load


# ------------------------------------------------------------------------- every config
def test_registry_and_files_agree() -> None:
    files = {p.stem for p in CONFIGS_DIR.glob("*.yaml")}
    unregistered = sorted(files - set(registry.CONFIGS))
    missing = sorted(set(registry.CONFIGS) - files)
    assert not unregistered, f"configs/*.yaml not in hlmtune.registry.CONFIGS: {unregistered}"
    assert not missing, f"registered configs without a file in configs/: {missing}"
    for name, recipe in registry.CONFIGS.items():
        assert recipe in registry.RECIPES and recipe in RECIPE_KEYS, f"{name}: unknown recipe {recipe}"
        assert registry.config_path(name) == _path(name)


def test_llama3_8b_configs_are_the_issue_matrix() -> None:
    shipped = {n: r for n, r in registry.CONFIGS.items() if n.startswith("llama3_8b_")}
    assert shipped == {n: METHODS[m][0] for n, (m, _) in LLAMA3_8B.items()}


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_config_validates_for_its_recipe(name: str, load) -> None:
    validate_config(load(name), registry.CONFIGS[name])


# Keys of the beat-classification builders that choose or draw training examples, augment them
# (training only: evaluation prompts never change), or add training targets (rr_target: labels only,
# the prompt is unchanged); every other key shapes the prompt the model reads (a new builder key
# counts as a prompt key by default).
ECG_DRAW_KEYS = {"split", "split_file", "records", "shards_dir", "classes", "balance", "num_examples", "seed",
                 "random_test_fraction", "augment", "template_swap", "record_balance", "previous_swap",
                 "premature_synth", "rr_target", "augment_stretch", "early_n_weight"}
ECG_FINETUNE_CONFIGS = ("ecg_lora", "ecg_qlora", "ecg_dpo", "ecg_qat")


def test_ecg_finetuning_configs_build_the_same_prompts(load) -> None:
    """DPO starts from the LoRA classifier and must read its prompts; the four share one input design."""
    import inspect

    from hlmtune.data_builders import ecg_beat_classification_dataset, ecg_beat_dpo_dataset

    keys = set(inspect.signature(ecg_beat_classification_dataset).parameters) - {"tokenizer"} - ECG_DRAW_KEYS
    assert keys == set(inspect.signature(ecg_beat_dpo_dataset).parameters) - {"tokenizer"} - ECG_DRAW_KEYS
    assert {"context_beats", "template_beats", "template_delta", "next_rr"} <= keys
    defaults = {k: p.default for k, p in inspect.signature(ecg_beat_classification_dataset).parameters.items()}
    prompts = {}
    for name in ECG_FINETUNE_CONFIGS:
        ds = OmegaConf.to_container(load(name).dataset, resolve=True)
        prompts[name] = {k: ds.get(k, defaults[k]) for k in sorted(keys)}
    differ = {n: {k: v for k, v in p.items() if v != prompts["ecg_lora"][k]} for n, p in prompts.items()}
    assert not any(differ.values()), f"prompt keys that differ from ecg_lora: {differ}"


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_header_documents_launch_and_overrides(name: str) -> None:
    header = _header(name)
    assert header, f"{name}.yaml must start with a comment header"
    text = "\n".join(header)
    assert re.search(r"^Launch\b", text, re.M), f"{name}: header has no 'Launch' section"
    assert re.search(r"^Override example", text, re.M), f"{name}: header has no 'Override example'"
    # Every command in the header runs this config with its own recipe (copy-paste slips).
    runs = re.findall(r"hlmtune run (?:--\S+ \S+ )*(\S+) --config (\S+)", text)
    assert runs, f"{name}: header has no `hlmtune run` command"
    for recipe, config in runs:
        assert (recipe, config) == (registry.CONFIGS[name], name), f"{name}: header runs `{recipe} --config {config}`"


# ------------------------------------------------------------------------- Llama3-8B layout
@pytest.mark.parametrize("name", LLAMA3_8B_NAMES)
def test_8b_reads_the_hub_layout_from_one_model_dir(name: str, load) -> None:
    raw = OmegaConf.to_container(OmegaConf.load(_path(name)), resolve=False)
    assert raw["model_dir"] == MODEL_DIR
    # Every other path is derived from ${model_dir}: the literal appears once.
    literal = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{where}.{k}" if where else k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}[{i}]")
        elif isinstance(node, str) and "Meta-Llama-3-8B-Instruct" in node:
            literal.append(where)

    walk(raw, "")
    assert literal == ["model_dir"]
    assert raw["tokenizer"]["path"] == "${model_dir}/original/tokenizer.model"
    assert raw["output_dir"] == f"/tmp/hlmtune/runs/{name}"

    cfg = OmegaConf.to_container(load(name), resolve=True)
    ck = cfg["checkpointer"]
    assert ck["_component_"] == "torchtune.training.FullModelHFCheckpointer"
    assert (ck["checkpoint_dir"], ck["model_type"], ck["output_dir"]) == (MODEL_DIR, "LLAMA3", cfg["output_dir"])
    from torchtune.training import FormattedCheckpointFiles

    # max_filename must stay the string "00004" (YAML would read 00004 as the int 4).
    files = FormattedCheckpointFiles.from_dict(ck["checkpoint_files"]).build_checkpoint_filenames()
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert cfg["metric_logger"]["log_dir"] == f"/tmp/hlmtune/runs/{name}/logs"


@pytest.mark.parametrize("name", LLAMA3_8B_NAMES)
def test_8b_defaults(name: str, load) -> None:
    method, dataset = LLAMA3_8B[name]
    cfg = OmegaConf.to_container(load(name), resolve=True)
    dpo = method == "lora_dpo"
    expected = {
        "dtype": "bf16",
        "device": "cuda",
        "data_parallel": "auto",
        "data_loader": {"split": "distributed", "num_workers": 0, "pin_memory": True},
        "enable_activation_checkpointing": "auto",
        "batch_size": 2,
        "gradient_accumulation_steps": 8,
        "epochs": 1,
        "log_peak_memory_stats": True,
        "save_every_n_steps": None,
        "max_steps_per_epoch": None,
    }
    assert {k: cfg.get(k) for k in expected} == expected
    assert cfg["model"]["_component_"] == METHODS[method][1]
    assert cfg["tokenizer"]["max_seq_len"] == (1024 if dpo else 2048)
    opt = cfg["optimizer"]
    # Full-weight QAT uses torchtune's full-weight lr; the paper's 3e-4 is the header override.
    lr = 2e-5 if method == "qat" else 3e-4
    assert (opt["_component_"], opt["lr"], opt["fused"]) == ("torch.optim.AdamW", lr, True)
    assert cfg["lr_scheduler"] == {
        "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
        "num_warmup_steps": 100,
    }
    if dpo:
        assert cfg["loss"]["_component_"] == "torchtune.rlhf.loss.DPOLoss" and cfg["loss"]["beta"] == 0.1
    else:
        assert cfg["loss"] == {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"}
    assert cfg["metric_logger"]["_component_"] == "torchtune.training.metric_logging.DiskLogger"
    ds = cfg["dataset"]
    assert ds["_component_"] == BUILDERS[dataset]
    assert ds.get("subset_size") is None  # the paper's subset is an override, not the default
    if dataset in TEMPLATES:
        assert ds["prompt_template"] == TEMPLATES[dataset]
    if dataset == "hh_rlhf":
        assert ds["on_bad_row"] == "skip"  # the real data has pairs with an empty final turn
    if method in ("qat", "qat_lora"):
        assert cfg["quantizer"] == {
            "_component_": "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer",
            "groupsize": 256,
        }
        assert cfg["quantize"]["enabled"] is True


# ------------------------------------------------------------------------- models on meta
_MODELS: Dict[str, Tuple[int, Any]] = {}


def _meta_model(model_cfg: DictConfig, dtype: str) -> Tuple[int, Any]:
    """(parameter count, module) from ``build_model_on_meta``, cached per model section."""
    key = OmegaConf.to_yaml(model_cfg) + dtype
    if key not in _MODELS:
        import torchtune.config

        built = {}
        real = torchtune.config.instantiate

        def keep(cfg, *args, **kwargs):  # build_model_on_meta returns only the count
            built["model"] = real(cfg, *args, **kwargs)
            return built["model"]

        with mock.patch.object(torchtune.config, "instantiate", keep):
            n = build_model_on_meta(model_cfg, dtype)
        _MODELS[key] = (n, built["model"])
    return _MODELS[key]


@pytest.mark.parametrize("name", LLAMA3_8B_NAMES)
def test_8b_model_builds_on_meta(name: str, load) -> None:
    from torchao.dtypes.nf4tensor import NF4Tensor

    method, _ = LLAMA3_8B[name]
    cfg = load(name)
    n, model = _meta_model(cfg.model, cfg.dtype)
    assert LLAMA3_8B_PARAMS == 8_030_261_248  # Meta's model card: 8.03B
    assert all(p.is_meta for p in model.parameters())
    lora = sum(p.numel() for k, p in model.named_parameters() if "lora_" in k)
    base_q = model.layers[0].attn.q_proj.weight
    if method == "qat":
        assert (n, lora) == (LLAMA3_8B_PARAMS, 0)
        return
    # NF4Tensor reports its logical shape, so QLoRA counts like LoRA; its base linears are NF4.
    assert (n, lora) == (LLAMA3_8B_PARAMS + LORA_PARAMS, LORA_PARAMS)
    assert isinstance(base_q, NF4Tensor) is (method == "qlora")
    assert not isinstance(model.output.weight, NF4Tensor)  # the output projection stays bf16


# ------------------------------------------------------------------------- overrides
@pytest.mark.parametrize("name", LLAMA3_8B_NAMES)
def test_8b_paper_settings_from_the_header_validate(name: str, load) -> None:
    overrides = _header_overrides(name, "Paper settings")
    assert overrides == PAPER_OVERRIDES
    cfg = load(name, overrides)
    validate_config(cfg, registry.CONFIGS[name])
    got = {k: cfg[k] for k in ("batch_size", "epochs", "dtype", "enable_activation_checkpointing", "gradient_accumulation_steps")}
    assert got == {"batch_size": 2, "epochs": 1, "dtype": "fp32", "enable_activation_checkpointing": False, "gradient_accumulation_steps": 1}
    assert (cfg.optimizer.lr, cfg.lr_scheduler.num_warmup_steps) == (3e-4, 100)


_ONE_PER_RECIPE = sorted({r: n for n, r in sorted(registry.CONFIGS.items(), reverse=True) if n.startswith("llama3_8b_")}.values())


@pytest.mark.parametrize("name", _ONE_PER_RECIPE)
@pytest.mark.parametrize(
    "override, closest", [("batch_sise=2", "batch_size"), ("optimizer.lrr=1e-4", "lr"), ("gradient_acumulation_steps=4", "gradient_accumulation_steps")]
)
def test_typo_override_names_the_closest_key(name: str, override: str, closest: str, load) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"did you mean '{closest}'")):
        validate_config(load(name, [override]), registry.CONFIGS[name])


@pytest.mark.parametrize("name", ["llama3_8b_lora_alpaca", "llama3_8b_lora_dpo_hh_rlhf"])
def test_dataset_typo_fails_before_reading_data(name: str, load) -> None:
    from torchtune import config

    cfg = load(name, ["dataset.subset_sise=500"])
    # The builders take **load_dataset_kwargs; they reject near-misses of their own arguments
    # before loading anything (tokenizer None: never reached).
    with pytest.raises(TypeError, match="subset_size"):
        config.instantiate(cfg.dataset, None)


def test_dataset_typo_is_a_config_error(load) -> None:
    with pytest.raises(ConfigError, match="did you mean 'subset_size'"):
        validate_config(load("llama3_8b_lora_alpaca", ["dataset.subset_sise=500"]), "lora_finetune_distributed")


# One config per dataset: the header's local-data override builds the dataset from the real
# sample in $HLM_DATA/text. Samples with >= 500 usable rows are named in the header and run with
# the header's subset as is; the SlimOrca (13 rows) and stack-exchange (25 pairs) samples are too
# small for the paper's subset, so their headers name a user path, swapped for the sample here.
_ONE_PER_DATASET = sorted({d: n for n, (_, d) in sorted(LLAMA3_8B.items(), reverse=True)}.values())
_SMALL_SAMPLES = {"slimorca": "slimorca_sample.jsonl", "stack_exchange": "stack_exchange_paired_tiny.jsonl"}


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from torchtune.models.llama3 import llama3_tokenizer

    from hlmtune.tiny import write_tiny_tokenizer

    tok = write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return llama3_tokenizer(tok["path"], special_tokens_path=tok["special_tokens_path"], max_seq_len=256)


@pytest.mark.parametrize("name", _ONE_PER_DATASET)
def test_8b_local_data_override_builds_the_dataset(name: str, real_text_data_dir: Path, tiny_tokenizer, load) -> None:
    from torchtune import config

    method, dataset = LLAMA3_8B[name]
    overrides = [os.path.expandvars(o) for o in _header_overrides(name, "Override example")]
    assert "dataset.source=json" in overrides and "dataset.subset_size=500" in overrides
    assert any(o.startswith("dataset.data_files=") for o in overrides)
    if dataset in _SMALL_SAMPLES:
        overrides += [f"dataset.data_files={real_text_data_dir / _SMALL_SAMPLES[dataset]}", "dataset.subset_size=8"]
    cfg = load(name, overrides)
    validate_config(cfg, registry.CONFIGS[name])
    data_file = Path(cfg.dataset.data_files)
    assert data_file.parent == real_text_data_dir and data_file.is_file(), data_file
    ds = config.instantiate(cfg.dataset, tiny_tokenizer)
    assert len(ds) == cfg.dataset.subset_size
    key = "chosen_input_ids" if method == "lora_dpo" else "tokens"
    assert len(ds[0][key]) > 1


# ------------------------------------------------------------------------- CLI
_CLI_CASES = {
    "ok": ("validate", "--config", "llama3_8b_lora_alpaca"),
    "typo": ("validate", "--no-model", "--config", "llama3_8b_lora_alpaca", "batch_sise=2"),
}


@pytest.fixture(scope="module")
def cli() -> Dict[str, subprocess.CompletedProcess]:
    """Every ``hlmtune`` invocation of this module, run concurrently (each imports torch)."""
    procs = {
        k: subprocess.Popen([str(HLMTUNE), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for k, args in _CLI_CASES.items()
    }
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[k] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def test_cli_validate_ok(cli) -> None:
    r = cli["ok"]
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK: llama3_8b_lora_alpaca.yaml is valid for lora_finetune_distributed")
    assert "8.05B params built on meta" in r.stdout  # 8.03B base + 19.7M adapters


def test_cli_validate_typo(cli) -> None:
    r = cli["typo"]
    assert r.returncode == 2
    assert "did you mean 'batch_size'" in r.stderr
    assert "OK" not in r.stdout
