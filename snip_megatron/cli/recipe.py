"""Recipe schema (model / parallel / data / train + SnipConfig), layout checks and Hydra composition.

The dataclasses are the source of truth: they are registered in Hydra's ConfigStore and every YAML
file under `configs/` only picks values of their fields (an unknown key or a wrong type fails at
composition). `compose_recipe(overrides)` -> a validated `RunRecipe`.
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Optional

from snip_megatron.config import SnipConfig
from snip_megatron.shapes import PRESETS, ModelShape
from snip_megatron.train.config import TrainingSchedule

ENTRIES = ("auto", "compact", "megatron")
RECOMPUTE = (None, "full", "selective")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
DATA_KINDS = ("mock", "corpus", "indexed")
CONFIG_DIR_ENV = "SNIP_CONFIG_DIR"


def _positive(owner: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


def _model_recipe_class() -> type:
    """ModelShape's fields as a mutable dataclass for Hydra (defaults: llama_tiny's). Derived, not
    written out: the shape's fields and the presets exist once, in snip_megatron.shapes."""
    hints = typing.get_type_hints(ModelShape)
    tiny = PRESETS["llama_tiny"]

    def shape(self) -> ModelShape:
        """The ModelShape (validates divisibility of heads and groups)."""
        try:
            return ModelShape(**{f.name: getattr(self, f.name) for f in fields(ModelShape)})
        except ValueError as e:
            raise ValueError(str(e).replace("ModelShape.", "model.")) from None

    return make_dataclass(
        "ModelRecipe", [(f.name, hints[f.name], field(default=getattr(tiny, f.name))) for f in fields(ModelShape)],
        kw_only=True, namespace={"shape": shape, "__module__": __name__,
                                 "__doc__": "A Llama-like decoder: snip_megatron.shapes.ModelShape's fields."})


ModelRecipe = _model_recipe_class()


@dataclass(kw_only=True)
class ParallelRecipe:
    """How the model and the batch are split over ranks (world = nnodes x nproc_per_node)."""

    name: str = "single"
    """Layout name (logs)."""
    tp: int = 1
    """Tensor-parallel size: divides heads, query groups and the FFN width."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B); None: not interleaved."""
    dp: Optional[int] = None
    """Data-parallel size; None: whatever the world leaves (world / (tp x pp))."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    recompute: Optional[str] = None
    """Activation recompute: "full" (every layer, uniform, one layer a chunk), "selective" (the
    attention core) or None."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks."""
    nnodes: int = 1
    """Nodes."""
    nproc_per_node: int = 1
    """Processes (GPUs) per node."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.dp if self.dp is not None else self.world_size // (self.tp * self.pp)


@dataclass(kw_only=True)
class DataRecipe:
    """Training text."""

    name: str = "mock"
    """Data recipe name (logs)."""
    kind: str = "mock"
    """mock: Megatron's random tokens; corpus: a text corpus tokenized here (cached);
    indexed: an existing Megatron .bin/.idx prefix with its tokenizer."""
    corpus: str = "stdlib"
    """kind=corpus: "stdlib" (the built-in Python standard library text), a folder, glob or .jsonl."""
    path: Optional[str] = None
    """kind=indexed: the .bin/.idx path prefix."""
    tokenizer: Optional[str] = None
    """A tokenizers JSON file; kind=corpus trains one of `model.vocab_size` when None."""
    cache_dir: str = ".cache/snip-data"
    """Where tokenized corpora are cached."""
    split: str = "95,5,0"
    """Train/valid/test split by documents (Megatron --split)."""


@dataclass(kw_only=True)
class TrainRecipe(TrainingSchedule):
    """The schedule of one run (snip_megatron.train.config.TrainingSchedule, the same fields for both
    loops) plus where it runs and keeps its files."""

    name: str = "tiny"
    """Train recipe name (logs)."""
    entry: str = "auto"
    """auto: the compact loop for llama_tiny, snip-pretrain-gpt otherwise; or compact / megatron."""
    run_dir: str = "runs/${model.name}-${snip.name}"
    """Run folder: checkpoints, plans, logs, heat map."""
    load: Optional[str] = None
    """Checkpoint folder to resume from (None: `run_dir` when it holds a checkpoint)."""
    cpu: Optional[bool] = None
    """Force the CPU path (gloo, CPU shim); None: CPU when there is no GPU."""
    transformer_impl: str = "local"
    """Megatron's --transformer-impl: "local" (SNIP's emulated linears in the local spec, any
    device) or "transformer_engine" (Megatron's TE spec, SNIP planning TE's linears; GPU)."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard folder (Megatron's --tensorboard-dir, the compact loop's): the run's metrics and
    SNIP's figures at each plan; None: none. E.g. train.tensorboard_dir='${train.run_dir}/tensorboard'."""
    wandb_project: Optional[str] = None
    """W&B project (Megatron's --wandb-project, with --wandb-exp-name the recipe's run folder name):
    the run's metrics and SNIP's figures; None: none. Megatron-LM's loop only (train.entry=megatron)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"train.transformer_impl={self.transformer_impl!r} is not valid; choose one "
                             f"of: {', '.join(TRANSFORMER_IMPLS)}")
        if self.entry not in ENTRIES:
            raise ValueError(f"train.entry={self.entry!r} is not valid; choose one of: {', '.join(ENTRIES)}")


@dataclass(kw_only=True)
class SnipRecipe(SnipConfig):
    """SnipConfig plus the recipe's name."""

    name: str = "default"
    """SNIP recipe name (logs, run folder)."""

    def snip_config(self) -> SnipConfig:
        values = {k: v for k, v in vars(self).items() if k != "name"}
        return SnipConfig(**values)


