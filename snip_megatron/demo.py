"""`make demo`: the built-in default job.

Today: the Megatron-Core smoke training on CPU (a tiny Llama-like GPT through Megatron's own
schedule, DDP and Adam). It becomes the SNIP quickstart (tiny recipe, real text, SNIP at 75% FP4)
as the training loop and controller land.
"""

from snip_megatron.megatron import smoke


def main() -> None:
    smoke.main(["--steps", "30"])


if __name__ == "__main__":
    main()
