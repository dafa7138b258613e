"""The conformance report: a header (who was tested where) and an op x level table, as JSON and Markdown."""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Cell:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    skip_reasons: list[str] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.failed:
            return "fail"
        if self.passed:
            return "pass"
        return "skip"


class Results:
    def __init__(self):
        self.cells: dict[tuple[str, int], Cell] = {}

    def add(self, op: str, level: int, rep, nodeid: str) -> None:
        cell = self.cells.setdefault((op, level), Cell())
        if rep.passed:
            cell.passed += 1
        elif rep.skipped:
            cell.skipped += 1
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            reason = reason.removeprefix("Skipped: ")
            if reason not in cell.skip_reasons:
                cell.skip_reasons.append(reason)
        else:
            cell.failed += 1
            text = rep.longreprtext
            # The kit's own failure message (with the repro) is the part after "Failed: ".
            message = text[text.rfind("Failed: ") + 8:] if "Failed: " in text else text[-3000:]
            cell.failures.append({"test": nodeid, "message": message.strip()[:4000]})

    def to_json(self, header: dict, levels: dict[int, str]) -> dict:
        ops = sorted({op for op, _ in self.cells})
        table = {}
        for op in ops:
            table[op] = {}
            for level in levels:
                cell = self.cells.get((op, level))
                if cell is None:
                    continue
                table[op][str(level)] = {"status": cell.status, "passed": cell.passed, "failed": cell.failed,
                                         "skipped": cell.skipped, "skip_reasons": cell.skip_reasons,
                                         "failures": cell.failures}
        statuses = [c.status for c in self.cells.values()]
        return {"header": header, "levels": {str(k): v for k, v in levels.items()}, "results": table,
                "summary": {"pass": statuses.count("pass"), "fail": statuses.count("fail"),
                            "skip": statuses.count("skip"), "ok": "fail" not in statuses}}


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
        })
    return info


MARK = {"pass": "pass", "fail": "**FAIL**", "skip": "skip"}


def markdown(data: dict) -> str:
    h = data["header"]
    levels = data["levels"]
    lines = [f"# HAL conformance: backend `{h.get('backend')}`", ""]
    for key in ("backend_class", "device", "device_name", "contract", "contract_fingerprint", "hal_version",
                "torch", "triton", "python", "depth", "date", "hal_env"):
        lines.append(f"- {key}: `{h.get(key)}`")
    lines += ["", "| op | " + " | ".join(f"{k}. {v}" for k, v in levels.items()) + " |",
              "|---|" + "---|" * len(levels)]
    for op, row in data["results"].items():
        cells = []
        for level in levels:
            cell = row.get(level)
            if cell is None:
                cells.append("")
            elif cell["status"] == "skip":
                cells.append("skip: " + "; ".join(cell["skip_reasons"])[:80])
            else:
                cells.append(f"{MARK[cell['status']]} ({cell['passed']}/{cell['passed'] + cell['failed']})")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    s = data["summary"]
    lines += ["", f"**{'CONFORMS' if s['ok'] else 'DOES NOT CONFORM'}**: {s['pass']} cells pass, {s['fail']} fail, "
                  f"{s['skip']} skipped."]
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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown(data) + "\n")
