"""PLACEHOLDER: being written (registers no subcommand yet)."""


def register(sub) -> None:
    pass
