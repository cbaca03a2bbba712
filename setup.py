"""Where the one import package ``tidegate`` finds its parts (everything else is in pyproject.toml).

The roles, the kernels and the benchmarks stay at the top of the repository, the project's
layout, and install as subpackages of ``tidegate``: ``producer/`` is ``tidegate.producer``,
``kernels/`` is ``tidegate.kernels``, and so on. A folder added under any of them is found here,
so the wheel's only top-level package stays ``tidegate``.
"""

from setuptools import find_packages, setup

# The folders at the repository's top that install inside ``tidegate``.
PARTS = ("producer", "worker", "kernels", "streaming", "benchmarks")


def packages() -> list[str]:
    found = find_packages(include=["tidegate", "tidegate.*"])
    for part in PARTS:
        found.append(f"tidegate.{part}")
        found += [f"tidegate.{part}.{p}" for p in find_packages(part)]
    return found


setup(
    packages=packages(),
    package_dir={"tidegate": "tidegate", **{f"tidegate.{part}": part for part in PARTS}},
)
