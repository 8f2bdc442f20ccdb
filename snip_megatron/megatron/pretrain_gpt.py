"""snip-pretrain-gpt: GPT pretraining on Megatron-LM's loop (`megatron.training.pretrain`) with SNIP.

    torchrun --nproc-per-node 8 -m snip_megatron.megatron.pretrain_gpt <Megatron-LM arguments> \\
        --snip --snip-fp4-budget 0.75 --snip-interval 1000

Takes every Megatron-LM argument plus the `--snip*` flags (snip_megatron.megatron.args) and
`--corpus` (text tokenized here). The model is Megatron's GPTModel with SNIP's planned linears in
its layer spec and the plan as `TransformerConfig.quant_recipe`. The model is built with, first to
last: a pinned `--snip-plan`; the plan of the checkpoint being resumed; `--snip-plan`;
`--snip-initial-precision` everywhere. After the warm-up the controller
(`snip_megatron.controller.SnipController`) re-plans (SNIP) or applies `--snip-baseline`'s rule.
It runs at the step boundary of Megatron's loop: its `train_step` is wrapped (`SnipRun.step_begin`,
`SnipHooks`), so measurements use the step's own micro-batches outside the pipeline schedule. The
plan and the controller's state are written next to every checkpoint as `snip_state.json`, so a
resumed run starts from the plan it stopped with.
Needs megatron-core >= 0.19 (which ships `megatron.training`); runs on CPU (gloo) without a GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional, Protocol

from snip_megatron.config import SnipConfig
from snip_megatron.megatron.args import add_snip_args, snip_config_from_args

STATE_FILE = "snip_state.json"
STATE_VERSION = 1
BACKENDS = ("auto", "emulated", "te", "local")
# Megatron-LM flags a CPU run needs (no fused CUDA kernels, gloo, local layer spec); the user's own
# flags come after these, so a value given on the command line still wins.
CPU_FLAGS = [
    "--distributed-backend", "gloo",
    "--transformer-impl", "local",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
]


# -- arguments ----------------------------------------------------------------------------------


def add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--corpus`: real text tokenized here (snip_megatron.data) instead of a prepared --data-path."""
    g = parser.add_argument_group(title="snip-megatron data")
    g.add_argument("--corpus", default=None, metavar="SPEC",
                   help='Text to train on: "stdlib", a folder, a glob or file.jsonl[:field]; '
                        "tokenized once and cached (see --corpus-cache).")
    g.add_argument("--corpus-cache", default=".cache/snip-data", metavar="DIR",
                   help="Cache folder of tokenized corpora (default %(default)s).")
    g.add_argument("--corpus-tokenizer", default=None, metavar="PATH",
                   help="tokenizers JSON file for --corpus or --data-path; default: train one of "
                        "--vocab-size tokens on the corpus.")
    g.add_argument("--snip-backend", choices=BACKENDS, default="auto",
                   help="Planned linears: emulated (fake quantization, any device), te (Transformer "
                        "Engine, GPU), local (Megatron's plain linears, no quantization; a reference); "
                        "auto: te with --transformer-impl transformer_engine, else emulated.")
    return parser


