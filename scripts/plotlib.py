"""Shared by the plot scripts: matplotlib, installed with pip on first use when it is missing."""
import subprocess
import sys


def pyplot():
    try:
        import matplotlib
    except ImportError:
        print("installing matplotlib ...", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "matplotlib"])
        import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
