"""What the tests share besides conftest.py's fixtures: tiny fakes (``fakes``), image factories (``imaging``) and the
server starter the fixtures use (``servers``)."""
