"""One module per ``packed-formats`` sub-command (see packed_formats.cli)."""
