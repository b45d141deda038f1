"""Matplotlib for qgate's pictures: headless, with every label drawn as the text it is.

    plt = pyplot()      # the Agg backend; "$" in a label (a tenant, a route, a word from traffic) is a dollar sign

Labels come from traffic (tenants, routes, words) and from specs (variant names). Matplotlib parses text between two
dollar signs as TeX, and raises on TeX it cannot parse, so a tenant named "$\\frac{$" would stop a calibration or a
drift check at its picture; qgate draws no formulas, so math parsing is off.
"""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend, with math parsing of text off."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt
