"""`python -m aisched_prefect.cli`: the same as `aisched`."""

from aisched_prefect.cli import main

main()
