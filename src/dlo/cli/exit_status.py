"""Exit statuses the `dlo` command shares between its launcher and its commands."""

# What a shell reports for a process ended by Ctrl-C (128 + SIGINT).
INTERRUPTED_STATUS = 130
