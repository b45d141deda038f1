"""Weight and KV-cache quantization through llm-compressor, saved in compressed-tensors format.

qgate quantize --model runs/base --calib runs/calib/calib --scheme awq-w4a16 --out runs/awq
"""
