"""The Hugging Face families jaxmp maps, one module each.

Each module declares ``FAMILY``, its :class:`~jaxmp.models.hf.spec.Family` record: the
``config.json`` fields it reads (typed, ranged, with transformers' defaults for it), the
ModelConfig fields it fixes, its MoE tensor names and the few hooks it needs. A module may
build on another's declarations, as transformers' ``modular_*.py`` files do (GLM-4.5 takes
DeepSeek-V3's router fields). :data:`FAMILIES` collects every module of this package, so
adding a family is adding its module (and its test parameters and its row in the README's
family table).
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Dict

from jaxmp.models.hf.spec import Family

__all__ = ["FAMILIES"]


def _collect() -> Dict[str, Family]:
    families = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        family = importlib.import_module(f"{__name__}.{info.name}").FAMILY
        if family.model_type != info.name:
            raise ValueError(f"{__name__}.{info.name} declares model_type "
                             f"{family.model_type!r}; a family's module is named after it")
        families[family.model_type] = family
    return families


# ``{model_type: Family}``, in the order of the module names.
FAMILIES: Dict[str, Family] = _collect()
