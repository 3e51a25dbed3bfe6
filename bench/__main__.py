"""``make bench``: every benchmark, printed as Markdown tables of ratios to same-run baselines."""

from __future__ import annotations

import platform
import sys

from bench import codec, streams


def main() -> None:
    print(
        f"# Switchyard benchmarks ({platform.python_implementation()} {platform.python_version()})"
    )
    print("\n## Codec: per-message cost\n", flush=True)
    print(codec.table(codec.run()), flush=True)
    print(
        "\n## Whole ext_proc streams on one core (headers + 4 KB body, full-duplex)\n", flush=True
    )
    kinds = sys.argv[1:] or list(streams.KINDS)
    results = []
    for kind in kinds:
        print(f"  measuring {kind} ...", file=sys.stderr, flush=True)
        results.append(streams.measure(kind))
    print(streams.table(results))


if __name__ == "__main__":
    main()
