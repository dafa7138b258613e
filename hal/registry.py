"""Backend discovery: the only module that touches entry points.

Backends register under the entry-point group ``hal.backends``; stevedore finds and imports them.
A plugin whose import raises is kept with its exception (so ``hal doctor`` and the selection error
can say why), and two packages that register one name are a conflict, reported with both package
names whenever that name is used.
"""

from __future__ import annotations

import importlib.metadata
import traceback
from dataclasses import dataclass, field

from stevedore import ExtensionManager

from hal.backend import Backend, Probe
from hal.errors import BackendConflictError, BackendLoadError, BackendNotFoundError

NAMESPACE = "hal.backends"


@dataclass
class BackendInfo:
    """One installed backend: where it comes from, and its class or why it failed to import."""

    name: str
    target: str
    package: str = "?"
    version: str = "?"
    cls: type[Backend] | None = None
    load_error: BaseException | None = None
    conflicts: list[str] = field(default_factory=list)  # "package (target)" of every other claimant

    def probe(self) -> Probe:
        if self.conflicts:
            return Probe.missing(f"name conflict: also registered by {', '.join(self.conflicts)}")
        if self.load_error is not None:
            return Probe.missing(f"import of {self.target} failed: "
                                 f"{type(self.load_error).__name__}: {self.load_error}")
        try:
            return self.cls.probe()
        except Exception as exc:  # a probe must not raise; if it does, report it as the reason
            return Probe.missing(f"probe raised {type(exc).__name__}: {exc}")

    @property
    def kind(self) -> str:
        return getattr(self.cls, "kind", "?")


def _owners() -> dict[tuple[str, str], tuple[str, str]]:
    """(entry-point name, target) -> (distribution name, version) for the group."""
    owners = {}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group == NAMESPACE:
                owners.setdefault((ep.name, ep.value), (dist.metadata["Name"], dist.version))
    return owners


_cache: dict[str, BackendInfo] | None = None


def discover(refresh: bool = False) -> dict[str, BackendInfo]:
    """Every backend registered under ``hal.backends``, by name (sorted)."""
    global _cache
    if _cache is not None and not refresh:
        return _cache
    if refresh:
        ExtensionManager.ENTRY_POINT_CACHE.pop(NAMESPACE, None)
    failures: dict[tuple[str, str], BaseException] = {}

    def on_failure(_manager, entry_point, exc):
        failures[(entry_point.name, entry_point.value)] = exc

    manager = ExtensionManager(NAMESPACE, invoke_on_load=False, on_load_failure_callback=on_failure)
    owners = _owners()
    claims: dict[str, list[BackendInfo]] = {}
    for ep in manager.list_entry_points():
        package, version = owners.get((ep.name, ep.value), ("?", "?"))
        info = BackendInfo(ep.name, ep.value, package, version)
        claims.setdefault(ep.name, []).append(info)
    for ext in manager.extensions:
        for info in claims[ext.name]:
            if info.target != ext.entry_point.value:
                continue
            if isinstance(ext.plugin, type) and issubclass(ext.plugin, Backend):
                info.cls = ext.plugin
            else:
                info.load_error = TypeError(f"{info.target} is not a subclass of hal.backend.Backend")
    for (name, target), exc in failures.items():
        for info in claims[name]:
            if info.target == target:
                info.load_error = exc
    found = {}
    for name, infos in sorted(claims.items()):
        if len(infos) > 1:
            for info in infos:
                info.conflicts = [f"{o.package} ({o.target})" for o in infos if o is not info]
        found[name] = infos[0]
    _cache = found
    return found


def describe_installed() -> str:
    """One line per installed backend with its availability: for error messages."""
    lines = []
    for name, info in discover().items():
        probe = info.probe()
        lines.append(f"  {name:<10} {'available' if probe.available else 'unavailable: ' + probe.reason}")
    return "\n".join(lines) or "  (none: is the package installed?)"


def installed_summary() -> str:
    """The installed backends on one line, ``name (available|unavailable)``, for one-line errors."""
    found = discover()
    return ", ".join(f"{name} ({'available' if info.probe().available else 'unavailable'})"
                     for name, info in found.items()) or "none (is the package installed?)"


def backend_class(name: str) -> type[Backend]:
    """The class registered under ``name``; clear errors for unknown, broken and conflicting names."""
    found = discover()
    if name not in found:
        raise BackendNotFoundError(f"no backend named {name!r}. Installed backends:\n{describe_installed()}")
    info = found[name]
    if info.conflicts:
        raise BackendConflictError(
            f"backend name {name!r} is registered by more than one package: {info.package} ({info.target}), "
            f"{', '.join(info.conflicts)}. Uninstall one of them.")
    if info.load_error is not None:
        detail = "".join(traceback.format_exception_only(type(info.load_error), info.load_error)).strip()
        raise BackendLoadError(f"backend {name!r} ({info.package}) is installed but importing {info.target} "
                               f"failed: {detail}") from info.load_error
    return info.cls
