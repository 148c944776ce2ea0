"""CPU API summaries with torch.profiler: event classification, and a real 2-rank gloo run."""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from hlmtune.cli import main as hlmtune_main
from hlmtune.profiling.analysis import collect
from hlmtune.profiling.torchprof import collective_name, summarize_events


@dataclass
class _Ev:
    key: str
    count: int
    cpu_time_total: float  # us, inclusive
    self_cpu_time_total: float  # us


def test_summarize_events_categories_and_shares() -> None:
    evs = [
        _Ev("data", 4, 200_000, 1_000), _Ev("forward", 4, 300_000, 1_000), _Ev("backward", 4, 400_000, 1_000),
        _Ev("optimizer_step", 4, 50_000, 1_000), _Ev("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 5, 100_000, 90_000),
        _Ev("gloo:all_reduce", 8, 120_000, 120_000), _Ev("c10d::allreduce_", 8, 80_000, 80_000),
        _Ev("aten::mm", 40, 250_000, 250_000), _Ev("aten::add_", 40, 10_000, 10_000),
    ]
    body = summarize_events(evs, wall_s=2.0, top=5)
    head = {r["name"]: r for r in body["headline"]}
    assert head["backward"]["seconds"] == pytest.approx(0.4) and head["backward"]["share"] == pytest.approx(0.2)
    assert head["dataloader_next"]["seconds"] == pytest.approx(0.1) and head["dataloader_next"]["calls"] == 5
    # c10d op and its gloo work item describe the same collective: the larger one counts
    assert head["gloo_all_reduce"]["seconds"] == pytest.approx(0.12) and head["gloo_all_reduce"]["calls"] == 8
    assert head["gloo_all_gather"]["seconds"] == 0.0
    ops = [r for r in body["rows"] if r["category"] == "cpu_op"]
    self_total = sum(e.self_cpu_time_total for e in evs) * 1e-6
    mm = next(r for r in ops if r["name"] == "aten::mm")
    assert mm["share"] == pytest.approx(0.25 / self_total)
    assert [r["name"] for r in ops][0] == "aten::mm"  # sorted by self time


@dataclass
class _CudaEv(_Ev):
    device_type: str = "DeviceType.CPU"
    self_device_time_total: float = 0.0  # us


def test_cuda_kernels_become_gpu_kernel_rows() -> None:
    evs = [
        _CudaEv("aten::mm", 40, 250_000, 250_000, "DeviceType.CPU", 900_000),  # a CPU op: its launches' time
        _CudaEv("ampere_sgemm_128x64_nn", 40, 0, 0, "DeviceType.CUDA", 600_000),
        _CudaEv("vectorized_elementwise_kernel", 80, 0, 0, "DeviceType.CUDA", 200_000),
    ]
    body = summarize_events(evs, wall_s=2.0, top=5)
    kern = [r for r in body["rows"] if r["category"] == "gpu_kernel"]
    assert [r["name"] for r in kern] == ["ampere_sgemm_128x64_nn", "vectorized_elementwise_kernel"]
    assert kern[0]["seconds"] == pytest.approx(0.6) and kern[0]["share"] == pytest.approx(0.75) and kern[0]["calls"] == 40
    assert body["totals"]["gpu_kernel"] == pytest.approx(0.8)
    head = {r["name"]: r for r in body["headline"]}
    assert head["all_kernels"]["share"] == pytest.approx(0.4) and head["all_kernels"]["calls"] == 120
    # a CPU-only profile (no CUDA entries) has no kernel rows
    assert not [r for r in summarize_events(evs[:1], wall_s=2.0)["rows"] if r["category"] == "gpu_kernel"]


def test_collective_names() -> None:
    assert collective_name("gloo:all_reduce") == "all_reduce"
    assert collective_name("c10d::allgather_") == "all_gather"
    assert collective_name("c10d::reduce_scatter_") == "reduce_scatter"
    assert collective_name("aten::mm") is None


_SCRIPT = '''
import torch, torch.distributed as dist
from torch.profiler import record_function
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ds = torch.utils.data.TensorDataset(torch.randn(96, 64), torch.randn(96, 1))
for x, y in torch.utils.data.DataLoader(ds, batch_size=16):
    with record_function("data"):
        x = x.clone()
    with record_function("forward"):
        loss = torch.nn.functional.mse_loss(model(x), y)
    with record_function("backward"):
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
    with record_function("optimizer_step"):
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_two_rank_gloo_run_profiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    script = tmp_path / "ddp_tiny.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    out = tmp_path / "prof"
    rc = hlmtune_main(["profile", "torch", "--out", str(out), "--", sys.executable, "-m", "torch.distributed.run",
                       "--nproc_per_node", "2", "--master-port", "29561", str(script)])
    assert rc == 0
    s = json.loads((out / "api_summary.json").read_text())
    assert s["source"] == "torch.profiler" and set(s["ranks"]) == {"0", "1"}
    assert len(s["ignored"]) == 1 and "launcher" in s["ignored"][0]["reason"]  # torchrun's own process
    for rank in ("0", "1"):
        head = {r["name"]: r for r in s["ranks"][rank]["headline"]}
        assert head["gloo_all_reduce"]["calls"] == 6 * 4  # 6 steps x 4 parameter tensors
        assert head["gloo_all_reduce"]["seconds"] > 0
        for name in ("data", "forward", "backward", "optimizer_step"):
            assert head[name]["calls"] == 6 and 0 < head[name]["share"] < 1
        assert head["dataloader_next"]["calls"] == 7  # 6 batches + StopIteration
        assert any(r["category"] == "cpu_op" and r["name"].startswith("aten::") for r in s["ranks"][rank]["rows"])
    # The same table shape goes into `hlmtune collect` next to a run.
    from test_profiling_analysis import make_run

    run = tmp_path / "runs" / "n2"
    make_run(run, monkeypatch, world_size=2, step_times=[0.2] * 3, tokens_per_step=10)
    (run / "api_summary.json").write_text((out / "api_summary.json").read_text())
    res = collect([tmp_path / "runs"], tmp_path / "table")
    assert res["rows"][0]["api_gloo_all_reduce_pct"] > 0
    assert (tmp_path / "table" / "api_share_stacked.png").stat().st_size > 5000


def test_a_pack_rank_writes_its_profile_although_it_skips_atexit(tmp_path: Path) -> None:
    # Pack recipes run as `python -m hlmtune._rank ...`, which ends with os._exit (no atexit):
    # the profile must still be written, or every torchrun run of a pack recipe profiles nothing.
    script = tmp_path / "work.py"
    script.write_text("import torch\nx = torch.ones(64, 64)\nfor _ in range(3):\n    x = x @ x / 64\n")
    out = tmp_path / "prof"
    rc = hlmtune_main(["profile", "torch", "--out", str(out), "--", sys.executable, "-m", "hlmtune._rank", str(script)])
    assert rc == 0
    s = json.loads((out / "api_summary.json").read_text())
    (only,) = s["ranks"].values()
    assert any(r["name"] == "aten::mm" and r["calls"] == 3 for r in only["rows"])


def test_shapes_option_splits_an_operator_by_input_shape(tmp_path: Path) -> None:
    # Two multiplies of different sizes are one aten::mm row; with --shapes they are two rows,
    # the larger one first (it has the most self time), each naming its inputs' shapes.
    script = tmp_path / "work.py"
    script.write_text("import torch\na = torch.ones(256, 256)\nb = torch.ones(8, 8)\n"
                      "for _ in range(4):\n    a @ a\n    b @ b\n")
    out = tmp_path / "prof"
    rc = hlmtune_main(["profile", "torch", "--out", str(out), "--shapes", "10", "--", sys.executable, str(script)])
    assert rc == 0
    (only,) = json.loads((out / "api_summary.json").read_text())["ranks"].values()
    mm = [r for r in only["rows"] if r["category"] == "cpu_op_shape" and r["name"] == "aten::mm"]
    assert [r["input_shapes"] for r in mm] == [[[256, 256], [256, 256]], [[8, 8], [8, 8]]]
    assert [r["calls"] for r in mm] == [4, 4] and mm[0]["seconds"] > mm[1]["seconds"]
    assert 0 < sum(r["share"] for r in mm) <= 1
    # without the option: no shape rows (record_shapes off)
    rc = hlmtune_main(["profile", "torch", "--out", str(out), "--", sys.executable, str(script)])
    (only,) = json.loads((out / "api_summary.json").read_text())["ranks"].values()
    assert rc == 0 and not [r for r in only["rows"] if r["category"] == "cpu_op_shape"]
