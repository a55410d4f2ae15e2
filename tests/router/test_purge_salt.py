"""A client's salt cannot name a purge epoch: without a tenant, a salt starting with "purge:" is
refused, so no request reaches the blocks of another epoch (`cachesvc.kv.hashing.epoch_salt`)."""

from __future__ import annotations

import pytest

from cachesvc.kv.hashing import epoch_salt
from router.auth import tenant_cache_salt
from router.domain import InvalidInput


def test_without_a_tenant_the_purge_prefix_is_refused() -> None:
    # Epoch 0 of this salt would be epoch 1 of salt "x": the purged blocks of "x".
    with pytest.raises(InvalidInput, match="cache_salt must not start with 'purge:'"):
        tenant_cache_salt(None, epoch_salt("x", 1))


def test_a_tenant_salt_never_names_an_epoch() -> None:
    salt = tenant_cache_salt("acme", "purge:1/x")
    assert salt == "tenant:acme/purge:1/x"
    assert epoch_salt(salt, 0) != epoch_salt("tenant:acme/x", 1)
