"""Fused residual-add + RMSNorm, the op every decode layer runs twice.

problem.py builds weights and inputs, stock.py is vLLM's native torch sequence, fused.py is one
Triton kernel with its dispatch guard.
"""
