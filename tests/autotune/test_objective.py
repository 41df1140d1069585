"""Objective values: throughput, pareto, the documented weighted formula, and what needs NVML."""

import pytest

from autotune.exceptions import SpecError
from autotune.objective import Objective, measured_attrs
from autotune.study.view import Outcome


def test_values_per_objective():
    attrs = {"imgs_per_s": 3000.0, "util_mean": 50.0, "power_mean_w": 600.0}
    assert Objective(kind="throughput").values(attrs) == [3000.0]
    assert Objective(kind="pareto").values(attrs) == [3000.0, 50.0]
    w = Objective(kind="weighted", weights={"throughput": 1.0, "util": 0.5, "power": 0.0})
    assert w.values(attrs)[0] == pytest.approx(3000.0 * 0.5 ** 0.5)
    per_joule = Objective(kind="weighted", weights={"throughput": 1.0, "util": 0.0, "power": 1.0})
    assert per_joule.values(attrs)[0] == pytest.approx(5.0)  # images per joule
    assert Objective(kind="pareto").infeasible_values() == [0.0, 0.0]


def test_objectives_that_need_nvml_are_refused_without_it():
    Objective(kind="throughput").check(False, "no GPU")
    with pytest.raises(SpecError, match=r"pareto needs NVML GPU utilization.*use --objective throughput"):
        Objective(kind="pareto").check(False, "no GPU")
    Objective(kind="weighted", weights={"throughput": 1.0, "util": 0.0, "power": 0.0}).check(False, "no GPU")


def test_states_and_the_windows_estimate_when_there_is_no_summary():
    assert [Outcome.ended(c) for c in (None, "oom", "config", "nccl", "hang", "loader", "crash")] == \
        [Outcome.MEASURED, Outcome.INFEASIBLE, Outcome.INFEASIBLE, *[Outcome.FAIL] * 4]
    assert Outcome.ended(None, part=True) == Outcome.PART and Outcome.ended("oom", pruned=True) == Outcome.PRUNED
    windows = [{"images": 90, "seconds": 1.0}, {"images": 110, "seconds": 1.0}, {"images": 100, "seconds": 1.0}]
    a = measured_attrs(windows, None)  # a run killed after its windows: their total over their seconds
    assert a["imgs_per_s"] == pytest.approx(100.0) and a["ci_half_width"] > 0.1 and a["precise"] is False
    assert measured_attrs([], None) == {}
