"""The oracle tools' environments are installed after collection, before any test's timeout starts; one that cannot
be installed is one line naming the package, and the tests that need it fail with that line, at once."""

from __future__ import annotations

import pytest

from tests.helpers.tool_env import FAILED, PeerUnavailable, ToolEnv, install_before_the_tests


def test_a_tool_that_cannot_be_installed_is_one_line_naming_it_and_is_not_tried_again(tmp_path, monkeypatch):
    missing = ToolEnv(name="missing", requirements=("specdoctor-no-such-package==0.0.1",), check="import missing")
    monkeypatch.setattr(ToolEnv, "directory", lambda self: tmp_path / self.name)
    monkeypatch.delitem(FAILED, "missing", raising=False)
    said: list[str] = []
    install_before_the_tests([missing], said.append)
    assert said[0].startswith("installing the missing environment (specdoctor-no-such-package==0.0.1)")
    assert len(said) == 2 and said[1].startswith("missing: pip install specdoctor-no-such-package==0.0.1 failed:")
    assert "\n" not in said[1]
    monkeypatch.setattr("tests.helpers.tool_env._run", lambda *args: pytest.fail("tried again"))
    with pytest.raises(PeerUnavailable, match="specdoctor-no-such-package"):
        missing.ensure()
    monkeypatch.delitem(FAILED, "missing")
