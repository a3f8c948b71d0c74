"""A ``multipart/form-data`` body (RFC 7578) read whole from memory: its text fields and its files, by name, in order.

The HTTP worker holds a request's body in memory before the app sees it (app/hosting/worker.py), so the parts are
found with ``bytes.find`` over it in one pass and each file is one slice: werkzeug's streaming parser, made for
bodies that do not fit in memory, took 0.66 ms of the worker's CPU for one 100 KB photo and 7 ms for sixteen on
the 2-core VM, about as much as the rest of the request (docs/performance.md). What werkzeug accepts is read the
same way: a preamble and an epilogue are ignored, header names are case-insensitive, a part is a file when its
``Content-Disposition`` names a ``filename`` (RFC 2231's ``filename*`` too) or, unlike werkzeug, when its
``Content-Type`` is an image's or ``application/octet-stream`` (a nameless Blob of FormData), a boundary may be
longer than RFC 2046's 70 characters, and text fields are UTF-8. A body that
is not one (no boundary, a part cut short, a part without a name) is a 400 ``bad_request`` saying what is wrong, a
text field too long or too many of them a 400 ``invalid_request``, and a form with more files than a request may
carry a 413 before the rest is read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from werkzeug.http import parse_options_header

from app.errors import BadRequest, MalformedBody, TooManyImages

_FILE_TYPES = ("image/", "application/octet-stream")  # a part of these types is a file, named or not
MAX_FIELD_BYTES = 4096  # a text field's value: the forms' fields are numbers and names
MAX_FIELDS = 16  # text fields beside the files (each endpoint knows a few and refuses the others by name)
MAX_HEADER_BYTES = 8192  # a part's header block (its disposition, its type): looked for no further
_CRLF = b"\r\n"
_HEADERS_END = b"\r\n\r\n"
_CLOSED = -1  # _after_delimiter: the closing delimiter


@dataclass(frozen=True)
class FilePart:
    """One file of the form: its name as the client gave it (None: none or empty) and its bytes."""

    filename: str | None
    data: bytes


@dataclass
class FormData:
    """A form's text fields and files, each by field name in the order they came."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    files: dict[str, list[FilePart]] = field(default_factory=dict)

    def field(self, name: str) -> str | None:
        """The first value of text field ``name``, or None."""
        values = self.fields.get(name)
        return values[0] if values else None

    def names(self) -> list[str]:
        """Every field's name, files first, each once."""
        return [*self.files, *(name for name in self.fields if name not in self.files)]


def parse_form_data(body: bytes, boundary: str, max_files: int) -> FormData:
    """The form in ``body``, its parts delimited by ``boundary`` (the Content-Type's parameter, as the request parsed
    it: werkzeug's ``mimetype_params``); MalformedBody when it is not one, BadRequest for a text field too long or too
    many, TooManyImages as soon as it holds more than ``max_files`` files."""
    if not boundary:  # RFC 2046 caps it at 70 characters; werkzeug's own test client sends longer ones, and reads them
        raise MalformedBody("multipart/form-data needs a boundary parameter in its Content-Type")
    delimiter = b"--" + boundary.encode("latin-1", "replace")
    start = body.find(delimiter)
    if start == -1 or (start > 0 and body[start - 2:start] != _CRLF):
        raise MalformedBody("the multipart body holds no part: its boundary never starts a line")
    form, files, separator = FormData(), 0, _CRLF + delimiter
    at = start + len(delimiter)
    while True:
        headers_start = _after_delimiter(body, at)
        if headers_start == _CLOSED:  # what follows is the epilogue
            return form
        if headers_start is None:
            raise MalformedBody("the multipart body is cut short or malformed after a boundary")
        if body.startswith(_CRLF, headers_start):  # a part without headers
            headers, content_start = b"", headers_start + 2
        else:
            headers_end = body.find(_HEADERS_END, headers_start, headers_start + MAX_HEADER_BYTES + 4)
            if headers_end == -1:
                raise MalformedBody("a part of the multipart body ends inside its headers" if body.find(
                    _HEADERS_END, headers_start) == -1 else f"a part's headers run past {MAX_HEADER_BYTES} bytes")
            headers, content_start = body[headers_start:headers_end], headers_end + 4
        content_end, at = _part_end(body, separator, content_start)
        name, filename = _disposition(headers)
        if filename is None:
            _add_field(form, name, body, content_start, content_end)
        else:
            files += 1
            if files > max_files:
                raise TooManyImages(f"more than {max_files} files in one request; the limit is {max_files}")
            form.files.setdefault(name, []).append(FilePart(filename or None, body[content_start:content_end]))


