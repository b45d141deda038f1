"""Pipelines: a strict YAML spec that chains every stage.

qgate run pipelines/promote.yaml
"""
