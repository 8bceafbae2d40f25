"""The step-knob benchmark's variants (run on a GPU, kernels/benchmarks/bench_step_knobs.py) name
attributes their modules still have: a renamed constant fails here, not an hour into a GPU run."""
from __future__ import annotations

from zipmoe.kernels.benchmarks.bench_step_knobs import knob_sets


def test_every_knob_names_an_attribute_its_module_has_and_each_set_starts_and_ends_committed():
    for name, (cases, variants) in knob_sets().items():
        assert cases and variants[0][1] == [] and variants[-1][1] == [], name
        for variant, patches in variants:
            for obj, attr, _ in patches:
                assert hasattr(obj, attr), f"{name}: {variant}: {obj.__name__} has no {attr}"
