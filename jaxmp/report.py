"""``python -m jaxmp.report``: the command line of :mod:`jaxmp.analysis.report`."""
import sys

from jaxmp.analysis.report import main

if __name__ == "__main__":
    from jaxmp._entry import cpu_without_a_gpu, quiet_xla_logs

    cpu_without_a_gpu()  # no CUDA plugin traceback on a machine without a GPU
    quiet_xla_logs()  # the report says in its own words what XLA's C++ warnings are about
    sys.exit(main())
