"""The pure helpers of the dev-cluster installer: versions, the Debian mirror, /etc/os-release."""

from __future__ import annotations

from pathlib import Path

import pytest

from singularity_slurm.devcluster.install import debian_mirror, os_release, parse_version_tuple
from singularity_slurm.errors import DevClusterError

# --- criu --version -------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "version"), [
    ("Version: 4.1.1\nGitID: v4.1.1-12-gabcdef\n", (4, 1)),
    ("Version: 3.17.1\n", (3, 17)),
    ("Version: 4.0\n", (4, 0)),
    ("GitID: v9.9\nVersion: 4.1\n", (4, 1)),
    ("criu 3.18\n", (3, 18)),
])
def test_parse_version_tuple_prefers_the_version_line(text: str, version: tuple[int, int]) -> None:
    assert parse_version_tuple(text) == version


@pytest.mark.parametrize("text", ["", "criu: command not found\n", "Version: unknown\n"])
def test_parse_version_tuple_without_a_version_is_none(text: str) -> None:
    assert parse_version_tuple(text) is None


def test_criu_3_17_is_older_than_the_minimum() -> None:
    old, new = parse_version_tuple("Version: 3.17.1\n"), parse_version_tuple("Version: 4.0\n")

    assert old < (4, 0) <= new


# --- the Debian mirror ----------------------------------------------------------------------------


def apt_dir(tmp_path: Path, sources_list: str | None = None,
            dropins: dict[str, str] | None = None) -> Path:
    """An /etc/apt stand-in: sources.list (when given) and files in sources.list.d."""
    root = tmp_path / "apt"
    (root / "sources.list.d").mkdir(parents=True)
    if sources_list is not None:
        (root / "sources.list").write_text(sources_list)
    for name, text in (dropins or {}).items():
        (root / "sources.list.d" / name).write_text(text)
    return root


def test_mirror_from_a_one_line_sources_list(tmp_path: Path) -> None:
    root = apt_dir(tmp_path, "deb http://deb.debian.org/debian bookworm main\n")

    assert debian_mirror(root) == "http://deb.debian.org/debian"


def test_mirror_with_options_and_a_trailing_slash(tmp_path: Path) -> None:
    root = apt_dir(tmp_path, "deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] "
                             "http://mirror.example.org/debian/ bookworm main contrib\n")

    assert debian_mirror(root) == "http://mirror.example.org/debian"


def test_mirror_from_a_deb822_sources_file(tmp_path: Path) -> None:
    root = apt_dir(tmp_path, dropins={"debian.sources": (
        "Types: deb\n"
        "URIs: http://security.debian.org/debian-security\n"
        "Suites: bookworm-security\n"
        "\n"
        "Types: deb\n"
        "URIs: https://mirror.example.org/debian/\n"
        "Suites: bookworm bookworm-updates\n"
        "Components: main\n"
    )})

    assert debian_mirror(root) == "https://mirror.example.org/debian"


def test_comments_source_lines_and_other_archives_are_skipped(tmp_path: Path) -> None:
    root = apt_dir(tmp_path, (
        "# deb http://commented.example.org/debian bookworm main\n"
        "deb-src http://src.example.org/debian bookworm main\n"
        "deb http://security.debian.org/debian-security bookworm-security main\n"
        "deb http://archive.example.org/ubuntu jammy main\n"
        "deb http://real.example.org/debian bookworm main\n"
    ))

    assert debian_mirror(root) == "http://real.example.org/debian"


def test_sources_list_comes_before_the_drop_in_folder(tmp_path: Path) -> None:
    root = apt_dir(tmp_path, "deb http://first.example.org/debian bookworm main\n",
                   {"a.list": "deb http://second.example.org/debian bookworm main\n"})

    assert debian_mirror(root) == "http://first.example.org/debian"


def test_drop_ins_are_read_in_name_order(tmp_path: Path) -> None:
    root = apt_dir(tmp_path, None, {
        "b.list": "deb http://b.example.org/debian bookworm main\n",
        "a.sources": "Types: deb\nURIs: http://a.example.org/debian\nSuites: trixie\n",
    })

    assert debian_mirror(root) == "http://a.example.org/debian"


def test_backup_files_in_the_drop_in_folder_are_ignored(tmp_path: Path) -> None:
    root = apt_dir(tmp_path, None, {
        "old.list.save": "deb http://stale.example.org/debian bookworm main\n",
        "debian.sources.bak": "URIs: http://stale.example.org/debian\n",
    })

    with pytest.raises(DevClusterError) as info:
        debian_mirror(root)

    assert str(info.value) == "no Debian archive found in /etc/apt sources; add one and try again"


def test_no_sources_at_all_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DevClusterError):
        debian_mirror(apt_dir(tmp_path))


def test_missing_apt_folder_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DevClusterError):
        debian_mirror(tmp_path / "absent")


# --- /etc/os-release ------------------------------------------------------------------------------


def test_os_release_reads_quoted_and_bare_values(tmp_path: Path) -> None:
    path = tmp_path / "os-release"
    path.write_text(
        'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\n'
        "NAME=\"Debian GNU/Linux\"\n"
        'VERSION_ID="12"\n'
        "VERSION_CODENAME=bookworm\n"
        "ID=debian\n"
        "HOME_URL=\"https://www.debian.org/\"\n"
        "\n"
    )

    assert os_release(path) == {
        "PRETTY_NAME": "Debian GNU/Linux 12 (bookworm)", "NAME": "Debian GNU/Linux",
        "VERSION_ID": "12", "VERSION_CODENAME": "bookworm", "ID": "debian",
        "HOME_URL": "https://www.debian.org/",
    }


def test_os_release_skips_lines_without_equals(tmp_path: Path) -> None:
    path = tmp_path / "os-release"
    path.write_text("garbage\nID=debian\n")

    assert os_release(path) == {"ID": "debian"}
