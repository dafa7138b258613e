"""The conformance report: a header (who was tested where) and an op x level table, as JSON and Markdown."""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

from hal.errors import HalError


DECLARED = "declared unsupported by the backend: "  # the kit's skip reason for a declared capability gap
# The skip reason for an op the bound contract does not cover (MoE ops under a contract without [moe]):
# reported like a declared gap, with the reason, since there is no rule for the backend to honour.
NOT_IN_CONTRACT = "not in the contract: "


@dataclass
class Cell:
    """One op x level cell: counts of tests, and why they skipped or failed."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0       # skipped without a declaration: NOT conformance
    unsupported: int = 0   # skipped because the backend declared the capability missing
    skip_reasons: list[str] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)

    @property
    def status(self) -> str:
        """fail > skip (undeclared) > pass > unsupported (declared only)."""
        if self.failed:
            return "fail"
        if self.skipped:
            return "skip"
        if self.passed:
            return "pass"
        return "unsupported"

    def to_json(self) -> dict:
        return {"status": self.status, "passed": self.passed, "failed": self.failed, "skipped": self.skipped,
                "unsupported": self.unsupported, "skip_reasons": self.skip_reasons, "failures": self.failures}

    @classmethod
    def from_json(cls, data: dict) -> "Cell":
        return cls(data["passed"], data["failed"], data["skipped"], data.get("unsupported", 0),
                   list(data["skip_reasons"]), list(data["failures"]))

    def absorb(self, other: "Cell") -> None:
        """Add another shard's counts of the same cell."""
        self.passed += other.passed
        self.failed += other.failed
        self.skipped += other.skipped
        self.unsupported += other.unsupported
        self.skip_reasons += [r for r in other.skip_reasons if r not in self.skip_reasons]
        self.failures += other.failures


class Results:
    def __init__(self):
        self.cells: dict[tuple[str, int], Cell] = {}
        self.tests: dict[str, dict] = {}   # node id -> {"op", "level", "outcome"}: what resume and merge use

    def add(self, op: str, level: int, rep, nodeid: str) -> None:
        cell = self.cells.setdefault((op, level), Cell())
        if rep.passed:
            cell.passed += 1
            outcome = "passed"
        elif rep.skipped:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            reason = reason.removeprefix("Skipped: ")
            if reason.startswith((DECLARED, NOT_IN_CONTRACT)):
                cell.unsupported += 1
                outcome = "unsupported"
            else:
                cell.skipped += 1
                outcome = "skipped"
            if reason not in cell.skip_reasons:
                cell.skip_reasons.append(reason)
        else:
            cell.failed += 1
            outcome = "failed"
            text = rep.longreprtext
            # The kit's own failure message (with the repro) is the part after "Failed: ".
            message = text[text.rfind("Failed: ") + 8:] if "Failed: " in text else text[-3000:]
            cell.failures.append({"test": nodeid, "message": message.strip()[:4000]})
        self.tests[nodeid] = {"op": op, "level": level, "outcome": outcome}

    def absorb_json(self, data: dict, origin: str = "report") -> None:
        """Add a report's cells and tests (a shard, or the report a resumed run appends to)."""
        for nodeid in data.get("tests", {}):
            if nodeid in self.tests:
                raise HalError(f"{origin}: test {nodeid} is recorded twice (overlapping shards or a report "
                               f"merged with itself); merge the reports of disjoint shards only")
        self.tests.update(data.get("tests", {}))
        for op, row in data["results"].items():
            for level, cell in row.items():
                self.cells.setdefault((op, int(level)), Cell()).absorb(Cell.from_json(cell))

    def to_json(self, header: dict, levels: dict[int, str]) -> dict:
        table: dict[str, dict] = {}
        for (op, level), cell in sorted(self.cells.items()):
            table.setdefault(op, {})[str(level)] = cell.to_json()
        statuses = [c.status for c in self.cells.values()]
        expected = header.get("selection", {}).get("tests")
        complete = expected is None or len(self.tests) >= expected
        return {"header": header, "levels": {str(k): v for k, v in levels.items()}, "results": table,
                "tests": dict(sorted(self.tests.items())),
                "summary": {"pass": statuses.count("pass"), "fail": statuses.count("fail"),
                            "skip": statuses.count("skip"), "unsupported": statuses.count("unsupported"),
                            "tests_run": len(self.tests), "tests_selected": expected, "complete": complete,
                            "ok": complete and "fail" not in statuses and "skip" not in statuses}}


# Header fields that must agree for two reports to be merged (or a run to append to a report).
MERGE_KEYS = ("backend", "backend_class", "contract", "contract_fingerprint", "depth")


def check_compatible(first: dict, other: dict, first_name: str, other_name: str) -> None:
    """Raise unless two report headers are of the same backend, contract, depth and test selection."""
    for key in MERGE_KEYS:
        if first.get(key) != other.get(key):
            raise HalError(f"cannot merge {other_name} into {first_name}: {key} is {other.get(key)!r} there but "
                           f"{first.get(key)!r} here; merge only reports of one backend, contract and depth")
    a, b = first.get("selection", {}), other.get("selection", {})
    for key in ("levels", "ops", "tests", "max_examples"):
        if a.get(key) != b.get(key):
            raise HalError(f"cannot merge {other_name} into {first_name}: their test selections differ ({key} "
                           f"{b.get(key)!r} vs {a.get(key)!r}); run every shard with the same --level/--op")


