"""One module per `autotune` subcommand; each registers itself with `autotune.cli.command`."""
