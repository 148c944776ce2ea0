"""``CollectorLogger``: a torchtune metric logger that records per-step timing and memory.

Use it as the ``metric_logger`` of any recipe (the pack's or torchtune's built-in ones); it
wraps the logger you already use, so everything that logger did still happens::

    metric_logger:
      _component_: hlmtune.profiling.collector.CollectorLogger
      log_dir: ${output_dir}/metrics
      warmup_steps: 1
      wrapped:
        _component_: torchtune.training.metric_logging.DiskLogger
        log_dir: ${output_dir}/logs

Files (see ``hlmtune.profiling.runs`` and docs/profiling.md for every key):
``<log_dir>/run.json``, ``<log_dir>/steps.jsonl``, ``<log_dir>/summary.json``.

Only the process with ``RANK`` 0 (or no ``RANK``) writes files; other ranks only forward.
Per step it costs a read of ``/proc/self/status`` (when the recipe logs no memory peaks), one ``json.dumps`` and one buffered write + flush
(no fsync, no CUDA synchronisation): see ``benchmarks/collector_overhead.py``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from hlmtune.training.memory import CPU_NAMES, CUDA_NAMES, PeakMemory, since_start_name
from hlmtune.profiling.runs import (
    API_SUMMARY_FILE,
    RUN_FILE,
    RUN_SCHEMA,
    STEPS_FILE,
    SUMMARY_FILE,
    SUPERSEDED_PREFIX,
    atomic_write_json,
    read_steps,
    sanitize,
    summarize_steps,
)

# torchtune's built-in recipes log get_memory_stats() keys (GiB) without the unit suffix.
# torchtune 0.6.1's get_memory_stats resets the CUDA peaks each time it is called
# (reset_stats=True, torchtune/training/memory.py), so these are peaks since the previous log.
_BUILTIN_MEMORY_KEYS = {
    "peak_memory_alloc": "peak_memory_alloc_gib",
    "peak_memory_reserved": "peak_memory_reserved_gib",
    "peak_memory_active": "peak_memory_active_gib",
}
_RANK_KEY = re.compile(r"^(peak_(?:memory_(?:alloc|reserved|active)|rss)(?:_since_start)?_gib)_rank\d+$")


def _now() -> float:
    """Monotonic clock of the collector (a module function so tests can drive it)."""
    return time.perf_counter()


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    try:
        return int(v) if v not in (None, "") else None
    except ValueError:
        return None


def _to_float(v: Any) -> Any:
    """Plain Python scalar for JSON (tensors / numpy scalars via ``.item()``)."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    item = getattr(v, "item", None)
    if callable(item):
        try:
            return item()
        except Exception:  # a multi-element tensor: keep its repr, never fail a training step
            return str(v)
    return str(v)


def _component_name(node: Any) -> Optional[str]:
    """Last dotted part of a ``_component_`` path (``torchtune.models.llama3.lora_llama3_8b`` ->
    ``lora_llama3_8b``), or the node itself when it is a string."""
    if isinstance(node, Mapping):
        comp = node.get("_component_")
        return str(comp).rsplit(".", 1)[-1] if comp else None
    if isinstance(node, str):
        return node.rsplit(".", 1)[-1]
    return None


