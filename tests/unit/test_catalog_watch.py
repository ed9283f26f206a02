"""``shared.infra.catalog.watch_file`` / ``watch_regions``: a file's new contents once per change of its
modification time (the router re-reads the regions file operators edit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from shared.domain.inventory import InventoryError
from shared.infra.catalog import load_regions, packaged_file, watch_file, watch_regions


def touch(path: Path, text: str, *, mtime_ns: int) -> None:
    """Write ``text`` and set the modification time (a filesystem's clock may not tick between writes)."""
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_the_contents_come_once_per_change_and_none_in_between(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    touch(path, "one", mtime_ns=1_000_000_000)
    changed = watch_file(path, lambda p: p.read_text())
    assert changed() is None  # unchanged since the watch began
    touch(path, "two", mtime_ns=2_000_000_000)
    assert changed() == "two"
    assert changed() is None
    touch(path, "three", mtime_ns=1_500_000_000)  # any change of the time counts, also backwards
    assert changed() == "three"


def test_a_file_created_after_the_watch_began_is_read_and_a_gone_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "later.txt"
    changed = watch_file(path, lambda p: p.read_text())
    touch(path, "here", mtime_ns=3_000_000_000)
    assert changed() == "here"
    path.unlink()
    with pytest.raises(OSError):
        changed()


def test_the_shipped_regions_never_change() -> None:
    assert watch_regions(None)() is None


def test_an_edited_regions_file_is_parsed_and_a_bad_one_raises_once(tmp_path: Path) -> None:
    path = tmp_path / "regions.yaml"
    shipped = yaml.safe_load(packaged_file("regions.yaml").read_text())
    touch(path, yaml.safe_dump(shipped), mtime_ns=1_000_000_000)
    changed = watch_regions(path)
    assert changed() is None
    name = sorted(shipped["regions"])[0]
    shipped["regions"][name]["pue"] = 1.5
    touch(path, yaml.safe_dump(shipped), mtime_ns=2_000_000_000)
    regions = changed()
    assert regions is not None and regions[name].pue == 1.5 and set(regions) == set(load_regions())
    touch(path, "regions: [", mtime_ns=3_000_000_000)
    with pytest.raises(InventoryError):
        changed()
    assert changed() is None  # not read again until it changes again
