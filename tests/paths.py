"""Where the tests find the repository, the shared data and their own fixtures, from any
test folder (tests/ mirrors the package's folders)."""

from pathlib import Path

#: The repository root.
REPO = Path(__file__).resolve().parents[1]
#: ../shared beside the repository (may be absent: tests skip with a reason).
SHARED = REPO.parent / "shared"
#: The demo's data, shipped inside the package (protein_performer/data/demo/).
DEMO_DATA = REPO / "protein_performer" / "data" / "demo"
#: Small hand-made files the tests read (tests/fixtures/).
FIXTURES = REPO / "tests" / "fixtures"
