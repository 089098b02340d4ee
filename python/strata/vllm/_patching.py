"""The patch machinery of strata.vllm (patches.py) and strata.vllm.offload: a Patch names the
vLLM versions it was written against and checks, before anything is touched, that its targets
exist with the signatures it expects and that the private attributes it reads exist; on any
other version, or a target that changed, it refuses with UnsupportedVllm."""

import importlib
import inspect
import re


class UnsupportedVllm(RuntimeError):
    """vLLM's version, or a patched function, is not the one strata.vllm was written for."""


def parse_version(text):
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        raise UnsupportedVllm(f"strata.vllm: cannot read vLLM version {text!r}")
    return tuple(int(x or 0) for x in m.groups())


def _fmt(v):
    return ".".join(map(str, v))


class Patch:
    """One patch: ``targets`` = {"module:attr": [parameter names expected]}; ``attributes`` =
    {"module" or "module:Class": [attribute names read]}: a module's (or a class's) attributes,
    or attributes its instances get in ``__init__`` (``self.<name> =`` in its source)."""

    def __init__(self, name, first, end, targets, apply, attributes=None):
        self.name, self.first, self.end = name, first, end
        self.targets, self._apply = targets, apply
        self.attributes = attributes or {}

    @property
    def versions(self):
        return f">={_fmt(self.first)},<{_fmt(self.end)}"

    def check(self, version):
        v = parse_version(version)
        if not self.first <= v < self.end:
            raise UnsupportedVllm(
                f"strata.vllm: patch {self.name!r} supports vLLM {self.versions}, "
                f"this is vLLM {version}; refusing to patch (unset STRATA_VLLM to run stock vLLM)"
            )
        for target, params in self.targets.items():
            obj = _resolve(target)
            got = list(inspect.signature(obj).parameters)
            if got[: len(params)] != params:
                raise UnsupportedVllm(
                    f"strata.vllm: patch {self.name!r}: {target} takes {got}, expected {params} "
                    f"(vLLM {version}); refusing to patch"
                )
        for owner, names in self.attributes.items():
            obj = _resolve(owner)
            missing = [n for n in names if not _has_attribute(obj, n)]
            if missing:
                raise UnsupportedVllm(
                    f"strata.vllm: patch {self.name!r} reads {owner} attributes {missing}, "
                    f"which vLLM {version} does not have; refusing to patch"
                )

    def apply(self):
        self._apply()


def _resolve(target):
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def _has_attribute(obj, name):
    """Whether ``obj`` has attribute ``name``, or, for a class, sets it on its instances in
    ``__init__`` (its source assigns ``self.<name>``)."""
    if hasattr(obj, name):
        return True
    if not isinstance(obj, type):
        return False
    try:
        source = inspect.getsource(obj.__init__)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=", source) is not None
