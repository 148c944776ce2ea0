"""nsys: commands built, stats CSV (current and legacy layouts) and SQLite parsing, headline metrics."""

from __future__ import annotations

import csv
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Dict, List

import pytest

from hlmtune.cli import main as hlmtune_main
from hlmtune.profiling.analysis import collect
from hlmtune.profiling.nsys import (
    STATS_REPORTS,
    NsysFormatError,
    build_profile_command,
    build_stats_command,
    nccl_collective,
    normalize_api_name,
    normalize_memop,
    parse_sqlite,
    parse_stats_csv,
    summarize_path,
)

FIX = Path(__file__).parent / "fixtures" / "nsys"


def _csv(name: str) -> List[Dict[str, str]]:
    with open(FIX / name, newline="") as f:
        return list(csv.DictReader(f))


def _head(summary: dict, rank: str) -> Dict[str, dict]:
    return {r["name"]: r for r in summary["ranks"][rank]["headline"]}


def test_fixture_headers_are_nsys_documented_columns() -> None:
    assert list(_csv("report_rank0_cuda_api_sum.csv")[0]) == [
        "Time (%)", "Total Time (ns)", "Num Calls", "Avg (ns)", "Med (ns)", "Min (ns)", "Max (ns)", "StdDev (ns)", "Name"]
    assert list(_csv("report_rank0_cuda_gpu_kern_sum.csv")[0])[2] == "Instances"
    assert list(_csv("report_rank0_cuda_gpu_mem_time_sum.csv")[0])[-1] == "Operation"
    assert list(_csv("report_rank0_cuda_gpu_mem_size_sum.csv")[0])[0] == "Total (MB)"


def test_csv_headline_metrics_per_rank_match_raw_columns() -> None:
    s = summarize_path([FIX / f for f in sorted(p.name for p in FIX.glob("report_rank*.csv"))])
    assert s["source"] == "nsys-csv" and set(s["ranks"]) == {"0", "1"}
    for rank in ("0", "1"):
        api = _csv(f"report_rank{rank}_cuda_api_sum.csv")
        head = _head(s, rank)
        total_api = sum(float(r["Total Time (ns)"]) for r in api)
        for raw in api:
            name = normalize_api_name(raw["Name"])
            if name in head:
                assert head[name]["seconds"] == pytest.approx(float(raw["Total Time (ns)"]) * 1e-9)
                assert head[name]["calls"] == int(raw["Num Calls"])
                # our share of the API total agrees with nsys' own rounded Time (%)
                assert 100 * head[name]["share"] == pytest.approx(float(raw["Time (%)"]), abs=0.051)
        assert s["ranks"][rank]["totals"]["cuda_api"] == pytest.approx(total_api * 1e-9)
        assert head["cudaLaunchKernel"]["calls"] > 1_000_000  # the _v7000 suffix was normalized
        kern = _csv(f"report_rank{rank}_cuda_gpu_kern_sum.csv")
        ag = sum(float(r["Total Time (ns)"]) for r in kern if "AllGather" in r["Name"])
        assert head["nccl_AllGather"]["seconds"] == pytest.approx(ag * 1e-9)
        ar = [r for r in kern if "AllReduce" in r["Name"]]
        assert head["nccl_AllReduce"]["calls"] == sum(int(r["Instances"]) for r in ar)
        size = {r["Operation"]: float(r["Total (MB)"]) for r in _csv(f"report_rank{rank}_cuda_gpu_mem_size_sum.csv")}
        assert head["memcpy_HtoD"]["bytes"] == pytest.approx(size["[CUDA memcpy Host-to-Device]"] * 1e6)
        assert head["memcpy_DtoD"]["bytes"] == pytest.approx(size["[CUDA memcpy Device-to-Device]"] * 1e6)
        memt = {r["Operation"]: r for r in _csv(f"report_rank{rank}_cuda_gpu_mem_time_sum.csv")}
        dtoh = memt["[CUDA memcpy Device-to-Host]"]
        assert head["memcpy_DtoH"]["seconds"] == pytest.approx(float(dtoh["Total Time (ns)"]) * 1e-9)
        assert 100 * head["memcpy_DtoH"]["share"] == pytest.approx(float(dtoh["Time (%)"]), abs=0.051)


