import pytest

from snip_megatron.train.config import TrainConfig


def test_sequence_longer_than_the_model_raises():
    with pytest.raises(ValueError, match="seq_length=256 is longer than the model's sequence length 128"):
        TrainConfig(model="llama_tiny", seq_length=256)
    assert TrainConfig(model="llama_tiny", seq_length=64).seq_len == 64


@pytest.mark.parametrize("field, value, match", [
    ("model", "llama_nope", "unknown model"),
    ("steps", 0, "steps"),
    ("lr_decay_style", "exp", "lr_decay_style"),
    ("min_lr", 1.0, "min_lr"),
    ("backend", "cuda", "backend"),
    ("precision", "fp2", "precision"),
    ("formats", "nvfp4", "TrainConfig.formats must be a Formats"),
    ("params_dtype", "fp16", "params_dtype"),
    ("warmup_steps", 500, "warmup_steps"),
    ("load_step", 3, "load_dir"),
    ("mla", {"kv_lora_rank": 64}, "TrainConfig.mla must be a models.gpt.MLADims"),
    ("moe", {"num_experts": 4}, "TrainConfig.moe must be a models.gpt.MoEDims"),
])
def test_bad_fields_raise_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{field: value})


@pytest.mark.compat
def test_multi_latent_attention_needs_one_tensor_parallel_rank():
    """Megatron's MLA needs sequence parallelism at TP > 1 (snip_megatron/megatron/mla.py), which the
    compact loop does not run: refused with the way out. (On megatron-core < 0.17 without TE MLA
    cannot be built at all: refused at once, naming why.)"""
    from snip_megatron.megatron.apply import megatron_core_version
    from snip_megatron.megatron.model import te_importable

    if megatron_core_version() < (0, 17) and not te_importable():
        with pytest.raises(ValueError, match=r"multi-latent attention on megatron-core < 0.17 needs Transformer Engine"):
            TrainConfig(model="llama_tiny_mla")
        return
    with pytest.raises(ValueError, match=r"the compact loop cannot run this \(--model llama_tiny_mla, --tp 2.*--model "
                                         r"llama_tiny_mla \(multi-latent attention\) at --tp 2: .*snip-pretrain-gpt "
                                         r"--multi-latent-attention --sequence-parallel"):
        TrainConfig(model="llama_tiny_mla", tp=2)
    assert TrainConfig(model="llama_tiny").mla is None and TrainConfig(model="llama_tiny_mla").mla is not None


def test_moe_runs_at_one_process_on_the_local_spec(monkeypatch):
    """The compact loop runs MoE at one process (Megatron-LM's loop runs it at EP/PP/DP): tp/pp > 1
    (and dp > 1, at the Trainer's start-up) are refused, and the TE backend with Megatron-LM's
    loop's reason."""
    from snip_megatron.te import installed

    with pytest.raises(ValueError, match=r"MoE on 2 processes: the compact loop runs MoE at one process; "
                                         r"snip-pretrain-gpt runs it"):
        TrainConfig(model="llama_tiny_moe", tp=2)
    monkeypatch.setattr(installed, "te_installed", lambda: True)  # a GPU machine's TE
    with pytest.raises(ValueError, match=r"cannot run this \(--model llama_tiny_moe, .*\): --backend te: the compact "
                                         r"loop's Transformer Engine path needs a GPU"):
        TrainConfig(model="llama_tiny_moe", backend="te")
    assert TrainConfig(model="llama_tiny").moe is None and TrainConfig(model="llama_tiny_moe").moe is not None


def test_the_schedule_fields_are_checked_by_their_owner():
    from snip_megatron.train.config import TrainingSchedule

    with pytest.raises(ValueError, match="TrainingSchedule.eval_batches must be a positive integer"):
        TrainingSchedule(eval_batches=0)
    with pytest.raises(ValueError, match="TrainConfig.eval_batches must be a positive integer"):
        TrainConfig(eval_batches=0)  # the same check, named for the config that failed


def test_local_backend_cannot_take_fp8():
    with pytest.raises(ValueError, match="emulated"):
        TrainConfig(backend="local", precision="fp8")


def test_defaults():
    c = TrainConfig(steps=50)
    assert c.num_warmup_steps == 5 and c.data_config.vocab_size == c.shape.vocab_size == 4096
