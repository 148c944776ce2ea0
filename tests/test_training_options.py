"""The pack's typed keys: one parse, defaults, errors naming the key, torchtune's AC semantics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hlmtune.training.options import (
    ActivationCheckpointing,
    DataLoaderOptions,
    PackOptions,
    QuantizeOptions,
    parse_pack_options,
    section_keys,
)
from hlmtune.training.options import closest
from hlmtune.training.schema import RECIPE_KEYS

FULL = RECIPE_KEYS["full_finetune_distributed"]
LORA = RECIPE_KEYS["lora_finetune_distributed"]
QAT = RECIPE_KEYS["qat_distributed"]


def _parse(data, accepted=FULL):
    errors = []
    opts = parse_pack_options(data, accepted, errors, closest)
    return opts, errors


def test_defaults_and_typed_values():
    opts, errors = _parse({})
    assert errors == [] and opts == PackOptions()
    assert opts.data_loader == DataLoaderOptions(pin_memory=False, num_workers=0, split="distributed")
    assert opts.log_peak_memory_stats is True and opts.activation_checkpointing.every_n_layers == 0
    opts, errors = _parse({
        "data_loader": {"pin_memory": True, "num_workers": 2, "split": "contiguous", "prefetch_factor": 4},
        "data_parallel": "ddp", "save_every_n_steps": 5, "keep_last_n_checkpoints": 2,
        "quantize": {"enabled": False, "output_name": "q.pt"}, "log_peak_memory_stats": False,
    }, QAT)
    assert errors == []
    assert opts.data_loader == DataLoaderOptions(True, 2, "contiguous", 4, False)
    assert (opts.data_parallel, opts.save_every_n_steps, opts.keep_last_n_checkpoints) == ("ddp", 5, 2)
    assert opts.quantize == QuantizeOptions(enabled=False, output_name="q.pt")
    assert opts.log_peak_memory_stats is False
    assert section_keys(DataLoaderOptions) == {"pin_memory", "num_workers", "split", "prefetch_factor", "persistent_workers"}


def test_errors_name_the_key_and_the_closest():
    _, errors = _parse({
        "data_loader": {"pin_memroy": True, "num_workers": -1, "split": "contigous"},
        "data_parallel": "fdsp", "save_every_n_steps": 0, "keep_last_n_checkpoints": "2",
        "log_peak_memory_stats": "yes", "quantize": {"enabeld": True},
    }, QAT)
    text = "\n".join(errors)
    assert "unknown key 'data_loader.pin_memroy' (did you mean 'data_loader.pin_memory'?)" in text
    assert "data_loader.num_workers must be an integer >= 0, got -1" in text
    assert "data_loader.split must be one of ('distributed', 'contiguous'), got 'contigous' (did you mean 'contiguous'?)" in text
    assert "data_parallel must be one of" in text and "did you mean 'fsdp'" in text
    assert "save_every_n_steps must be a positive integer or null, got 0" in text
    assert "keep_last_n_checkpoints must be a positive integer or null, got '2'" in text
    assert "log_peak_memory_stats must be True or False" in text
    assert "unknown key 'quantize.enabeld' (did you mean 'quantize.enabled'?)" in text
    assert len(errors) == 8
    _, errors = _parse({"data_loader": [1]})
    assert errors == ["data_loader must be a mapping, got [1]"]


@pytest.mark.parametrize("data,accepted,every_n", [
    ({"enable_activation_checkpointing": True}, FULL, 1),
    ({"ac_mode": "full"}, FULL, 1),
    ({"ac_mode": "selective", "ac_option": 2}, FULL, 2),
    ({"ac_mode": "selective", "ac_option": "3"}, FULL, 3),  # torchtune casts '3'
    ({"ac_mode": "selective", "ac_option": 0}, FULL, 1),  # 0: every layer
    ({"ac_mode": "none"}, FULL, 0),
    ({"ac_mode": "full", "enable_activation_checkpointing": True}, FULL, 0),  # torchtune applies neither
    ({"ac_mode": "full"}, LORA, 0),  # LoRA recipes do not read ac_mode (a warning says so)
    ({"ac_mode": "full", "enable_activation_checkpointing": True}, LORA, 1),
])
def test_activation_checkpointing_follows_torchtune(data, accepted, every_n):
    opts, errors = _parse(data, accepted)
    assert errors == [] and opts.activation_checkpointing.every_n_layers == every_n


def test_activation_checkpointing_errors_and_layers():
    for option, needle in (("op", "not implemented in torchtune 0.6.1"), (-1, "integer >= 0"), (None, "integer >= 0")):
        _, errors = _parse({"ac_mode": "selective", "ac_option": option})
        assert len(errors) == 1 and needle in errors[0], errors
    assert ActivationCheckpointing(2).layers(5) == [1, 3]
    assert ActivationCheckpointing(1).layers(3) == [0, 1, 2]
    assert ActivationCheckpointing(0).layers(3) == []


def test_collector_reads_the_data_loader_section(tmp_path: Path):
    """Runs of torchtune's own recipes log no run info: the collector fills pin_memory and
    num_workers from the config's ``data_loader`` (it read ``dataloader`` before)."""
    from hlmtune.profiling.collector import CollectorLogger

    log = CollectorLogger(log_dir=str(tmp_path / "m"))
    log.log_config({"data_loader": {"pin_memory": True, "num_workers": 3}, "device": "cpu"})
    log.log_dict({"loss": 1.0}, step=1)
    log.close()
    run = json.loads((tmp_path / "m" / "run.json").read_text())
    assert (run["pin_memory"], run["num_workers"]) == (True, 3)


