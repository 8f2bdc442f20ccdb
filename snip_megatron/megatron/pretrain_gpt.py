"""snip-pretrain-gpt: GPT pretraining on Megatron-LM's loop (`megatron.training.pretrain`) with SNIP.

    torchrun --nproc-per-node 8 -m snip_megatron.megatron.pretrain_gpt <Megatron-LM arguments> \\
        --snip --snip-fp4-budget 0.75 --snip-interval 1000

Takes every Megatron-LM argument plus the `--snip*` flags (snip_megatron.megatron.args) and
`--corpus` (text tokenized here). The model is Megatron's GPTModel with SNIP's planned linears in
its layer spec and the plan as `TransformerConfig.quant_recipe`. The plan comes from, first to
last: a pinned `--snip-plan`; the checkpoint being resumed; `--snip-plan`; `--snip-baseline`;
`--snip-initial-precision` everywhere. The plan (and the controller's state) is written next to
every checkpoint as `snip_state.json`, so a resumed run starts from the plan it stopped with.

The controller (`snip_megatron.controller.SnipController`) is driven from `forward_step`, the one
function of ours Megatron's loop calls every step: see `SnipRun.on_forward` and `SnipHooks`.
Needs megatron-core >= 0.19 (which ships `megatron.training`); runs on CPU (gloo) without a GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import dataclass, field
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
    """What the loop calls on a controller (every method optional). `snip_megatron.controller.
    SnipController` implements it; tests pass a recorder."""

    def on_train_start(self, run: "SnipRun", model_chunks: list) -> None: ...
    def on_step_begin(self, run: "SnipRun", iteration: int, model_chunks: list) -> None: ...
    def on_step_end(self, run: "SnipRun", iteration: int, loss: Optional[float]) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


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
    """The plan the model runs now (snip_megatron.plan.Plan), None when SNIP is off."""
    plan_source: str = "off"
    """Where `plan` came from (logged and saved)."""
    controller: Any = None
    """Object with (some of) the SnipHooks methods, or None: the plan stays fixed."""
    controller_state: Optional[dict] = None
    """Controller state restored from a checkpoint, handed over when the controller starts."""
    model_chunks: list = field(default_factory=list)
    """This rank's model chunks, once built."""
    _iteration: Optional[int] = None
    _losses: list = field(default_factory=list)

    # Called from forward_step for every micro-batch: the first call of a new iteration is the
    # step boundary, where the controller may measure or apply a new plan.
    def on_forward(self, iteration: int, training: bool) -> None:
        if not training or iteration == self._iteration:
            return
        if self._iteration is None:
            self._call("on_train_start", self, self.model_chunks)
        else:
            self._call("on_step_end", self, self._iteration, self._mean_loss())
        self._iteration = iteration
        self._losses.clear()
        self._call("on_step_begin", self, iteration, self.model_chunks)

    def record_loss(self, loss: float) -> None:
        self._losses.append(loss)

    def _mean_loss(self) -> Optional[float]:
        return sum(self._losses) / len(self._losses) if self._losses else None

    def _call(self, name: str, *args) -> None:
        fn = getattr(self.controller, name, None)
        if fn is not None:
            fn(*args)

    def set_plan(self, plan, source: str) -> None:
        """Apply `plan` to this rank's chunks (every rank, same step) and remember it."""
        from snip_megatron.megatron.quant_recipe import build_recipe

        plan.check_model(self.num_layers)
        for chunk in self.model_chunks:
            module = _unwrap(chunk)
            offset = _layer_offset(module.config, getattr(module, "vp_stage", None))
            recipe = build_recipe(plan, layer_offset=offset, backend=_recipe_backend(self.backend),
                                  num_layers=self.num_layers, fp8_recipe=self.config.fp8_recipe,
                                  fp4_recipe=self.config.fp4_recipe)
            from megatron.core.quantization.utils import get_quant_config_or_none

            for name, sub in module.named_modules():
                if hasattr(sub, "finish_init") and name:
                    sub.finish_init(get_quant_config_or_none(name, recipe))
        self.plan, self.plan_source = plan, source

    def state_dict(self, iteration: int) -> dict:
        state = {"version": STATE_VERSION, "iteration": iteration, "snip_config": self.config.to_dict(),
                 "plan_source": self.plan_source,
                 "plan": self.plan.to_dict() if self.plan is not None else None}
        fn = getattr(self.controller, "state_dict", None)
        state["controller"] = fn() if fn is not None else self.controller_state
        return state


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


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


def write_state(save_dir: str, iteration: int, run: SnipRun) -> Path:
    """Write snip_state.json into the checkpoint folder of `iteration` (atomic rename)."""
    folder = Path(save_dir) / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(run.state_dict(iteration), indent=1))
    os.replace(tmp, path)
    return path