def add_extra_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `extra_args_provider` of this entry point: SNIP flags and data flags."""
    return add_data_args(add_snip_args(parser))


def require_megatron_training() -> None:
    """Fail with a clear message where megatron.training is missing (megatron-core < 0.19)."""
    try:
        import megatron.training  # noqa: F401
        from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: F401
    except Exception as e:  # ImportError, or a broken optional dependency behind it
        try:
            import megatron.core as mcore
            have = f"megatron-core {mcore.__version__}"
        except Exception:
            have = "no megatron-core"
        raise SystemExit(
            f"snip-pretrain-gpt needs megatron.training (shipped with megatron-core >= 0.19); this "
            f"environment has {have} ({type(e).__name__}: {e}). Install megatron-core>=0.19 or use "
            "a Megatron-LM checkout with patches/megatron-lm-pretrain_gpt.patch.") from None


# -- plan and controller state ------------------------------------------------------------------


class SnipHooks(Protocol):
    """What the loop calls on a controller; `snip_megatron.controller.SnipController` has these.

    `trainer` is a `MegatronStep`: this rank's chunks, optimizer and the step's micro-batches.
    `step` is 1-based (Megatron's iteration + 1). `on_step_end` gets {"loss": the step's mean loss}
    (None on ranks that compute no loss, unless the loss guard is on: then every rank has it).
    """

    plan: Any
    def attach(self, model_chunks: list, step: int = 0) -> None: ...
    def on_step_start(self, trainer: "MegatronStep", step: int) -> None: ...
    def on_step_end(self, trainer: "MegatronStep", step: int, metrics: dict) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class MegatronStep:
    """The trainer a controller sees at a step boundary of Megatron-LM's loop.

    `current_batch` reads the step's micro-batches ahead on first access; train_step then trains
    on exactly those (`data_iterator()`), so a measurement never moves the data position."""

    def __init__(self, chunks: list, optimizer, data_iterator, num_microbatches: int,
                 seq_length: int, micro_batch_size: int):
        self.chunks = chunks
        self.optimizer = optimizer
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self._source = data_iterator
        self._n = num_microbatches
        self._buffered = None

    @property
    def current_batch(self) -> list:
        """The step's micro-batches (None items on ranks that read no data)."""
        if self._buffered is None:
            self._buffered = _buffer_step(self._source, self._n)
        return self._buffered[1]

    def data_iterator(self):
        """What train_step must read this step: the original, or a replay of the buffered batches."""
        return self._source if self._buffered is None else self._buffered[0]


@dataclass
class SnipRun:
    """SNIP's state inside one snip-pretrain-gpt process: config, current plan, controller."""

    config: SnipConfig
    """The SNIP flags."""
    num_layers: int
    """Transformer layers of the whole model (plans cover 1..num_layers)."""
    backend: str = "emulated"
    """Planned-linear backend (emulated, te or local)."""
    plan: Any = None
    """The plan the model was built with (snip_megatron.plan.Plan), None when SNIP is off."""
    plan_source: str = "off"
    """Where `plan` came from (logged and saved)."""
    controller: Any = None
    """An object with the SnipHooks methods, or None: the plan stays fixed."""
    controller_state: Optional[dict] = None
    """Controller state restored from a checkpoint, handed over when the controller attaches."""
    seq_length: int = 0
    """Tokens per sample (for the controller's extra passes)."""
    micro_batch_size: int = 0
    """Samples per micro-batch (for the controller's extra passes)."""
    built_with_plan: bool = True
    """The model was built with the plan in its quant_recipe (False: apply it at the first step)."""
    _attached: bool = False
    _checked: bool = False
    _trainer: Any = None

    def ensure_applied(self, model: list) -> None:
        """Before the first step: this rank's planned linears run the plan. Built with it
        (`built_with_plan`, this entry point): checked; otherwise (a patched Megatron-LM
        pretrain_gpt.py builds the model itself): applied now."""
        if self.plan is None or self.backend == "local":
            return
        from snip_megatron.megatron.apply import apply_plan, current_plan

        local = current_plan(list(model))
        wrong = [f"{k}: {local[k]} (plan: {self.plan[k]})" for k in local if local[k] is not self.plan[k]]
        if wrong and not self.built_with_plan:
            apply_plan(list(model), self.plan, fp8_recipe=self.config.fp8_recipe,
                       fp4_recipe=self.config.fp4_recipe, num_layers=self.num_layers)
            local, wrong = current_plan(list(model)), []
        if wrong or not len(local):
            raise RuntimeError(f"the model does not run the SNIP plan ({self.plan_source}): "
                               + ("; ".join(wrong[:6]) if wrong else "no planned linears found"))
        _print_rank_0(f"[snip] rank 0 runs the plan on its {len(local)} planned linears: {local.counts()}")

    def current_plan(self):
        """The plan the model runs now: the controller's once it is attached."""
        plan = getattr(self.controller, "plan", None) if self._attached else None
        return plan if plan is not None else self.plan

    # Step boundary, before Megatron's train_step: the controller may measure on this step's
    # micro-batches (which train_step then trains on) and apply a new plan.
    def step_begin(self, step: int, model: list, optimizer, data_iterator, num_microbatches=None):
        if not self._checked:
            self._checked = True
            self.ensure_applied(model)
        if self.controller is None:
            return data_iterator
        if not self._attached:
            self.controller.attach(list(model), step - 1)
            if self.controller_state is not None:
                self.controller.load_state_dict(self.controller_state)
            self._attached = True
        trainer = MegatronStep(list(model), optimizer, data_iterator,
                               num_microbatches or _num_microbatches(), self.seq_length,
                               self.micro_batch_size)
        self.controller.on_step_start(trainer, step)
        self._trainer = trainer
        return trainer.data_iterator()

    def step_end(self, step: int, loss) -> None:
        if self.controller is None:
            return
        loss = float(loss) if loss is not None else None
        if self.config.loss_guard_factor > 0:
            loss = _loss_on_every_rank(loss)
        self.controller.on_step_end(self._trainer, step, {"loss": loss})

    def state_dict(self, iteration: int) -> dict:
        plan = self.current_plan()
        state = {"version": STATE_VERSION, "iteration": iteration, "snip_config": self.config.to_dict(),
                 "plan_source": self.plan_source if plan is self.plan else "controller",
                 "plan": plan.to_dict() if plan is not None else None}
        if self.controller is not None and self._attached:
            state["controller"] = self.controller.state_dict()
        else:
            state["controller"] = self.controller_state
        return state


