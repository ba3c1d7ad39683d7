"""The demo runs end to end and reports every tier."""

from __future__ import annotations

from typing import Any

from trainer import demo


def test_demo_uses_every_tier(tmp_path: Any, capsys: Any) -> None:
    assert demo.main(["--output-dir", str(tmp_path), "--max-steps", "2", "--block-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "device window: peak" in out and "RAM cache:" in out and "disk:" in out
    assert (tmp_path / "final" / "config.json").exists()
