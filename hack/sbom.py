#!/usr/bin/env python3
"""CycloneDX 1.5 SBOM of the capmox binary: every crate in its normal dependency graph.

Reads `cargo metadata --locked` (the resolved graph) and Cargo.lock (checksums); needs nothing
but python3 and cargo, and no network beyond what cargo itself may fetch from crates.io.
Build and dev dependencies are left out: they are not in the binary. Platform-specific
dependencies follow the image's target, x86_64-unknown-linux-musl (see Dockerfile).
"""

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = "capmox"
TARGET = "x86_64-unknown-linux-musl"
CRATES_IO = "registry+https://github.com/rust-lang/crates.io-index"


class SbomError(Exception):
    """The graph cannot be described faithfully; the message says what to fix."""


def cargo_metadata(manifest_dir: Path) -> dict:
    out = subprocess.run(
        ["cargo", "metadata", "--locked", "--format-version", "1", "--filter-platform", TARGET],
        cwd=manifest_dir,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def lock_checksums(manifest_dir: Path) -> dict:
    lock = tomllib.loads((manifest_dir / "Cargo.lock").read_text())
    return {(p["name"], p["version"]): p.get("checksum") for p in lock.get("package", [])}


def product_graph(meta: dict) -> tuple[str, dict]:
    """The root package's id and, for each package reachable over normal edges, its deps."""
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    root = next((p["id"] for p in meta["packages"] if p["name"] == ROOT and p["source"] is None), None)
    if root is None:
        raise SbomError(f"no workspace package named {ROOT} in cargo metadata")
    edges, todo = {}, [root]
    while todo:
        pkg = todo.pop()
        if pkg in edges:
            continue
        deps = [
            d["pkg"]
            for d in nodes[pkg]["deps"]
            if any(k["kind"] is None for k in d["dep_kinds"])
        ]
        edges[pkg] = sorted(set(deps))
        todo.extend(deps)
    return root, edges


def purl(pkg: dict) -> str:
    return f"pkg:cargo/{pkg['name']}@{pkg['version']}"


def component(pkg: dict, checksum: str | None) -> dict:
    if pkg["source"] != CRATES_IO:
        raise SbomError(f"{pkg['name']} {pkg['version']} comes from {pkg['source']}, not crates.io")
    if not pkg.get("license"):
        raise SbomError(f"{pkg['name']} {pkg['version']} declares no SPDX licence expression")
    comp = {
        "type": "library",
        "bom-ref": purl(pkg),
        "name": pkg["name"],
        "version": pkg["version"],
        "purl": purl(pkg),
        "licenses": [{"expression": pkg["license"]}],
        "externalReferences": [
            {
                "type": "distribution",
                "url": f"https://crates.io/crates/{pkg['name']}/{pkg['version']}",
            }
        ],
    }
    if checksum:
        comp["hashes"] = [{"alg": "SHA-256", "content": checksum}]
    return comp


def sbom(manifest_dir: Path) -> dict:
    meta = cargo_metadata(manifest_dir)
    checksums = lock_checksums(manifest_dir)
    packages = {p["id"]: p for p in meta["packages"]}
    root, edges = product_graph(meta)
    product = packages[root]
    ref = {pid: purl(packages[pid]) for pid in edges}
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "version": 1,
        "metadata": {
            "component": {
                "type": "application",
                "bom-ref": ref[root],
                "name": product["name"],
                "version": product["version"],
                "purl": ref[root],
                "licenses": [{"expression": product["license"]}],
            },
            "properties": [{"name": "cargo:target", "value": TARGET}],
        },
        "components": [
            component(packages[pid], checksums.get((packages[pid]["name"], packages[pid]["version"])))
            for pid in sorted(edges, key=lambda p: (packages[p]["name"], packages[p]["version"]))
            if pid != root
        ],
        "dependencies": [
            {"ref": ref[pid], "dependsOn": [ref[d] for d in deps]}
            for pid, deps in sorted(edges.items(), key=lambda e: ref[e[0]])
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON SBOM")
    parser.add_argument("--manifest-dir", default=Path(__file__).resolve().parent.parent, type=Path)
    args = parser.parse_args()
    try:
        doc = sbom(args.manifest_dir)
    except (SbomError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", None) or err
        print(f"sbom: {detail}", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"sbom: {len(doc['components'])} crates written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
