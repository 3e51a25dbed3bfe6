"""``python -m stubs.generate``: type stubs for the ext_proc messages, for mypy.

xds-protos ships Envoy's generated message classes with no type information,
so to mypy every message would be ``Any`` and a misspelt field would reach
the wire unchecked. mypy-protobuf writes ``.pyi`` stubs from a protobuf file
descriptor; it is a protoc plugin, which reads a ``CodeGeneratorRequest`` on
stdin and answers a ``CodeGeneratorResponse`` on stdout. protoc itself is not
needed: the installed modules carry their own descriptors
(``DESCRIPTOR.serialized_pb``), so the request is built from exactly the
classes the services run with, and the stubs cannot drift from them unnoticed
(``tests/test_stubs.py`` regenerates and compares).

Stubs are written beside this file, into ``stubs/`` (``mypy_path``), for the
modules ``wire`` and ``serving`` import and every file those import, so no
field's type is left ``Any``;
``google.protobuf``'s own types come from types-protobuf. Stubs cost nothing
at run time: mypy alone reads them.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from google.protobuf.descriptor import FileDescriptor

MODULES: Final = (
    "envoy.service.ext_proc.v3.external_processor_pb2",
    "envoy.config.core.v3.base_pb2",
    "envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2",
    "envoy.type.v3.http_status_pb2",
)
"""The xds-protos modules whose messages the services build and read (stubs are written
for these and for the files they import)."""

TYPED_ELSEWHERE: Final = "google/protobuf/"
"""Files whose stubs types-protobuf already ships."""

OUT: Final = Path(__file__).resolve().parent

PLUGIN: Final = "protoc-gen-mypy"
"""mypy-protobuf's protoc plugin (the dev extra installs it beside this Python)."""


def _closure(files: Sequence[FileDescriptor]) -> Iterator[FileDescriptor]:
    """``files`` and everything they import, each after its imports (protoc's order)."""
    seen: set[str] = set()

    def visit(file: FileDescriptor) -> Iterator[FileDescriptor]:
        if file.name in seen:
            return
        seen.add(file.name)
        for dependency in file.dependencies:
            yield from visit(dependency)
        yield file

    for file in files:
        yield from visit(file)


def request(modules: Sequence[str] = MODULES) -> plugin_pb2.CodeGeneratorRequest:
    """The plugin's input: stubs for ``modules`` and every file they import."""
    files = list(_closure([importlib.import_module(name).DESCRIPTOR for name in modules]))
    message = plugin_pb2.CodeGeneratorRequest(
        file_to_generate=[f.name for f in files if not f.name.startswith(TYPED_ELSEWHERE)],
        parameter="quiet",
    )
    for file in files:
        message.proto_file.append(descriptor_pb2.FileDescriptorProto.FromString(file.serialized_pb))
    return message


def plugin_path() -> str:
    """The plugin beside this interpreter (a virtualenv's bin), else on PATH."""
    beside = Path(sys.executable).parent / PLUGIN
    found = str(beside) if beside.exists() else shutil.which(PLUGIN)
    if found is None:
        raise SystemExit(f"{PLUGIN} not found: install the dev extra (mypy-protobuf)")
    return found


def generate(out: Path = OUT) -> list[Path]:
    """Write the stubs under ``out`` (replacing what is there); return the files written."""
    ran = subprocess.run(
        [plugin_path()], input=request().SerializeToString(), capture_output=True, check=True
    )
    response = plugin_pb2.CodeGeneratorResponse.FromString(ran.stdout)
    if response.error:
        raise SystemExit(f"{PLUGIN}: {response.error}")
    for old in out.rglob("*.pyi"):  # this file stays; files no longer generated go
        old.unlink()
    written = []
    for file in response.file:
        path = out / file.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(file.content)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m stubs.generate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=OUT, help="where to write (default: stubs/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
