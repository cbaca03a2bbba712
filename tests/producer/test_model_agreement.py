"""The API's check that live workers serve the models it was given: one warning per change of
the models only the workers know, naming them, their worker counts and the API's idle models."""

from __future__ import annotations

from tidegate.producer.model_agreement import ModelAgreement


def test_agreeing_workers_say_nothing() -> None:
    agreement = ModelAgreement(["chat", "code"])
    assert agreement.observe(["chat", "code", None]) is None  # None: the default, chat
    assert agreement.observe([]) is None


def test_a_foreign_model_is_named_once_per_change() -> None:
    agreement = ModelAgreement(["SmolLM2-135M-Instruct"])
    warning = agreement.observe(["random_tiny"])
    assert warning is not None
    assert warning.startswith("live workers serve models this API was not started with: "
                              "random_tiny (1 worker); none serves SmolLM2-135M-Instruct, "
                              "which this API queues jobs for.")
    assert "--model list" in warning
    assert agreement.observe(["random_tiny"]) is None  # the same disagreement: said already
    warning = agreement.observe(["random_tiny", "random_tiny", "other", None])
    assert warning is not None and ": other (1 worker), random_tiny (2 workers)." in warning
    assert "none serves" not in warning  # a worker without a model serves the default
    assert agreement.observe(["SmolLM2-135M-Instruct"]) is None  # they agree again
    assert agreement.observe(["random_tiny"]) is not None  # and disagree again: said again
