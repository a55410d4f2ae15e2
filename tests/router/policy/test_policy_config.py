"""The routing thresholds in RouterConfig: validated at start, handed to the policy as is."""

from __future__ import annotations

import pytest

from cachesvc.kv.config import ConfigError
from router.config import RouterConfig
from router.policy.routing import PrefixAware, make_policy


def test_the_config_reaches_the_policy() -> None:
    config = RouterConfig(
        balance_abs_threshold=3,
        balance_rel_threshold=1.25,
        balance_queue_factor=1.5,
        balance_queue_slack_s=3.0,
        balance_traffic_factor=0.0,
        route_queue_weight=0.5,
        route_tie_fraction=0.2,
        route_work_half_life_s=10.0,
        route_busy_weight=0.5,
        route_busy_half_life_s=60.0,
    )
    policy = make_policy("prefix_aware", **config.policy_options())
    assert isinstance(policy, PrefixAware)
    assert (policy.abs_threshold, policy.rel_threshold) == (3, 1.25)
    assert (policy.queue_factor, policy.queue_slack_s) == (1.5, 3.0)
    assert (policy.queue_weight, policy.tie_fraction) == (0.5, 0.2)
    assert (policy.work_half_life_s, policy.traffic_factor) == (10.0, 0.0)
    assert (policy.busy_weight, policy.busy_half_life_s) == (0.5, 60.0)
    for name in ("round_robin", "least_loaded"):  # they take no thresholds and ignore them
        assert make_policy(name, **config.policy_options()).name == name


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("balance_queue_factor", 0.5, "balance_queue_factor must be >= 1"),
        ("balance_queue_slack_s", -1.0, "balance_queue_slack_s must be >= 0"),
        ("balance_traffic_factor", 0.5, r"balance_traffic_factor must be 0 \(off\) or >= 1"),
        ("route_queue_weight", 1.5, r"route_queue_weight must be in \[0, 1\]"),
        ("route_tie_fraction", -0.1, r"route_tie_fraction must be in \[0, 1\]"),
        ("route_work_half_life_s", 0.0, "route_work_half_life_s must be positive"),
        ("route_busy_weight", -0.1, "route_busy_weight must be >= 0"),
        ("route_busy_half_life_s", 0.0, "route_busy_half_life_s must be positive"),
        ("balance_rel_threshold", 0.5, "balance_rel_threshold must be >= 1"),
    ],
)
def test_bad_thresholds_say_how_to_fix_them(field: str, value: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterConfig(**{field: value})  # type: ignore[arg-type]
