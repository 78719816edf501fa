"""Deviceless GPU compiles (jaxmp.analysis.gpu) shared by every test of one pytest process:
each distinct step, keyed by its config file, overrides, target and device count, is
compiled once per test run, however many tests (and modules) read it. Tests that share
a compile are in one xdist group (tests/conftest.py), so that one worker compiles it."""
import functools

from _configs import load_config
from jaxmp.analysis import gpu


@functools.lru_cache(maxsize=None)
def compiled_step(config, overrides=(), target="H200", devices=1):
    """``gpu.compile_step`` of ``configs/CONFIG.py`` with ``overrides`` (a tuple of
    ``--config.KEY=VALUE`` items) for ``devices`` x ``target``, compiled once."""
    return gpu.compile_step(load_config(config, list(overrides)), gpu.get_target(target), devices)


@functools.lru_cache(maxsize=None)
def gpu_report(config, overrides=(), target="H200", devices=1, top=0):
    """``gpu.gpu_report`` of the step :func:`compiled_step` compiles (and shares)."""
    step = compiled_step(config, overrides, target, devices)
    return gpu.gpu_report(load_config(config, list(overrides)), gpu.get_target(target), devices,
                          top=top, step=step)
