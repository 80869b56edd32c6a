"""Run the adversarial corpus (tests/adversarial/corpus.py) on one device and print its table.

    python benchmarks/adversarial_corpus.py --device cpu|cuda [--out FILE.json] [--only NAME ...]

Each row is one attack evaluated in a child process exactly as the tests do (same run_attack,
same caught()); the table (attack, expected, got, caught) is what docs/adversarial.md records.
Exits 1 if any attack was not caught.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.adversarial.corpus import ATTACKS, Attack, Got, run_attack


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    attacks = [a for a in ATTACKS if args.device in a.devices]
    if args.only:
        attacks = [a for a in attacks if a.name in args.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pathgate-corpus-") as scratch:
        for attack in attacks:
            started = time.monotonic()
            got = run_attack(attack, args.device, Path(scratch) / attack.name)
            rows.append(_row(attack, got, time.monotonic() - started))
            print(f"{attack.name}: {rows[-1]['got']} ({rows[-1]['seconds']:.0f} s)", flush=True)
    print(_markdown(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": args.device, "rows": rows}, indent=2))
    return 0 if all(r["caught"] for r in rows) else 1


def _row(attack: Attack, got: Got, seconds: float) -> dict[str, object]:
    if "blocked" in attack.reasons:
        detail = "blocked" if got.observed.get("blocked") else f"NOT blocked: {got.observed}"
    elif attack.max_speedup is not None:
        fastest = f"{max(got.speedups):.2f}x" if got.speedups else "none measured"
        detail = f"largest speedup {fastest} (caught at or below {attack.max_speedup}x)"
    else:
        wanted = [r for r in got.reasons if any(w in r for w in attack.reasons)] or got.reasons
        detail = wanted[0] if wanted else ""
    return {
        "attack": attack.name,
        "what": attack.what,
        "expected": " or ".join(attack.expected),
        "got": got.outcome,
        "reason": detail[:160],
        "caught": got.caught(attack),
        "seconds": round(seconds, 1),
        "warnings": len(got.warnings),
    }


def _markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "| attack | what it does | expected | got | reason (first matching) | caught |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        reason = str(r["reason"]).replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {r['attack']} | {r['what']} | {r['expected']} | {r['got']} | {reason} | "
            f"{'yes' if r['caught'] else '**NO**'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