def test_legacy_layout_and_banner_lines() -> None:
    s = summarize_path([FIX / "legacy"])
    head = _head(s, "all")
    assert head["cudaStreamSynchronize"]["share"] == pytest.approx(1.5 / 2.25)
    assert head["nccl_AllReduce"]["seconds"] == pytest.approx(0.3)
    assert head["memcpy_HtoD"]["bytes"] == pytest.approx(2048 * 1024)  # legacy sizes are KiB
    assert head["memcpy_HtoD"]["share"] == pytest.approx(0.6)
    text = "Processing [report.sqlite] with [cuda_api_sum.py]...\n\n ** CUDA API Summary (cuda_api_sum):\n\n" + (
        FIX / "report_rank0_cuda_api_sum.csv").read_text()
    kind, rows = parse_stats_csv(text, "stdout")
    assert kind == "cuda_api_sum" and len(rows) == 8
    assert parse_stats_csv("", "empty.csv") == ("empty", [])


def test_bad_csv_names_file_and_row(tmp_path: Path) -> None:
    bad = (FIX / "report_rank0_cuda_api_sum.csv").read_text().replace("18422", "lots", 1)
    with pytest.raises(NsysFormatError, match=r"x\.csv: row 2"):
        parse_stats_csv(bad, "x.csv")
    with pytest.raises(NsysFormatError, match="no nsys stats header"):
        parse_stats_csv('"a","b"\n1,2\n', "y.csv")


def test_name_normalization() -> None:
    assert normalize_api_name("cudaLaunchKernel_v7000") == "cudaLaunchKernel"
    assert normalize_api_name("cudaMemcpyAsync_v3020") == "cudaMemcpyAsync"
    assert normalize_api_name("cudaMemcpyAsync_ptsz") == "cudaMemcpyAsync"
    assert normalize_api_name("cudaLaunchKernel_ptsz_v7000") == "cudaLaunchKernel"  # CUPTI's own order
    assert normalize_api_name("cudaMemcpyAsync_v3020_ptds") == "cudaMemcpyAsync"
    assert normalize_memop("[CUDA memcpy Host-to-Device]") == normalize_memop("[CUDA memcpy HtoD]") == "memcpy_HtoD"
    assert normalize_memop("[CUDA memset]") == "memset"
    assert nccl_collective("ncclDevKernel_AllGather_RING_LL(ncclDevComm *, unsigned long, ncclWork *)") == "nccl_AllGather"
    assert nccl_collective("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)") == "nccl_AllReduce"
    assert nccl_collective("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)") == "nccl_ReduceScatter"
    assert nccl_collective("ncclAllReduceRingLLKernel_sum_f32(ncclColl)") == "nccl_AllReduce"
    assert nccl_collective("ampere_sgemm_128x64_tn") is None


def _make_sqlite(path: Path) -> None:
    """Two processes (two ranks) in one export, with the documented tables and id packing."""
    con = sqlite3.connect(path)
    con.executescript(
        """
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, eventClass INTEGER,
            globalTid INTEGER, correlationId INTEGER, nameId INTEGER, returnValue INTEGER, callchainId INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, contextId INTEGER,
            streamId INTEGER, correlationId INTEGER, globalPid INTEGER, demangledName INTEGER, shortName INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER, end INTEGER, deviceId INTEGER, contextId INTEGER,
            streamId INTEGER, correlationId INTEGER, globalPid INTEGER, bytes INTEGER, copyKind INTEGER,
            srcKind INTEGER, dstKind INTEGER);
        """
    )
    names = {1: "cudaLaunchKernel_v7000", 2: "cudaStreamSynchronize_v3020", 3: "cudaMemcpyAsync_v3020",
             4: "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm *, unsigned long, ncclWork *)", 5: "ncclDevKernel_AllReduce_Sum",
             6: "sgemm", 7: "sgemm"}
    con.executemany("INSERT INTO StringIds VALUES (?, ?)", names.items())
    for p, (pid, t0) in enumerate([(4242, 1000), (4243, 2000)]):
        gtid = (pid << 24) | pid  # nsys: pid in bits 24..47, tid in the low bits
        gpid = pid << 24
        rt = [(t0 + 10, t0 + 20 + p, 1), (t0 + 30, t0 + 130, 2), (t0 + 140, t0 + 150, 3), (t0 + 200, t0 + 215, 1)]
        con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME (start, end, globalTid, nameId) VALUES (?, ?, ?, ?)",
                        [(s, e, gtid, n) for s, e, n in rt])
        con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL (start, end, globalPid, demangledName, shortName) VALUES (?, ?, ?, ?, ?)",
                        [(t0 + 20, t0 + 60, gpid, 4, 5), (t0 + 60, t0 + 90 + 10 * p, gpid, 6, 7)])
        con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY (start, end, globalPid, bytes, copyKind) VALUES (?, ?, ?, ?, ?)",
                        [(t0 + 140, t0 + 148, gpid, 4096, 1), (t0 + 150, t0 + 152, gpid, 512, 2), (t0 + 160, t0 + 161, gpid, 256, 8)])
    con.commit()
    con.close()


