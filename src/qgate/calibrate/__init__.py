"""Calibration and shadow sets sampled from production traffic logs.

qgate calibrate sample --traffic traffic.jsonl --out runs/calib
"""