def _num_microbatches() -> int:
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return get_num_microbatches()


def _buffer_step(data_iterator, n: int):
    """Read the step's `n` micro-batches ahead; returns (an iterator over them, the list).

    Megatron hands ranks that read no data a None iterator (they get None items), and a list of
    iterators with virtual pipelining (the micro-batches of the first chunk that reads data are
    returned: every chunk that reads gets the same ones)."""
    if isinstance(data_iterator, list):
        pairs = [_buffer_step(it, n) for it in data_iterator]
        reading = [p[1] for p in pairs if any(b is not None for b in p[1])]
        return [p[0] for p in pairs], reading[0] if reading else [None] * n
    if data_iterator is None:
        return None, [None] * n
    from megatron.core.rerun_state_machine import RerunDataIterator

    batches = [next(data_iterator) for _ in range(n)]
    if isinstance(data_iterator, RerunDataIterator):
        data_iterator.advance()  # drop its copies: the replay iterator below keeps its own
    return RerunDataIterator(iter(batches)), batches


def _loss_on_every_rank(loss):
    """The last pipeline stage's loss on every rank of its pipeline (one scalar all-reduce)."""
    import torch
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return loss
    t = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
    torch.distributed.all_reduce(t, group=ps.get_pipeline_model_parallel_group())
    return float(t.item())


def _layer_offset(config, vp_stage) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config, vp_stage=vp_stage)


def _recipe_backend(backend: str) -> str:
    return "te" if backend == "te" else "emulated"


def read_state(checkpoint_dir: "str | None") -> Optional[dict]:
    """The snip_state.json of the checkpoint Megatron will resume from (`--load`), if any."""
    if not checkpoint_dir:
        return None
    tracker = Path(checkpoint_dir) / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}"
    path = Path(checkpoint_dir) / name / STATE_FILE
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"{path}: unknown snip state version {state.get('version')!r} "
                         f"(this snip-megatron reads version {STATE_VERSION})")
    return state


def write_state(save_dir: str, iteration: int, run: SnipRun) -> tuple[Path, dict]:
    """Write snip_state.json into the checkpoint folder of `iteration` (atomic rename)."""
    folder = Path(save_dir) / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    state = run.state_dict(iteration)
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)
    return path, state


