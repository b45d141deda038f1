"""Configs built from mappings: unknown keys and values of the wrong type are ConfigErrors naming their key path."""

import dataclasses

import pytest

from qgate.errors import ConfigError, ConfigProblems
from qgate.gates.evalgate import EvalConfig
from qgate.gates.shadow import ShadowConfig
from qgate.naming import build_config
from qgate.quantize.schemes import scheme_config


def test_values_of_the_wrong_type_are_refused_with_their_path_and_value():
    data = {"max_new_tokens": 4.5, "kl_p99_max": "abc", "top_k": True, "positions": 3}
    with pytest.raises(ConfigProblems) as e:
        build_config(ShadowConfig, data, "gates.shadow")
    assert [p.message for p in e.value.problems] == [
        "gates.shadow.max_new_tokens: Input should be a valid integer (got 4.5)",
        "gates.shadow.kl_p99_max: Input should be a valid number or null (got 'abc')",
        "gates.shadow.top_k: Input should be a valid integer (got True)",
        "gates.shadow.positions: Input should be a valid string (got 3)",
    ]
    with pytest.raises(
        ConfigError, match=r"^gates.eval.tasks\[1\]: Input should be a valid string \(got \['a', 2\]\)$"
    ):
        build_config(EvalConfig, {"tasks": ["a", 2]}, "gates.eval")
    with pytest.raises(ConfigError, match=r"^options.ignore: Input should be a list \(got 'lm_head'\)$"):
        scheme_config("gptq-w4a16", ignore="lm_head")
    with pytest.raises(ConfigError, match=r"^options.symmetric: Input should be a valid boolean \(got 1\)$"):
        scheme_config("awq-w4a16", symmetric=1)


def test_values_of_the_right_type_build_as_given():
    cfg = build_config(ShadowConfig, {"kl_p99_max": 1, "kl_mean_max": None, "max_prompts": 8}, "gates.shadow")
    assert cfg.kl_p99_max == 1 and cfg.kl_mean_max is None and cfg.max_prompts == 8  # an int is a number
    tasks = ["chatterbot_ppl", "bigbench_strategyqa"]
    assert build_config(EvalConfig, {"tasks": tasks}, "gates.eval").tasks == tuple(tasks)  # YAML lists as tuples
    assert scheme_config("gptq-w4a16", ignore=["lm_head"], dampening_frac=1e-2).ignore == ("lm_head",)
    assert dataclasses.asdict(build_config(ShadowConfig, {}, "gates.shadow")) == dataclasses.asdict(ShadowConfig())
