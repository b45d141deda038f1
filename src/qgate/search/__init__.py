"""Search for the smallest variant that passes the gate: per-layer sensitivity and the fallback plan.

qgate search --spec pipelines/promote.yaml --variant awq-w4a16-searched
"""
