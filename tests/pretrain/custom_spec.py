"""A user's `--spec` for the runs in test_runs.py: Megatron's local GPT layer spec with its own
TransformerLayer subclass, so a test can see that Megatron built the user's spec."""

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_layer import TransformerLayer


class UserTransformerLayer(TransformerLayer):
    """Megatron's TransformerLayer under another name."""


def user_layer_spec(config, vp_stage=None):
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.module = UserTransformerLayer
    return spec
