"""Repository tools run as modules (`python -m ppserve.tools.<name>`): they write files the tests check."""
