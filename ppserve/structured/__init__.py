"""Structured outputs and tool calls: the constraint a request carries (spec.py), the grammar backend
that compiles it (backend.py), the compile cache (grammars.py), the chat side of tools (tools.py,
tool_parser.py). ARCHITECTURE.md#structured-outputs says where each part runs."""
