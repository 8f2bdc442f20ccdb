"""Smoke training: a tiny Llama-like GPT on one fixed batch, through Megatron's own schedule
(`get_forward_backward_func`), DDP and optimizer (`get_megatron_optimizer`, Adam, grad clipping).

    python -m snip_megatron.megatron.smoke --steps 20
    torchrun --standalone --nproc_per_node 2 -m snip_megatron.megatron.smoke --tp 2

Prints one line per step; `--out FILE` writes {"losses": [...]} as JSON from the last stage's
first rank. The loss must fall: the model memorises the batch.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from snip_megatron.megatron import runtime
from snip_megatron.shapes import ModelShape

SMOKE_SHAPE = ModelShape(name="smoke", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                         num_attention_heads=4, num_query_groups=2, vocab_size=256, seq_length=32)


def wrap_ddp_and_optimizer(chunks: list, config, *, lr: float, clip_grad: float,
                           distributed_optimizer: bool, weight_decay: float = 0.0):
    """Megatron DDP around each chunk and Megatron's Adam over them."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    ddp_chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                          disable_bucketing=(i > 0))
                  for i, chunk in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp_chunks[0].no_sync if len(ddp_chunks) == 1 else [c.no_sync for c in ddp_chunks]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                        bf16=config.bf16, fp16=False, params_dtype=config.params_dtype,
                        use_distributed_optimizer=distributed_optimizer),
        ddp_chunks)
    return ddp_chunks, optimizer


def train_fixed_batch(shape: ModelShape = SMOKE_SHAPE, *, steps: int = 20, micro_batch_size: int = 2,
                      num_microbatches: int = 2, lr: float = 3e-3, clip_grad: float = 1.0,
                      distributed_optimizer: bool = False, backend: str = "emulated",
                      seed: int = 1234, log=print) -> list[float]:
    """Train on one fixed set of micro-batches; returns the per-step mean loss (last stage only;
    other stages return an empty list). Parallel state must be initialised."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from snip_megatron.megatron.batch import make_forward_step, random_batch
    from snip_megatron.megatron.model import build_model_chunks

    runtime.seed_all(seed)
    chunks = build_model_chunks(shape, backend=backend)
    config = chunks[0].config
    ddp_chunks, optimizer = wrap_ddp_and_optimizer(chunks, config, lr=lr, clip_grad=clip_grad,
                                                   distributed_optimizer=distributed_optimizer)
    generator = torch.Generator().manual_seed(seed)  # same data on every rank
    batches = [random_batch(micro_batch_size, shape.seq_length, shape.vocab_size, generator)
               for _ in range(num_microbatches)]
    forward_backward = get_forward_backward_func()
    forward_step = make_forward_step()
    losses = []
    for step in range(steps):
        start = time.perf_counter()
        for chunk in ddp_chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        data = [iter(batches) for _ in ddp_chunks] if len(ddp_chunks) > 1 else iter(batches)
        reduced = forward_backward(forward_step_func=forward_step, data_iterator=data,
                                   model=ddp_chunks, num_microbatches=num_microbatches,
                                   seq_length=shape.seq_length, micro_batch_size=micro_batch_size,
                                   forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            loss = sum(float(r["lm loss"]) for r in reduced) / len(reduced)
            losses.append(loss)
            log(f"step {step:3d}  loss {loss:.6f}  grad_norm {float(grad_norm or 0):.4f}  "
                f"{(time.perf_counter() - start) * 1e3:.0f} ms")
    return losses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--backend", default="emulated", choices=("emulated", "local"))
    parser.add_argument("--out", default=None, help="write the losses as JSON here")
    args = parser.parse_args(argv)

    rank, _ = runtime.init_process_group()
    runtime.initialize_model_parallel(tp=args.tp, pp=args.pp, vpp=args.vpp)
    from megatron.core import parallel_state as ps

    def log(msg):
        print(f"[rank {rank}] {msg}", flush=True)

    losses = train_fixed_batch(steps=args.steps, distributed_optimizer=args.distributed_optimizer,
                               backend=args.backend, log=log)
    reporter = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0 \
        and ps.get_data_parallel_rank() == 0
    if reporter:
        log(f"first loss {losses[0]:.6f} -> last loss {losses[-1]:.6f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"losses": losses}, f)
    runtime.destroy(process_group=True)


if __name__ == "__main__":
    main()
