"""Serving engines built from quantized checkpoints, and runners that score token ids on them.

qgate engine build --checkpoint runs/awq --backend cpu --out runs/awq-cpu
"""
