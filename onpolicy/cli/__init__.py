"""The ``onpolicy`` command line: one module per subcommand, wired in ``main``."""
