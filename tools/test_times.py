"""Seconds per test file, from the JUnit XML reports ``make test`` writes (``.test-times/*.xml``), slowest
first: the measured order for ``SLOWEST_FILES`` in test/conftest.py (xdist hands files out in that
order, so a long file that starts last no longer ends the run alone).

    python tools/test_times.py [REPORT.xml ...]     (default: .test-times/*.xml)
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import xml.etree.ElementTree as ET
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def file_seconds(reports: List[str]) -> Dict[str, Dict[str, float]]:
    """report name -> test file -> summed test seconds (setup and teardown included, as pytest reports)."""
    out: Dict[str, Dict[str, float]] = {}
    for path in reports:
        totals: Dict[str, float] = collections.defaultdict(float)
        for case in ET.parse(path).getroot().iter("testcase"):
            parts = case.get("classname", "").split(".")  # "test.test_api" or "test.test_api.TestClass"
            module = next((p for p in parts if p.startswith("test_")), parts[-1])
            totals[f"{module}.py"] += float(case.get("time", 0) or 0)
        out[os.path.basename(path)] = dict(totals)
    return out


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="*", help="JUnit XML files (default: .test-times/*.xml)")
    parser.add_argument("--top", type=int, default=16, help="how many files the SLOWEST_FILES line names")
    args = parser.parse_args(argv)
    reports = args.reports or sorted(glob.glob(os.path.join(ROOT, ".test-times", "*.xml")))
    if not reports:
        parser.error("no reports: run make test first (it writes .test-times/*.xml), or name them")
    combined: Dict[str, float] = collections.defaultdict(float)
    for name, totals in file_seconds(reports).items():
        print(f"{name}: {sum(totals.values()):.0f} s in tests")
        for file, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
            combined[file] += seconds
            print(f"  {seconds:8.1f}  {file}")
    slowest = [f for f, _ in sorted(combined.items(), key=lambda kv: -kv[1])][:args.top]
    print(f"SLOWEST_FILES = {slowest!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