def initial_plan(cfg: SnipConfig, num_layers: int, resumed: Optional[dict]):
    """(plan, source) the model is built with; (None, "off") when SNIP is off.

    A baseline's rule, like SNIP's measured plans, takes over after the warm-up (the controller);
    until then every planned linear runs `initial_precision` (or `--snip-plan`)."""
    from snip_megatron.plan import Plan

    if not cfg.enabled:
        return None, "off"
    if cfg.pin_plan:
        return Plan.load(cfg.plan).check_model(num_layers), f"pinned {cfg.plan}"
    if resumed is not None and resumed.get("plan") is not None:
        return Plan.from_dict(resumed["plan"]).check_model(num_layers), "checkpoint"
    if cfg.plan is not None:
        return Plan.load(cfg.plan).check_model(num_layers), f"file {cfg.plan}"
    return Plan.uniform(num_layers, cfg.initial_precision), f"initial {cfg.initial_precision}"


def model_shape(args):
    """The ModelShape of Megatron's arguments (for the controller's FLOP table)."""
    from snip_megatron.shapes import ModelShape

    return ModelShape(name="megatron", num_layers=args.num_layers, hidden_size=args.hidden_size,
                      ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                      num_query_groups=args.num_query_groups or args.num_attention_heads,
                      vocab_size=args.padded_vocab_size, seq_length=args.seq_length)


def pipeline_stages(num_layers: int, pp: int, vpp: Optional[int]) -> dict:
    """LayerKey -> pipeline rank holding it (even split; interleaved chunks with VPP)."""
    from snip_megatron.plan import all_keys

    chunks = pp * (vpp or 1)
    per_chunk = num_layers // chunks
    return {k: ((k.layer - 1) // per_chunk) % pp for k in all_keys(num_layers)}


def measure_on_step(run: SnipRun):
    """The controller's `measure(trainer, step)`: statistics and noise passes through Megatron's
    schedule on the step's own micro-batches; the table on global rank 0, None elsewhere."""

    def measure(trainer: MegatronStep, step: int):
        import torch

        from snip_megatron.stats import measure_config_from
        from snip_megatron.stats.measure import measure as stats_measure

        table = stats_measure(trainer.chunks, forward_step, trainer.current_batch,
                              seq_length=trainer.seq_length, micro_batch_size=trainer.micro_batch_size,
                              optimizer=trainer.optimizer, config=measure_config_from(run.config))
        return table if torch.distributed.get_rank() == 0 else None

    return measure


def make_controller(run: SnipRun, args):
    """SNIP's controller for a config that measures or runs a baseline; None for a fixed plan."""
    if not run.config.enabled or run.config.pin_plan:
        return None
    if not run.config.measures and run.config.baseline is None:
        return None
    if args.sequence_parallel and (run.config.measures or run.config.baseline == "min_rel_error"):
        raise ValueError("--snip measurement does not support --sequence-parallel yet; drop "
                         "--sequence-parallel, or pin a plan (--snip-plan PATH --snip-pin-plan)")
    from snip_megatron.controller import SnipController

    shape = model_shape(args)
    return SnipController(
        run.config, shape, total_steps=args.train_iters, run_dir=args.save,
        tokens_per_step=args.global_batch_size * args.seq_length,
        stages=pipeline_stages(args.num_layers, args.pipeline_model_parallel_size,
                               args.virtual_pipeline_model_parallel_size),
        log=_print_rank_0, measure=measure_on_step(run))


# -- model, data, forward step ------------------------------------------------------------------


_RUN: Optional[SnipRun] = None  # this process's SNIP state; set by main()


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron's GPTModel for one chunk, with SNIP's planned linears and this chunk's plan."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from snip_megatron.megatron.spec import get_layer_spec

    args = get_args()
    run = _RUN
    config = copy.copy(config if config is not None else core_transformer_config_from_args(args))
    backend = run.backend if run is not None and run.plan is not None else "local"
    if run is not None and run.plan is not None:
        from snip_megatron.megatron.quant_recipe import build_recipe

        # Each chunk gets its own recipe: the plan is keyed by global layer, module paths by local.
        config.quant_recipe = build_recipe(
            run.plan, layer_offset=_layer_offset(config, vp_stage), backend=_recipe_backend(backend),
            num_layers=args.num_layers, fp8_recipe=run.config.fp8_recipe, fp4_recipe=run.config.fp4_recipe)
    spec = get_layer_spec(backend) if backend == "te" else get_layer_spec(backend, args.normalization)
    kwargs = {"vp_stage": vp_stage} if vp_stage is not None else {}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, **kwargs)
    return model


BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch: TP rank 0 reads it and broadcasts it over the TP group; pipeline
    stages that neither embed nor compute the loss get None."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    args = get_args()
    first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    if not (first or last):
        return {k: None for k in BATCH_KEYS}
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    shape = (args.micro_batch_size, args.seq_length)
    dtypes = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
              "position_ids": torch.int64}
    if ps.get_tensor_model_parallel_rank() == 0:
        sample = next(data_iterator)
        batch = {k: sample[k].to(device=device, dtype=dtypes[k]) for k in BATCH_KEYS}
    else:
        batch = {k: torch.empty(shape, dtype=dtypes[k], device=device) for k in BATCH_KEYS}
    if ps.get_tensor_model_parallel_world_size() > 1:
        for k in BATCH_KEYS:
            torch.distributed.broadcast(batch[k], ps.get_tensor_model_parallel_src_rank(),
                                        group=ps.get_tensor_model_parallel_group())
    return batch


