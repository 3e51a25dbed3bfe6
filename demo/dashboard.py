"""The Grafana dashboard's panels, drawn from a real run: ``python -m demo.dashboard OUT.png``.

Grafana itself cannot be installed from the package registries this project
uses (PyPI, npm, Debian: it is none of them), so this draws the same panels
another way. It starts the demo gateway (``demo.topology``) with every picker
at ``--request-metrics=response``, a real Prometheus (Debian's ``prometheus``
package: ``apt-get install prometheus``) scraping the pickers and BBR every
second, and sends streamed and whole completions to both models for
``--seconds``, some with a TTFT objective (``x-llm-d-slo-ttft-ms``) and a
TPOT one. Then it asks Prometheus for each panel's own PromQL, as the
dashboard JSON writes it (``$namespace`` → every namespace,
``$__rate_interval`` → 15 s), and draws every panel with data in a grid with
matplotlib.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Final

import aiohttp

from demo.topology import Topology, free_ports

DASHBOARD: Final = (
    Path(__file__).parent.parent
    / "manifests"
    / "components"
    / "monitoring"
    / "switchyard-dashboard.json"
)
MODELS: Final = ("model-a", "model-b")


def pod_file(directory: Path) -> Path:
    ports = iter(free_ports(4))
    lines = ["pods:"]
    for pool, model in zip("ab", MODELS, strict=True):
        for replica in range(2):
            lines += [f"- name: {pool}-{replica}", "  address: 127.0.0.1"]
            lines += [f"  ports: [{next(ports)}]", f"  labels: {{pool: {pool}, model: {model}}}"]
    path = directory / "pods.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start_prometheus(work: Path, targets: list[int]) -> tuple[subprocess.Popen[bytes], int]:
    """A real Prometheus scraping ``targets`` (metrics ports) every second, as namespace demo."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("demo.dashboard: no prometheus binary (apt-get install prometheus)")
    (port,) = free_ports(1)
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "switchyard",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{t}" for t in targets],
                        "labels": {"namespace": "demo"},
                    }
                ],
            }
        ],
    }
    (work / "prometheus.yml").write_text(json.dumps(config))
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(work / "prometheus.log").open("wb"),
    )
    return process, port


async def traffic(url: str, seconds: float, seed: int) -> int:
    """Completions to both models, streamed or whole, some with objectives; how many."""
    rng, sent = random.Random(seed), 0
    deadline = time.monotonic() + seconds

    async def client(http: aiohttp.ClientSession, number: int) -> None:
        nonlocal sent
        while time.monotonic() < deadline:
            model = MODELS[number % 2]
            stream = rng.random() < 0.7
            headers = {}
            if rng.random() < 0.6:
                headers["x-llm-d-slo-ttft-ms"] = str(rng.choice((50, 150, 400)))
                headers["x-llm-d-slo-tpot-ms"] = str(rng.choice((8, 12, 30)))
            body = {
                "model": model,
                "prompt": " ".join(
                    f"w{rng.randrange(9999)}" for _ in range(rng.randrange(20, 400))
                ),
                "max_tokens": rng.randrange(8, 64),
                "stream": stream,
            }
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as answer:
                await answer.read()
            sent += 1
            await asyncio.sleep(rng.random() * 0.2)

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(client(http, n) for n in range(6)))
    return sent


def promql(expr: str) -> str:
    """A panel's query with Grafana's variables filled in: every namespace, 15 s rates."""
    return expr.replace('=~"$namespace"', '=~".*"').replace("$__rate_interval", "15s")


def query_range(port: int, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    arguments = {"query": promql(expr), "start": start, "end": end, "step": 2}
    url = f"http://127.0.0.1:{port}/api/v1/query_range?{urllib.parse.urlencode(arguments)}"
    with urllib.request.urlopen(url, timeout=30) as answer:
        result: list[dict[str, Any]] = json.load(answer)["data"]["result"]
    return result


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend; a label Prometheus dropped (an empty value) is ``""``."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: labels.get(m[1]) or '""', template)


def draw(port: int, start: float, end: float, out: Path) -> int:
    """Each panel with data, in the dashboard's order, two to a row; how many were drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        lines = []
        for target in panel["targets"]:
            for series in query_range(port, target["expr"], start, end):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                points = [(t, v) for t, v in points if math.isfinite(v)]
                if points:
                    lines.append((legend(target["legendFormat"], series["metric"]), points))
        if lines:
            panels.append((panel, lines))
    rows = math.ceil(len(panels) / 2)
    figure, axes = plt.subplots(rows, 2, figsize=(16, 3.2 * rows), squeeze=False)
    figure.suptitle(json.loads(DASHBOARD.read_text())["title"] + " (a real demo run)", fontsize=14)
    for axis, (panel, lines) in zip(axes.flat, panels, strict=False):
        for label, points in lines[:8]:
            axis.plot([t for t, _ in points], [v for _, v in points], label=label, linewidth=1.2)
        axis.set_title(panel["title"], fontsize=10, loc="left")
        axis.tick_params(labelsize=8)
        axis.set_xlabel(f"seconds ({panel['fieldConfig']['defaults'].get('unit', '')})", fontsize=7)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6, loc="upper left", ncols=2)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    figure.savefig(out, dpi=80)
    return len(panels)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m demo.dashboard")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        picker_args = {pool: ["--request-metrics=response"] for pool in "ab"}
        with Topology(work, pod_file(work), picker_args=picker_args) as gateway:
            scraped = [n for n in gateway.services if n == "bbr" or n.startswith("lwepp-")]
            ports = [gateway.services[name].listening["metrics_port"] for name in scraped]
            prometheus, port = start_prometheus(work, ports)
            try:
                start = time.time()
                sent = asyncio.run(traffic(gateway.url, args.seconds, args.seed))
                time.sleep(3)  # the last scrape
                drawn = draw(port, start, time.time(), args.out)
            finally:
                prometheus.terminate()
                prometheus.wait(10)
    print(f"{sent} requests; {drawn} panels drawn to {args.out}")


if __name__ == "__main__":
    main()