def test_sqlite_export_split_per_process(tmp_path: Path) -> None:
    db = tmp_path / "report.sqlite"
    _make_sqlite(db)
    parsed = parse_sqlite(db)
    assert set(parsed) == {"0", "1"} and parsed["0"]["_pid"][0]["pid"] == 4242
    s = summarize_path([db])
    assert s["source"] == "nsys-sqlite"
    for rank, extra in (("0", 0), ("1", 1)):
        head = _head(s, rank)
        assert head["cudaLaunchKernel"]["calls"] == 2
        assert head["cudaLaunchKernel"]["seconds"] == pytest.approx((10 + extra + 15) * 1e-9)
        api_total = (10 + extra) + 100 + 10 + 15
        assert head["cudaStreamSynchronize"]["share"] == pytest.approx(100 / api_total)
        assert head["nccl_AllReduce"]["seconds"] == pytest.approx(40e-9)
        assert head["nccl_AllReduce"]["share"] == pytest.approx(40 / (40 + 30 + 10 * extra))
        assert head["memcpy_HtoD"]["bytes"] == 4096 and head["memcpy_DtoD"]["bytes"] == 256
        assert head["memcpy_HtoD"]["share"] == pytest.approx(8 / 11)
    with pytest.raises(NsysFormatError, match="not an nsys SQLite"):
        empty = tmp_path / "other.sqlite"
        sqlite3.connect(empty).execute("CREATE TABLE t (x)").connection.close()
        parse_sqlite(empty)
    garbage = tmp_path / "report.sqlite"
    garbage.write_text("garbage, not a database" * 10)
    with pytest.raises(NsysFormatError, match=r"report\.sqlite: not an SQLite database"):
        parse_sqlite(garbage)


def test_commands_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    cmd = build_profile_command(["hlmtune", "run", "x", "--config", "a b.yaml"], "/o", window_s=720)
    assert cmd == ["nsys", "profile", "--trace=cuda,nvtx,osrt", "--sample=none", "--cpuctxsw=none",
                   "--force-overwrite=true", "--output", "/o/report", "--duration", "720", "--kill", "none",
                   "hlmtune", "run", "x", "--config", "a b.yaml"]
    assert "--kill" not in build_profile_command(["x"], "/o", window_s=10, kill_app=True)
    assert "--kill" not in build_profile_command(["x"], "/o")
    monkeypatch.setenv("RANK", "3")
    assert "/o/report_rank3" in build_profile_command(["x"], "/o")
    assert build_stats_command("/o/report.nsys-rep", "/o/stats/report") == [
        "nsys", "stats", "--report", ",".join(STATS_REPORTS), "--format", "csv", "--output", "/o/stats/report",
        "--force-export=true", "/o/report.nsys-rep"]
    with pytest.raises(ValueError, match="no command"):
        build_profile_command([], "/o")


