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


def suite_figures(path: str) -> Dict[str, float]:
    """A report's wall seconds and test counts, as pytest wrote them (``<testsuite time= tests= ...>``)."""
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    return {k: float(suite.get(k, 0)) for k in ("time", "tests", "failures", "errors", "skipped")}


def summary(reports: List[str], top: int = 25) -> None:
    """make test's closing lines: each environment's wall time and counts, both together, and the
    slowest files over both."""
    total = 0.0
    for path in reports:
        fig = suite_figures(path)
        total += fig["time"]
        print(f"{os.path.basename(path)}: {fig['time']:.0f} s wall, {fig['tests']:.0f} tests "
              f"({fig['failures']:.0f} failed, {fig['errors']:.0f} errors, {fig['skipped']:.0f} skipped)")
    print(f"make test: {total:.0f} s wall ({total / 60:.1f} min; the budget is 30 min on 2 cores)")
    combined: Dict[str, float] = collections.defaultdict(float)
    for totals in file_seconds(reports).values():
        for file, seconds in totals.items():
            combined[file] += seconds
    print(f"the {top} slowest files (seconds in tests, both environments):")
    for file, seconds in sorted(combined.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {seconds:8.1f}  {file}")


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="*", help="JUnit XML files (default: .test-times/*.xml)")
    parser.add_argument("--top", type=int, default=16, help="how many files the SLOWEST_FILES line names")
    parser.add_argument("--summary", action="store_true", help="wall time per environment and the 25 slowest files")
    args = parser.parse_args(argv)
    reports = args.reports or sorted(glob.glob(os.path.join(ROOT, ".test-times", "*-env.xml")))
    if not reports:
        parser.error("no reports: run make test first (it writes .test-times/*.xml), or name them")
    if args.summary:
        summary(reports)
        return 0
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
