"""Shared by the plot scripts: matplotlib from Debian's python3-matplotlib (scripts/setup-deps.sh installs
it), drawing to files."""
import sys


def pyplot():
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"error: matplotlib is missing from {sys.executable}: run the script with Debian's /usr/bin/python3 "
                 "(scripts/setup-deps.sh installs python3-matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
