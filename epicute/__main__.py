"""``python -m epicute``: the ``epicute`` command line (see :mod:`epicute.cli`)."""

from epicute.cli import app

app(prog_name="epicute")
