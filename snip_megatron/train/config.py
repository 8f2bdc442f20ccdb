"""The training settings: the schedule both training loops share, and the compact loop's TrainConfig.

`TrainingSchedule` is the one owner of the optimisation and bookkeeping fields (steps, batch,
learning rate, validation and checkpoint cadence); `TrainConfig` (the compact loop) and the recipe's
`TrainRecipe` (snip_megatron.cli.recipe, which drives both loops) extend it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from snip_megatron.data.prepare import DataConfig
from snip_megatron.formats.precision import Formats, Precision
from snip_megatron.megatron.spec import BACKENDS
from snip_megatron.models import gpt
from snip_megatron.models.gpt import MLADims, MoEDims
from snip_megatron.shapes import ModelShape, get_shape

LR_DECAY_STYLES = ("cosine", "linear", "constant")
PARAM_DTYPES = ("fp32", "bf16")


def _check_positive(owner: str, names, obj, optional: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        if optional and v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{owner}.{name} must be a positive integer{' or None' if optional else ''}, "
                             f"got {v!r}")


@dataclass(kw_only=True)
class TrainingSchedule:
    """How long, how big and how fast one run trains, and how often it validates and saves."""

    steps: int = 100
    """Optimizer steps to run in total (a resumed run continues up to this)."""
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
    params_dtype: str = "fp32"
    """Parameter dtype: fp32 (CPU runs) or bf16 (GPU runs); fp32 master weights either way."""
    seed: int = 1234
    """Seed for weights, data order and RNG streams."""
    eval_interval: int | None = 50
    """Validate every this many steps (and after the last step); None disables."""
    eval_batches: int = 8
    """Batches per validation, the same ones every time (compact loop: micro-batches; Megatron-LM:
    its --eval-iters)."""
    log_interval: int = 1
    """Write a metrics line every this many steps."""
    save_interval: int | None = None
    """Save every this many steps (and after the last step when saving is on); None: at the end only."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_positive(owner, ("steps", "micro_batch_size", "eval_batches", "log_interval"), self)
        _check_positive(owner, ("global_batch_size", "eval_interval", "save_interval"), self, optional=True)
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"{owner}.warmup_steps={self.warmup_steps} must be in [0, steps={self.steps}]")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"{owner}.lr_decay_style={self.lr_decay_style!r}; valid: {', '.join(LR_DECAY_STYLES)}")
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"{owner}.lr={self.lr} must be > 0 and {owner}.min_lr={self.min_lr} in [0, lr]")
        if self.params_dtype not in PARAM_DTYPES:
            raise ValueError(f"{owner}.params_dtype={self.params_dtype!r}; valid: {', '.join(PARAM_DTYPES)}")
        if self.clip_grad < 0:
            raise ValueError(f"{owner}.clip_grad={self.clip_grad} must be >= 0")

    @property
    def num_warmup_steps(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else self.steps // 10



@dataclass(kw_only=True)
class TrainConfig(TrainingSchedule):
    """One run of the compact loop: the schedule plus model, data, parallelism, precision, files."""

    model: str | ModelShape = "llama_tiny"
    """Preset name (snip_megatron.shapes) or a ModelShape. Its vocab_size is replaced by the tokenizer's."""
    mla: MLADims | None = None
    """Multi-latent attention's widths (models.gpt.MLADims); None: the preset's (llama_tiny_mla has
    it), else dense grouped-query attention."""
    moe: MoEDims | None = None
    """The MoE layers' experts (models.gpt.MoEDims, on Megatron's local spec); None: the preset's
    (llama_tiny_moe has them), else dense MLPs."""
    data: DataConfig | None = None
    """Corpus and tokenizer; None means the stdlib corpus with a tokenizer of the model's vocab size."""
    split: str = "95,5,0"
    """Megatron's train,valid,test split of the corpus, by document."""
    seq_length: int | None = None
    """Tokens per sample; None uses the model's seq_length, longer than it is an error."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    distributed_optimizer: bool = False
    """Shard optimizer state over DP (Megatron's distributed optimizer)."""
    backend: str = "emulated"
    """Planned linears: "emulated" (SNIP's emulated layers, any plan), "local" (plain Megatron); "te" is refused
    (support rule compact-te: snip-pretrain-gpt runs Transformer Engine linears)."""
    precision: str = "bf16"
    """Initial uniform precision of every planned linear (bf16, fp8 or fp4); with SNIP, the
    controller's plan replaces it before the first step."""
    formats: Formats = field(default_factory=Formats)
    """The FP8/FP4 formats of the emulated linears; with SNIP, SnipConfig.formats (what it measures)."""
    metrics_path: str | None = None
    """JSONL file for metrics (one object per logged step); None disables."""
    tensorboard_dir: str | None = None
    """TensorBoard folder: the logged metrics (train/loss, train/val_loss, ...) and SNIP's figures
    of each plan; None disables. Needs the tensorboard package."""
    save_dir: str | None = None
    """Checkpoint folder; None disables saving."""
    load_dir: str | None = None
    """Resume from the latest checkpoint in this folder (it must hold one)."""
    load_step: int | None = None
    """Resume from this step instead of the latest."""
    progress: bool = True
    """Show a progress bar with loss and tokens/s."""

    def __post_init__(self) -> None:
        super().__post_init__()
        shape = self.shape  # raises for unknown presets
        _check_positive("TrainConfig", ("tp", "pp"), self)
        _check_positive("TrainConfig", ("seq_length",), self, optional=True)
        if self.seq_length is not None and self.seq_length > shape.seq_length:
            raise ValueError(f"TrainConfig.seq_length={self.seq_length} is longer than the model's "
                             f"sequence length {shape.seq_length} ({shape.name}); use at most {shape.seq_length}")
        if self.backend not in BACKENDS:
            raise ValueError(f"TrainConfig.backend={self.backend!r}; valid: {', '.join(BACKENDS)}")
        Precision.parse(self.precision)
        if not isinstance(self.formats, Formats):
            raise ValueError(f"TrainConfig.formats must be a Formats, got {self.formats!r}")
        if self.backend == "local" and Precision.parse(self.precision) is not Precision.BF16:
            raise ValueError(f"TrainConfig.precision={self.precision!r} needs backend='emulated' "
                             f"(the 'local' backend runs plain Megatron linears)")
        if self.load_step is not None and self.load_dir is None:
            raise ValueError("TrainConfig.load_step needs load_dir")
        if self.mla is None and isinstance(self.model, str):
            self.mla = gpt.PRESET_MLA.get(self.model)
        if self.mla is not None and not isinstance(self.mla, MLADims):
            raise ValueError(f"TrainConfig.mla must be a models.gpt.MLADims or None, got {self.mla!r}")
        if self.moe is None and isinstance(self.model, str):
            self.moe = gpt.PRESET_MOE.get(self.model)
        if self.moe is not None and not isinstance(self.moe, MoEDims):
            raise ValueError(f"TrainConfig.moe must be a models.gpt.MoEDims or None, got {self.moe!r}")
        self.check_support(world_size=self.tp * self.pp)

    def check_support(self, world_size: int) -> None:
        """Refuse what the compact loop cannot run on `world_size` processes (snip_megatron.support's
        rules: MoE beyond one process or on TE, MLA at TP > 1, ...), each with its fix."""
        from snip_megatron.train.settings import check

        check(self, world_size)

    @property
    def shape(self) -> ModelShape:
        """The model shape (before the tokenizer sets its vocabulary size)."""
        return self.model if isinstance(self.model, ModelShape) else get_shape(self.model)

    @property
    def inventory(self):
        """The planned linears of the model (models.inventory.Inventory; multi-latent attention's
        with `mla`, the MoE layers' with `moe`)."""
        return gpt.inventory(self.shape, mla=self.mla, moe=self.moe)

    @property
    def seq_len(self) -> int:
        return self.seq_length or self.shape.seq_length

    @property
    def data_config(self) -> DataConfig:
        return self.data if self.data is not None else DataConfig(vocab_size=self.shape.vocab_size)
