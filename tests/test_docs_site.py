"""The docs site: `mkdocs build --strict` (mkdocs.yml) builds every page of the nav, with a search
index, and fails on a link or anchor that resolves nowhere; the built reference lists every key
the schemas have."""

from __future__ import annotations

import json
import re
import sys
from html import unescape
from pathlib import Path

import pytest
import yaml

from scripts import config_reference as reference
from tests.helpers import REPO, run_cmd

pytestmark = pytest.mark.slow


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values():
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run_cmd([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
            timeout=120, cwd=REPO, env={"NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    return out


def _built(site: Path, page: str) -> Path:
    """Where mkdocs writes `page` (use_directory_urls: guides/x.md -> guides/x/index.html)."""
    stem = page.removesuffix(".md")
    return site / ("index.html" if stem == "index" else f"{stem}/index.html")


def test_every_page_of_the_nav_is_built_and_every_page_is_in_the_nav(site: Path) -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    pages = _nav_pages(config["nav"])
    on_disk = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert set(pages) == on_disk
    for page in ("getting-started.md", "guides/strategies.md", "guides/launchers.md",
                 "guides/slurm.md", "explanations/run-flow.md", "reference/config.md",
                 "errors.md"):  # fmt: skip
        assert page in pages, page
    for page in pages:
        assert _built(site, page).is_file(), page


def test_the_search_index_holds_every_page(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text())
    locations = {doc["location"].split("#")[0] for doc in index["docs"]}
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    for page in _nav_pages(config["nav"]):
        stem = page.removesuffix(".md")
        assert ("" if stem == "index" else f"{stem}/") in locations, page
    text = " ".join(doc["text"] for doc in index["docs"])
    assert "max_skipped_fraction" in text  # the generated reference is searchable


def test_the_built_reference_lists_every_schema_key(site: Path) -> None:
    html = unescape(_built(site, "reference/config.md").read_text())
    tables = [t for t in html.split("<table>")[1:] if "<th>type</th>" in t.split("</thead>")[0]]
    rows = {key for t in tables for key in re.findall(r"<tr>\s*<td><code>([\w.]+)</code></td>", t)}
    assert {key for _, key in reference.schema_keys()} == rows


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[strategies](guides/strategies.md#no-such-heading)\n")
    (docs / "guides").mkdir()
    (docs / "guides" / "strategies.md").write_text("# Strategies\n")
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    config["nav"] = ["index.md", "guides/strategies.md"]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    result = run_cmd([sys.executable, "-m", "mkdocs", "build", "--strict"], timeout=120,
                     cwd=tmp_path, env={"NO_MKDOCS_2_WARNING": "1"}, check=False)  # fmt: skip
    assert result.returncode == 1
    assert "no-such-heading" in result.output and "Aborted with 1 warnings in strict mode" in (
        result.output
    )
