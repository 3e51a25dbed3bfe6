"""docs/walkthrough.md shows the messages a real run exchanges, so it cannot drift from the code."""

from __future__ import annotations

import pytest

from demo import walkthrough


@pytest.mark.e2e
def test_walkthrough_matches_a_fresh_capture() -> None:
    """Every captured block in the walkthrough equals what BBR, LWEPP and the client see now.

    On failure, run ``python -m demo.walkthrough --write`` and read the diff:
    it is the change in behaviour the document has to explain.
    """
    document = walkthrough.DOC.read_text()
    blocks = walkthrough.capture()
    named = set(walkthrough.BLOCK.findall(document))
    assert len(named) >= 10, "the walkthrough lost its captured blocks"
    assert walkthrough.render(document, blocks) == document
