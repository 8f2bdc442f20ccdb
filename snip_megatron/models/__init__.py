"""Model-family adapters: the only code that knows which modules of a model are planned linears.

`inventory.Inventory` is the pure list of planned linears (keys, shapes, parallel kinds, FLOPs) every
other part works from; `gpt` (dense GPTModel) builds it from a shape or discovers it from built chunks.
"""
