"""Shared by the plot scripts: matplotlib from Debian's python3-matplotlib (scripts/setup-deps.sh installs
it), drawing to files."""
import sys


def pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit("error: matplotlib is missing: run scripts/setup-deps.sh (it installs Debian's python3-matplotlib) "
                 "or use a Python that has it")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