def _git_commit(cwd: Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _versions() -> Dict[str, Optional[str]]:
    from importlib import metadata

    out: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for dist in ("torch", "torchtune", "torchao", "hlmtune"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _recipe_name() -> Optional[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    leaf = str(getattr(spec, "name", None) or "__main__").rsplit(".", 1)[-1]
    if leaf != "__main__":  # `python -m pkg` runs pkg.__main__: the name is then argv's
        return leaf
    if sys.argv and sys.argv[0]:
        return Path(sys.argv[0]).stem or None
    return None


def _default_run_name(log_dir: Path) -> str:
    """The log_dir's folder name, or its parent's when the folder is a generic ``metrics``/``logs``."""
    p = log_dir.resolve()
    return p.parent.name if p.name in ("metrics", "logs", "profiling") and p.parent.name else p.name


def infer_method(recipe: Optional[str], model: Optional[str]) -> Optional[str]:
    """Fine-tuning method from the recipe and model names (the recipes' specs decide).

    See ``hlmtune.training.spec.method_for``: pack recipes by their ``RecipeSpec``,
    torchtune's others by the family they share with one (``lora_finetune_single_device``
    -> ``lora``, ``qlora`` with a ``qlora_*`` model), ``knowledge_distillation_*`` -> ``kd``.

    Args:
        recipe (Optional[str]): recipe name.
        model (Optional[str]): model builder name.

    Returns:
        Optional[str]: the method, or the recipe name when no rule matches.
    """
    from hlmtune.training.spec import method_for

    return method_for(recipe, model)


def overrides_from_argv(argv: List[str]) -> List[str]:
    """Command-line config overrides (``key=value`` / ``~key``) after the recipe's flags."""
    out = []
    skip_next = False
    for a in argv[1:]:
        if skip_next:
            skip_next = False
            continue
        if a in ("--config", "-c"):
            skip_next = True
            continue
        if not a.startswith("-") and ("=" in a or a.startswith("~")):
            out.append(a)
    return out


class CollectorLogger:
    """Metric logger that records per-step timing/memory and wraps the user's own logger.

    Implements torchtune's ``MetricLoggerInterface`` (``log``, ``log_dict``, ``log_config``,
    ``close``) plus ``log_run_info`` (the pack's metric contract). Every call is forwarded to
    the wrapped logger unchanged; unknown attributes are looked up on it as well.

    Args:
        log_dir (str): run directory for ``run.json``, ``steps.jsonl``, ``summary.json``.
        wrapped (Any): the user's logger: a ``_component_`` spec (dict / DictConfig, built
            here with ``torchtune.config.instantiate``), an already built logger, or None.
        warmup_steps (int): optimizer steps excluded from the iteration-time statistics.
            Default 1 (the first step pays for lazy initialisation / compilation).
        run_name (Optional[str]): a label for the run; default: the folder name of ``log_dir``.
        method (Optional[str]): overrides the method inferred from the recipe name.
        model (Optional[str]): overrides the model inferred from ``model._component_``.
        dataset (Optional[str]): overrides the dataset inferred from ``dataset._component_``.
        template (Optional[str]): overrides the prompt template inferred from the config.
        forward_measured (bool): also forward the collector's own measurements (wall
            iteration time, peak RSS...) to the wrapped logger. Default False: the wrapped
            logger sees exactly the recipe's payload.
        reset_cuda_peak (bool): when the collector measures CUDA peaks itself (the recipe did
            not log them), reset them after reading so each step's peak is its own. Default
            True; False leaves torch's counters alone and records only the since-start peaks.
    """

    def __init__(
        self,
        log_dir: str,
        wrapped: Any = None,
        *,
        warmup_steps: int = 1,
        run_name: Optional[str] = None,
        method: Optional[str] = None,
        model: Optional[str] = None,
        dataset: Optional[str] = None,
        template: Optional[str] = None,
        forward_measured: bool = False,
        reset_cuda_peak: bool = True,
    ) -> None:
        self._t_start = _now()
        self._wall_start = time.time()
        self._wrapped = self._build_wrapped(wrapped)
        if int(warmup_steps) < 0:
            raise ValueError(f"CollectorLogger: warmup_steps must be >= 0, got {warmup_steps}")
        self.log_dir = Path(log_dir)
        self._warmup = int(warmup_steps)
        self._forward_measured = bool(forward_measured)
        self._reset_cuda_peak = bool(reset_cuda_peak)
        self._rank = _env_int("RANK") or 0
        self._world = _env_int("WORLD_SIZE") or 1
        self._active = self._rank == 0
        self._closed = False
        self._prev_t: Optional[float] = None
        self._prev_step: Optional[int] = None
        self._pending: Dict[str, Any] = {}  # scalars from log() awaiting the next record
        self._log_every = 1  # the recipe's log_every_n_steps, from log_config
        self._steps_f = None
        self._explicit = {
            k: v for k, v in {"method": method, "model": model, "dataset": dataset, "template": template}.items() if v
        }
        self._meta: Dict[str, Any] = {}
        # Own peak readings, made only when the recipe logs none (one process-wide counter:
        # never reset it under a recipe that reads it itself).
        self._trackers: Dict[str, PeakMemory] = {}
        if self._active:
            self._open(run_name)

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _build_wrapped(wrapped: Any) -> Any:
        if wrapped is None:
            return None
        if isinstance(wrapped, Mapping) or type(wrapped).__name__ == "DictConfig":
            if "_component_" not in wrapped:
                raise ValueError(
                    "CollectorLogger: 'wrapped' must be a logger or a mapping with a '_component_' "
                    f"key (e.g. torchtune.training.metric_logging.DiskLogger); got keys {sorted(wrapped)}"
                )
            from omegaconf import OmegaConf
            from torchtune import config as tt_config

            node = wrapped if type(wrapped).__name__ == "DictConfig" else OmegaConf.create(dict(wrapped))
            return tt_config.instantiate(node)
        for name in ("log", "log_dict", "log_config", "close"):
            if not callable(getattr(wrapped, name, None)):
                raise TypeError(f"CollectorLogger: wrapped logger {type(wrapped).__name__} has no {name}()")
        return wrapped

    def _open(self, run_name: Optional[str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        old = [n for n in (RUN_FILE, STEPS_FILE, SUMMARY_FILE) if (self.log_dir / n).exists()]
        if old and (self.log_dir / API_SUMMARY_FILE).exists():
            old.append(API_SUMMARY_FILE)  # a profile of the earlier run belongs with it
        if old:
            # A rerun into the same log_dir: keep the earlier record, never mix two runs.
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
            dest = self.log_dir / f"{SUPERSEDED_PREFIX}{stamp}"
            dest.mkdir()
            for n in old:
                os.replace(self.log_dir / n, dest / n)
        local_world = _env_int("LOCAL_WORLD_SIZE") or self._world
        nodes = _env_int("GROUP_WORLD_SIZE") or max(1, self._world // max(1, local_world))
        self._meta = {
            "schema": RUN_SCHEMA,
            "status": "running",
            "run_name": run_name or _default_run_name(self.log_dir),
            "log_dir": str(self.log_dir.resolve()),
            "started": datetime.fromtimestamp(self._wall_start, timezone.utc).isoformat(),
            "closed": None,
            "warmup_steps": self._warmup,
            "recipe": _recipe_name(),
            "method": None,
            "model": None,
            "dataset": None,
            "template": None,
            "world_size": self._world,
            "local_world_size": local_world,
            "nodes": nodes,
            "rank": self._rank,
            "device": None,
            "device_name": None,
            "dtype": None,
            "pin_memory": None,
            "num_workers": None,
            "batch_size": None,
            "gradient_accumulation_steps": None,
            "data_parallel": None,
            "run_info_from_recipe": False,
            "argv": list(sys.argv),
            "overrides": overrides_from_argv(list(sys.argv)),
            "config": None,
            "versions": _versions(),
            "git_commit": _git_commit(Path.cwd()),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "slurm": {
                "job_id": os.environ.get("SLURM_JOB_ID"),
                "array_job_id": os.environ.get("SLURM_ARRAY_JOB_ID"),
                "array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID"),
                "nodelist": os.environ.get("SLURM_JOB_NODELIST"),
            },
        }
        self._meta.update(self._explicit)
        self._write_meta()
        # Line-buffered text file: each record is one write + flush, no fsync (cheap).
        self._steps_f = open(self.log_dir / STEPS_FILE, "a", encoding="utf-8")

    def _write_meta(self) -> None:
        atomic_write_json(self.log_dir / RUN_FILE, self._meta)

    # ------------------------------------------------------- metadata calls
    def log_config(self, config: Any) -> None:
        """Record the resolved config and infer recipe metadata; forward to the wrapped logger.

        Args:
            config (DictConfig): the recipe's config (after command-line overrides).
        """
        if self._active:
            try:
                self._record_config(config)
            except Exception as e:  # metadata must never break training
                self._meta["config_error"] = f"{type(e).__name__}: {e}"
            self._write_meta()
        if self._wrapped is not None:
            self._wrapped.log_config(config)

    def _record_config(self, config: Any) -> None:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            try:
                cfg = OmegaConf.to_container(config, resolve=True)
            except Exception:  # unresolvable interpolation: keep it literal
                cfg = OmegaConf.to_container(config, resolve=False)
        else:
            cfg = dict(config)
        self._meta["config"] = sanitize(cfg)
        every = cfg.get("log_every_n_steps") if isinstance(cfg, Mapping) else None
        if isinstance(every, int) and every >= 1:
            self._log_every = every

        def get(*path: str) -> Any:
            node: Any = cfg
            for p in path:
                if not isinstance(node, Mapping) or p not in node:
                    return None
                node = node[p]
            return node

        info = self._meta
        fill = {
            "model": _component_name(get("model")),
            "dataset": self._dataset_name(get("dataset")),
            "template": self._template_name(cfg),
            "device": get("device"),
            "dtype": get("dtype"),
            "batch_size": get("batch_size"),
            "gradient_accumulation_steps": get("gradient_accumulation_steps"),
            "pin_memory": get("pin_memory") if get("pin_memory") is not None else get("data_loader", "pin_memory"),
            "num_workers": get("num_workers") if get("num_workers") is not None else get("data_loader", "num_workers"),
        }
        for k, v in fill.items():
            if info.get(k) is None and v is not None and k not in self._explicit:
                info[k] = v
        if info.get("method") is None:
            info["method"] = infer_method(info.get("recipe"), info.get("model"))
        if info.get("device_name") is None:
            info["device_name"] = self._device_name(str(info.get("device") or "cpu"))

    @staticmethod
    def _dataset_name(node: Any) -> Optional[str]:
        if isinstance(node, list):  # torchtune accepts a list of datasets (ConcatDataset)
            names = [_component_name(n) for n in node]
            return "+".join(n for n in names if n) or None
        return _component_name(node)

    @staticmethod
    def _template_name(cfg: Mapping) -> Optional[str]:
        ds = cfg.get("dataset")
        nodes = ds if isinstance(ds, list) else [ds]
        for node in nodes:
            if isinstance(node, Mapping):
                for key in ("template", "prompt_template", "new_system_prompt"):
                    if node.get(key) is not None:
                        return _component_name(node[key]) or str(node[key])
        tok = cfg.get("tokenizer")
        if isinstance(tok, Mapping) and tok.get("prompt_template") is not None:
            return _component_name(tok["prompt_template"]) or str(tok["prompt_template"])
        return None

    @staticmethod
    def _device_name(device: str) -> Optional[str]:
        if device.startswith("cuda"):
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available():
                return torch.cuda.get_device_name()
            return None
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine() or None

    def log_run_info(self, info: Mapping[str, Any]) -> None:
        """Run facts from a pack recipe (contract keys); they take precedence over inference.

        Args:
            info (Mapping[str, Any]): ``recipe, method, model, dataset, world_size, nodes,
                device, device_name, dtype, pin_memory, num_workers, batch_size,
                gradient_accumulation_steps, data_parallel`` (any subset; extra keys kept).
        """
        if self._active:
            for k, v in info.items():
                if k in self._explicit:
                    continue
                # mappings and lists (e.g. fast_paths) stay JSON structures; scalars via .item()
                self._meta[k] = sanitize(v if isinstance(v, (dict, list, tuple)) else _to_float(v))
            self._meta["run_info_from_recipe"] = True
            if "world_size" in info:
                self._world = int(info["world_size"])
            self._write_meta()
        fwd = getattr(self._wrapped, "log_run_info", None)
        if callable(fwd):
            fwd(info)

    # -------------------------------------------------------------- metrics
    def log(self, name: str, data: Any, step: int) -> None:
        """Forward a single scalar; it is added to the next ``log_dict`` record (no timing of its own)."""
        if self._active and not self._closed:
            self._pending[name] = _to_float(data)
        if self._wrapped is not None:
            self._wrapped.log(name, data, step)

    def log_dict(self, payload: Mapping[str, Any], step: int) -> None:
        """Record one optimizer step (or ``log_every_n_steps`` steps) and forward the payload.

        Args:
            payload (Mapping[str, Any]): the recipe's metrics.
            step (int): global optimizer step.
        """
        rec = self._record(payload, step)
        if self._wrapped is not None:
            if self._forward_measured and rec is not None:
                extra = {k: v for k, v in rec.items() if k not in payload and k not in ("step", "steps_elapsed", "time")}
                self._wrapped.log_dict({**payload, **extra}, step=step)
            else:
                self._wrapped.log_dict(payload, step=step)

    def _record(self, payload: Mapping[str, Any], step: int) -> Optional[Dict[str, Any]]:
        if not self._active or self._closed:
            return None
        now = _now()
        step = int(step)
        prev_step = self._prev_step if self._prev_step is not None else 0
        # A second call for the same step (e.g. extra metrics) is a record of 0 steps: it
        # carries values but no timing, and the next step is still timed from the last step.
        repeat = self._prev_step is not None and step <= prev_step
        if self._prev_step is None:
            # First record: a fresh run logging every k steps covers k steps; a resumed run
            # starts at a large step, so never count more than log_every_n_steps.
            steps_elapsed = max(1, min(step, self._log_every))
        else:
            steps_elapsed = 0 if repeat else step - prev_step
        rec: Dict[str, Any] = {"step": step, "steps_elapsed": steps_elapsed, "time": time.time()}
        if self._pending:
            rec.update(self._pending)
            self._pending = {}
        for k, v in payload.items():
            rec[_BUILTIN_MEMORY_KEYS.get(k, k)] = _to_float(v)
        if repeat:
            rec.pop("iteration_time_s", None)
            rec["iteration_time_s"] = None
            rec["iteration_time_source"] = None
        elif "iteration_time_s" in rec:
            rec["iteration_time_source"] = "recipe"
        elif self._prev_t is not None:
            # Built-in recipes: wall time between consecutive log_dict calls per step elapsed.
            rec["iteration_time_s"] = (now - self._prev_t) / steps_elapsed
            rec["iteration_time_source"] = "collector"
        else:
            rec["iteration_time_s"] = None  # first call: nothing to time against
            rec["iteration_time_source"] = None
        if "tokens_per_second" not in rec and isinstance(rec.get("tokens_per_second_per_gpu"), (int, float)):
            rec["tokens_per_second"] = rec["tokens_per_second_per_gpu"] * self._world
        if not repeat:
            self._measure_memory(rec)
        rec["elapsed_s"] = now - self._t_start
        # CPU seconds of this process (all its threads): per-step differences are the work
        # done, much less sensitive than wall time to other jobs on a shared host.
        rec["process_cpu_s"] = time.process_time()
        if not repeat:
            self._prev_t = now
            self._prev_step = step
        try:
            line = json.dumps(rec, allow_nan=False)
        except ValueError:
            line = json.dumps(sanitize(rec))
        self._steps_f.write(line + "\n")
        self._steps_f.flush()
        return rec

    def _measure_memory(self, rec: Dict[str, Any]) -> None:
        """Fill in the peaks the recipe did not log (built-in recipes), on this rank only.

        The collector's own readings are peaks between two ``log_dict`` calls (counters reset
        after each reading) and since process start (:class:`hlmtune.training.memory.PeakMemory`).
        The first record's interval began when the logger was built, inside the recipe's
        setup, so it carries only the since-start value: "peak over steps" excludes setup.
        """
        r = self._rank
        recipe_ranks = {int(m.group(0).rsplit("_rank", 1)[1]) for m in map(_RANK_KEY.match, rec) if m}
        torch = sys.modules.get("torch")
        first = self._prev_step is None
        if not any(k in rec for k in CUDA_NAMES) and torch is not None and torch.cuda.is_initialized():
            self._own_reading(rec, "cuda", first, reset=self._reset_cuda_peak)
        if not any(k in rec for k in CPU_NAMES) and not any(since_start_name(k) in rec for k in CPU_NAMES):
            self._own_reading(rec, "cpu", first, reset=True)
        for name in (*CUDA_NAMES, *CPU_NAMES):
            for key in (name, since_start_name(name)):
                if key in rec and not any(k.startswith(key + "_rank") for k in rec):
                    rec[f"{key}_rank{r}"] = rec[key]
        # How many ranks the peaks cover: a pack recipe gathers every rank; otherwise (torchtune's
        # built-in recipes build the metric logger on rank 0 only) this rank alone.
        rec["memory_ranks"] = len(recipe_ranks) if recipe_ranks else 1

    def _own_reading(self, rec: Dict[str, Any], kind: str, first: bool, *, reset: bool) -> None:
        tracker = self._trackers.get(kind)
        if tracker is None:
            tracker = self._trackers[kind] = PeakMemory(kind)
        values = tracker.end_step()
        if reset:
            tracker.begin_step()
        for name in tracker.names:
            rec[since_start_name(name)] = values[since_start_name(name)]
            # Without a reset (or before the first one) a reading is not one interval's peak.
            if not first and reset and (kind == "cuda" or tracker.per_step):
                rec[name] = values[name]
        rec[f"memory_source_{kind}"] = "collector"

    # ---------------------------------------------------------------- close
    def summary(self) -> Dict[str, Any]:
        """The run summary so far (same definitions as ``summary.json``).

        Records are re-read from ``steps.jsonl`` rather than kept in memory, so a run of a
        million steps costs no memory in the training process.
        """
        if not self._active:
            return {}
        if self._steps_f is not None and not self._steps_f.closed:
            self._steps_f.flush()
        records, _notes = read_steps(self.log_dir / STEPS_FILE)
        s = summarize_steps(records, warmup_steps=self._warmup, world_size=self._world)
        s["wall_time_s"] = _now() - self._t_start
        return s

    def close(self) -> None:
        """Write ``summary.json`` (complete: true), finalise ``run.json``, close the wrapped logger."""
        if self._active and not self._closed:
            self._closed = True
            if self._steps_f is not None:
                self._steps_f.close()
            s = self.summary()
            s["complete"] = True
            atomic_write_json(self.log_dir / SUMMARY_FILE, s)
            self._meta["status"] = "closed"
            self._meta["closed"] = datetime.now(timezone.utc).isoformat()
            self._write_meta()
        if self._wrapped is not None:
            self._wrapped.close()

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: delegate (e.g. DiskLogger's
        # path_to_log_file). Guard against recursion before __init__ sets _wrapped.
        wrapped = self.__dict__.get("_wrapped")
        if wrapped is None:
            raise AttributeError(name)
        return getattr(wrapped, name)
