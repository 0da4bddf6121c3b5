"""The command line: one Typer app per command group."""
