"""Write the generated part of docs/events.md from the event registry (``ddiloco.core.events``).

The text between the two markers is replaced; the rest of the page is kept.
``tests/test_events.py`` fails when the page and the registry disagree.

Usage: ``python scripts/gen_events_doc.py``
"""

from __future__ import annotations

import pathlib

from ddiloco.core import events

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "events.md"


def main() -> None:
    text = DOC.read_text()
    begin, end = text.index(events.DOC_BEGIN), text.index(events.DOC_END) + len(events.DOC_END) + 1
    DOC.write_text(text[:begin] + events.reference_markdown() + text[end:])


if __name__ == "__main__":
    main()