def loss_func(loss_mask, output_tensor):
    """Summed masked loss, token count and the report Megatron averages over DP ranks."""
    import torch

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron's forward_step_func (training, validation and the controller's extra passes)."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args

    if return_schedule_plan:
        raise ValueError("snip-pretrain-gpt does not support --overlap-moe-expert-parallel-comm")
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    batch = get_batch(data_iterator, vp_stage)
    # No attention mask: Megatron's attention applies the causal mask itself.
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _prepared_corpus(args):
    """Tokenize --corpus into the cache (rank 0 first, the others then find it there)."""
    import torch

    from snip_megatron.data.prepare import DataConfig, prepare

    config = DataConfig(corpus=args.corpus, cache_dir=args.corpus_cache, vocab_size=args.vocab_size,
                        tokenizer=args.corpus_tokenizer)
    if torch.distributed.get_rank() == 0:
        data = prepare(config)
    torch.distributed.barrier()
    if torch.distributed.get_rank() != 0:
        data = prepare(config)
    return data


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Train/valid/test GPT datasets: Megatron's mock data, --corpus text, or --data-path."""
    from megatron.core import parallel_state as ps
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, print_rank_0

    args = get_args()
    if args.mock_data:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

        tokenizer, blend, cache, dataset_type = build_tokenizer(args), None, None, MockGPTDataset
    else:
        from snip_megatron.data.gpt import ensure_helpers
        from snip_megatron.data.tokenizer import MegatronTokenizer

        if args.corpus is not None:
            data = _prepared_corpus(args)
            prefix, tok_path, cache = data.prefix, data.tokenizer_path, str(data.cache_dir) + "/gpt_indices"
            if data.vocab_size > args.vocab_size:
                raise ValueError(f"--corpus {args.corpus}: its tokenizer has {data.vocab_size} tokens, "
                                 f"more than --vocab-size {args.vocab_size}")
        else:
            if not args.data_path or not args.corpus_tokenizer:
                raise ValueError("give --mock-data, --corpus SPEC, or --data-path PREFIX with "
                                 "--corpus-tokenizer PATH")
            prefix, tok_path, cache = args.data_path[0], args.corpus_tokenizer, args.data_cache_path
        ensure_helpers()
        tokenizer, blend, dataset_type = MegatronTokenizer(tok_path), ([prefix], None), GPTDataset
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, split=args.split,
        path_to_cache=cache, tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, mmap_bin_files=True)
    print_rank_0(f"> building GPT datasets ({dataset_type.__name__}) ...")

    def built_here():
        return (ps.get_tensor_model_parallel_rank() == 0
                and (ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
                     or ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)))

    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, built_here, config).build()


datasets_provider.is_distributed = True  # called on every rank (the corpus step has a barrier)


