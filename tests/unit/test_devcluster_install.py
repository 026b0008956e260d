"""The pure helpers of the dev-cluster installer: versions, the Debian mirror, /etc/os-release, the
private apt's sources, and what decides whether criu is built again (its patches and build stamp)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from singularity_slurm.devcluster.install import (
    CRIU_VERSION,
    build_stamp,
    criu_patches,
    debian_mirror,
    os_release,
    parse_release,
    parse_source_uris,
    sources_list,
    tarball_version,
)
from singularity_slurm.errors import DevClusterError

REPO = Path(__file__).resolve().parents[2]

# --- criu --version -------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "release"), [
    ("Version: 4.1.1\nGitID: v4.1.1-12-gabcdef\n", "4.1.1"),
    ("Version: 3.17.1\n", "3.17.1"),
    ("Version: 4.0\n", "4.0"),
    ("GitID: v9.9\nVersion: 4.1\n", "4.1"),
])
def test_parse_release_reads_the_version_line(text: str, release: str) -> None:
    assert parse_release(text) == release


@pytest.mark.parametrize("text", ["", "criu: command not found\n", "Version: unknown\n", "criu 3.18\n"])
def test_parse_release_without_a_version_line_is_none(text: str) -> None:
    assert parse_release(text) is None


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


# --- the private apt ------------------------------------------------------------------------------


def test_sources_list_for_binary_packages_by_default() -> None:
    text = sources_list("http://deb.debian.org/debian", "trixie")

    assert text == "deb http://deb.debian.org/debian trixie main\n"


def test_sources_list_for_source_packages() -> None:
    text = sources_list("http://mirror.example.org/debian", "trixie", kinds=("deb-src",))

    assert text == "deb-src http://mirror.example.org/debian trixie main\n"


def test_sources_list_with_both_kinds() -> None:
    assert sources_list("http://m/debian", "trixie", ("deb", "deb-src")).splitlines() == [
        "deb http://m/debian trixie main", "deb-src http://m/debian trixie main"]


PRINT_URIS = (
    "'http://deb.debian.org/debian/pool/main/c/criu/criu_4.1.1-1.dsc' criu_4.1.1-1.dsc 2806 "
    "SHA256:12206f74ab852907156db8fdf1fb2a40ebbc897d28c133a2cbe804fab13f8b62\n"
    "'http://deb.debian.org/debian/pool/main/c/criu/criu_4.1.1.orig.tar.xz' criu_4.1.1.orig.tar.xz "
    "1021136 SHA256:f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe\n"
    "'http://deb.debian.org/debian/pool/main/c/criu/criu_4.1.1-1.debian.tar.xz' "
    "criu_4.1.1-1.debian.tar.xz 12368 "
    "SHA256:103855d69544c3417abdb5b309c1773db98af2293c4dc48bba39e244b85c778e\n"
)


def test_parse_source_uris_gives_each_file_with_its_hash() -> None:
    files = parse_source_uris("NOTICE: 'criu' packaging is maintained in Git\n" + PRINT_URIS)

    assert [name for _, name, _ in files] == [
        "criu_4.1.1-1.dsc", "criu_4.1.1.orig.tar.xz", "criu_4.1.1-1.debian.tar.xz"]
    assert files[1] == ("http://deb.debian.org/debian/pool/main/c/criu/criu_4.1.1.orig.tar.xz",
                        "criu_4.1.1.orig.tar.xz",
                        "SHA256:f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe")


def test_parse_source_uris_skips_a_file_without_a_hash() -> None:
    line = "'http://m/debian/pool/c/criu_4.1.1.orig.tar.xz' criu_4.1.1.orig.tar.xz 1021136\n"

    assert parse_source_uris(line) == []


@pytest.mark.parametrize(("name", "version"), [
    ("criu_4.1.1.orig.tar.xz", "4.1.1"),
    ("criu_4.2.orig.tar.gz", "4.2"),
    ("criu_4.1.1-1.debian.tar.xz", None),
    ("criu_4.1.1-1.dsc", None),
    ("crit_4.1.1.orig.tar.xz", None),
])
def test_tarball_version(name: str, version: str | None) -> None:
    assert tarball_version(name) == version


# --- the criu patches and the build stamp ---------------------------------------------------------


def patch_folder(tmp_path: Path, files: dict[str, str]) -> Path:
    folder = tmp_path / "criu_patches"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_patches_are_the_patch_files_in_name_order(tmp_path: Path) -> None:
    folder = patch_folder(tmp_path, {"0010-later.patch": "b", "0002-first.patch": "a", "__init__.py": "",
                                     "README": "not a patch", "0003-old.patch.orig": "stale"})
    (folder / "0005-a-folder.patch").mkdir()

    assert criu_patches(folder) == [("0002-first.patch", b"a"), ("0010-later.patch", b"b")]


def test_an_empty_patch_folder_gives_no_patches(tmp_path: Path) -> None:
    assert criu_patches(patch_folder(tmp_path, {"__init__.py": ""})) == []


def test_the_stamp_names_the_upstream_version() -> None:
    assert build_stamp("4.1.1", []).splitlines()[0] == "criu 4.1.1"
    assert re.fullmatch(r"patches sha256:[0-9a-f]{64}", build_stamp("4.1.1", []).splitlines()[1])


def test_the_stamp_changes_with_a_patch() -> None:
    base = build_stamp("4.1.1", [("0001-a.patch", b"one"), ("0002-b.patch", b"two")])
    others = [
        build_stamp("4.1.1", [("0001-a.patch", b"one"), ("0002-b.patch", b"two\n")]),  # contents
        build_stamp("4.1.1", [("0001-a.patch", b"one"), ("0003-b.patch", b"two")]),  # a name
        build_stamp("4.1.1", [("0001-a.patch", b"one")]),  # one gone
        build_stamp("4.1.1", [("0001-a.patch", b"one"), ("0002-b.patch", b"two"), ("0003-c.patch", b"")]),
        build_stamp("4.1.1", [("0001-a.patch", b"onetwo"), ("0002-b.patch", b"")]),  # bytes moved
        build_stamp("4.2", [("0001-a.patch", b"one"), ("0002-b.patch", b"two")]),  # the version
    ]

    assert base not in others
    assert len(set(others)) == len(others)


def test_the_stamp_is_the_same_for_the_same_patches(tmp_path: Path) -> None:
    folder = patch_folder(tmp_path, {"0002-b.patch": "two", "0001-a.patch": "one"})

    assert build_stamp("4.1.1", criu_patches(folder)) == build_stamp(
        "4.1.1", [("0002-b.patch", b"two"), ("0001-a.patch", b"one")])


def test_the_stamp_changes_when_a_patch_file_changes(tmp_path: Path) -> None:
    folder = patch_folder(tmp_path, {"0001-a.patch": "--- a/criu/x.c\n+++ b/criu/x.c\n"})
    before = build_stamp(CRIU_VERSION, criu_patches(folder))
    (folder / "0001-a.patch").write_text("--- a/criu/x.c\n+++ b/criu/x.c\n@@ -1 +1 @@\n")

    assert build_stamp(CRIU_VERSION, criu_patches(folder)) != before


def test_each_project_patch_names_a_test_that_exists() -> None:
    patches = criu_patches(REPO / "checkpoint" / "criu_patches")

    for name, data in patches:
        named = re.findall(r"^Tested by (tests/\S+\.py)\.?$", data.decode(), re.M)
        assert named, f"{name} names no test (`Tested by tests/....py.` before its diff)"
        assert all((REPO / path).is_file() for path in named), f"{name}: {named}"
