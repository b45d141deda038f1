"""qgate's command line: one module per command group, one exception table."""
