"""The one Registry every name-chosen table uses: duplicates refused, unknown names listed."""

import pytest

from omni_core.errors import ConfigError
from omni_core.registry import Registry


def first(x):
    return x


def second(x):
    return -x


def test_a_name_taken_by_other_code_is_refused_and_the_same_code_may_register_again():
    losses: Registry = Registry("policy loss")
    losses.add("mine", first)
    losses.add("mine", first)  # a module reload registers the same function again
    with pytest.raises(ValueError, match="'mine' is already registered"):
        losses.add("mine", second)
    assert losses.get("mine") is first


def test_an_unknown_name_is_a_config_error_naming_the_known_ones_and_the_hint():
    losses: Registry = Registry("policy loss", hint="add one with @register_policy_loss")
    losses.decorator("b")(first)
    losses.decorator("a")(second)
    with pytest.raises(ConfigError, match=r"unknown policy loss 'c'; known: a, b; add one with @register_policy_loss"):
        losses.get("c")
    assert losses.get("c", None) is None  # the mapping form monkeypatch.setitem uses
    assert losses.names() == ["a", "b"] and "a" in losses and len(losses) == 2


def test_every_registry_of_the_library_refuses_a_second_definition_of_a_name():
    from omni_core.algorithms.policy_loss import register_policy_loss
    from omni_core.rewards.registry import register_reward

    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("gspo")(second)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("gsm8k")(lambda data_source, solution_str, ground_truth, extra_info=None: 0.0)