def _after_delimiter(body: bytes, at: int) -> int | None:
    """Where the part after a delimiter ending at ``at`` starts (its headers), _CLOSED after the closing delimiter
    (``--``), None when what follows ends no delimiter (optional spaces, then a line end)."""
    if body.startswith(b"--", at):
        return _CLOSED
    line_end = body.find(_CRLF, at)
    return None if line_end == -1 or body[at:line_end].strip(b" \t") else line_end + 2


def _part_end(body: bytes, separator: bytes, start: int) -> tuple[int, int]:
    """Where the part starting at ``start`` ends and where the delimiter after it does: the next CRLF and
    delimiter that a line end (after optional spaces) or the closing ``--`` follows; the boundary's text followed by
    anything else is the part's content, as werkzeug reads it. An empty part whose delimiter follows its headers'
    blank line with no CRLF of its own (werkzeug's test client writes an empty file so) ends where it starts, as
    werkzeug reads it: a boundary never appears in a part's content."""
    delimiter = separator[len(_CRLF):]
    if body.startswith(delimiter, start) and _after_delimiter(body, start + len(delimiter)) is not None:
        return start, start + len(delimiter)
    end = body.find(separator, start)
    while end != -1:
        if _after_delimiter(body, end + len(separator)) is not None:
            return end, end + len(separator)
        end = body.find(separator, end + 1)
    raise MalformedBody("the multipart body ends before its closing boundary")


def _disposition(headers: bytes) -> tuple[str, str | None]:
    """The part's field name and filename from its Content-Disposition; None: not a file. A part without a filename
    whose Content-Type is an image's or ``application/octet-stream`` is a file too, its filename "" (Node's and the
    browsers' FormData send a Blob without a name so); any other (a field sent as JSON, as text) is a field."""
    name = filename = None
    typed = False
    for line in headers.split(_CRLF):
        header, _, value = line.decode("utf-8", "replace").partition(":")
        header = header.strip().lower()
        if header == "content-disposition":
            kind, options = header_options(value.strip())
            if kind.lower() != "form-data" or not options.get("name"):
                break
            name, filename = options["name"], options.get("filename")
        elif header == "content-type":
            typed = value.strip().lower().startswith(_FILE_TYPES)
    if name is None:
        raise MalformedBody('every part of a multipart/form-data body needs Content-Disposition: form-data; '
                            'name="..."')
    return name, "" if filename is None and typed else filename


# An option that is a name and a quoted value free of escapes (what browsers, curl and client libraries send), and
# options that are each one, parted by ";"
_QUOTED_OPTION = re.compile(r'([A-Za-z0-9_-]+)="([^"\\%]*)"')
_QUOTED_OPTIONS = re.compile(rf'(?:{_QUOTED_OPTION.pattern}[ \t]*(?:;[ \t]*|\Z))+')


def header_options(value: str) -> tuple[str, dict[str, str]]:
    """werkzeug's ``parse_options_header(value)``: a header's value and its options by lower-case name. Options that
    are each a name and a quoted value without escapes are read with one expression (1.6 against 9 us for a part's
    ``form-data; name="image"; filename="cat.jpg"``: werkzeug scans a quoted value a character at a time, once per
    file of a form); anything else (a token value, an escape, ``%22``, RFC 2231's ``name*``) is werkzeug's."""
    kind, _, rest = value.partition(";")
    kind, rest = kind.strip(" \t"), rest.strip(" \t")
    if kind and rest and _QUOTED_OPTIONS.fullmatch(rest):
        return kind, {name.lower(): quoted for name, quoted in _QUOTED_OPTION.findall(rest)}
    return parse_options_header(value)


def _add_field(form: FormData, name: str, body: bytes, start: int, end: int) -> None:
    if end - start > MAX_FIELD_BYTES:
        raise BadRequest(f"form field {name!r} holds {end - start} bytes; a field holds at most {MAX_FIELD_BYTES} "
                         "(send an image as a file: a part with a filename, or an image's Content-Type)")
    if sum(map(len, form.fields.values())) >= MAX_FIELDS:
        raise BadRequest(f"more than {MAX_FIELDS} form fields beside the images")
    form.fields.setdefault(name, []).append(body[start:end].decode("utf-8", "replace"))
