"""``make bench``: every benchmark, printed as Markdown tables of ratios to same-run baselines."""

from __future__ import annotations

import platform
import sys

from bench import codec, hooks, plugins, streams


def main() -> None:
    print(
        f"# Switchyard benchmarks ({platform.python_implementation()} {platform.python_version()})"
    )
    print("\n## Codec: per-message cost\n", flush=True)
    print(codec.table(codec.run()), flush=True)
    print("\n## Plugins: per-call cost (filters, scorers, data-source steps)\n", flush=True)
    print(plugins.table(*plugins.run()), flush=True)
    print("\n## Hooks: what the pipeline adds per request (do-nothing plugins)\n", flush=True)
    print(hooks.table(hooks.run()), flush=True)
    print("", flush=True)
    print(hooks.stream_table(hooks.stream_rows()), flush=True)
    print(
        "\n## Whole ext_proc streams on one core (headers + 4 KB body, full-duplex)\n", flush=True
    )
    kinds = sys.argv[1:] or list(streams.KINDS)
    print(f"  measuring {', '.join(kinds)} in interleaved rounds ...", file=sys.stderr, flush=True)
    print(streams.table(streams.measure(kinds)))


if __name__ == "__main__":
    main()