@pytest.mark.parametrize("mode, device, dp, want, reason", [
    ("default", "cuda", "fsdp", "default", None),
    ("max-autotune-no-cudagraphs", "cpu", "ddp", "max-autotune-no-cudagraphs", None),
    ("reduce-overhead", "cuda", "ddp", "reduce-overhead", None),
    ("reduce-overhead", "cuda", "none", "reduce-overhead", None),
    ("max-autotune", "cuda", "none", "max-autotune", None),
    ("reduce-overhead", "cuda", "fsdp", "default", "FSDP2"),
    ("max-autotune", "cuda", "fsdp", "max-autotune-no-cudagraphs", "FSDP2"),
    ("reduce-overhead", "cpu", "ddp", "default", "none on cpu"),
])
def test_cuda_graphs_only_where_they_can_replay(mode, device, dp, want, reason):
    from hlmtune.training.options import effective_compile_mode

    got, why = effective_compile_mode(mode, device, dp)
    assert got == want
    assert (why is None) == (reason is None) and (reason is None or reason in why)


def test_compile_mode_is_parsed_and_checked():
    opts, errors = _parse({"compile_mode": "reduce-overhead"}, LORA)
    assert errors == [] and opts.compile_mode == "reduce-overhead" and PackOptions().compile_mode == "default"
    _, errors = _parse({"compile_mode": "reduce_overhead"}, LORA)
    assert errors and "did you mean 'reduce-overhead'" in errors[0]


@pytest.mark.parametrize("mode, device, dp, compiled_with, graphs", [
    ("reduce-overhead", "cuda", "ddp", "reduce-overhead", True),
    ("reduce-overhead", "cuda", "fsdp", "torchtune", False),
    ("max-autotune-no-cudagraphs", "cpu", "none", "max-autotune-no-cudagraphs", False),
    ("default", "cpu", "none", "torchtune", False),
])
def test_layers_compile_in_the_effective_mode(monkeypatch, tmp_path, mode, device, dp, compiled_with, graphs):
    """Every transformer layer is compiled with the mode (or by torchtune's own helper); graphs
    turn on the per-step cudagraph_mark_step_begin."""
    import types

    import torch
    from torchtune import training
    from torchtune.models.llama3 import llama3

    from hlmtune.training.recipe import RecipeBase

    model = llama3(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32, max_seq_len=16)
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append(kw.get("mode")))
    monkeypatch.setattr(training, "compile_model", lambda m, verbose=True: calls.append("torchtune"))
    fake = types.SimpleNamespace(_compile_mode=mode, _device=torch.device(device), _is_rank_zero=False,
                                 _cudagraphs=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    RecipeBase._compile_layers(fake, model, dp)
    assert calls == (["torchtune"] if compiled_with == "torchtune" else [compiled_with] * 2)
    # inductor's cache: a folder of this process's ATen kernels (another set's cached code was wrong)
    kernels = torch.backends.cpu.get_cpu_capability().lower()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / f"aten-{kernels}")
    assert fake._cudagraphs is graphs
