"""The installed package must contain every subpackage (CI uses an editable install, which would
not notice a package missing from pyproject's explicit list; the GPU machine uses a plain install)."""

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapped = {name: Path(path) for name, path in config["package-dir"].items()}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hal").rglob("__init__.py")}
    for name, path in mapped.items():
        if name != "hal":
            found |= {name + "".join("." + part for part in p.parent.relative_to(ROOT / path).parts)
                      for p in (ROOT / path).rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
