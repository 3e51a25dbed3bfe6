"""The micro-benchmarks as one report section: codec, plugins and the hook pipeline.

Each is a ratio to a baseline measured in the same run (see each module):
the xds-protos codec against envoy-data-plane's, every plugin against a
do-nothing one, the hook pipeline and admission (flow control's request
control) against a bare round-robin pick.
"""

from __future__ import annotations

from bench import admission, codec, hooks, plugins
from bench.report import Options, Section, progress


def run(options: Options) -> Section:
    """Measure the three micro-benchmarks (a tiny budget when ``options.quick``)."""
    scale = 0.02 if options.quick else 1.0
    progress("micro: codec")
    blocks = ["**Codec: per-message cost**\n\n" + codec.table(codec.run(budget=0.5 * scale))]
    progress("micro: plugins")
    rows, bytes_per_block = plugins.run(budget=0.1 * scale)
    blocks.append("**Plugins: per-call cost**\n\n" + plugins.table(rows, bytes_per_block))
    progress("micro: hook pipeline")
    blocks.append(
        "**Hooks: what the pipeline adds per request (do-nothing plugins)**\n\n"
        + hooks.table(hooks.run(budget=0.3 * scale, rounds=1 if options.quick else 3))
    )
    progress("micro: admission")
    blocks.append(
        "**Admission: what governing a request adds (the request control alone)**\n\n"
        + admission.table(admission.run(budget=0.3 * scale, rounds=1 if options.quick else 3))
    )
    streams, rounds = (200, 1) if options.quick else (2000, 3)
    blocks.append(hooks.stream_table(hooks.stream_rows(streams=streams, rounds=rounds)))
    return Section(
        key="micro",
        title="Micro-benchmarks: codec, plugins, hook pipeline",
        command="make bench-micro",
        blocks=blocks,
        notes=["Each figure is a ratio to a baseline measured in the same run, same process."],
    )