# -- Megatron seams -----------------------------------------------------------------------------


def _print_rank_0(msg: str) -> None:
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, flush=True)


def install_checkpoint_hook(run: SnipRun) -> None:
    """After every Megatron checkpoint save, write snip_state.json into its folder (rank 0)."""
    import torch
    from megatron.training import get_args
    from megatron.training import training as mtraining

    from snip_megatron.plan import Plan

    original = mtraining.save_checkpoint

    def save_checkpoint(iteration, *args, **kwargs):
        result = original(iteration, *args, **kwargs)
        margs = get_args()
        if margs.save and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            path, state = write_state(margs.save, iteration, run)
            counts = Plan.from_dict(state["plan"]).counts() if state["plan"] else None
            print(f"[snip] saved plan ({state['plan_source']}, {counts}) to {path}", flush=True)
        return result

    mtraining.save_checkpoint = save_checkpoint


def install_step_hook(run: SnipRun) -> None:
    """Wrap Megatron's `train_step`: SNIP's step boundary, outside the pipeline schedule, on
    every rank, with the data iterator, the model chunks and the optimizer at hand."""
    from megatron.training import training as mtraining

    original = mtraining.train_step

    def train_step(forward_step_func, data_iterator, model, optimizer, *args, **kwargs):
        from megatron.training import get_args

        iteration = kwargs.get("iteration")
        if iteration is None:
            iteration = get_args().curr_iteration
        step = iteration + 1
        data_iterator = run.step_begin(step, model, optimizer, data_iterator)
        # Gradient stochastic rounding: a stream per (layer, step), so a resumed run rounds alike.
        from snip_megatron.megatron.sr_seed import reseed_stochastic_rounding

        reseed_stochastic_rounding(model, step, get_args().seed)
        result = original(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)
        run.step_end(step, result[0].get("lm loss") if result[0] else None)
        return result

    mtraining.train_step = train_step


def skip_prebuilt_helpers() -> None:
    """Megatron-LM compiles its dataset helpers with `make` at start-up; the megatron-core wheel
    ships them prebuilt and without the Makefile, so compile only when the import fails."""
    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers

    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original()

    dataset_utils.compile_helpers = compile_helpers


def prepare_cpu(args) -> None:
    """No GPU: gloo process group, the CPU shim and Megatron's model-parallel state, set up before
    `pretrain` (Megatron skips model-parallel init when it sees no CUDA device)."""
    from megatron.training import training as mtraining

    from snip_megatron.megatron import runtime

    runtime.quiet_megatron_warnings()
    runtime.init_process_group(backend="gloo", timeout_s=60.0 * args.distributed_timeout_minutes)
    runtime.initialize_model_parallel(tp=args.tensor_model_parallel_size,
                                      pp=args.pipeline_model_parallel_size,
                                      vpp=args.virtual_pipeline_model_parallel_size, seed=args.seed)
    mtraining.initialize_megatron = partial(mtraining.initialize_megatron, allow_no_cuda=True)


def patch_arguments_for_cpu() -> None:
    """Megatron's argument checks ask the GPU's architecture when TP > 1; there is none on CPU."""
    from megatron.training import arguments as marguments

    if hasattr(marguments, "get_device_arch_version"):
        marguments.get_device_arch_version = lambda: 0