def test_cli_dry_run_and_missing_nsys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    rc = hlmtune_main(["profile", "nsys", "--dry-run", "--window-s", "720", "--out", str(tmp_path),
                       "--", "hlmtune", "run", "lora_finetune_distributed", "--config", "my cfg.yaml"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[0] == (f"nsys profile --trace=cuda,nvtx,osrt --sample=none --cpuctxsw=none --force-overwrite=true "
                      f"--output {tmp_path}/report --duration 720 --kill none hlmtune run lora_finetune_distributed --config 'my cfg.yaml'")
    assert out[1].startswith("nsys stats --report cuda_api_sum,cuda_gpu_kern_sum,cuda_gpu_mem_time_sum,cuda_gpu_mem_size_sum --format csv")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert shutil.which("nsys") is None
    rc = hlmtune_main(["profile", "nsys", "--out", str(tmp_path), "--", "true"])
    err = capsys.readouterr().err
    assert rc == 2 and "`nsys` (NVIDIA Nsight Systems CLI) is not on PATH" in err
    assert not (tmp_path / "report.nsys-rep").exists()


def test_parse_cli_feeds_collect_table_and_stacked_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_profiling_analysis import make_run

    run = tmp_path / "runs" / "n2" / "metrics"
    make_run(tmp_path / "runs" / "n1" / "metrics", monkeypatch, world_size=1, step_times=[0.5] * 6, tokens_per_step=100)
    make_run(run, monkeypatch, world_size=2, step_times=[0.3] * 3, tokens_per_step=200)
    assert hlmtune_main(["profile", "parse", str(FIX), "--out", str(run)]) == 0
    api = json.loads((run / "api_summary.json").read_text())
    assert set(api["ranks"]) == {"0", "1"}
    res = collect([tmp_path / "runs"], tmp_path / "table")
    row = next(r for r in res["rows"] if r["devices"] == 2)
    mean_share = sum(_head(api, k)["cudaStreamSynchronize"]["share"] for k in ("0", "1")) / 2
    assert row["api_cudaStreamSynchronize_pct"] == pytest.approx(100 * mean_share)
    assert "api_cudaStreamSynchronize_pct" in (tmp_path / "table" / "table.csv").read_text().splitlines()[0]
    api_rows = list(csv.DictReader(open(tmp_path / "table" / "api_table.csv")))
    assert {r["rank"] for r in api_rows} == {"0", "1"}
    assert (tmp_path / "table" / "api_share_stacked.png").stat().st_size > 5000


_FAKE_NSYS = '''#!{python}
"""Stand-in for the nsys CLI: records its argv; `profile` runs the app and writes the report,
`stats` writes the documented <prefix>_<report>.csv files (copied from the fixtures)."""
import json, shutil, subprocess, sys
from pathlib import Path
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[0] == "profile":
    out = args[args.index("--output") + 1]
    i = args.index("--output") + 2
    while i < len(args) and args[i].startswith("--"):
        i += 2
    rc = subprocess.run(args[i:]).returncode
    Path(out + ".nsys-rep").write_bytes(b"fake report")
    sys.exit(rc)
if args[0] == "stats":
    prefix = args[args.index("--output") + 1]
    for rep in args[args.index("--report") + 1].split(","):
        shutil.copy(Path({fix!r}) / f"report_rank0_{{rep}}.csv", f"{{prefix}}_{{rep}}.csv")
'''


def test_profile_nsys_runs_profile_then_stats_and_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import sys

    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "nsys_calls.jsonl"
    fake = bindir / "nsys"
    fake.write_text(_FAKE_NSYS.format(python=sys.executable, log=str(log), fix=str(FIX)))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    out = tmp_path / "run" / "metrics"
    marker = tmp_path / "app_ran"
    rc = hlmtune_main(["profile", "nsys", "--window-s", "5", "--out", str(out), "--",
                       sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ok')"])
    assert rc == 0 and marker.read_text() == "ok"
    calls = [json.loads(l) for l in log.read_text().splitlines()]
    assert calls[0] == ["stats", "--help-reports"]  # which report names this nsys knows
    calls = calls[1:]
    assert [c[0] for c in calls] == ["profile", "stats"]
    assert calls[1][-1] == str(out / "report.nsys-rep")
    s = json.loads((out / "api_summary.json").read_text())
    assert s["source"] == "nsys-csv" and list(s["ranks"]) == ["all"]  # one report for the whole tree
    head = _head(s, "all")
    raw = {normalize_api_name(r["Name"]): r for r in _csv("report_rank0_cuda_api_sum.csv")}
    assert head["cudaStreamSynchronize"]["calls"] == int(raw["cudaStreamSynchronize"]["Num Calls"])


# --------------------------------------------------------------------------- real nsys output
REAL = FIX / "nsys_2022.4.2"


def _known_events() -> Dict[str, Dict[str, float]]:
    """The CUDA events add_cuda_events.py wrote, recomputed here: name -> seconds, calls, bytes."""
    out: Dict[str, Dict[str, float]] = {}
    api = {"cudaLaunchKernel": (100, 5_000), "cudaStreamSynchronize": (10, 200_000), "cudaMemcpyAsync": (25, 8_000),
           "cudaEventSynchronize": (4, 50_000), "cudaEventDestroy": (4, 1_000)}
    for name, (n, d) in api.items():  # durations d + (i % 3) * 10 ns
        out[name] = {"seconds": sum(d + (i % 3) * 10 for i in range(n)) * 1e-9, "calls": n}
    kern = {"nccl_AllReduce": (10, 1_000_000), "nccl_AllGather": (8, 600_000), "nccl_ReduceScatter": (8, 700_000)}
    for name, (n, d) in kern.items():  # durations d + (i % 2) * 100 ns
        out[name] = {"seconds": sum(d + (i % 2) * 100 for i in range(n)) * 1e-9, "calls": n}
    for name, n, d, b in (("memcpy_HtoD", 20, 100_000, 1_000_000), ("memcpy_DtoH", 5, 3_000, 4), ("memcpy_DtoD", 6, 20_000, 2_000_000)):
        out[name] = {"seconds": n * d * 1e-9, "calls": n, "bytes": n * b}
    return out


@pytest.mark.parametrize("source", ["csv", "sqlite"])
def test_real_nsys_2022_4_output_gives_the_known_events(source: str) -> None:
    """Files written by Nsight Systems 2022.4.2 itself (Debian bookworm non-free package): its
    ``nsys stats`` reports ``cudaapisum/gpukernsum/gpumemtimesum/gpumemsizesum`` and its SQLite
    export, holding CUDA events of known length (see nsys_2022.4.2/README in fixtures)."""
    files = sorted(REAL.glob("report_rank*_*.csv")) if source == "csv" else sorted(REAL.glob("report_rank*.sqlite"))
    s = summarize_path(files)
    assert s["source"] == f"nsys-{source}" and set(s["ranks"]) == {"0", "1"}
    known = _known_events()
    for rank in ("0", "1"):
        head = _head(s, rank)
        assert set(head) == set(known)
        for name, k in known.items():
            assert head[name]["seconds"] == pytest.approx(k["seconds"], rel=1e-9), name
            assert head[name]["calls"] == k["calls"], name
            if "bytes" in k and (source == "sqlite" or k["bytes"] >= 1e6):
                # nsys stats prints sizes in MB with 3 decimals: 20 bytes of DtoH read as 0.000.
                assert head[name]["bytes"] == pytest.approx(k["bytes"]), name
        assert sum(r["share"] for r in head.values() if r["category"] == "cuda_api") == pytest.approx(1.0)


def test_real_nsys_header_layout_of_2022_4() -> None:
    """2022.4 still names the reports cudaapisum ... but prints the new columns, and its kernel
    summary has GridXYZ / BlockXYZ before Name."""
    with open(REAL / "report_rank0_cudaapisum.csv", newline="") as f:
        assert next(csv.reader(f)) == ["Time (%)", "Total Time (ns)", "Num Calls", "Avg (ns)", "Med (ns)", "Min (ns)",
                                       "Max (ns)", "StdDev (ns)", "Name"]
    with open(REAL / "report_rank0_gpukernsum.csv", newline="") as f:
        assert next(csv.reader(f))[-3:] == ["GridXYZ", "BlockXYZ", "Name"]


def test_real_cpu_only_export_is_a_clear_error() -> None:
    """A real nsys 2022.4.2 export of a run without CUDA (this machine has no GPU)."""
    with pytest.raises(NsysFormatError, match="cpu_only.sqlite: no CUDA trace data"):
        parse_sqlite(REAL / "cpu_only.sqlite")


def test_stats_report_names_follow_the_installed_nsys() -> None:
    """nsys 2022.4.2 (its real --help-reports output) only knows cudaapisum ...; it prints an error
    for cuda_api_sum and still exits 0, so the names must come from the installed version."""
    from hlmtune.profiling.nsys import stats_reports_for

    old = stats_reports_for((REAL / "help_reports.txt").read_text())
    assert old == ("cudaapisum", "gpukernsum", "gpumemtimesum", "gpumemsizesum")
    assert stats_reports_for("  cuda_api_sum -- CUDA API Summary\n  cuda_gpu_kern_sum -- ...\n") == STATS_REPORTS
    cmd = build_stats_command("r.nsys-rep", "out/report", reports=old)
    assert cmd[cmd.index("--report") + 1] == "cudaapisum,gpukernsum,gpumemtimesum,gpumemsizesum"
