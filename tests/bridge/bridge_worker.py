"""One Megatron-Bridge pretrain() of the tiny GPT with SNIP, on CPU, for the bridge lane's tests:
one process (`python`) or several (`torchrun`, gloo). Each rank writes <out>/rank<R>.json: the
losses it saw (last pipeline stage), the plan its own linears run at the end, and the
controller's plan and history; `--kill-at K` ends the process abruptly when step K starts (after
the checkpoints before it are written), as a crash would."""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from te_stub import lora_layers  # noqa: E402

lora_layers.install()


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--distopt", action="store_true")
    p.add_argument("--recompute", action="store_true", help="full activation recompute, every layer")
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--ckpt-step", type=int, default=None)
    p.add_argument("--weights-only", action="store_true",
                   help="load only the weights of --load (no optimizer or RNG state)")
    p.add_argument("--save-interval", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--snip", default="{}", help="SnipConfig fields as JSON (enabled is set)")
    p.add_argument("--no-snip", action="store_true", help="plain Bridge (no SNIP)")
    p.add_argument("--hybrid", default=None, help="a HybridModel of this layer pattern (HybridModelProvider, "
                   "Transformer Engine linears: run over the TE double) instead of the GPT")
    p.add_argument("--model", choices=("gpt", "mla", "moe", "deepseek"), default="gpt",
                   help="the GPT (tiny.tiny_config), MLAModelProvider's (tiny_mla_config), a Qwen3-MoE "
                   "(tiny_moe_config) or a DeepSeek-V3-style MLA + MoE (tiny_deepseek_config)")
    p.add_argument("--mtp", type=int, default=0, help="multi-token-prediction layers of the GPT, MLA or DeepSeek model")
    p.add_argument("--untied", action="store_true", help="untied embeddings and output layer (MTP at PP > 1 needs "
                   "them: support rule mtp-pp-tied-embeddings)")
    p.add_argument("--te", action="store_true", help="Transformer Engine linears (Bridge's default TE layer spec; "
                   "run over the TE double)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism (an MoE model's experts over EP ranks)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallelism (default: Megatron's, the TP size)")
    p.add_argument("--cp", type=int, default=1, help="context parallelism (Bridge's gpt_step splits each "
                   "micro-batch over the CP ranks; TE's attention, over the TE double)")
    p.add_argument("--probe", default=None, help="a folder: every TE linear of each rank recorded after each step "
                   "(tests/pretrain/pretrain_worker.py `probe`)")
    return p.parse_args(argv)


def model_config(args):
    """The ConfigContainer of the arguments' model and layout."""
    import functools

    from tests.bridge import tiny

    if args.hybrid:
        make = functools.partial(tiny.tiny_hybrid_config, args.hybrid)
    else:
        make = {"gpt": tiny.tiny_config, "moe": tiny.tiny_moe_config,
                "mla": functools.partial(tiny.tiny_mla_config, mtp_num_layers=args.mtp or None),
                "deepseek": functools.partial(tiny.tiny_deepseek_config, mtp_num_layers=args.mtp or None)}[args.model]
    layers = {} if args.hybrid else {"num_layers": args.layers}
    cfg = make(**layers, iters=args.iters, tp=args.tp, pp=args.pp, vpp=args.vpp,
               distributed_optimizer=args.distopt, save=args.save, load=args.load, save_interval=args.save_interval)
    m = cfg.model
    if args.hybrid and args.model == "moe":  # the pattern's E layers: the tiny Qwen3-MoE's experts
        for name, value in tiny.QWEN3_MOE.items():
            setattr(m, name, value)
    if args.mtp and args.model == "gpt":
        m.mtp_num_layers = args.mtp
    if args.untied:
        m.share_embeddings_and_output_weights = False
    if args.te or args.hybrid:
        tiny.on_te(m, layer_spec=args.te)
    m.sequence_parallel = args.sp
    m.context_parallel_size = args.cp
    m.expert_model_parallel_size = args.ep
    m.expert_tensor_parallel_size = args.etp
    cfg.checkpoint.ckpt_step = args.ckpt_step
    if args.recompute:
        m.recompute_granularity, m.recompute_method, m.recompute_num_layers = "full", "uniform", 1
    if args.weights_only:
        cfg.checkpoint.load_optim = cfg.checkpoint.load_rng = False
    if args.probe:  # the probe checks that every step moves every weight: no step at learning rate 0
        cfg.scheduler.lr_warmup_iters = 0
    return cfg


def main(argv=None) -> None:
    args = parse(argv)
    from tests.bridge import cpu, tiny

    cpu.install()
    if args.hybrid or args.te:  # over the TE double: SNIP reads the double's GPU generation
        from tests.pretrain.pretrain_worker import use_the_doubles_gpu

        assert use_the_doubles_gpu(), "--hybrid and --te run over the TE double (tests/te_double on PYTHONPATH)"
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from snip_megatron.bridge import enable_snip
    from snip_megatron.bridge.run import active
    from snip_megatron.config import SnipConfig
    from snip_megatron.megatron.apply import current_plan

    cfg = model_config(args)
    snip = SnipConfig(enabled=not args.no_snip, **json.loads(args.snip))
    record = tiny.recorder()
    callbacks = enable_snip(cfg, snip) + [record]
    run = active(cfg)
    if args.probe and run is not None:
        from pathlib import Path

        from snip_megatron.bridge.run import make_controller
        from tests.pretrain.pretrain_worker import probe

        Path(args.probe).mkdir(parents=True, exist_ok=True)
        run.controller_factory = lambda *a: probe(make_controller(*a), Path(args.probe))

    class Kill(Callback):
        def on_train_step_start(self, context):
            if context.state.train_state.step + 1 == args.kill_at:
                os._exit(17)  # no clean-up, no final checkpoint: a crash

    if args.kill_at is not None:
        callbacks.append(Kill())
    pretrain(cfg, forward_step, callbacks=callbacks)
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {"rank": rank, "losses": record.losses,
           "local_plan": {str(k): p.value for k, p in current_plan(record.model).items()},
           "plan": {str(k): p.value for k, p in run.controller.plan.items()} if run else None,
           "history": run.controller.history if run else None,
           "plan_source": run.controller.plan_source if run else None}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1)
    cpu.uninstall()


if __name__ == "__main__":
    main()
