#!/usr/bin/env python3
"""Cut the Proxmox VE API schema down to the endpoints capmox uses.

The full API viewer data (`apidata.json`, about 2 MB per PVE release) is a tree of
nodes with `path`, `info` (keyed by HTTP method) and `children`. The conformance tests
only need, for each endpoint named in `endpoints.txt` beside this script, which
parameters it declares and of what type, and what its answer is documented to hold
(`returns`: types, enums and the properties of objects and array items). This script writes exactly that, with the
sha256 of the file it was cut from, so the repository carries facts, not the whole schema.

Usage (standard library only):

    python3 tests/data/pve-api/subset.py FULL/apidata.json tests/data/pve-api/apidata.json
    python3 tests/data/pve-api/subset.py FULL/pve8/apidata.json tests/data/pve-api/pve8/apidata.json

An endpoint listed in `endpoints.txt` but absent from the full schema is left out of the
output (the conformance test then reports it); the script names it on stderr.
"""

import hashlib
import json
import sys
from pathlib import Path

# Parameter facts worth keeping: enough to check names, types and obvious limits.
KEPT_FACTS = ("type", "optional", "enum", "minimum", "maximum", "maxLength", "pattern")


def endpoints(listing: Path) -> list[tuple[str, str]]:
    """(method, path) pairs of `endpoints.txt`, skipping comments and blank lines."""
    pairs = []
    for line in listing.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        method, path = line.split(maxsplit=1)
        pairs.append((method, path))
    return pairs


def index(nodes: list, out: dict) -> None:
    """Maps path -> method -> info for every node of the viewer tree."""
    for node in nodes:
        if node.get("info"):
            out[node["path"]] = node["info"]
        index(node.get("children") or [], out)


def parameter(declared: dict) -> dict:
    """The kept facts of one parameter; a `format` only when it is a plain name."""
    kept = {key: declared[key] for key in KEPT_FACTS if key in declared}
    if isinstance(declared.get("format"), str):
        kept["format"] = declared["format"]
    return kept


def returns(declared: dict) -> dict:
    """The kept facts of a return schema: type, enum, optional, and the same for the
    properties of an object or the items of an array (so answers can be checked)."""
    kept = {key: declared[key] for key in ("type", "optional", "enum") if key in declared}
    if isinstance(declared.get("properties"), dict):
        kept["properties"] = {
            name: returns(p) for name, p in sorted(declared["properties"].items())
        }
    if isinstance(declared.get("items"), dict):
        kept["items"] = returns(declared["items"])
    return kept


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    full, output = Path(argv[1]), Path(argv[2])
    raw = full.read_bytes()
    by_path: dict = {}
    index(json.loads(raw), by_path)
    subset: dict = {}
    missing = []
    for method, path in endpoints(Path(__file__).with_name("endpoints.txt")):
        info = by_path.get(path, {}).get(method)
        if info is None:
            missing.append(f"{method} {path}")
            continue
        properties = (info.get("parameters") or {}).get("properties") or {}
        subset.setdefault(path, {})[method] = {
            "name": info.get("name"),
            "parameters": {name: parameter(p) for name, p in sorted(properties.items())},
            "returns": returns(info.get("returns") or {}),
        }
    document = {
        "source": {"file": full.name, "sha256": hashlib.sha256(raw).hexdigest()},
        "generated_by": "tests/data/pve-api/subset.py",
        "endpoints": subset,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    for endpoint in missing:
        print(f"not in {full}: {endpoint}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
