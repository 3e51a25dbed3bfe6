"""The committed type stubs of the ext_proc messages match the installed xds-protos."""

from __future__ import annotations

from pathlib import Path

from stubs import generate as stubgen


def test_the_committed_stubs_are_what_the_generator_writes_now(tmp_path: Path) -> None:
    """``stubs/`` is current: regenerating from the installed descriptors changes no file."""
    written = stubgen.generate(tmp_path)
    fresh = {path.relative_to(tmp_path): path.read_text() for path in written}
    committed = {
        path.relative_to(stubgen.OUT): path.read_text() for path in stubgen.OUT.rglob("*.pyi")
    }
    assert sorted(fresh) == sorted(committed), "run: make stubs"
    stale = [str(name) for name, text in fresh.items() if committed[name] != text]
    assert stale == [], "run: make stubs"


def test_the_stubs_cover_every_file_the_services_messages_import() -> None:
    """Each generated module is one xds-protos ships, and the roots' imports are all typed."""
    request = stubgen.request()
    generated = set(request.file_to_generate)
    assert "envoy/service/ext_proc/v3/external_processor.proto" in generated
    for file in request.proto_file:
        if file.name in generated:
            missing = [
                dep
                for dep in file.dependency
                if dep not in generated and not dep.startswith(stubgen.TYPED_ELSEWHERE)
            ]
            assert missing == [], file.name
