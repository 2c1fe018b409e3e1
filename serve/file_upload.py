"""``POST /v1/files``: the multipart body parsed as it arrives (python-multipart's streaming parser),
the file part written straight to its destination folder with a running size check.

Nothing is spooled to ``$TMPDIR`` and nothing is held whole in memory: the server holds one read of
the body at a time, and an upload past ``--max-upload-bytes`` stops at the first byte too many (413)
with its partial file removed. The other form fields (``purpose``) are small and capped.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from python_multipart.multipart import MultipartParser, parse_options_header

from tasks.batch_store import StoreError

MAX_FIELD = 1024  # bytes of a form field other than the file
MAX_PARTS = 8


class Upload:
    """What the form held: its text fields, and the file part written to ``path`` (``size`` bytes)."""

    def __init__(self, folder: Path, limit: int):
        self.fields: dict[str, str] = {}
        self.path = folder / f".upload-{uuid.uuid4().hex}.part"  # renamed into place by the store
        self.filename: str | None = None
        self.size, self.limit = 0, limit
        self._file = None
        self._parts = 0
        self._name = self._header = self._value = b""
        self._headers: dict[bytes, bytes] = {}
        self._field = bytearray()

    # python-multipart callbacks (data[start:end] is the piece)
    def on_part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise StoreError(f"the form has more than {MAX_PARTS} parts; send 'file' and 'purpose'")
        self._headers, self._field, self._name = {}, bytearray(), b""

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def on_header_end(self) -> None:
        self._headers[self._header.lower()] = self._value
        self._header = self._value = b""
        if len(self._headers) > 16:
            raise StoreError("a form part has too many headers")

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = options.get(b"name", b"")
        if b"filename" in options:
            if self._name != b"file" or self._file is not None:
                raise StoreError("the form may hold one file, in the field 'file'", param="file")
            self.filename = options[b"filename"].decode("utf-8", "replace")
            self._file = open(self.path, "wb")  # noqa: SIM115 - closed by finish()/discard()

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._file is not None and self._name == b"file" and not self._file.closed:
            self.size += end - start
            if self.size > self.limit:
                raise StoreError(f"the file exceeds the limit of {self.limit} bytes (--max-upload-bytes)", 413,
                                 "file")
            self._file.write(data[start:end])
            return
        self._field += data[start:end]
        if len(self._field) > MAX_FIELD:
            raise StoreError(f"the form field {self._name.decode('latin-1')!r} is longer than {MAX_FIELD} bytes")

    def on_part_end(self) -> None:
        if self._file is not None and self._name == b"file":
            self._file.flush()
            os.fsync(self._file.fileno())  # on disk before the store renames it into place
            self._file.close()
        else:
            self.fields[self._name.decode("utf-8", "replace")] = self._field.decode("utf-8", "replace")

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
        self.path.unlink(missing_ok=True)


async def receive_upload(content_type: str, chunks: AsyncIterator[bytes], folder: Path, limit: int) -> Upload:
    """Parse a multipart body from ``chunks``, writing its file part into ``folder`` (StoreError: 400
    for a malformed form, 413 past ``limit``; the partial file is removed)."""
    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise StoreError("expected a multipart/form-data body with 'file' and 'purpose'")
    up = Upload(folder, limit)
    parser = MultipartParser(boundary, {n: getattr(up, n) for n in dir(up) if n.startswith("on_")})
    try:
        async for chunk in chunks:
            parser.write(chunk)
        parser.finalize()
        if up._file is None or not up._file.closed:
            raise StoreError("'file' is required (a JSONL file of Batch API requests)", param="file")
    except Exception as e:  # a StoreError (or any other error) goes on as it is, a parser's is this form's 400
        up.discard()
        if type(e).__name__ in ("MultipartParseError", "FormParserError", "ValueError"):
            raise StoreError(f"expected a multipart/form-data body with 'file' and 'purpose': {e}") from None
        raise
    return up
