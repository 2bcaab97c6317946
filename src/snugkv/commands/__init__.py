"""Subcommands of the `snugkv` CLI; each module defines `register(subparsers)`."""
