"""benchmarks/checkpoint_restore.py: the configuration it sets for a run and puts back (pure logic
and a file of the test's; the runs themselves need the dev cluster)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import checkpoint_restore as bench  # noqa: E402


@pytest.mark.parametrize(("text", "expected"), [
    ('[preemption]\nwarn_time = 60\n\n[redis]\nport = 1\n',
     '[preemption]\nwarn_time = 60\n\nstream_pages = "never"\n[redis]\nport = 1\n'),
    ('[preemption]\nstream_pages = "always"\nwarn_time = 60\n',
     '[preemption]\nstream_pages = "never"\nwarn_time = 60\n'),
    ('[preemption]\nwarn_time = 60\n', '[preemption]\nwarn_time = 60\nstream_pages = "never"\n'),
    ('[redis]\nport = 1\n', '[redis]\nport = 1\n\n[preemption]\nstream_pages = "never"\n'),
])
def test_a_setting_replaces_its_line_or_joins_its_section(text: str, expected: str) -> None:
    assert bench.with_setting(text, "preemption", "stream_pages", '"never"') == expected


def test_the_configuration_is_put_back_byte_for_byte_even_when_the_run_fails(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    original = b'# the site\'s own words\n[preemption]\nwarn_time = 60\n'
    path.write_bytes(original)
    with pytest.raises(RuntimeError), bench.configured(path, "preemption", "stream_pages", '"never"'):
        assert 'stream_pages = "never"' in path.read_text()
        raise RuntimeError("the run failed")
    assert path.read_bytes() == original
