"""qgate: quantize LLMs, gate them against real traffic, and promote only what passes.

qgate run pipelines/promote.yaml
"""

__version__ = "0.1.0"
