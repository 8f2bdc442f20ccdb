"""What SNIP supports, with one owner: the rules over Megatron-Core's configs (each written once
with its reason and fix, spelled per entry) and the support matrix made from them.

    settings.py  Settings: the run's configs (TransformerConfig, DDP, optimizer, checkpoint) and facts
    rule.py      Rule: condition, why, fix, an example that makes it hold
    rules/       every rule, by subject (precision, features, models, MoE)
    names.py     how each entry spells a setting (Megatron-LM flag, Bridge field, compact-loop flag)
    check.py     the rules applied to one run

Each entry (pretrain/, bridge/, train/) converts its user input to Settings at its edge and asks
`check.refusals`; nothing else decides what SNIP refuses.
"""
