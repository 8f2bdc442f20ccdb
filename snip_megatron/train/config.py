"""TrainConfig: everything the compact training loop needs, checked once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from snip_megatron.data.prepare import DataConfig
from snip_megatron.formats.precision import Precision
from snip_megatron.formats.spec import FP4_RECIPES, FP8_RECIPES
from snip_megatron.shapes import ModelShape, get_shape

LR_DECAY_STYLES = ("cosine", "linear", "constant")
PARAM_DTYPES = ("fp32", "bf16")
BACKENDS = ("emulated", "local", "te")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run: model, data, optimizer, schedule, parallelism, logging and checkpoints."""

    model: str | ModelShape = "llama_tiny"
    """Preset name (snip_megatron.shapes) or a ModelShape. Its vocab_size is replaced by the tokenizer's."""
    data: DataConfig | None = None
    """Corpus and tokenizer; None means the stdlib corpus with a tokenizer of the model's vocab size."""
    split: str = "95,5,0"
    """Megatron's train,valid,test split of the corpus, by document."""
    steps: int = 100
    """Optimizer steps to run in total (a resumed run continues up to this)."""
    seq_length: int | None = None
    """Tokens per sample; None uses the model's seq_length, longer than it is an error."""
    micro_batch_size: int = 4
    """Samples per micro-batch per data-parallel rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all DP ranks; None = micro_batch_size x DP (one micro-batch)."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the decay."""
    warmup_steps: int | None = None
    """Linear warm-up steps; None = 10% of `steps`."""
    lr_decay_style: str = "cosine"
    """Decay after warm-up: cosine, linear or constant."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    distributed_optimizer: bool = False
    """Shard optimizer state over DP (Megatron's distributed optimizer)."""
    params_dtype: str = "fp32"
    """Parameter dtype: fp32 or bf16 (fp32 master weights either way)."""
    backend: str = "emulated"
    """Planned linears: "emulated" (SNIP's emulated layers, any plan), "local" (plain Megatron), "te"."""
    precision: str = "bf16"
    """Initial uniform precision of every planned linear (bf16, fp8 or fp4)."""
    fp8_recipe: str = "blockwise"
    """The FP8 format of the emulated linears (formats.FP8_RECIPES); SNIP's must be the same."""
    fp4_recipe: str = "nvfp4"
    """The FP4 format of the emulated linears (formats.FP4_RECIPES); SNIP's must be the same."""
    seed: int = 1234
    """Seed for weights, data order and RNG streams."""
    eval_interval: int | None = 50
    """Validate every this many steps (and after the last step); None disables."""
    eval_batches: int = 8
    """Micro-batches of held-out data per validation (the same ones every time)."""
    log_interval: int = 1
    """Write a metrics line every this many steps."""
    metrics_path: str | None = None
    """JSONL file for metrics (one object per logged step); None disables."""
    save_dir: str | None = None
    """Checkpoint folder; None disables saving."""
    save_interval: int | None = None
    """Save every this many steps (and after the last step when save_dir is set)."""
    load_dir: str | None = None
    """Resume from the latest checkpoint in this folder (it must hold one)."""
    load_step: int | None = None
    """Resume from this step instead of the latest."""
    progress: bool = True
    """Show a progress bar with loss and tokens/s."""

    def __post_init__(self) -> None:
        shape = self.shape  # raises for unknown presets
        for name in ("steps", "micro_batch_size", "tp", "pp", "eval_batches", "log_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive integer, got {v!r}")
        for name in ("seq_length", "global_batch_size", "eval_interval", "save_interval"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"TrainConfig.{name} must be a positive integer or None, got {v!r}")
        if self.seq_length is not None and self.seq_length > shape.seq_length:
            raise ValueError(f"TrainConfig.seq_length={self.seq_length} is longer than the model's "
                             f"sequence length {shape.seq_length} ({shape.name}); use at most {shape.seq_length}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"TrainConfig.warmup_steps={self.warmup_steps} must be in [0, steps={self.steps}]")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"TrainConfig.lr_decay_style={self.lr_decay_style!r}; valid: {', '.join(LR_DECAY_STYLES)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"TrainConfig.min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        if self.params_dtype not in PARAM_DTYPES:
            raise ValueError(f"TrainConfig.params_dtype={self.params_dtype!r}; valid: {', '.join(PARAM_DTYPES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"TrainConfig.backend={self.backend!r}; valid: {', '.join(BACKENDS)}")
        Precision.parse(self.precision)
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"TrainConfig.fp8_recipe={self.fp8_recipe!r}; valid: {', '.join(FP8_RECIPES)}")
        if self.fp4_recipe not in FP4_RECIPES:
            raise ValueError(f"TrainConfig.fp4_recipe={self.fp4_recipe!r}; valid: {', '.join(FP4_RECIPES)}")
        if self.backend == "local" and Precision.parse(self.precision) is not Precision.BF16:
            raise ValueError(f"TrainConfig.precision={self.precision!r} needs backend='emulated' "
                             f"(the 'local' backend runs plain Megatron linears)")
        if self.clip_grad < 0:
            raise ValueError(f"TrainConfig.clip_grad={self.clip_grad} must be >= 0")
        if self.load_step is not None and self.load_dir is None:
            raise ValueError("TrainConfig.load_step needs load_dir")

    @property
    def shape(self) -> ModelShape:
        """The model shape (before the tokenizer sets its vocabulary size)."""
        return self.model if isinstance(self.model, ModelShape) else get_shape(self.model)

    @property
    def seq_len(self) -> int:
        return self.seq_length or self.shape.seq_length

    @property
    def data_config(self) -> DataConfig:
        return self.data if self.data is not None else DataConfig(vocab_size=self.shape.vocab_size)

    @property
    def num_warmup_steps(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else self.steps // 10