def _ckpt_format_flags() -> list[str]:
    """Megatron's default checkpoint writer (torch_dist) starts worker processes through psutil;
    where psutil is missing, default to the per-rank `torch` format (a user flag still wins)."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        return ["--ckpt-format", "torch"]
    return []


def start_snip(args, *, backend: str, controller=None, built_with_plan: bool = True) -> SnipRun:
    """SNIP's state for parsed Megatron `args`: the plan to start from (checkpoint first), the
    controller, and the hooks into megatron.training (step boundary, checkpoint save).
    Raises ValueError (naming the flag) for a bad SNIP setting."""
    global _RUN
    snip = snip_config_from_args(args)
    resumed = read_state(args.load)
    plan, source = initial_plan(snip, args.num_layers, resumed)
    _RUN = run = SnipRun(config=snip, num_layers=args.num_layers, backend=backend, plan=plan,
                         plan_source=source, seq_length=args.seq_length,
                         micro_batch_size=args.micro_batch_size, built_with_plan=built_with_plan,
                         controller_state=(resumed or {}).get("controller"))
    run.controller = controller if controller is not None else make_controller(run, args)
    _print_rank_0(f"[snip] {'on' if snip.enabled else 'off'}; backend {backend}; plan: {source}"
                  + (f" {plan.counts()}" if plan is not None else ""))
    install_checkpoint_hook(run)
    install_step_hook(run)
    return run


def setup_megatron_lm(args, model_cfg) -> Optional[SnipRun]:
    """SNIP inside a Megatron-LM checkout's own pretrain_gpt.py (patches/megatron-lm-pretrain_gpt.patch).

    Call after `model_cfg = gpt_config_from_args(args)`, before `pretrain(...)`: puts SNIP's
    emulated linears into `model_cfg.transformer_layer_spec` (Transformer Engine linears are kept
    with --transformer-impl transformer_engine), and hooks the plan, the controller and
    snip_state.json into megatron.training. The plan is applied at the first step. Does nothing
    without --snip / --snip-plan / --snip-baseline."""
    try:
        if not snip_config_from_args(args).enabled:
            return None
        backend = "te" if args.transformer_impl == "transformer_engine" else "emulated"
        if backend == "emulated":
            from snip_megatron.megatron.spec import get_snip_layer_spec

            model_cfg.transformer_layer_spec = get_snip_layer_spec(args.normalization)
        return start_snip(args, backend=backend, built_with_plan=False)
    except ValueError as e:
        raise SystemExit(f"pretrain_gpt.py: SNIP: {e}") from None


def main(argv: list[str] | None = None, controller=None) -> int:
    """Parse Megatron + SNIP arguments, start SNIP and run `megatron.training.pretrain`.

    `controller`: an object with the SnipHooks methods (default: SnipController when SNIP
    measures or runs a baseline).
    """
    from snip_megatron.megatron.startup import quiet_startup; quiet_startup()  # before megatron.core loads
    require_megatron_training()
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    # The SNIP flags first, on their own: a bad one fails in a second, not after Megatron's start-up.
    early = add_snip_args(argparse.ArgumentParser(prog="snip-pretrain-gpt", add_help=False, allow_abbrev=False))
    try:
        snip_config_from_args(early.parse_known_args(argv)[0])
    except ValueError as e:
        print(f"snip-pretrain-gpt: error: {e}", file=sys.stderr)
        return 2
    cpu = not torch.cuda.is_available()
    if cpu:
        argv = CPU_FLAGS + _ckpt_format_flags() + argv
    sys.argv = [sys.argv[0]] + argv  # Megatron parses sys.argv
    import warnings

    warnings.filterwarnings("ignore", message=".*model provider.*")
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    if cpu:
        patch_arguments_for_cpu()
        # Megatron requires this with TP > 1 (a CUDA stream setting); meaningless on CPU.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = parse_and_validate_args(extra_args_provider=add_extra_args,
                                   args_defaults={"tokenizer_type": "NullTokenizer"})
    backend = args.snip_backend
    if backend == "auto":
        backend = "te" if args.transformer_impl == "transformer_engine" and not cpu else "emulated"
    if backend == "te" and cpu:
        print("snip-pretrain-gpt: error: --snip-backend te needs a GPU; use emulated", file=sys.stderr)
        return 2
    try:
        snip_config_from_args(args)  # fail before any process group exists
        if cpu:
            prepare_cpu(args)
        start_snip(args, backend=backend, controller=controller)
    except ValueError as e:
        print(f"snip-pretrain-gpt: error: {e}", file=sys.stderr)
        return 2
    skip_prebuilt_helpers()
    container = pretrain_cfg_container_from_args(args, None)
    pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)
    return 0


def cli() -> None:
    """Console entry point `snip-pretrain-gpt`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
