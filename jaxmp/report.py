"""``python -m jaxmp.report``: the command line of :mod:`jaxmp.analysis.report`."""
import sys

from jaxmp.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
