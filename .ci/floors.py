"""Writes the constraints file that pins each direct dependency of pyproject.toml with a
floor (``>=X``) to that floor (``==X``): the lowest versions jaxmp claims to work with.
``.ci/run`` installs them into a second venv and runs the tests that touch each floor's
reason (pip has no lowest-direct resolution of its own; uv's ``--resolution
lowest-direct`` is the same idea).

    python .ci/floors.py EXTRA [EXTRA ...] > constraints.txt
"""
import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
project = project["project"]
wanted = project["dependencies"] + [r for extra in sys.argv[1:]
                                    for r in project["optional-dependencies"][extra]]
pins = {}
for requirement in wanted:
    match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", requirement)
    name, spec = match.group(1).lower(), match.group(3)
    floor = re.search(r"(?:>=|==)\s*([0-9][^,;\s]*)", spec)
    if floor:
        pins[name] = floor.group(1)
for name, version in sorted(pins.items()):
    print(f"{name}=={version}")