def merge(reports: list[tuple[str, dict]]) -> dict:
    """One report from shard reports ``[(name, data), ...]``: counts of a cell present in several add up."""
    if not reports:
        raise HalError("hal conformance merge needs at least one report")
    first_name, first = reports[0]
    results = Results()
    for name, data in reports:
        check_compatible(first["header"], data["header"], first_name, name)
        results.absorb_json(data, name)
    header = dict(first["header"])
    header["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    header["selection"] = dict(header.get("selection", {}), shard=None,
                               merged_from=[d["header"].get("selection", {}).get("shard") or name
                                            for name, d in reports])
    levels = {int(k): v for k, v in first["levels"].items()}
    return results.to_json(header, levels)


def load(path: str | os.PathLike) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise HalError(f"cannot read conformance report {path}: {exc}") from exc
    if not isinstance(data, dict) or not {"header", "levels", "results"} <= set(data):
        raise HalError(f"{path} is not a HAL conformance report (no header/levels/results); write one with "
                       f"`hal conformance --backend NAME --json {path}`")
    return data


def header(backend, depth: str) -> dict:
    import torch

    from hal import __version__

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hal_version": __version__, "torch": torch.__version__, "triton": triton_version,
        "python": platform.python_version(), "machine": platform.machine(), "depth": depth,
        "hal_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("HAL_")},
    }
    if backend is not None:
        probe = type(backend).probe()
        info.update({
            "backend": backend.name, "backend_class": f"{type(backend).__module__}.{type(backend).__qualname__}",
            "device": probe.device or str(backend.device),
            "device_name": torch.cuda.get_device_name() if backend.device.type == "cuda" else platform.processor(),
            "contract": backend.contract.name if backend.contract else None,
            "contract_fingerprint": backend.fingerprint,
            "declared_unsupported": sorted(f"{op} {str(dtype).replace('torch.', '')}"
                                           for op, dtype in getattr(backend, "unsupported", ())),
        })
    return info


MARK = {"pass": "pass", "fail": "**FAIL**", "skip": "**SKIPPED (not declared)**", "unsupported": "unsupported"}


def verdict(summary: dict) -> str:
    if summary["fail"] or summary["skip"]:
        return "DOES NOT CONFORM"
    if not summary.get("complete", True):
        return "INCOMPLETE"
    return "CONFORMS"


def markdown(data: dict) -> str:
    h = data["header"]
    levels = data["levels"]
    lines = [f"# HAL conformance: backend `{h.get('backend')}`", ""]
    for key in ("backend_class", "device", "device_name", "contract", "contract_fingerprint", "hal_version",
                "torch", "triton", "python", "depth", "selection", "date", "hal_env"):
        lines.append(f"- {key}: `{h.get(key)}`")
    lines += ["", "| op | " + " | ".join(f"{k}. {v}" for k, v in levels.items()) + " |",
              "|---|" + "---|" * len(levels)]
    for op, row in data["results"].items():
        cells = []
        for level in levels:
            cell = row.get(level)
            if cell is None:
                cells.append("")
            elif cell["status"] in ("skip", "unsupported"):
                cells.append(f"{MARK[cell['status']]}: " + "; ".join(cell["skip_reasons"])[:80])
            else:
                cells.append(f"{MARK[cell['status']]} ({cell['passed']}/{cell['passed'] + cell['failed']})")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    s = data["summary"]
    run = f" {s['tests_run']} of {s['tests_selected']} selected tests run." if s.get("tests_selected") else ""
    lines += ["", f"**{verdict(s)}**: {s['pass']} cells pass, {s['fail']} fail, {s['skip']} skipped without a "
                  f"declaration, {s.get('unsupported', 0)} declared unsupported or not in the contract.{run}"]
    if s["skip"]:
        lines += ["", "A skipped cell is not conformance: the backend refused or skipped tests without declaring "
                      "the capability missing (`Backend.unsupported`)."]
    if not s.get("complete", True):
        lines += ["", "Not every selected test has run: merge the other shards (`hal conformance merge`) or resume "
                      "(`--resume`)."]
    failures = [(op, lvl, f) for op, row in data["results"].items() for lvl, c in row.items() for f in c["failures"]]
    if failures:
        lines += ["", "## Failures (first of each cell)", ""]
        seen = set()
        for op, lvl, f in failures:
            if (op, lvl) in seen:
                continue
            seen.add((op, lvl))
            lines += [f"### {op}, level {lvl} ({levels[lvl]})", "", "```", f["message"], "```", ""]
    return "\n".join(lines)


def write(data: dict, path: str | os.PathLike) -> None:
    """JSON and Markdown, each replaced atomically (a run killed mid-write leaves the previous report,
    which ``--resume`` can continue)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, text in ((path, json.dumps(data, indent=2) + "\n"), (path.with_suffix(".md"), markdown(data) + "\n")):
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, target)
