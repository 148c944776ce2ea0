"""Grid files: schema errors name the file and key, expansion order, exclusions, node limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlmtune.sweep.grid import GridError, expand, load_grid
from sweep_helpers import write_grid

BASE = {"name": "g", "config": "tiny_lora", "node": {"gpus": 4, "cpus": 64}}


def _grid(tmp_path: Path, **kw):
    return write_grid(tmp_path / "grid.yaml", {**BASE, **kw})


def _err(tmp_path: Path, **kw) -> str:
    with pytest.raises(GridError) as e:
        expand(load_grid(_grid(tmp_path, **kw)))
    assert str(tmp_path / "grid.yaml") in str(e.value)
    return str(e.value)


def test_product_order_labels_and_overrides(tmp_path):
    tasks = expand(load_grid(_grid(tmp_path, axes={
        "method": {"values": [{"value": "lora", "set": {"batch_size": 2}}, {"value": "qlora", "label": "q"}]},
        "devices": [1, 4],
        "window": {"key": "dataset.max_seq_len", "label": "w{value}", "values": [128, 256]},
    })))
    assert [t.name for t in tasks][:3] == ["lora-devices1-w128", "lora-devices1-w256", "lora-devices4-w128"]
    assert len(tasks) == 8 and [t.id for t in tasks] == list(range(8))
    assert tasks[0].set == {"batch_size": 2, "dataset.max_seq_len": 128}
    assert tasks[-1].set == {"dataset.max_seq_len": 256} and tasks[-1].name == "q-devices4-w256"
    assert tasks[0].dir_name == "000-lora-devices1-w128"
    # resources: 1 of 4 GPUs gets a quarter of the node's 64 CPUs
    assert (tasks[0].slurm["devices"], tasks[0].slurm["gpus"], tasks[0].slurm["cpus_per_task"]) == (1, 1, 16)
    assert tasks[2].slurm["cpus_per_task"] == 64


def test_zip_varies_together_and_exclude(tmp_path):
    tasks = expand(load_grid(_grid(tmp_path, config="llama3_8b_{method}_alpaca", axes={"method": ["lora", "qat"]},
                                   zip=[{"cpus_per_task": [8, 16], "workers": {"key": "data_loader.num_workers", "values": [7, 15]}}],
                                   exclude=[{"method": "qat", "cpus_per_task": [8]}])))
    assert [(t.axes["method"], t.slurm["cpus_per_task"], t.set["data_loader.num_workers"]) for t in tasks] == [
        ("lora", 8, 7), ("lora", 16, 15), ("qat", 16, 15)]


def test_config_template_from_axes(tmp_path):
    tasks = expand(load_grid(_grid(tmp_path, config="llama3_8b_{method}_{dataset}",
                                   axes={"method": ["lora", "qat"], "dataset": ["alpaca", "samsum"]})))
    assert [t.config for t in tasks] == ["llama3_8b_lora_alpaca", "llama3_8b_lora_samsum", "llama3_8b_qat_alpaca", "llama3_8b_qat_samsum"]


def test_floats_like_configs(tmp_path):
    p = tmp_path / "grid.yaml"
    p.write_text("name: g\nconfig: tiny_lora\naxes:\n  lr: {key: optimizer.lr, values: [3e-4, 1e-3]}\n")
    assert [t.set["optimizer.lr"] for t in expand(load_grid(p))] == [0.0003, 0.001]


@pytest.mark.parametrize("kw,expect", [
    ({"axis": {"lr": [1]}}, "unknown key 'axis' (did you mean 'axes'?)"),
    ({"slurm": {"partion": "gpu"}, "axes": {"devices": [1]}}, "slurm: unknown key 'partion' (did you mean 'partition'?)"),
    ({"axes": {"lr": {"key": "optimizer.lr", "valuse": [1]}}}, "axes.lr: unknown key 'valuse' (did you mean 'values'?)"),
    ({"axes": {"devices": []}}, "axes.devices: empty axis"),
    ({}, "axes: no axes"),
    ({"axes": {"lr": [0.1, 0.2]}}, "axes.lr: this axis changes nothing"),
    ({"axes": {"device": [1, 2]}}, "axes.device: this axis changes nothing (did you mean 'devices'?)"),
    ({"axes": {"cpu_per_task": [8]}}, "axes.cpu_per_task: this axis changes nothing (did you mean 'cpus_per_task'?)"),
    ({"axes": {"devices": [1, 1]}}, "axes.devices[1]: value 1 appears twice"),
    ({"axes": {"devices": [1]}, "zip": [{"cpus_per_task": [8, 16], "w": {"key": "data_loader.num_workers", "values": [1, 2, 3]}}]},
     "zip[0]: zip lists differ in length: cpus_per_task has 2, w has 3"),
    ({"axes": {"devices": [2, 8]}}, "task 1 (devices=8): devices=8 per node but a node has 4 GPUs (node.gpus)"),
    ({"axes": {"cpus_per_task": [16, 128]}}, "task 1 (cpus_per_task=128): cpus_per_task=128 but a node has 64 CPUs"),
    ({"axes": {"devices": [1]}, "config": "x_{methd}"}, "{methd} is not an axis"),
    ({"axes": {"devices": [1]}, "exclude": [{"devics": 1}]}, "'devics' is not an axis (did you mean 'devices'?)"),
    ({"axes": {"devices": [1]}, "exclude": [{"devices": 1}]}, "every combination is excluded"),
    ({"axes": {"time": ["1:00:00", "2 hours"]}}, "axes.time[1]: '2 hours' is not a SLURM time"),
    ({"axes": {"devices": [1]}, "slurm": {"partition": "gpu; rm -rf /"}}, "slurm.partition: 'gpu; rm -rf /': expected one word"),
    ({"name": "my sweep", "axes": {"devices": [1]}}, "name: 'my sweep'"),
    ({"axes": {"a": {"key": "batch_size", "values": [1]}, "b": {"values": [{"value": 1, "set": {"batch_size": 2}}]}}},
     "axes 'a' and 'b' both set 'batch_size' (1 vs 2)"),
])
def test_bad_grids_name_key_axis_and_value(tmp_path, kw, expect):
    assert expect in _err(tmp_path, **kw)


def test_cpu_nodes_count_ranks_against_cpus(tmp_path):
    msg = _err(tmp_path, node={"gpus": 0, "cpus": 2}, axes={"devices": [1, 4]})
    assert "task 1 (devices=4): devices=4 CPU ranks per node but a node has 2 CPUs" in msg
    tasks = expand(load_grid(_grid(tmp_path, node={"gpus": 0}, axes={"devices": [1, 2]})))
    assert [(t.slurm["cpus_per_task"], t.slurm["gpus"]) for t in tasks] == [(1, 0), (2, 0)]


def test_an_unquoted_slurm_time_is_the_time_written(tmp_path):
    """YAML 1.1 reads 2:00:00 as 7200 (base 60): a grid keeps it as the text, for SLURM's --time."""
    p = tmp_path / "grid.yaml"
    p.write_text("name: g\nconfig: tiny_lora\nslurm: {time: 2:00:00}\naxes:\n  time: [30:00, 1-00:00:00]\n"
                 "  lr: {key: optimizer.lr, values: [3e-4]}\n")
    tasks = expand(load_grid(p))
    assert [t.slurm["time"] for t in tasks] == ["30:00", "1-00:00:00"]
    p.write_text("name: g\nconfig: tiny_lora\nslurm: {time: 2:00:00}\naxes:\n  lr: {key: optimizer.lr, values: [3e-4]}\n")
    assert expand(load_grid(p))[0].slurm["time"] == "2:00:00"


