"""The shared recipe: everything a pack recipe does that does not depend on the method.

A recipe file subclasses :class:`RecipeBase` (or :class:`SFTRecipe`) and overrides only what
differs: which parameters train (:meth:`RecipeBase.set_trainable`), how the model is prepared
(:meth:`RecipeBase.prepare_model`, e.g. QAT fake quantization), the loss of one micro-batch
(:meth:`RecipeBase.train_step`) and what is exported at epoch end
(:meth:`RecipeBase.export_state_dict`).

Parallelism. ``data_parallel: auto`` shards with FSDP2 on CUDA (the memory of an 8B model
needs it) and replicates with DDP on CPU: CPU ranks share one host's memory, so FSDP's
per-step all-gather of frozen weights would only add traffic. At world size 1 there is no
wrapper at all.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.data import ConcatDataset, Subset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, training, utils
from torchtune.modules import TransformerCrossAttentionLayer, TransformerSelfAttentionLayer
from tqdm import tqdm

from hlmtune.files import atomic_torch_save
from hlmtune.training import checkpoint as ckpt
from hlmtune.training.activation_memory import choose_checkpointed_layers
from hlmtune.training.dist import (
    DistInfo,
    all_gather_floats,
    broadcast_module_params,
    init_distributed,
    rank_zero_value,
    teardown_distributed,
)
from hlmtune.training.options import PackOptions, effective_compile_mode
from hlmtune.training.fastpath import (
    blocked_attention_decision, chunked_cross_entropy, cpu_model_name, gqa_pays, inductor_cache_for_kernels,
    linear_shapes, onednn_linear_decision,
    target_logits_applies, target_positions_only, use_addmm_lora,
    use_blocked_causal_attention, use_complex_rope, use_gqa_attention, use_onednn_linear,
)
from hlmtune.training.errors import RunError, install_exit_hook
from hlmtune.training.rundir import RunDirLock, check_run_dirs
from hlmtune.training.memory import PeakMemory
from hlmtune.training.schema import PROFILER_COMPONENT, config_warnings, resolve_component, validate_config
from hlmtune.training.spec import RecipeSpec

log = utils.get_logger("INFO")


def quiet_known_warnings() -> None:
    """Drop third-party warnings that say nothing about the run.

    torchdata's ``StatefulDataLoader.__init__`` calls ``torch.set_vital``, which torch 2.13
    deprecated: every run printed "'set_vital' is deprecated, please do not call" once per
    rank, about a call the user does not make. Installed when this module is imported.
    """
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


quiet_known_warnings()


class RecipeBase:
    """Data-parallel training loop shared by every pack recipe.

    A recipe class declares ``SPEC`` (a literal :class:`~hlmtune.training.spec.RecipeSpec`:
    its name, method label, mirrored torchtune recipe, added and required keys; the registry,
    validation and the collector read it) and overrides the hooks. ``RECIPE`` and ``METHOD``
    are the spec's name and method.

    Args:
        cfg (DictConfig): the resolved config (overrides applied). It is validated here:
            unknown keys and bad component arguments raise ``ConfigError``.
    """

    SPEC: RecipeSpec
    RECIPE: str = ""
    METHOD: str = ""
    DEFAULT_COLLATE: str = "torchtune.data.padded_collate_sft"
    ROWS_PER_EXAMPLE: int = 1  # rows one example puts through the model (DPO: chosen + rejected)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("SPEC")
        if spec is not None:
            cls.RECIPE, cls.METHOD = spec.name, spec.method

    def __init__(self, cfg: DictConfig) -> None:
        self.options: PackOptions = validate_config(cfg, self.SPEC)
        self._cfg = cfg
        self._dist: DistInfo = init_distributed(cfg.get("device"))
        self._device = self._dist.device
        self._dtype = training.get_dtype(cfg.dtype, device=self._device)
        self._is_rank_zero = self._dist.is_rank_zero
        if self._is_rank_zero:
            for line in config_warnings(cfg, self.SPEC):
                log.warning(line)
        self.world_size = self._dist.world_size
        self.rank = self._dist.rank
        self.seed = training.set_seed(seed=cfg.seed, debug_mode=cfg.get("cudnn_deterministic_mode", None))
        self._output_dir = Path(cfg.output_dir)
        # The output folder is checked on every rank and held by rank 0 for the life of the run
        # (a second run into it is refused); problems there are one line, exit 2 (training/rundir.py).
        install_exit_hook()
        check_run_dirs(cfg)
        self._run_lock: Optional[RunDirLock] = RunDirLock.acquire(self._output_dir) if self._is_rank_zero else None

        # Loop settings.
        self.total_epochs: int = cfg.epochs
        self.max_steps_per_epoch: Optional[int] = cfg.get("max_steps_per_epoch", None)
        self._gradient_accumulation_steps: int = cfg.gradient_accumulation_steps
        self._clip_grad_norm: Optional[float] = cfg.get("clip_grad_norm", None)
        self._log_every_n_steps: int = cfg.get("log_every_n_steps", None) or 1
        self._save_every_n_steps: Optional[int] = self.options.save_every_n_steps
        self._keep_last_n: Optional[int] = self.options.keep_last_n_checkpoints
        self._resume: bool = bool(cfg.get("resume_from_checkpoint", False))
        self._compile: bool = bool(cfg.get("compile", False))
        self._compile_mode: str = self.options.compile_mode  # resolved in setup_model (device, wrapper)
        self._cudagraphs: bool = False  # compiled with CUDA graphs: each step marks a new graph replay
        # CPU, fp32, eager: the linear layers' GEMM library ("onednn" or "mkl"; None elsewhere).
        # Decided at the first model build, by rank 0 (a timing probe at the model's layer
        # shapes, kept per host: fastpath.onednn_linear_decision) and shared: the two sum in
        # different orders, and ranks or reruns that chose apart did not reproduce each other's losses.
        self._cpu_linear: Optional[str] = None
        self._cpu_linear_why: Optional[str] = None  # the probe's reason (run.json)
        # CPU, eager: causal attention in query blocks ("blocked") or one SDPA call ("sdpa"),
        # decided at the first model build by rank 0's probe at the model's shape (run.json).
        self._cpu_attention: Optional[str] = None
        self._cpu_attention_why: Optional[str] = None
        self._fast_paths: Dict[str, str] = {}  # every model-level fast path taken, with why (run.json)
        self._ac_every_n: int = self.options.activation_checkpointing.every_n_layers
        self._enable_offload: bool = bool(cfg.get("enable_activation_offloading", False))
        if self._enable_offload and self._device.type != "cuda":
            raise RuntimeError("enable_activation_offloading=True needs CUDA (it streams activations to host memory)")
        self._data_parallel: str = self._resolve_data_parallel(self.options.data_parallel)
        dl = self.options.data_loader
        self._pin_memory: bool = dl.pin_memory and self._device.type == "cuda"
        self._num_workers: int = dl.num_workers
        self._split: str = dl.split
        self._prefetch_factor: Optional[int] = dl.prefetch_factor
        self._persistent_workers: bool = dl.persistent_workers
        self._log_memory: bool = self.options.log_peak_memory_stats
        # This step's peak (reset at each step start) and the peak since process start.
        self._peak: Optional[PeakMemory] = PeakMemory(self._device) if self._log_memory else None

        # Built in setup().
        self._metric_logger: Any = None
        self._checkpointer: Any = None
        self._tokenizer: Any = None
        self._model: Optional[torch.nn.Module] = None  # what forward() is called on (maybe wrapped)
        self._inner_model: Optional[torch.nn.Module] = None  # unwrapped (DDP's .module), for hooks
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._lr_scheduler: Any = None
        self._loss_fn: Any = None
        self._dataloader: Optional[StatefulDataLoader] = None
        self._sampler: Optional[StatefulDistributedSampler] = None
        self._profiler: Any = None
        self._activations_ctx: Any = contextlib.nullcontext()

        # Training progress (restored on resume).
        self.epochs_run: int = 0
        self.global_step: int = 0
        self._step_in_epoch: int = 0
        self._steps_per_epoch: int = 0

    # ------------------------------------------------------------------ setup
    def setup(self, cfg: DictConfig) -> None:
        """Build logger, model, tokenizer, loss, optimizer, data, scheduler; resume if asked.

        Args:
            cfg (DictConfig): the same config as ``__init__``.
        """
        if self._is_rank_zero:
            self._metric_logger = config.instantiate(cfg.metric_logger)
            self._metric_logger.log_config(cfg)
            self._save_config_as_run(cfg)
            if hasattr(self._metric_logger, "log_run_info"):
                self._metric_logger.log_run_info(self.run_info(cfg))
        base_sd = self.load_base_checkpoint(cfg)
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._model = self.setup_model(cfg, base_sd)
        del base_sd
        if self._is_rank_zero and hasattr(self._metric_logger, "log_run_info"):
            info: Dict[str, Any] = {"fast_paths": dict(self._fast_paths)}
            if self._cpu_attention:
                info.update(cpu_attention=self._cpu_attention, cpu_attention_why=self._cpu_attention_why)
            if self._cpu_linear:
                info.update(cpu_linear=self._cpu_linear, cpu_linear_why=self._cpu_linear_why)
            self._metric_logger.log_run_info(info)
        self._loss_fn = config.instantiate(cfg.loss)
        if self._compile:
            training.compile_loss(self._loss_fn, verbose=self._is_rank_zero)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._inner_model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        self._optimizer = config.instantiate(cfg.optimizer, [p for p in self._model.parameters() if p.requires_grad])
        self._dataloader = self.setup_data(cfg)
        per_epoch = len(self._dataloader) // self._gradient_accumulation_steps
        if self.max_steps_per_epoch is not None:
            if self.max_steps_per_epoch > per_epoch and self._is_rank_zero:
                # The epoch ends first: say so, rather than run fewer steps than asked without a word.
                log.warning(
                    f"max_steps_per_epoch {self.max_steps_per_epoch} > the {per_epoch} optimizer steps of an "
                    f"epoch: each epoch stops at {per_epoch}; raise epochs for more steps"
                )
            per_epoch = min(per_epoch, self.max_steps_per_epoch)
        if per_epoch == 0:
            raise ValueError(
                f"no optimizer step fits in an epoch: {len(self._dataloader)} batches per rank "
                f"(dataset / world_size {self.world_size} / batch_size {cfg.batch_size}) < "
                f"gradient_accumulation_steps {self._gradient_accumulation_steps}"
            )
        self._steps_per_epoch = per_epoch
        if cfg.get("lr_scheduler", None) is not None:
            self._lr_scheduler = config.instantiate(
                cfg.lr_scheduler, self._optimizer, num_training_steps=self.total_epochs * per_epoch
            )
        if self._resume:
            self._restore()
        self._profiler = self._setup_profiler(cfg.get("profiler", None))

    def _save_config_as_run(self, cfg: DictConfig) -> None:
        """``<output_dir>/torchtune_config.yaml``: the resolved config, whatever the metric logger.

        torchtune's DiskLogger writes the same file; other loggers (the collector alone, WandB)
        do not, and ``hlmtune eval <run dir>`` and sweeps read the config a run ran with.
        """
        from hlmtune.files import atomic_write_text

        path = self._output_dir / "torchtune_config.yaml"
        self._output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))

    def run_info(self, cfg: DictConfig) -> Dict[str, Any]:
        """Run metadata for the collector (``log_run_info``), see docs/ARCHITECTURE.md."""
        dataset = cfg.dataset
        if isinstance(dataset, ListConfig):
            ds_name = "+".join(str(d.get("_component_", "")).rsplit(".", 1)[-1] for d in dataset)
        else:
            ds_name = str(dataset.get("_component_", "")).rsplit(".", 1)[-1]
        return {
            "recipe": self.RECIPE,
            "method": self.method_name(cfg),
            "model": str(cfg.model.get("_component_", "")).rsplit(".", 1)[-1],
            "dataset": ds_name,
            "world_size": self.world_size,
            "nodes": self._dist.nodes,
            "device": self._device.type,
            "device_name": torch.cuda.get_device_name(self._device) if self._device.type == "cuda" else cpu_model_name(),
            "dtype": cfg.dtype,
            "pin_memory": self._pin_memory,
            "num_workers": self._num_workers,
            "batch_size": cfg.batch_size,
            "gradient_accumulation_steps": self._gradient_accumulation_steps,
            "data_parallel": self._data_parallel,
            "host": socket.gethostname(),
        }

    def method_name(self, cfg: DictConfig) -> str:
        """Method label for metrics (``lora``, ``qlora`` ...); subclasses refine it."""
        return self.METHOD

    def _compile_layers(self, model: torch.nn.Module, data_parallel: str) -> None:
        """torchtune's per-layer compile, in the config's ``compile_mode``.

        Inductor's cache gets a folder of this process's ATen kernels first, which the loss, compiled
        after the model, uses too (a cache filled under other kernels gave wrong code:
        :func:`~hlmtune.training.fastpath.inductor_cache_for_kernels`).
        """
        inductor_cache_for_kernels()
        mode, why = effective_compile_mode(self._compile_mode, self._device.type, data_parallel)
        if why and self._is_rank_zero:
            log.warning(why)
        if mode == "default":
            training.compile_model(model, verbose=self._is_rank_zero)  # torchtune's own, unchanged
            return
        backend = os.environ.get("TORCH_COMPILE_BACKEND", "inductor")
        for m in reversed(list(model.modules())):  # as training.compile_model, with the mode
            if isinstance(m, (TransformerSelfAttentionLayer, TransformerCrossAttentionLayer)):
                m.compile(backend=backend, mode=mode)
        self._cudagraphs = mode in ("reduce-overhead", "max-autotune")

    def _resolve_data_parallel(self, mode: str) -> str:
        if self.world_size == 1:
            return "none"
        if mode == "auto":
            return "fsdp" if self._device.type == "cuda" else "ddp"
        return mode

    # ------------------------------------------------------------------ model
    def load_base_checkpoint(self, cfg: DictConfig) -> Optional[Dict[str, Any]]:
        """Load the starting weights through the config's torchtune checkpointer.

        Returns:
            Optional[Dict[str, Any]]: the model state dict, or None (random initialisation)
            when the config has no ``checkpointer``.
        """
        if cfg.get("checkpointer", None) is None:
            return None
        # Resumable state is the pack's own (see training/checkpoint.py): the torchtune
        # checkpointer only reads base weights and writes the per-epoch model export.
        ck_cfg = OmegaConf.merge(cfg.checkpointer, {"resume_from_checkpoint": False}) if "resume_from_checkpoint" in cfg.checkpointer else cfg.checkpointer
        self._checkpointer = config.instantiate(ck_cfg)
        return self._checkpointer.load_checkpoint()[training.MODEL_KEY]

    def set_trainable(self, model: torch.nn.Module) -> None:
        """Choose trainable parameters (default: all). LoRA recipes train adapters only."""
        for p in model.parameters():
            p.requires_grad_(True)

    def prepare_model(self, model: torch.nn.Module, cfg: DictConfig) -> torch.nn.Module:
        """Transform the freshly built model before sharding (e.g. QAT fake quantization)."""
        return model

    def init_buffers(self, model: torch.nn.Module) -> None:
        """Compute the buffers no checkpoint holds (RoPE caches), on the current default device."""
        for m in model.modules():
            if hasattr(m, "rope_init"):
                m.rope_init()

    def extra_init_state_dict(self, model: torch.nn.Module) -> Dict[str, torch.Tensor]:
        """Full-size initial values for parameters the base checkpoint lacks (LoRA adapters).

        Loaded together with the checkpoint, so FSDP shards and unsharded replicas start from
        the same numbers whatever the world size. Default: none.
        """
        return {}

    def check_loaded_keys(self, missing: List[str], unexpected: List[str]) -> None:
        """Fail on a checkpoint that does not match the model (full fine-tuning: exact match)."""
        if missing or unexpected:
            raise RuntimeError(f"checkpoint does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")

    def setup_model(self, cfg: DictConfig, base_sd: Optional[Dict[str, Any]]) -> torch.nn.Module:
        """Build the trained model (see :meth:`build_model`) and remember its unwrapped module.

        Returns:
            torch.nn.Module: the model to call in the training loop.
        """
        model, inner = self.build_model(cfg, base_sd, frozen=False, data_parallel=self._data_parallel)
        self._inner_model = inner
        self._activations_ctx = training.get_act_offloading_ctx_manager(inner, self._enable_offload)
        return model

    def build_model(
        self, cfg: DictConfig, base_sd: Optional[Dict[str, Any]], *, frozen: bool, data_parallel: str
    ) -> Tuple[torch.nn.Module, torch.nn.Module]:
        """Build, prepare, load and wrap a model for data parallelism.

        FSDP2: built on the meta device, sharded, then the full state dict is scattered into
        the shards (no rank ever holds a full replica). DDP / single rank: built on the device,
        loaded, wrapped (DDP only when something trains).

        Args:
            cfg (DictConfig): config.
            base_sd (Optional[Dict[str, Any]]): starting weights, None for random init.
            frozen (bool): no parameter trains (DPO reference models).
            data_parallel (str): ``fsdp``, ``ddp`` or ``none``.

        Returns:
            Tuple[torch.nn.Module, torch.nn.Module]: (model to call, unwrapped model).
        """
        t0 = time.perf_counter()
        fsdp = data_parallel == "fsdp"
        model = self._instantiate_model(cfg, meta=fsdp and base_sd is not None)
        model = self.prepare_model(model, cfg)
        if frozen:
            model.requires_grad_(False)
        else:
            self.set_trainable(model)
        self._use_fast_paths(model)  # after the trainable set: the GEMM probe times what trains
        # Chosen before compiling: auto measures layer 0 eagerly.
        ac_layers = [] if frozen else self.checkpointed_layers(cfg, model, fsdp)
        if self._compile:
            self._compile_layers(model, data_parallel)
        apply_activation_checkpointing(model, ac_layers)
        if fsdp:
            self._shard_and_load(model, cfg, base_sd)
        else:
            if base_sd is not None:
                missing, unexpected = model.load_state_dict({**base_sd, **self.extra_init_state_dict(model)}, strict=False)
                self.check_loaded_keys(list(missing), list(unexpected))
            with self._device:
                self.init_buffers(model)
        training.validate_no_params_on_meta_device(model)
        inner = model
        if data_parallel == "ddp" and not frozen:
            from torch.nn.parallel import DistributedDataParallel as DDP

            broadcast_module_params(model, only_trainable=True)
            model = DDP(
                model,
                device_ids=[self._device] if self._device.type == "cuda" else None,
                init_sync=False,  # trainable params broadcast above; frozen base is identical by loading
                find_unused_parameters=False,
            )
        if self._is_rank_zero:
            n_train = sum(p.numel() for p in inner.parameters() if p.requires_grad)
            n_all = sum(p.numel() for p in inner.parameters())
            log.info(
                "model ready in %.1fs: %s params, %s trainable, data_parallel=%s, world_size=%d",
                time.perf_counter() - t0, f"{n_all:,}", f"{n_train:,}", data_parallel, self.world_size,
            )
        dist.barrier()
        return model, inner

    def _instantiate_model(self, cfg: DictConfig, *, meta: bool) -> torch.nn.Module:
        """``cfg.model`` built on the meta device (FSDP2 loading a checkpoint) or the run's device."""
        init_device = torch.device("meta") if meta else self._device
        # torchtune seeds each rank with seed + rank; build the model from the config seed so
        # every rank starts from the same initialisation (random init, LoRA adapters).
        with torch.random.fork_rng(devices=[self._device] if self._device.type == "cuda" else []):
            torch.manual_seed(cfg.seed)
            if self._device.type == "cuda":
                torch.cuda.manual_seed(cfg.seed)
            with training.set_default_dtype(self._dtype), init_device:
                return config.instantiate(cfg.model)

    def _use_fast_paths(self, model: torch.nn.Module) -> None:
        """Same math, less work (``hlmtune/training/fastpath.py``), each where it pays."""
        # The unconditional ones do less work on every host (fewer passes or no copies; cleared
        # at 1 and 2 threads by torch.profiler, docs/benchmarks.md); the probed ones say why.
        taken = self._fast_paths
        if gqa_pays(self._device, self._dtype) and use_gqa_attention(model):  # no K/V head copies
            taken["gqa_attention"] = f"SDPA reads grouped K/V heads on {self._device.type} {self._dtype}"
        if use_addmm_lora(model):  # LoRA's scale and sum inside one GEMM
            taken["addmm_lora"] = "one in-place GEMM per adapter instead of a multiply and an add"
        if not self._compile:
            if use_complex_rope(model):  # RoPE as one complex multiply
                taken["complex_rope"] = "one complex multiply instead of stacked halves (eager)"
            if self._device.type == "cpu" and self._blocked_attention(model):
                use_blocked_causal_attention(model)  # CPU flash attention: skip the hidden half
                taken["blocked_attention"] = str(self._cpu_attention_why)
            if self._device.type == "cpu" and self._linear_library(model) == "onednn":
                use_onednn_linear(model)  # oneDNN's fp32 GEMM where MKL's is the slower
                taken["onednn_linear"] = str(self._cpu_linear_why)

    def _linear_library(self, model: torch.nn.Module) -> Optional[str]:
        """Rank 0's GEMM-library probe at the model's layer shapes (fp32), decided once per run, shared."""
        if self._cpu_linear is None and self._dtype == torch.float32:
            pays, self._cpu_linear_why = rank_zero_value(onednn_linear_decision(linear_shapes(model))
                                                         if self._is_rank_zero else None)
            self._cpu_linear = "onednn" if pays else "mkl"
        return self._cpu_linear

    def _blocked_attention(self, model: torch.nn.Module) -> bool:
        """Rank 0's probe of query-block attention at the model's shape, decided once per run, shared."""
        if self._cpu_attention is None:
            from torchtune.modules import MultiHeadAttention

            attn = next((m for m in model.modules() if isinstance(m, MultiHeadAttention)), None)
            if attn is None:
                taken, why = False, "no torchtune attention module"
            else:
                seq = int(getattr(model, "max_seq_len", None) or 512)
                taken, why = rank_zero_value(blocked_attention_decision(attn.num_heads, attn.num_kv_heads, attn.head_dim, seq)
                                             if self._is_rank_zero else None)
            self._cpu_attention, self._cpu_attention_why = ("blocked" if taken else "sdpa"), why
        return self._cpu_attention == "blocked"

    def _shard_and_load(self, model: torch.nn.Module, cfg: DictConfig, base_sd: Optional[Dict[str, Any]]) -> None:
        """FSDP2: shard the (meta-built) model, then scatter the full state dict into the shards."""
        training.shard_model(
            model=model,
            shard_conditions=[partial(training.get_shard_conditions, names_to_match=cfg.get("custom_sharded_layers", None))],
            cpu_offload=cfg.get("fsdp_cpu_offload", False),
            reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
        )
        if base_sd is None:
            return
        with training.set_default_dtype(self._dtype), self._device:
            for m in model.modules():  # adapters are not in the base checkpoint
                if hasattr(m, "initialize_parameters") and any(p.is_meta for p in m.parameters(recurse=False)):
                    m.to_empty(device=self._device)
                    m.initialize_parameters()
            self.init_buffers(model)  # the meta-built model's RoPE caches
        full_sd = {**base_sd, **self.extra_init_state_dict(model)}
        missing, unexpected = training.load_from_full_model_state_dict(
            model, full_sd, self._device, strict=False, cpu_offload=cfg.get("fsdp_cpu_offload", False)
        )
        self.check_loaded_keys(list(missing), list(unexpected))

    def checkpointed_layers(self, cfg: DictConfig, model: torch.nn.Module, fsdp: bool) -> List[int]:
        """Layers to checkpoint: from the config, or measured (``enable_activation_checkpointing: auto``).

        Args:
            cfg (DictConfig): config (``batch_size``, ``tokenizer.max_seq_len``).
            model (torch.nn.Module): the built model, trainable parameters chosen, not yet wrapped.
            fsdp (bool): parameters and optimizer state sharded over the ranks.

        Returns:
            List[int]: 0-based layer indices.
        """
        ac = self.options.activation_checkpointing
        if not ac.auto:
            return ac.layers(len(model.layers)) if self._ac_every_n else []
        tok = cfg.get("tokenizer", None)
        max_seq_len = (tok.get("max_seq_len", None) if tok is not None else None) or getattr(model, "max_seq_len", None)
        if not max_seq_len:
            raise ValueError("enable_activation_checkpointing: auto needs tokenizer.max_seq_len (or a model with max_seq_len)")
        return choose_checkpointed_layers(
            model, rows=cfg.batch_size * self.ROWS_PER_EXAMPLE, max_seq_len=int(max_seq_len), dtype=self._dtype,
            device=self._device, budget_gib=ac.budget_gib, shards=self.world_size if fsdp else 1,
            log_fn=log.info if self._is_rank_zero else (lambda _msg: None),
        )

    # ------------------------------------------------------------------ data
    def setup_data(self, cfg: DictConfig) -> StatefulDataLoader:
        """Dataset, per-rank split, sampler and loader.

        ``data_loader.split``: ``distributed`` (default) interleaves samples over ranks with a
        shuffled ``DistributedSampler``; ``contiguous`` gives rank r the r-th block of the
        dataset (shuffled within the block), which keeps memory-mapped shards local per rank.

        Returns:
            StatefulDataLoader: resumable mid-epoch.
        """
        try:
            if isinstance(cfg.dataset, ListConfig):
                ds = ConcatDataset([config.instantiate(c, self._tokenizer) for c in cfg.dataset])
                packed = any(c.get("packed", False) for c in cfg.dataset)
            else:
                ds = config.instantiate(cfg.dataset, self._tokenizer)
                packed = cfg.dataset.get("packed", False)
        except (ValueError, FileNotFoundError) as e:
            # The builders' ValueErrors name the file, row or key the user fixes (a bad JSONL row,
            # token shards without the split's records, old shards): one line, not a chained
            # traceback per rank. `hlmtune run --debug` (HLM_DEBUG=1) keeps the traceback.
            if os.environ.get("HLM_DEBUG") == "1":
                raise
            raise RunError(f"dataset: {e}") from None
        if self._split == "contiguous":
            block = len(ds) // self.world_size  # equal blocks so every rank steps the same number of times
            ds = Subset(ds, range(self.rank * block, (self.rank + 1) * block))
            sampler = StatefulDistributedSampler(ds, num_replicas=1, rank=0, shuffle=cfg.shuffle, seed=self.seed)
        else:
            sampler = StatefulDistributedSampler(
                ds, num_replicas=self.world_size, rank=self.rank, shuffle=cfg.shuffle, seed=self.seed
            )
        self._sampler = sampler
        collate_name = cfg.get("collate_fn", self.DEFAULT_COLLATE)
        if packed:
            from torchtune.data import padded_collate_packed

            collate = padded_collate_packed
        else:
            fn = resolve_component(collate_name)
            import inspect

            params = inspect.signature(fn).parameters
            kwargs = {}
            if "padding_idx" in params:
                kwargs["padding_idx"] = self._tokenizer.pad_id
            if "ignore_idx" in params:
                kwargs["ignore_idx"] = self._loss_fn.ignore_index if hasattr(self._loss_fn, "ignore_index") else -100
            collate = partial(fn, **kwargs)
        extra: Dict[str, Any] = {}
        if self._num_workers > 0:
            extra["persistent_workers"] = self._persistent_workers
            if self._prefetch_factor is not None:
                extra["prefetch_factor"] = self._prefetch_factor
        return StatefulDataLoader(
            dataset=ds,
            batch_size=cfg.batch_size,
            sampler=sampler,
            collate_fn=collate,
            drop_last=True,  # equal step counts on every rank; avoids ragged last batches
            num_workers=self._num_workers,
            pin_memory=self._pin_memory,
            **extra,
        )

    # ------------------------------------------------------------------ step
    def mark(self, name: str) -> contextlib.AbstractContextManager:
        """A named range: NVTX on CUDA (Nsight Systems), ``record_function`` for torch.profiler."""
        return _Range(name, self._device.type == "cuda")

    def train_step(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Forward and backward of one micro-batch (no optimizer step).

        Returns:
            Dict[str, torch.Tensor]: at least ``loss_sum`` (detached, summed so that
            ``loss_sum / num_tokens`` summed over ranks is the logged loss) and ``num_tokens``;
            other entries are averaged over micro-batches and ranks and logged as is.
        """
        raise NotImplementedError

    def finish_gradients(self, num_tokens_global: float) -> None:
        """Normalise accumulated gradients before the optimizer step (default: nothing)."""

    def optimizer_step(self) -> Optional[float]:
        """Clip, step, zero, schedule. Returns the gradient norm when clipping."""
        grad_norm = None
        with self.mark("optimizer_step"):
            if self._clip_grad_norm is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    [p for p in self._model.parameters() if p.requires_grad], max_norm=float(self._clip_grad_norm)
                )
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
                grad_norm = float(grad_norm)
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
            if self._lr_scheduler is not None:
                self._lr_scheduler.step()
        return grad_norm

    def on_step_start(self) -> None:
        """Hook before each optimizer step (QAT uses it to switch fake quantization on)."""

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        """The training loop: epochs of optimizer steps of accumulated micro-batches."""
        # torchtune's cleanup_before_training calls torch.cpu.empty_cache, which CPU torch lacks.
        gc.collect()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        self._optimizer.zero_grad(set_to_none=True)
        self._profiler.start()
        try:
            for epoch in range(self.epochs_run, self.total_epochs):
                self._sampler.set_epoch(epoch)
                pbar = tqdm(
                    total=self._steps_per_epoch, initial=self._step_in_epoch, disable=not self._is_rank_zero,
                    desc=f"epoch {epoch + 1}/{self.total_epochs}", dynamic_ncols=True, file=sys.stderr,
                )
                data_iter = iter(self._dataloader)
                while self._step_in_epoch < self._steps_per_epoch:
                    metrics = self._one_optimizer_step(data_iter)
                    self._step_in_epoch += 1
                    self.global_step += 1
                    self._log(metrics, pbar)
                    self._profiler.step()
                    if self._save_every_n_steps and self.global_step % self._save_every_n_steps == 0 \
                            and self._step_in_epoch < self._steps_per_epoch:
                        self.save_state(epoch_done=False)
                pbar.close()
                self.epochs_run = epoch + 1
                self._step_in_epoch = 0
                self.end_of_epoch(epoch)
        finally:
            self._profiler.stop()

    def _one_optimizer_step(self, data_iter: Iterator) -> Dict[str, float]:
        self.on_step_start()
        if self._peak is not None:
            self._peak.begin_step()
        t0 = time.perf_counter()
        data_time = 0.0
        loss_sum = torch.zeros((), device=self._device, dtype=torch.float64)
        tokens = torch.zeros((), device=self._device, dtype=torch.float64)
        extras: Dict[str, torch.Tensor] = {}
        for micro in range(self._gradient_accumulation_steps):
            td = time.perf_counter()
            with self.mark("data"):
                batch = _to_device(next(data_iter), self._device, self._pin_memory)
            data_time += time.perf_counter() - td
            # DDP: only the last micro-batch all-reduces gradients.
            sync = contextlib.nullcontext()
            if self._data_parallel == "ddp" and micro < self._gradient_accumulation_steps - 1:
                sync = self._model.no_sync()
            if self._cudagraphs:  # outputs of the previous replay may be overwritten from here on
                torch.compiler.cudagraph_mark_step_begin()
            with sync:
                out = self.train_step(batch)
            loss_sum += out["loss_sum"].to(torch.float64)
            tokens += out["num_tokens"].to(torch.float64)
            for k, v in out.items():
                if k not in ("loss_sum", "num_tokens"):
                    extras[k] = extras.get(k, 0.0) + v.detach().to(torch.float64) / self._gradient_accumulation_steps
        # One collective: loss and token totals over ranks (also needed to normalise grads).
        keys = sorted(extras)
        local = torch.stack([loss_sum, tokens] + [extras[k] for k in keys])  # (2 + E,)
        dist.all_reduce(local)
        total_loss, total_tokens = float(local[0]), float(local[1])
        self.finish_gradients(total_tokens)
        grad_norm = self.optimizer_step()
        # Peak memory of this step and since start, per rank (one small all_gather); off with
        # log_peak_memory_stats: False. Names: hlmtune.training.memory.
        peaks = self._peak.end_step() if self._peak is not None else {}
        names = list(peaks)
        mem = [peaks[n] for n in names]
        per_rank = all_gather_floats(mem, self._device) if mem else []
        iter_time = time.perf_counter() - t0
        m: Dict[str, float] = {
            "loss": self.logged_loss(total_loss, total_tokens),
            "lr": training.get_lr(self._optimizer),
            "tokens": total_tokens,
            "tokens_per_second": total_tokens / iter_time,
            "tokens_per_second_per_gpu": total_tokens / iter_time / self.world_size,
            "iteration_time_s": iter_time,
            "data_time_s": data_time,
            "epoch": self.epochs_run,
        }
        for i, k in enumerate(keys):
            m[k] = float(local[2 + i]) / self.world_size
        if grad_norm is not None:
            m["grad_norm"] = grad_norm
        for j, name in enumerate(names if per_rank else []):
            vals = [r[j] for r in per_rank]
            m[name] = max(vals)
            for r, v in enumerate(vals):
                m[f"{name}_rank{r}"] = v
        return m

    def logged_loss(self, total_loss: float, total_tokens: float) -> float:
        """Loss to log from the rank-summed ``loss_sum`` and ``num_tokens`` (token-weighted mean)."""
        return total_loss / max(total_tokens, 1.0)

    def _log(self, metrics: Dict[str, float], pbar: tqdm) -> None:
        if not self._is_rank_zero:
            return
        self._metric_logger.log_dict(metrics, step=self.global_step)
        pbar.update(1)
        if self.global_step % self._log_every_n_steps == 0:
            pbar.set_postfix(loss=f"{metrics['loss']:.4f}", s_it=f"{metrics['iteration_time_s']:.3f}")

    # ------------------------------------------------------------------ checkpoints
    def end_of_epoch(self, epoch: int) -> None:
        """Export the model for this epoch; keep resumable state unless training is done."""
        if self.epochs_run < self.total_epochs:
            self.save_state(epoch_done=True)
        self.export_model(epoch)

    def save_state(self, *, epoch_done: bool) -> Path:
        """Write a resumable checkpoint at the current step (collective)."""
        with self.mark("checkpoint"):
            return ckpt.save_training_state(
                output_dir=self._output_dir,
                model=self._model,
                optimizer=self._optimizer,
                lr_scheduler=self._lr_scheduler,
                dataloader=self._dataloader,
                recipe_state={
                    "global_step": self.global_step,
                    "epochs_run": self.epochs_run,
                    "step_in_epoch": self._step_in_epoch,
                    "seed": self.seed,
                    "total_epochs": self.total_epochs,
                    "max_steps_per_epoch": self.max_steps_per_epoch,
                    "recipe": self.RECIPE,
                },
                keep_last=self._keep_last_n,
            )

    def _restore(self) -> None:
        found = ckpt.latest_checkpoint(self._output_dir)
        if found is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True but {ckpt.checkpoint_root(self._output_dir)} holds no complete "
                "checkpoint (step_<N>/state.json); run without it to start fresh"
            )
        state = ckpt.load_training_state(
            found, model=self._model, optimizer=self._optimizer, lr_scheduler=self._lr_scheduler, dataloader=self._dataloader
        )
        if state.get("recipe") not in (None, self.RECIPE):
            raise RuntimeError(f"checkpoint {found} was written by {state['recipe']}, not {self.RECIPE}")
        self.global_step = int(state["global_step"])
        self.epochs_run = int(state["epochs_run"])
        self._step_in_epoch = int(state["step_in_epoch"])
        if self._is_rank_zero:
            log.info("resumed from %s (epoch %d, step %d)", found, self.epochs_run, self.global_step)

    def export_state_dict(self) -> Optional[Dict[str, Any]]:
        """Full CPU state dict to export (rank 0; None elsewhere). Subclasses add adapters."""
        sd = training.gather_cpu_state_dict(self._inner_model, self._is_rank_zero, device=self._device)
        return {training.MODEL_KEY: sd} if self._is_rank_zero else None

    def export_model(self, epoch: int) -> None:
        """Write the epoch's model with the torchtune checkpointer (HF layout), or ``model.pt``."""
        self._write_export(self.export_state_dict(), epoch)
        dist.barrier()

    def _write_export(self, payload: Optional[Dict[str, Any]], epoch: int) -> None:
        if not self._is_rank_zero:
            return
        with self.mark("checkpoint"):
            if self._checkpointer is not None:
                self._checkpointer.save_checkpoint(
                    payload, epoch=epoch, intermediate_checkpoint=False,
                    adapter_only=bool(self._cfg.get("save_adapter_weights_only", False)),
                )
            else:
                out = self._output_dir / f"epoch_{epoch}"
                out.mkdir(parents=True, exist_ok=True)
                atomic_torch_save(payload[training.MODEL_KEY], out / "model.pt")

    # ------------------------------------------------------------------ teardown
    def _setup_profiler(self, cfg_profiler: Optional[DictConfig]) -> Any:
        if cfg_profiler is None or not cfg_profiler.get("enabled", False):
            return training.DummyProfiler()
        cfg_profiler = OmegaConf.merge({"_component_": PROFILER_COMPONENT}, cfg_profiler)
        profiler, _ = config.instantiate(cfg_profiler)
        return profiler

    def cleanup(self) -> None:
        """Close the metric logger and the process group; release the output folder."""
        if self._metric_logger is not None:
            self._metric_logger.close()
        teardown_distributed()
        if self._run_lock is not None:
            self._run_lock.release()


class SFTRecipe(RecipeBase):
    """Next-token cross-entropy on ``tokens``/``labels`` batches, token-weighted over ranks."""

    _target_logits: Optional[bool] = None  # logits only where labels are (fastpath.py); decided at step 1

    def train_step(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Forward/backward of one SFT micro-batch.

        The loss is scaled by this micro-batch's token count so that, after
        :meth:`finish_gradients` divides by the global count, the gradient is that of the
        mean over every target token of the step, whatever the split over ranks and
        micro-batches.
        """
        labels = batch.pop("labels")  # (B, T)
        # Shift: position t predicts token t+1; the last position predicts nothing.
        ignore = torch.full_like(labels[:, :1], self._loss_fn.ignore_index)
        labels = torch.cat([labels[:, 1:], ignore], dim=1)  # (B, T)
        if self._target_logits is None:
            self._target_logits = target_logits_applies(self._inner_model, self._loss_fn)
        with self.mark("forward"), self._activations_ctx:
            keep = labels != self._loss_fn.ignore_index  # (B, T)
            num_tokens = keep.sum()
            if self._target_logits:  # same loss, no logits for positions without a label
                with target_positions_only(self._inner_model, keep, chunked=True):
                    logits = self._model(**batch)  # (N, V) or its row chunks, N = num_tokens
                loss = chunked_cross_entropy(logits, labels[keep])
            else:
                logits = self._model(**batch)  # (B, T, V) or list of chunks
                loss = self._loss_fn(logits, labels) * num_tokens
        del logits
        with self.mark("backward"):
            loss.backward()
        return {"loss_sum": loss.detach(), "num_tokens": num_tokens.detach()}

    def finish_gradients(self, num_tokens_global: float) -> None:
        # DDP and FSDP average gradients over ranks; undo that and divide by the global token
        # count: grad = sum_ranks sum_tokens dL / N_tokens.
        if num_tokens_global > 0:
            training.scale_grads(self._model, torch.tensor(self.world_size / num_tokens_global, device=self._device))


def apply_activation_checkpointing(model: torch.nn.Module, layer_ids: List[int]) -> None:
    """Checkpoint the given transformer layers (activations recomputed in backward).

    Each chosen ``model.layers[i]`` is wrapped with torchtune's ``checkpoint_wrapper`` in
    ``full`` mode (non-reentrant), as torchtune 0.6.1's ``ac_mode`` does. The choice of
    layers is made by ``ActivationCheckpointing.layers`` from the layer index, not from
    torchtune's process-wide wrap counter (which carries over between models).

    Args:
        model (torch.nn.Module): a ``TransformerDecoder`` (has ``layers``).
        layer_ids (List[int]): 0-based layer indices.
    """
    from torchtune.training.activations import checkpoint_wrapper

    if not hasattr(model, "layers"):
        raise ValueError(f"activation checkpointing needs a model with .layers, got {type(model).__name__}")
    for i in layer_ids:  # (an empty list: nothing to do)
        model.layers[i] = checkpoint_wrapper(model.layers[i], "full", None)


class _Range(contextlib.ContextDecorator):
    """``record_function`` + NVTX range, cheap when no profiler is attached."""

    def __init__(self, name: str, nvtx: bool) -> None:
        self._name = name
        self._nvtx = nvtx
        self._rf = None

    def __enter__(self) -> "_Range":
        if self._nvtx:
            torch.cuda.nvtx.range_push(self._name)
        self._rf = torch.profiler.record_function(self._name)
        self._rf.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._rf.__exit__(*exc)
        if self._nvtx:
            torch.cuda.nvtx.range_pop()


def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """Move a collated batch (dict, tuple or list of tensors) to the device."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: _to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device, non_blocking) for v in batch)
    return batch
