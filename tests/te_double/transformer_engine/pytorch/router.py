"""Test double of `transformer_engine.pytorch.router` (TE 2.14). Megatron 0.16/0.19 import these
MoE router kernels unguarded when TE >= 2.7; the double does not model them."""


def _not_modelled(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"transformer_engine test double: the fused MoE router kernel "
                                  f"{name} is not modelled")

    kernel.__name__ = name
    return kernel


fused_topk_with_score_function = _not_modelled("fused_topk_with_score_function")
fused_compute_score_for_moe_aux_loss = _not_modelled("fused_compute_score_for_moe_aux_loss")
fused_moe_aux_loss = _not_modelled("fused_moe_aux_loss")
