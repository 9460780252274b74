"""The `dsv41` command line, one module per command."""
