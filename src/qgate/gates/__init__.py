"""Deploy gates: shadow disagreement on held-out traffic, offline evals, and the report.

qgate gate --candidate runs/awq-cpu --baseline runs/base --shadow runs/calib/shadow --out runs/gate-awq
"""
