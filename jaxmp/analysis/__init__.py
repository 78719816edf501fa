"""Analysis: what a run costs, read from the trainer's own program (never in the hot path).

* :mod:`~jaxmp.analysis.accounting`: per-device memory and gradient traffic per precision
  mode, from the :class:`~jaxmp.train.experiment.Experiment`'s jitted step;
* :mod:`~jaxmp.analysis.cost`: FLOPs, GPU-hours, days and energy; MFU;
* :mod:`~jaxmp.analysis.article`: the DeepSeek mixed-precision article's tables, rechecked;
* :mod:`~jaxmp.analysis.report`: the ``python -m jaxmp.report`` command line.

Depends on :mod:`jaxmp.train`; nothing in the trainer imports it.
"""
