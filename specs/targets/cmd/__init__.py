"""``cmd:PROGRAM ARGS``: a target in any language, a program speaking the JSON-lines protocol."""
