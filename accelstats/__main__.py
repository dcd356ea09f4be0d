"""``python3 -m accelstats``: the same command as the ``accelstats`` console script."""

from accelstats.cli import main

main()
