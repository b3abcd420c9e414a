"""docs/guides/pretrained.md's table of model families against strategies is what the families
answer (scripts/family_table.py generates it), not written by hand."""

from __future__ import annotations

import pytest

from scripts import family_table
from tests.helpers import REPO

pytest.importorskip("transformers")

PAGE = REPO / "docs" / "guides" / "pretrained.md"


def test_the_guides_table_is_what_the_families_answer() -> None:
    page = PAGE.read_text()
    assert family_table.with_table(page) == page, (
        "docs/guides/pretrained.md's table is not current: "
        "python scripts/family_table.py --write docs/guides/pretrained.md"
    )
    rows = {
        line.split(" | ")[0].strip("| ") for line in page.splitlines() if "transformers `" in line
    }
    assert {f"transformers `{kind}`" for kind in family_table.TRANSFORMERS} == rows
