"""The `hfjax` command line: the entry point (`main`), one module per command, and what only the command line
needs (the quickstart pipeline, the shipped configs, the configuration reference generator, error reporting)."""
