"""furlong.commands: the `furlong sft`, `export`, `demo` and `plot` commands."""
