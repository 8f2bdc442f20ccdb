"""The keyword arguments Megatron passes to a local linear's `_forward_impl`, and what SNIP's
emulated linears do with each.

Megatron's Column/RowParallelLinear.forward call `self._forward_impl(input=..., weight=..., ...)`
with keywords only; SNIP's emulated linears override that private method (parallel_linear.py), so
every keyword must be one SNIP knows: honoured, or refused when its value asks for something the
emulated GEMM does not do. A keyword SNIP does not know is refused by name, at construction (where
Megatron's forward is readable: `keywords_passed`) and at the call, never dropped.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

FORWARD_IMPL_KEYWORDS = {
    "input": "the GEMM's input",
    "weight": "the GEMM's weight",
    "bias": "honoured: added to the GEMM's output",
    "gradient_accumulation_fusion": "honoured: the weight gradient is added into weight.main_grad",
    "allreduce_dgrad": "honoured: the input's gradient is all-reduced over tensor parallelism",
    "sequence_parallel": "honoured: the input is all-gathered over the sequence-parallel group",
    "tp_group": "honoured: the group of those two collectives (None: the layer's own)",
    "grad_output_buffer": "refused unless None (defer_embedding_wgrad_compute)",
    "wgrad_deferral_limit": "honoured: read only with a grad_output_buffer, which is refused",
    "gtp_remat_size": "refused above 1 (generalized TP shards the weight: "
                      "ModelParallelConfig.tensor_parallel_num_weight_shards)",
    "output_dtype": "refused unless None or the input's dtype (the LM head's --output-logit-dtype)",
}
"""Every keyword Megatron-Core 0.16 through main passes to `_forward_impl`
(tensor_parallel/layers.py: `gtp_remat_size` from 0.19, `output_dtype` on main), and what the
emulated linears do with it."""


def check_keywords(owner: str, names) -> None:
    """TypeError naming each of `names` SNIP does not know (`owner`: the class, for the message)."""
    unknown = sorted(set(names) - set(FORWARD_IMPL_KEYWORDS))
    if unknown:
        raise TypeError(f"{owner}._forward_impl: Megatron passes {', '.join(unknown)}, which SNIP's emulated "
                        f"linear does not know (it knows {', '.join(FORWARD_IMPL_KEYWORDS)}): this Megatron is "
                        "newer than the ones this snip-megatron was written for (megatron-core 0.16 to 0.20); "
                        "update snip-megatron, or use one of those")


def check_values(owner: str, input_dtype, grad_output_buffer=None, gtp_remat_size=1, output_dtype=None) -> None:
    """ValueError naming the first keyword whose value the emulated GEMM cannot honour."""
    if grad_output_buffer is not None:
        raise ValueError(f"{owner}: defer_embedding_wgrad_compute (grad_output_buffer) is not supported by the "
                         "emulated quantized linear; turn --defer-embedding-wgrad-compute off")
    if gtp_remat_size not in (None, 1):
        raise ValueError(f"{owner}: gtp_remat_size={gtp_remat_size}: generalized tensor parallelism shards the "
                         "weight, and SNIP's emulated GEMM would read the shard as the whole weight; set "
                         "--tensor-parallel-num-weight-shards to the tensor-parallel size (no weight sharding)")
    if output_dtype is not None and output_dtype != input_dtype:
        raise ValueError(f"{owner}: output_dtype={output_dtype} (--output-logit-dtype) differs from the input's "
                         f"{input_dtype}; SNIP's emulated GEMM returns the input's dtype: drop the flag, or keep "
                         "this linear out of SNIP's plan")


@functools.lru_cache(maxsize=None)
def keywords_passed(forward) -> "tuple[str, ...] | None":
    """The keyword names `forward` (a Megatron linear's forward) passes to `self._forward_impl(...)`,
    read from its source; None where the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(forward)))
    except (OSError, TypeError):
        return None
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "_forward_impl"):
            names += [k.arg for k in node.keywords if k.arg is not None]
    return tuple(dict.fromkeys(names))


def check_module(module, megatron_class) -> None:
    """At construction of an emulated linear subclassing `megatron_class`: every keyword Megatron's
    forward passes is known, and the layer's own settings ask for nothing refused."""
    owner = type(module).__name__
    passed = keywords_passed(megatron_class.forward)
    if passed is not None:
        check_keywords(owner, passed)
    check_values(owner, getattr(getattr(module, "config", None), "params_dtype", None),
                 gtp_remat_size=getattr(module, "gtp_remat_size", 1),
                 output_dtype=getattr(module, "output_dtype", None))