@dataclass(kw_only=True)
class RunRecipe:
    """One training run: what model, split how, with which SNIP settings, on what data, how long."""

    model: ModelRecipe = field(default_factory=ModelRecipe)
    """Model shape."""
    parallel: ParallelRecipe = field(default_factory=ParallelRecipe)
    """Parallel layout."""
    snip: SnipRecipe = field(default_factory=SnipRecipe)
    """SNIP settings."""
    data: DataRecipe = field(default_factory=DataRecipe)
    """Training text."""
    train: TrainRecipe = field(default_factory=TrainRecipe)
    """Optimisation and bookkeeping."""

    @property
    def entry(self) -> str:
        """compact or megatron, with "auto" resolved."""
        if self.train.entry != "auto":
            return self.train.entry
        return "compact" if self.model.name.startswith("llama_tiny") else "megatron"


def validate_layout(recipe: RunRecipe) -> None:
    """Raise ValueError naming the recipe field when the parallel layout cannot run this model."""
    par, model, train = recipe.parallel, recipe.model, recipe.train
    for name in ("tp", "pp", "nnodes", "nproc_per_node"):
        _positive("parallel", name, getattr(par, name))
    if par.vpp is not None:
        _positive("parallel", "vpp", par.vpp)
        if par.pp < 2:
            raise ValueError(f"parallel.vpp={par.vpp} needs parallel.pp > 1 (interleaving needs stages)")
    if par.dp is not None:
        _positive("parallel", "dp", par.dp)
    recipe.model.shape()  # heads vs groups vs width
    world = par.world_size
    if par.dp is not None and par.tp * par.pp * par.dp != world:
        raise ValueError(f"parallel.tp x parallel.pp x parallel.dp = {par.tp} x {par.pp} x {par.dp} = "
                         f"{par.tp * par.pp * par.dp} != world size {world} "
                         f"(parallel.nnodes={par.nnodes} x parallel.nproc_per_node={par.nproc_per_node})")
    if world % (par.tp * par.pp):
        raise ValueError(f"world size {world} (parallel.nnodes x parallel.nproc_per_node) is not "
                         f"divisible by parallel.tp x parallel.pp = {par.tp * par.pp}")
    if model.num_attention_heads % par.tp:
        raise ValueError(f"model.num_attention_heads={model.num_attention_heads} is not divisible "
                         f"by parallel.tp={par.tp}")
    if model.num_query_groups % par.tp:
        raise ValueError(f"model.num_query_groups={model.num_query_groups} is not divisible by "
                         f"parallel.tp={par.tp}")
    if model.ffn_hidden_size % par.tp:
        raise ValueError(f"model.ffn_hidden_size={model.ffn_hidden_size} is not divisible by "
                         f"parallel.tp={par.tp}")
    chunks = par.pp * (par.vpp or 1)
    if model.num_layers % chunks:
        raise ValueError(f"model.num_layers={model.num_layers} is not divisible by parallel.pp"
                         + (f" x parallel.vpp = {par.pp} x {par.vpp}" if par.vpp else f"={par.pp}"))
    if par.sequence_parallel and par.tp < 2:
        raise ValueError("parallel.sequence_parallel needs parallel.tp > 1")
    if par.recompute not in RECOMPUTE:
        raise ValueError(f"parallel.recompute={par.recompute!r} is not valid; choose one of: "
                         f"{', '.join(str(r) for r in RECOMPUTE)}")
    dp = par.data_parallel_size
    if train.global_batch_size is not None and train.global_batch_size % (train.micro_batch_size * dp):
        raise ValueError(f"train.global_batch_size={train.global_batch_size} is not divisible by "
                         f"train.micro_batch_size x data-parallel size = {train.micro_batch_size} x {dp}")