def initial_plan(cfg: SnipConfig, num_layers: int, resumed: Optional[dict]):
    """(plan, source) the model is built with; (None, "off") when SNIP is off."""
    from snip_megatron.plan import Plan

    if not cfg.enabled:
        return None, "off"
    if cfg.pin_plan:
        return Plan.load(cfg.plan).check_model(num_layers), f"pinned {cfg.plan}"
    if resumed is not None and resumed.get("plan") is not None:
        return Plan.from_dict(resumed["plan"]).check_model(num_layers), "checkpoint"
    if cfg.plan is not None:
        return Plan.load(cfg.plan).check_model(num_layers), f"file {cfg.plan}"
    if cfg.baseline is not None:
        return baseline_plan(cfg, num_layers), f"baseline {cfg.baseline}"
    return Plan.uniform(num_layers, cfg.initial_precision), f"initial {cfg.initial_precision}"


def baseline_plan(cfg: SnipConfig, num_layers: int, shape=None):
    """The fixed-rule plan of `cfg.baseline` (uniform ones here; the others from the planner)."""
    from snip_megatron.plan import Plan

    if cfg.baseline.startswith("uniform_"):
        return Plan.uniform(num_layers, cfg.baseline.split("_", 1)[1])
    try:
        from snip_megatron.planner import baselines
    except ImportError as e:
        raise ValueError(f"--snip-baseline {cfg.baseline} needs snip_megatron.planner.baselines, "
                         f"which is not available here ({e})") from None
    return baselines.baseline_plan(cfg.baseline, num_layers=num_layers, config=cfg, shape=shape)


def make_controller(run: SnipRun):
    """The default controller: none yet, so the plan stays fixed.

    SnipController measures through `trainer.forward_backward` on the step's own batch; inside
    Megatron-LM's loop that needs a re-entrant pass from `forward_step`, which is not wired yet.
    Until it is, a measuring config runs its initial plan fixed and says so; pass `controller=`
    to `main` to drive one through the same hooks.
    """
    if run.config.measures:
        _print_rank_0("[snip] measuring and re-planning inside Megatron-LM's loop is not wired yet: "
                      f"the plan stays fixed at {run.plan_source} (use the compact loop, "
                      "snip-train train.entry=compact, for adaptive plans)")
    return None


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
    if run is not None:
        run.model_chunks.append(model)
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
    if _RUN is not None and num_tokens > 0:
        _RUN.record_loss(float(loss.detach()) / float(num_tokens))
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron's forward_step_func; also SNIP's step-boundary hook (see SnipRun.on_forward)."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args

    if return_schedule_plan:
        raise ValueError("snip-pretrain-gpt does not support --overlap-moe-expert-parallel-comm")
    if _RUN is not None:
        _RUN.on_forward(get_args().curr_iteration, model.training)
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

    original = mtraining.save_checkpoint

    def save_checkpoint(iteration, *args, **kwargs):
        result = original(iteration, *args, **kwargs)
        margs = get_args()
        if margs.save and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            path = write_state(margs.save, iteration, run)
            print(f"[snip] saved plan ({run.plan_source}) to {path}", flush=True)
        return result

    mtraining.save_checkpoint = save_checkpoint


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


def _ckpt_format_flags() -> list[str]:
    """Megatron's default checkpoint writer (torch_dist) starts worker processes through psutil;
    where psutil is missing, default to the per-rank `torch` format (a user flag still wins)."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        return ["--ckpt-format", "torch"]
    return []


def main(argv: list[str] | None = None, controller=None) -> int:
    """Parse Megatron + SNIP arguments, build the SNIP state and run `megatron.training.pretrain`.

    `controller`: an object with the SnipHooks methods (default: SnipController when SNIP measures).
    """
    global _RUN
    require_megatron_training()
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    cpu = not torch.cuda.is_available()
    if cpu:
        argv = CPU_FLAGS + _ckpt_format_flags() + argv
    sys.argv = [sys.argv[0]] + argv  # Megatron parses sys.argv
    if cpu:
        # Megatron's process-group setup must not run first on CPU: it would pick NCCL defaults.
        os.environ.setdefault("LOCAL_RANK", "0")
    import warnings

    warnings.filterwarnings("ignore", message=".*model provider.*")
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=add_extra_args,
                                   args_defaults={"tokenizer_type": "NullTokenizer"})
    try:
        snip = snip_config_from_args(args)
    except ValueError as e:
        print(f"snip-pretrain-gpt: error: {e}", file=sys.stderr)
        return 2
    backend = args.snip_backend
    if backend == "auto":
        backend = "te" if args.transformer_impl == "transformer_engine" and not cpu else "emulated"
    if backend == "te" and cpu:
        print("snip-pretrain-gpt: error: --snip-backend te needs a GPU; use emulated", file=sys.stderr)
        return 2
    if cpu:
        prepare_cpu(args)
    resumed = read_state(args.load)
    plan, source = initial_plan(snip, args.num_layers, resumed)
    _RUN = run = SnipRun(config=snip, num_layers=args.num_layers, backend=backend, plan=plan,
                         plan_source=source,
                         controller_state=(resumed or {}).get("controller"))
    run.controller = controller if controller is not None else make_controller(run)
    if run.controller is not None and run.controller_state is not None:
        run._call("load_state_dict", run.controller_state)
    _print_rank_0(f"[snip] {'on' if snip.enabled else 'off'}; backend {backend}; plan: {source}"
                  + (f" {plan.counts()}" if plan is not None else ""))
    install_checkpoint_hook(run)
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
