"""Which frontend calls the API-key interceptor checks (disagg.router.key_guard): pure."""

from __future__ import annotations

from disagg.router.key_guard import given_key, guarded, key_matches

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
REFLECTION_V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
GENERATE = "/disagg.v1.Serving/Generate"  # checks its own key, per call


def test_health_and_reflection_are_guarded_and_health_can_be_opened():
    for method in (HEALTH_CHECK, HEALTH_WATCH, REFLECTION, REFLECTION_V1):
        assert guarded(method, health_without_key=False)
    assert not guarded(HEALTH_CHECK, health_without_key=True)
    assert guarded(REFLECTION, health_without_key=True)  # reflection lists the API: never open
    assert not guarded(GENERATE, health_without_key=False)


def test_the_key_is_read_from_metadata_and_compared_exactly():
    assert given_key((("user-agent", "x"), ("x-api-key", "secret"))) == "secret"
    assert given_key(None) == "" and given_key(()) == ""
    assert key_matches("secret", "secret")
    assert not key_matches("secret", "secre") and not key_matches("secret", "")
    assert key_matches(None, "") and key_matches("", "anything")  # no key set: everyone
