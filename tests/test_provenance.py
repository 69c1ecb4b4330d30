"""The tree is self-contained: no reference to files outside it, no internal seed or issue names."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = re.compile(r"\.\./shared|seed 0[0-9]|issue [0-9]+|(FACTS|DESIGN|STYLE)\.md|/work/")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.splitlines() if f and f != "tests/test_provenance.py"]


def test_no_reference_outside_the_tree():
    hits = []
    for f in tracked_files():
        if not f.is_file():
            continue
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_sources_doc_cites_the_published_report():
    text = (ROOT / "docs" / "sources.md").read_text()
    assert "Inferact report (Sept 2026)" in text and "Inferact/tpu-megakernels" in text
    csv = (ROOT / "perfmodel" / "data" / "seed_measurements.csv").read_text()
    assert "Inferact" in csv and "docs/sources.md" in csv
