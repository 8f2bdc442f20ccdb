"""Megatron-LM's GPT forward step, batch and datasets (as its pretrain_gpt.py builds them, from
Megatron's own functions), plus `--corpus`: real text tokenized here instead of a prepared
`--data-path`.

Every data flag keeps its effect: attention masks (`--create-attention-mask-in-dataloader`),
`--reset-position-ids`, `--reset-attention-mask`, `--eod-mask-loss`, context-parallel slicing,
`--split`, `--data-cache-path`, `--mock-data`, `--data-path` blends and per-split paths.
"""

from __future__ import annotations

import argparse
from functools import partial

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
BACKEND_CHOICES = ("auto", "emulated", "te")
"""--snip-backend: auto picks te with --transformer-impl transformer_engine, else emulated."""


def add_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--corpus` (real text tokenized here) and `--snip-backend`."""
    g = parser.add_argument_group(title="snip-megatron data")
    g.add_argument("--corpus", default=None, metavar="SPEC",
                   help='Text to train on: "stdlib", a folder, a glob or file.jsonl[:field]; '
                        "tokenized once and cached (see --corpus-cache).")
    g.add_argument("--corpus-cache", default=".cache/snip-data", metavar="DIR",
                   help="Cache folder of tokenized corpora (default %(default)s).")
    g.add_argument("--corpus-tokenizer", default=None, metavar="PATH",
                   help="tokenizers JSON file for --corpus or --data-path; default: train one of "
                        "--vocab-size tokens on the corpus.")
    g.add_argument("--snip-backend", choices=BACKEND_CHOICES, default="auto",
                   help="Planned linears: emulated (SNIP's fake-quantized linears in Megatron's local "
                        "spec, any device) or te (Megatron's Transformer Engine linears, planned through "
                        "quant_recipe); auto: te with --transformer-impl transformer_engine, else emulated.")
    return parser


def get_batch(data_iterator, vp_stage=None, mtp_here: bool = False) -> dict:
    """This rank's micro-batch, as Megatron-LM's pretrain_gpt gets it: TP rank 0 reads it, Megatron
    broadcasts it over the TP group (the tensors this pipeline stage needs) and slices it for
    context parallelism. Stages that neither embed, compute the loss nor hold multi-token-prediction
    layers get Nones. `mtp_here`: this chunk builds MTP layers (the model's `mtp_process`), which
    embed the tokens again, so the stage gets every tensor (tokens and positions also on the last)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    from snip_megatron.megatron.batch import on_this_cp_rank

    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return dict.fromkeys(BATCH_KEYS)
    args = get_args()
    tp_rank = ps.get_tensor_model_parallel_rank()
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        batch = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in sample.items()}
        batch.setdefault("attention_mask", None)
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(),
        broadcast_group=ps.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        is_pipeline_last_stage=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage))
    batch = on_this_cp_rank(batch, ps.get_context_parallel_group())
    return {k: batch.get(k) for k in BATCH_KEYS}


def loss_func(loss_mask, output_tensor):
    """Summed masked loss, token count and the report Megatron averages over DP ranks (NaN/Inf
    checks as Megatron-LM's, through its rerun state machine)."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        machine = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron's forward_step_func (training, validation and the controller's measurement)."""
    from megatron.core.utils import get_attr_wrapped_model

    if return_schedule_plan:
        raise ValueError("--overlap-moe-expert-parallel-comm needs MoE, which SNIP refuses")
    # whether this chunk holds multi-token-prediction layers: GPTModel's and HybridModel's own
    # `mtp_process` (`mtp_on_this_rank`: the last stage, or where --pipeline-model-parallel-layout puts them)
    mtp_here = bool(get_attr_wrapped_model(model, "mtp_process"))
    batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"), mtp_here)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"], loss_mask=batch["loss_mask"])
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


def dataset_config(args):
    """GPTDatasetConfig from Megatron-LM's data flags (its `core_gpt_dataset_config_from_args`),
    with `--corpus` or `--corpus-tokenizer` for text tokenized by snip-megatron."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split, cache = None, None, args.data_cache_path
    corpus, corpus_tokenizer = getattr(args, "corpus", None), getattr(args, "corpus_tokenizer", None)
    if corpus is not None:  # (a script without add_data_args has neither)
        from snip_megatron.data.tokenizer import MegatronTokenizer

        data = _prepared_corpus(args)
        if data.vocab_size > args.vocab_size:
            raise ValueError(f"--corpus {corpus}: its tokenizer has {data.vocab_size} tokens, "
                             f"more than --vocab-size {args.vocab_size}")
        tokenizer, blend = MegatronTokenizer(data.tokenizer_path), ([data.prefix], None)
        cache = cache or str(data.cache_dir) + "/gpt_indices"
    else:
        if not args.mock_data:
            blend, blend_per_split = get_blend_and_blend_per_split(args)
            if blend is None and blend_per_split is None:
                raise ValueError("give --mock-data, --corpus SPEC, or --data-path PREFIX (with "
                                 "--corpus-tokenizer PATH or a Megatron --tokenizer-type)")
        if corpus_tokenizer is not None:
            from snip_megatron.data.tokenizer import MegatronTokenizer

            tokenizer = MegatronTokenizer(corpus_tokenizer)
        else:
            tokenizer = build_tokenizer(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, path_to_cache=cache,
        # Megatron-LM's own default when --data-path comes without --split; --corpus is such a path.
        split=args.split if args.split is not None or blend is None else "969, 30, 1",
        mmap_bin_files=args.mmap_bin_files, tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Train/valid/test GPT datasets: Megatron's mock data, --corpus text, or --data-path."""
    from megatron.core import parallel_state as ps
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args, print_rank_0
    from megatron.training.utils import is_first_or_last_pipeline_stage

    from snip_megatron.data.gpt import ensure_helpers

    args = get_args()
    config = dataset_config(args)
    dataset_type = MockGPTDataset if args.mock_data and getattr(args, "corpus", None) is None else GPTDataset
    if dataset_type is GPTDataset:
        ensure_helpers()
    print_rank_0(f"> building GPT datasets ({dataset_type.__name__}) ...")

    def built_here():
        return ps.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)

    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, built_here, config).build()


datasets_provider.is_distributed = True  # called on every rank (the corpus step has a barrier)
