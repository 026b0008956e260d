"""Redis keys are built only from validated parts: nothing a request or a peer says reaches a key."""

from __future__ import annotations

import pytest

from singularity_slurm.coordinator import keys
from singularity_slurm.errors import RegistryError


def test_keys_of_valid_parts() -> None:
    assert keys.job(7) == keys.job("7") == "singularity:job:7"
    assert keys.job_node(7, "n1.cluster-a_2") == "singularity:job:7:node:n1.cluster-a_2"
    assert keys.job_rendezvous(7, "0.1764571234567890123") == "singularity:job:7:rdzv:0.1764571234567890123"
    assert keys.job_rendezvous_ready(7, "0.1") == "singularity:job:7:rdzv:0.1:ready"
    assert keys.job_rendezvous_woken(7, "0.1") == "singularity:job:7:rdzv:0.1:woken"
    assert keys.job_reply(7, "0123456789abcdef0123456789abcdef") == (
        "singularity:job:7:reply:0123456789abcdef0123456789abcdef")
    assert keys.proxy_id("n1/gpu0") == "n1/gpu0"


@pytest.mark.parametrize("bad", [0, -1, "0", "-1", "7:node:x", "7 ", "", "٣", True, 1.0, None, 1 << 63,
                                 "9" * 20])
def test_a_job_id_that_is_not_a_positive_integer_is_refused(bad: object) -> None:
    with pytest.raises(keys.InvalidKeyPart) as info:
        keys.job(bad)  # type: ignore[arg-type]

    assert str(info.value) == f"job id must be a positive integer, got {bad!r}"


@pytest.mark.parametrize("bad", ["", "n1:rdzv", "n1*", "../n1", ".n1", "-n1", "n 1", "n1\n", "x" * 65, 7])
def test_a_node_name_outside_the_safe_alphabet_is_refused(bad: object) -> None:
    with pytest.raises(keys.InvalidKeyPart, match="^node name must be 1-64 letters"):
        keys.job_node(7, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "1:*", "1 2", "x" * 65, "*", None])
def test_a_generation_outside_the_safe_alphabet_is_refused(bad: object) -> None:
    with pytest.raises(keys.InvalidKeyPart, match="^rendezvous generation must be 1-64 letters"):
        keys.job_rendezvous(7, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "n1//gpu0", "n1/gpu0/x", "/gpu0", "n1/", "n1:gpu0", "n1/gpu 0"])
def test_a_proxy_id_that_is_not_name_or_node_slash_device_is_refused(bad: str) -> None:
    with pytest.raises(keys.InvalidKeyPart, match="^proxy id must be NAME or NODE/DEVICE"):
        keys.proxy_id(bad)


@pytest.mark.parametrize("bad", ["", "ABCDEF0123456789ABCDEF0123456789", "0" * 31, "0" * 33, "*"])
def test_a_request_id_that_is_not_32_hex_digits_is_refused(bad: str) -> None:
    with pytest.raises(keys.InvalidKeyPart, match="^request id must be 32 lowercase hex digits"):
        keys.job_reply(7, bad)


@pytest.mark.parametrize("bad", ["", "0" * 31, "g" * 32, None])
def test_a_rendezvous_token_that_is_not_32_hex_digits_is_refused(bad: object) -> None:
    with pytest.raises(keys.InvalidKeyPart, match="^a rendezvous record's token must be 32 lowercase hex"):
        keys.rendezvous_token(bad)  # type: ignore[arg-type]


def test_an_invalid_part_is_a_registry_error_and_a_value_error() -> None:
    assert issubclass(keys.InvalidKeyPart, RegistryError) and issubclass(keys.InvalidKeyPart, ValueError)
