"""Capture one request's ext_proc messages for ``docs/walkthrough.md``, and keep the doc true.

``python -m demo.walkthrough --write`` brings the demo gateway up on free
ports with message tracing on, sends one completion request, and rewrites
every captured block of the document (between ``<!-- capture: NAME -->`` and
``<!-- end capture -->``) from what BBR, the pool's LWEPP and the client
actually saw. The test suite runs the same capture and fails when a block
differs, so the walkthrough cannot drift from the code.

Run-to-run noise is normalised: the free ports are written as the demo's
fixed ones (8101, 8102, ...), and request ids, dates and timings as fixed
placeholders.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Final

import orjson

from demo.topology import Topology, free_ports
from pods.file import load_pods

DOC: Final = Path(__file__).resolve().parent.parent / "docs" / "walkthrough.md"
DEMO_PODS: Final = Path(__file__).resolve().parent / "pods.yaml"
REQUEST: Final = {"model": "llama-3-8b", "prompt": "Say hello", "max_tokens": 3}
BLOCK: Final = re.compile(r"(<!-- capture: (\S+) -->\n)(.*?)(<!-- end capture -->)", re.DOTALL)


def _pod_file(work_dir: Path) -> tuple[Path, dict[int, int]]:
    """The demo's pods on free ports, and the map from each free port back to the demo's."""
    text = DEMO_PODS.read_text()
    demo_ports = [port for pod in load_pods(DEMO_PODS) for port in pod.ports]
    mapping = dict(zip(free_ports(len(demo_ports)), demo_ports, strict=True))
    for free, demo in mapping.items():
        text = text.replace(f"[{demo}]", f"[{free}]")
    path = work_dir / "pods.yaml"
    path.write_text(text)
    return path, mapping


def _streams(trace: str) -> dict[int, list[tuple[str, str]]]:
    """A trace file as {stream number: [(heading, message text), ...]}."""
    streams: dict[int, list[tuple[str, str]]] = {}
    for part in re.split(r"^## ", trace, flags=re.MULTILINE)[1:]:
        heading, _, body = part.partition("\n")
        number = int(heading.split()[1])
        streams.setdefault(number, []).append((heading, body.rstrip()))
    return streams


def _normalise(text: str, ports: dict[int, int]) -> str:
    for free, demo in ports.items():
        text = re.sub(rf"\b{free}\b", str(demo), text)
    text = re.sub(
        r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b",
        "00000000-0000-0000-0000-000000000000",
        text,
    )
    text = re.sub(r'("date"\s+raw_value: )"[^"]*"', r'\1"<date>"', text)
    text = re.sub(r'(key: "date"\n\s+raw_value: )"[^"]*"', r'\1"<date>"', text)
    text = re.sub(r'(key: "x-envoy-upstream-service-time"\n\s+raw_value: )"\d+"', r'\1"<ms>"', text)
    text = re.sub(
        r"^(date|x-envoy-upstream-service-time): .*$", r"\1: <varies>", text, flags=re.MULTILINE
    )
    text = re.sub(r'"created":\d+', '"created":0', text)
    return re.sub(r'"id":"(cmpl|chatcmpl)-[^"]*"', r'"id":"\1-0"', text)


def _messages(trace_file: Path, ports: dict[int, int]) -> dict[str, str]:
    """Each message of the trace's first stream, keyed ``<- request_headers``, ``-> ...``."""
    ((first, *_),) = [sorted(_streams(trace_file.read_text()).items())[:1]]
    blocks: dict[str, str] = {}
    for heading, body in first[1]:
        _, _, arrow, phase = heading.split()
        key, count = f"{arrow} {phase}", 1
        while key in blocks:
            count += 1
            key = f"{arrow} {phase} {count}"
        blocks[key] = _normalise(body, ports)
    return blocks


def capture() -> dict[str, str]:
    """Run the demo gateway, send one request, and return every block the document shows."""
    with tempfile.TemporaryDirectory(prefix="switchyard-walkthrough-") as tmp:
        work_dir = Path(tmp)
        pod_file, ports = _pod_file(work_dir)
        with Topology(work_dir, pod_file, fail_open=["b"], trace=True) as gateway:
            ports[gateway.port] = 8080  # the demo's listener
            request = urllib.request.Request(
                f"{gateway.url}/v1/completions",
                data=orjson.dumps(REQUEST),
                headers={
                    "content-type": "application/json",
                    "user-agent": "curl/8.5.0",
                    "x-request-id": "6c0f3e9a-0000-4000-8000-000000000001",
                },
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                status, headers, body = response.status, response.headers, response.read()
            bbr = _messages(work_dir / "bbr.trace", ports)
            lwepp = _messages(work_dir / "lwepp-a.trace", ports)
    answer = "\n".join(
        [
            f"HTTP/1.1 {status}",
            *(f"{k.lower()}: {v}" for k, v in headers.items()),
            "",
            body.decode(),
        ]
    )
    blocks = {f"bbr {key}": value for key, value in bbr.items()}
    blocks |= {f"lwepp {key}": value for key, value in lwepp.items()}
    blocks["client response"] = _normalise(answer, ports)
    return {
        name.replace(" ", "_").replace("<-", "in").replace("->", "out"): text
        for name, text in blocks.items()
    }


def render(document: str, blocks: dict[str, str]) -> str:
    """``document`` with every capture block replaced by the captured text."""

    def fill(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in blocks:
            raise KeyError(
                f"docs/walkthrough.md names capture {name!r}; captured: {sorted(blocks)}"
            )
        return f"{match.group(1)}```text\n{blocks[name]}\n```\n{match.group(4)}"

    return BLOCK.sub(fill, document)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m demo.walkthrough", description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite docs/walkthrough.md")
    parser.add_argument("--list", action="store_true", help="print every captured block")
    args = parser.parse_args()
    blocks = capture()
    if args.list:
        for name, text in blocks.items():
            print(f"<!-- capture: {name} -->\n{text}\n")
    document = DOC.read_text()
    updated = render(document, blocks)
    if args.write:
        DOC.write_text(updated)
    elif updated != document:
        sys.exit("docs/walkthrough.md differs from a fresh capture: run with --write")


if __name__ == "__main__":
    main()
