"""MLflow Model Registry: register gated artifacts, promote by alias.

qgate register --gate runs/gate-awq --model-name smollm2-135m
qgate promote --model smollm2-135m --version 2 --alias production
"""