def validate(recipe: RunRecipe) -> RunRecipe:
    """The checks across fields of a recipe: layout, data and SNIP (ValueError naming the field)."""
    validate_layout(recipe)
    if recipe.data.kind not in DATA_KINDS:
        raise ValueError(f"data.kind={recipe.data.kind!r} is not valid; choose one of: {', '.join(DATA_KINDS)}")
    if recipe.data.kind == "indexed" and not recipe.data.path:
        raise ValueError("data.kind=indexed needs data.path (the .bin/.idx prefix)")
    if recipe.data.kind == "indexed" and not recipe.data.tokenizer:
        raise ValueError("data.kind=indexed needs data.tokenizer (its tokenizers JSON file)")
    if recipe.snip.enabled and recipe.snip.warmup < 1:
        recipe.snip.warmup_steps(recipe.train.steps)
    return recipe


def check_input_files(recipe: RunRecipe) -> RunRecipe:
    """Every file the recipe names exists and is what it should be (the plan fits the model), so a
    bad path fails at once, dry runs included, naming the field and the file."""
    from snip_megatron.plan import Plan

    snip, data, train = recipe.snip, recipe.data, recipe.train
    if snip.enabled and snip.plan:
        Plan.load_for(snip.plan, recipe.model.num_layers)
    if data.kind == "indexed":
        for suffix in (".bin", ".idx"):
            if not Path(data.path + suffix).is_file():
                raise ValueError(f"data.path={data.path!r}: {data.path}{suffix} does not exist (a Megatron "
                                 "indexed dataset is a .bin/.idx pair with this prefix)")
    if data.kind == "corpus" and data.corpus != "stdlib":
        from snip_megatron.data.sources import parse_corpus

        try:
            parse_corpus(data.corpus)
        except ValueError as e:
            raise ValueError(f"data.corpus: {e}") from None
    if data.tokenizer and not Path(data.tokenizer).exists():
        raise ValueError(f"data.tokenizer={data.tokenizer!r} does not exist (expected a tokenizers JSON file)")
    if train.load and not Path(train.load).is_dir():
        raise ValueError(f"train.load={train.load!r} is not a folder: give the checkpoint folder to resume from")
    return recipe


# -- Hydra ---------------------------------------------------------------------------------------


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore (`run_schema` and `<group>/schema`)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunRecipe)
    for group, node in (("model", ModelRecipe), ("parallel", ParallelRecipe), ("snip", SnipRecipe),
                        ("data", DataRecipe), ("train", TrainRecipe)):
        cs.store(group=group, name="schema", node=node)
    for name, shape in PRESETS.items():  # model=<preset>: the presets of snip_megatron.shapes
        cs.store(group="model", name=name, node=ModelRecipe(**{f.name: getattr(shape, f.name)
                                                               for f in fields(ModelShape)}))


def default_config_dir() -> Path:
    """`$SNIP_CONFIG_DIR`, else the `configs/` folder next to the package (source checkout, Docker)."""
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        return Path(env).resolve()
    return Path(__file__).resolve().parents[2] / "configs"


def compose_config(overrides: list[str] | None = None, *, config_dir: "str | Path | None" = None,
                   config_name: str = "config"):
    """The composed OmegaConf config (interpolations unresolved) for Hydra `overrides`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    cdir = Path(config_dir) if config_dir is not None else default_config_dir()
    if not (cdir / f"{config_name}.yaml").is_file():
        raise ValueError(f"no recipe {config_name!r} in {cdir} (set ${CONFIG_DIR_ENV} or --config-dir)")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(cdir.resolve()), version_base=None):
            return compose(config_name=config_name, overrides=list(overrides or []))
    except (HydraException, OmegaConfBaseException) as e:
        detail = f"{e} ({e.__cause__})" if e.__cause__ is not None else str(e)
        detail = " ".join(detail.split())  # Hydra writes several lines; one is enough here
        raise ValueError(f"cannot compose recipe with overrides {list(overrides or [])}: {detail}") from None


def to_recipe(cfg) -> RunRecipe:
    """OmegaConf config -> validated RunRecipe; dataclass ValueErrors keep their field names."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.resolve(cfg)
        recipe = OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, ValueError) as e:
        cause = e if isinstance(e, ValueError) else e.__cause__
        if isinstance(cause, ValueError):  # a dataclass check: say it in recipe terms
            raise ValueError(str(cause).replace("SnipConfig.", "snip.").replace("TrainRecipe.", "train.")) from None
        raise ValueError(f"bad recipe: {e}") from None
    return validate(recipe)


def compose_recipe(overrides: list[str] | None = None, *, config_dir=None,
                   config_name: str = "config") -> RunRecipe:
    """Compose, resolve and validate: `compose_recipe(["model=llama_7b", "parallel=tp4_pp2"])`."""
    cfg = compose_config(overrides, config_dir=config_dir, config_name=config_name)
    return to_recipe(cfg)
