"""A Kimi-K2-class MLA+MoE decode layer, one GPU's shard at TP8/EP8 (docs/mla_moe_notes.md).

config.py holds the architecture numbers, problem.py builds weights, inputs and the byte floor,
stock.py is vLLM's op sequence in torch (eager and torch.compile'd).
"""