def test_not_yaml_and_missing(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(GridError, match="bad.yaml: not valid YAML"):
        load_grid(p)
    with pytest.raises(GridError, match="no such grid file"):
        load_grid(tmp_path / "nope.yaml")
    p.write_text("!!python/object/apply:os.system ['true']\n")
    with pytest.raises(GridError, match="not valid YAML"):  # safe loading: no object construction
        load_grid(p)


@pytest.mark.parametrize("section,expect", [
    ({"node": {"gpu": 4}}, "unknown key 'node.gpu' (did you mean 'node.gpus'?)"),
    ({"node": {"gpus": -1}}, "node.gpus must be an integer >= 0, got -1"),
    ({"node": [1]}, "node must be a mapping"),
    ({"requeue": {"signal_seconds": 0}}, "requeue.signal_seconds must be an integer > 0"),
    ({"container": {"runtime": "apptainer"}}, "container: missing required key 'image'"),
    ({"container": {"image": "x.sif", "runtime": "apptaner"}}, "container.runtime must be one of"),
    ({"environment": {"vars": {"1A": "x"}}}, "'1A' is not an environment variable name"),
    ({"environment": {"setup": ["module load x"]}}, "environment.setup must be shell lines as one string"),
    ({"collect": {"enabled": "yes"}}, "collect.enabled must be True or False, got 'yes'"),
    ({"collect": {"slurm": {"partion": "x"}}}, "collect.slurm: unknown key 'partion' (did you mean 'partition'?)"),
])
def test_sections_are_checked_by_their_dataclass(tmp_path, section, expect):
    assert expect in _err(tmp_path, axes={"devices": [1]}, **section)


def test_sections_parse_to_typed_defaults(tmp_path):
    from hlmtune.sweep.grid import CollectSpec, ContainerSpec, EnvironmentSpec, NodeSpec, RequeueSpec

    g = load_grid(_grid(tmp_path, axes={"devices": [1]}))
    assert (g.node, g.requeue, g.environment, g.container, g.collect) == (
        NodeSpec(gpus=4, cpus=64), RequeueSpec(enabled=False), EnvironmentSpec(), None, CollectSpec())
    g = load_grid(_grid(tmp_path, axes={"devices": [1]}, requeue={}, environment={"vars": {"A": 1}},
                        container={"image": "a.sif", "binds": "/data"}))
    assert g.requeue.enabled and g.requeue.signal_seconds == 300  # a `requeue:` section turns it on
    assert g.environment.vars == {"A": "1"} and g.container == ContainerSpec(image="a.sif", binds=("/data",))
    assert not load_grid(_grid(tmp_path, axes={"devices": [1]}, requeue={"enabled": False})).requeue.enabled


def test_docs_show_every_key_of_every_section():
    import dataclasses
    import re

    from hlmtune.sweep.grid import GRID_SECTIONS, TASK_SLURM_KEYS, ARRAY_SLURM_KEYS

    docs = (Path(__file__).resolve().parent.parent / "docs" / "sweep.md").read_text()
    block = docs.split("## The grid file", 1)[1].split("```", 2)[1]
    for section, cls in GRID_SECTIONS.items():
        assert re.search(rf"^{section}:", block, re.M), section
        for f in dataclasses.fields(cls):
            assert re.search(rf"\b{f.name}\b", block), f"docs/sweep.md's grid example lacks {section}.{f.name}"
    for key in (*TASK_SLURM_KEYS, *ARRAY_SLURM_KEYS):
        assert re.search(rf"^\s+{key}:", block, re.M), f"slurm.{key}"
