"""Run each side of a benchmark in a subprocess of its own (its own threads, memory and peak
RSS) and read back the one ``RESULT {json}`` line it prints."""
from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "RESULT "


def report(result: dict) -> None:
    """What a side prints last: its result for the parent."""
    print(PREFIX + json.dumps(result))


def run_side(script: str, side: str, extra: list[str]) -> dict:
    """``script`` again with this process's arguments, ``--side side`` and ``extra``; its result.
    A side that fails ends the benchmark with the tail of its stderr."""
    cmd = [sys.executable, script, *sys.argv[1:], "--side", side, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{side} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(PREFIX):])


def pinned_versions() -> dict[str, str]:
    """name -> version of every ``name==version`` line of constraints.txt (names lower-cased)."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            out[name.strip().lower()] = version.strip()
    return out


def print_peers(*names: str) -> dict[str, str | None]:
    """Print the installed version of each peer package, and say where it is not the version
    constraints.txt pins (the one the bench's published figures were measured with)."""
    pins, found = pinned_versions(), {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    parts = []
    for name, version in found.items():
        pin = pins.get(name.lower())   # torch is pinned in the Makefile, not here
        note = f" (constraints.txt pins {pin}: run `make bench`)" if pin and version != pin else ""
        parts.append(f"{name} {version or 'not installed'}{note}")
    print("peers: " + ", ".join(parts))
    return found
