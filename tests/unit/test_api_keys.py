"""Client API keys (pdserve/common/api_keys.py) and the rule that keeps them off node services (pdserve/common/auth.py)."""

from __future__ import annotations

import os
import re

import grpc
import pytest

from pdserve.common.api_keys import ApiKeys
from pdserve.common.auth import Credentials, TokenError
from pdserve.router.config import RouterConfig

NODE = "node-token-0123"
REGISTRY = "pdserve.node.v1.Registry"


def keys_file(tmp_path, text: str):
    path = tmp_path / "keys"
    path.write_text(text)
    return path


def replace(path, text: str) -> None:
    aside = path.with_name(path.name + ".new")
    aside.write_text(text)
    os.replace(aside, path)


def test_keys_are_read_one_a_line_without_blanks_or_comments(tmp_path):
    keys = ApiKeys(keys_file(tmp_path, "# team a\nsk-a\n\n  sk-b  \n"))
    assert len(keys) == 2 and keys.valid(b"sk-a") and keys.valid(b"sk-b")
    assert not keys.valid(b"sk-c") and not keys.valid(b"# team a") and not keys.valid(b"")


@pytest.mark.parametrize("text, message", [
    ("# nothing\n\n", "holds no API key"),
    ("sk-a\nsk b\n", "line 2: the auth token may hold only visible ASCII (no spaces)"),
])
def test_a_file_without_usable_keys_is_refused_naming_it(tmp_path, text, message):
    path = keys_file(tmp_path, text)
    with pytest.raises(TokenError, match=re.escape(message)) as refused:
        ApiKeys(path)
    assert str(refused.value).startswith(f"--api-keys-file {path}")
    with pytest.raises(TokenError, match="cannot read it"):
        ApiKeys(tmp_path / "missing")


def test_a_replaced_file_is_read_again_and_a_broken_one_keeps_the_last_keys(tmp_path):
    path = keys_file(tmp_path, "sk-a\n")
    keys = ApiKeys(path)
    replace(path, "sk-b\nsk-c\n")
    assert not keys.valid(b"sk-a") and keys.valid(b"sk-c")
    replace(path, "# emptied by mistake\n")
    assert keys.valid(b"sk-b") and len(keys) == 2  # the last good keys stay in force
    os.remove(path)
    assert keys.valid(b"sk-b")


def test_a_client_key_opens_the_public_api_and_is_refused_the_registry(tmp_path):
    credentials = Credentials(NODE, ApiKeys(keys_file(tmp_path, "sk-a\n")), frozenset({REGISTRY}))
    assert credentials.refusal("pdserve.v1.Generation", "Bearer sk-a") is None
    assert credentials.refusal(REGISTRY, f"Bearer {NODE}") is None
    code, message = credentials.refusal(REGISTRY, "Bearer sk-a")
    assert code is grpc.StatusCode.PERMISSION_DENIED and message.startswith(
        "an API key opens only the public API, not pdserve.node.v1.Registry")
    for presented in ("Bearer sk-b", "sk-a", None, b"Bearer \xff"):
        assert credentials.refusal("pdserve.v1.Generation", presented)[0] is grpc.StatusCode.UNAUTHENTICATED


def test_a_node_knows_no_client_key():
    assert Credentials(NODE).refusal("pdserve.node.v1.DecodeNode", "Bearer sk-a")[0] is grpc.StatusCode.UNAUTHENTICATED


def test_api_keys_without_a_node_credential_are_refused_at_start():
    with pytest.raises(ValueError, match="--api-keys-file needs the node join credential"):
        RouterConfig(model="m", api_keys_file="keys")
