"""URL credentials are replaced wherever a URL is written (manifests, the experiment copy,
profiles, fit reports, error lines); everything else in the text is kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentab.redact import has_credentials, redact_text, redact_url, redact_value
from agentab.rundir import read_manifest, write_manifest


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://u:p@h:1/v1", "http://<redacted>@h:1/v1"),
        ("x https://a@b:c@h/x y", "x https://<redacted>@h/x y"),
        ('url = "http://alice:pw@127.0.0.1:8"  # http://h:2',
         'url = "http://<redacted>@127.0.0.1:8"  # http://h:2'),
        ("http://h:1/x?who=a@b", "http://h:1/x?who=a@b"),
        ("mail a@b.c, http://h/", "mail a@b.c, http://h/"),
        ("--url http://k@[::1]:8/", "--url http://<redacted>@[::1]:8/"),
    ],
)  # fmt: skip
def test_redact_text(text: str, expected: str) -> None:
    assert redact_text(text) == expected


def test_redact_url_and_has_credentials() -> None:
    assert redact_url("http://u:p@[::1]:8/v1") == "http://<redacted>@[::1]:8/v1"
    assert redact_url("http://h:8/v1") == "http://h:8/v1"
    assert has_credentials("https://token@h") and not has_credentials("https://h")


def test_a_manifest_is_written_without_credentials_at_any_depth(tmp_path: Path) -> None:
    manifest = {
        "url": "http://u:pw@h:1",
        "server": {"command": "vllm serve --api-server http://x:pw@h:2", "ok": [1, "http://h"]},
    }
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == {
        "url": "http://<redacted>@h:1",
        "server": {
            "command": "vllm serve --api-server http://<redacted>@h:2",
            "ok": [1, "http://h"],
        },
    }
    assert redact_value(("http://a:b@h", 3)) == ("http://<redacted>@h", 3)
