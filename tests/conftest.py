"""Session-wide test setup that must happen before any test module imports triton, and the test groups of a
parallel run.

CI runs the suite on two pytest-xdist workers (`.ci/run` sets PYTEST_ADDOPTS="-n 2 --dist loadgroup"). The
modules that start Ray (a `ray start` head, or `python -m strata_ray.run`, whose `ray.init()` attaches to a
cluster already running on the machine) share the group "ray", so they run one after another on one worker:
two clusters at once would meet through /tmp/ray's current-cluster file and Ray's fixed default ports. A
plain `python -m pytest` (no -n) runs everything in one process and ignores the groups.
"""

from pathlib import Path

import pytest

from tests.kernels.triton_interpret import INTERPRET  # noqa: F401  (sets TRITON_INTERPRET when it applies)

ROOT = Path(__file__).resolve().parent.parent
RAY_MODULES = ("tests/actors/", "tests/serve/", "tests/bench/test_bench.py", "tests/test_run_cli.py",
               "tests/test_config.py", "tests/experts/test_metrics.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(item.path).resolve().relative_to(ROOT).as_posix().startswith(RAY_MODULES):
            item.add_marker(pytest.mark.xdist_group("ray"))
