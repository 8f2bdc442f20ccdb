"""Each entry's real input for a rule's example: Megatron-LM's command line, derived from the
example through the entry's own names (support.names), so the flag a user would type is the one tested."""

from __future__ import annotations

TINY_MEGATRON_LM = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
                    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                    "--train-iters", "2", "--vocab-size", "256", "--mock-data", "--position-embedding-type", "rope",
                    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]
"""A tiny Llama-like GPT (RMSNorm, SwiGLU, RoPE) on mock data."""


def megatron_lm_input(example: dict) -> "tuple[list[str], dict, str] | None":
    """(argv, environment, family) of Megatron-LM's entry for `example`, or None where a setting has
    no Megatron-LM flag (the rule cannot be reached from its command line)."""
    from snip_megatron.support.names import MegatronLMNames

    names = MegatronLMNames()
    if not all(names.reaches(path) for path in example):
        return None
    argv, env, family = [], {}, "gpt"
    for path, value in example.items():
        if path == "run.family":
            family = value
        elif path == "run.world_size":
            env["WORLD_SIZE"] = str(value)
        elif path in ("run.cuda", "run.te_installed", "run.te_version"):
            continue  # facts of the machine: the test sets them
        elif path == "run.te_environ":
            env.update(dict(value))  # TE's switches: the launch's environment
        elif value is None or value is False:
            continue
        elif path == "run.backend":
            argv += ["--snip-backend", value]
        else:
            flag = names.name(path)
            if isinstance(value, (list, tuple)):
                value = ",".join(value)
            argv += [flag] if value is True else [flag, str(value)]
    return argv, env, family


def megatron_lm_args(*argv, world_size: int = 1):
    """Megatron-LM's parsed and validated arguments (with SNIP's flags and the CPU flags) of the
    tiny GPT and `argv`, as snip-pretrain-gpt's parse gives them (without Megatron's globals)."""
    import argparse
    import contextlib
    import io
    import os

    from megatron.training.arguments import add_megatron_arguments, validate_args

    from snip_megatron.pretrain import cpu
    from snip_megatron.pretrain.entry import add_extra_args

    cpu.patch_arguments_for_cpu()  # as snip-pretrain-gpt does on CPU: Megatron's GPU queries answered
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # ... and Megatron's TP > 1 requirement met
    parser = add_extra_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)))
    args = parser.parse_args([*cpu.cpu_flags(), *TINY_MEGATRON_LM, "--transformer-impl", "local", *argv])
    args.world_size, args.rank = world_size, 0
    with contextlib.redirect_stdout(io.StringIO()):  # Megatron prints its whole argument table
        validate_args(args, {"tokenizer_type": "NullTokenizer"})
    return args
