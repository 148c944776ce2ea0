"""Pre-launch checks: unset variables, missing input paths, unwritable output, one line each."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from hlmtune.preflight import env_problems, output_problems, path_problems, preflight


def _cfg(tmp_path: Path, **over):
    ck = tmp_path / "ckpt"
    ck.mkdir(exist_ok=True)
    (ck / "model.safetensors").write_text("x")
    (ck / "tokenizer.model").write_text("x")
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    cfg = {
        "model_dir": str(ck),
        "output_dir": str(tmp_path / "out" / "run"),
        "tokenizer": {"_component_": "t", "path": "${model_dir}/tokenizer.model", "max_seq_len": 8},
        "checkpointer": {"_component_": "c", "checkpoint_dir": "${model_dir}", "checkpoint_files": ["model.safetensors"],
                         "recipe_checkpoint": None, "output_dir": "${output_dir}"},
        "dataset": {"_component_": "d", "source": "json", "data_files": str(data)},
        "metric_logger": {"_component_": "m", "log_dir": "${output_dir}/logs"},
    }
    cfg.update(over)
    return OmegaConf.create(cfg)


def test_a_runnable_config_has_no_problems(tmp_path):
    assert preflight(_cfg(tmp_path)) == []


def test_missing_inputs_one_line_each_naming_key_and_value(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.model_dir = str(tmp_path / "nope")
    cfg.dataset.data_files = [str(tmp_path / "train.jsonl"), str(tmp_path / "missing.jsonl")]
    problems = preflight(cfg)
    nope = tmp_path / "nope"
    assert problems == [
        f"key 'model_dir': {nope}: does not exist",
        f"key 'tokenizer.path': {nope}/tokenizer.model: does not exist",
        f"key 'checkpointer.checkpoint_dir': {nope}: does not exist",
        f"key 'checkpointer.checkpoint_files': {nope}/model.safetensors: does not exist",
        f"key 'dataset.data_files': {tmp_path}/missing.jsonl: does not exist",
    ]


def test_checkpoint_file_formats_globs_and_shard_keys(tmp_path):
    data = {
        "checkpointer": {"checkpoint_dir": str(tmp_path),
                         "checkpoint_files": {"filename_format": "model-{}-of-{}.safetensors", "max_filename": "00002"}},
        "dataset": {"data_files": {"train": str(tmp_path / "*.jsonl")}, "manifest_path": str(tmp_path / "manifest.json"),
                    "shards_dir": str(tmp_path / "shards")},
        "tokenizer_like": {"path": "meta-llama/Meta-Llama-3-8B"},  # `path` outside a tokenizer: a hub id
        "remote": {"data_files": "hf://datasets/x/y.jsonl"},
    }
    problems = path_problems(data)
    assert problems == [
        f"key 'checkpointer.checkpoint_files': {tmp_path}/model-00001-of-00002.safetensors: does not exist",
        f"key 'checkpointer.checkpoint_files': {tmp_path}/model-00002-of-00002.safetensors: does not exist",
        f"key 'dataset.data_files': {tmp_path}/*.jsonl: no file matches",
        f"key 'dataset.manifest_path': {tmp_path}/manifest.json: does not exist",
        f"key 'dataset.shards_dir': {tmp_path}/shards: does not exist",
    ]
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "a.jsonl", "manifest.json"):
        (tmp_path / name).write_text("x")
    (tmp_path / "shards").mkdir()
    assert path_problems(data) == []


def test_unset_environment_variables_are_reported_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("HLM_TEST_UNSET", raising=False)
    cfg = _cfg(tmp_path, data_dir="${oc.env:HLM_TEST_UNSET}/text", other="${oc.env:HLM_TEST_UNSET,/fallback}")
    cfg.model_dir = "/nope"  # not reported: the config cannot resolve, so paths are not checked yet
    assert preflight(cfg) == [
        "key 'data_dir': ${oc.env:HLM_TEST_UNSET}/text: environment variable HLM_TEST_UNSET is not set "
        "(export it or override data_dir=...)"
    ]
    monkeypatch.setenv("HLM_TEST_UNSET", str(tmp_path))
    assert env_problems(cfg) == []


def test_output_dir_must_be_creatable(tmp_path):
    (tmp_path / "a_file").write_text("x")
    assert output_problems({"output_dir": str(tmp_path / "a_file" / "run")}) == [
        f"key 'output_dir': {tmp_path}/a_file/run: {tmp_path}/a_file is a file, not a directory"
    ]
    assert output_problems({"output_dir": str(tmp_path / "new" / "deeper")}) == []
